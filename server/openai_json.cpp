#include "server/openai_json.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <limits>
#include <random>

namespace baton {
namespace {

using Json = nlohmann::json;

// Output is always valid UTF-8 (the text stream guarantees it); `replace` keeps a bug from
// becoming an exception.
std::string dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

const char* type_name(const Json& j) {
  switch (j.type()) {
    case Json::value_t::null: return "null";
    case Json::value_t::boolean: return "a boolean";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned: return "an integer";
    case Json::value_t::number_float: return "a number";
    case Json::value_t::string: return "a string";
    case Json::value_t::array: return "an array";
    case Json::value_t::object: return "an object";
    default: return "something else";
  }
}

Status wrong_type(const std::string& field, const char* want, const Json& got) {
  return invalid_argument(field + " must be " + want + ", got " + type_name(got));
}

// A member of the request object; null when absent or null (OpenAI treats null as unset).
const Json* member(const Json& object, const char* name) {
  const auto it = object.find(name);
  return it == object.end() || it->is_null() ? nullptr : &*it;
}

Result<std::string> as_string(const Json& v, const std::string& field) {
  if (!v.is_string()) return wrong_type(field, "a string", v);
  return v.get<std::string>();
}

Result<bool> as_bool(const Json& v, const std::string& field) {
  if (!v.is_boolean()) return wrong_type(field, "a boolean", v);
  return v.get<bool>();
}

Result<double> as_number(const Json& v, const std::string& field) {
  if (!v.is_number()) return wrong_type(field, "a number", v);
  return v.get<double>();
}

// An integer that fits int32 (the GenerateRequest fields are int32).
Result<int32_t> as_int32(const Json& v, const std::string& field) {
  if (!v.is_number_integer()) return wrong_type(field, "an integer", v);
  constexpr auto lo = std::numeric_limits<int32_t>::min(), hi = std::numeric_limits<int32_t>::max();
  if (v.is_number_unsigned() ? v.get<uint64_t>() > static_cast<uint64_t>(hi)
                             : (v.get<int64_t>() < lo || v.get<int64_t>() > hi)) {
    return invalid_argument(field + " = " + v.dump() + " is out of range");
  }
  return static_cast<int32_t>(v.get<int64_t>());
}

// OpenAI accepts any 64-bit seed; baton's stream is keyed by its 64 bits.
Result<uint64_t> as_seed(const Json& v) {
  if (!v.is_number_integer()) return wrong_type("seed", "an integer", v);
  return v.is_number_unsigned() ? v.get<uint64_t>() : static_cast<uint64_t>(v.get<int64_t>());
}

// Features baton does not implement: refused by name unless the value is the one that means
// "off", so that no client believes it got what it asked for.
Status refuse_unsupported(const Json& body, OpenAiEndpoint endpoint) {
  auto off = [&](const char* name, auto is_off, const char* why) -> Status {
    const Json* v = member(body, name);
    if (v == nullptr || is_off(*v)) return {};
    return invalid_argument(std::string(name) + " = " + v->dump().substr(0, kMaxEchoBytes) + " is not supported: " + why);
  };
  auto is_one = [](const Json& v) { return v.is_number_integer() && v.get<int64_t>() == 1; };
  auto is_false = [](const Json& v) { return v.is_boolean() && !v.get<bool>(); };
  auto is_empty = [](const Json& v) { return (v.is_array() || v.is_object() || v.is_string()) && v.empty(); };
  auto is_text = [](const Json& v) { return v.is_object() && v.value("type", Json()) == "text"; };
  BATON_RETURN_IF_ERROR(off("best_of", is_one, "baton returns one choice per request (best_of = 1)"));
  BATON_RETURN_IF_ERROR(off("echo", is_false, "the prompt is not echoed"));
  BATON_RETURN_IF_ERROR(off("logit_bias", is_empty, "baton does not bias logits"));
  if (endpoint == OpenAiEndpoint::kCompletions) {
    BATON_RETURN_IF_ERROR(off("suffix", is_empty, "baton does not insert text"));
  } else {
    BATON_RETURN_IF_ERROR(off("tools", is_empty, "baton does not call tools"));
    BATON_RETURN_IF_ERROR(off("functions", is_empty, "baton does not call functions"));
    BATON_RETURN_IF_ERROR(off("response_format", is_text, "baton answers in plain text"));
  }
  return {};
}

// How many alternatives each token's log-probability comes with (-1: none asked). Completions:
// `logprobs`, null or 0–5. Chat: `logprobs` true, with `top_logprobs` 0–20 (which needs it).
Result<int> read_logprobs(const Json& body, OpenAiEndpoint endpoint) {
  const Json* lp = member(body, "logprobs");
  const Json* top = member(body, "top_logprobs");
  if (endpoint == OpenAiEndpoint::kCompletions) {
    if (top != nullptr) return invalid_argument("top_logprobs is a chat parameter: completions take logprobs = 0 to 5");
    if (lp == nullptr) return -1;
    BATON_ASSIGN_OR_RETURN(const int32_t n, as_int32(*lp, "logprobs"));
    if (n < 0 || n > 5) return invalid_argument("logprobs must be in [0, 5], got " + std::to_string(n));
    return n;
  }
  bool want = false;
  if (lp != nullptr) {
    BATON_ASSIGN_OR_RETURN(want, as_bool(*lp, "logprobs"));
  }
  if (top == nullptr) return want ? 0 : -1;
  BATON_ASSIGN_OR_RETURN(const int32_t n, as_int32(*top, "top_logprobs"));
  if (n < 0 || n > kMaxTopLogprobs) return invalid_argument("top_logprobs must be in [0, 20], got " + std::to_string(n));
  if (!want) return invalid_argument("top_logprobs needs logprobs = true");
  return n;
}

// The prompts of a completions request: a string, token ids, or an array of those (a choice each).
Result<std::vector<const Json*>> read_prompts(const Json& prompt) {
  if (prompt.is_string()) return std::vector<const Json*>{&prompt};
  if (!prompt.is_array()) return wrong_type("prompt", "a string, token ids or an array of those", prompt);
  if (prompt.empty()) return invalid_argument("prompt is an empty array: send text or token ids");
  if (!prompt[0].is_string() && !prompt[0].is_array()) return std::vector<const Json*>{&prompt};  // token ids
  if (prompt.size() > kMaxChoices) {
    return invalid_argument("prompt holds " + std::to_string(prompt.size()) + " prompts; at most " +
                            std::to_string(kMaxChoices) + " per request");
  }
  std::vector<const Json*> out;
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (!prompt[i].is_string() && !prompt[i].is_array()) {
      return wrong_type("prompt[" + std::to_string(i) + "]", "a string or an array of token ids", prompt[i]);
    }
    out.push_back(&prompt[i]);
  }
  return out;
}

// One completions prompt: a string or token ids. `field` names it in errors.
Status read_prompt(const Json& prompt, const std::string& field, RequestBuilder& b) {
  if (prompt.is_string()) return b.prompt_text(prompt.get<std::string>());
  if (prompt.empty()) return invalid_argument(field + " is an empty array: send text or token ids");
  std::vector<int32_t> ids;
  for (size_t i = 0; i < prompt.size(); ++i) {
    BATON_ASSIGN_OR_RETURN(const int32_t id, as_int32(prompt[i], field + "[" + std::to_string(i) + "]"));
    ids.push_back(id);
  }
  return b.prompt_ids(ids, field);
}

// Choice j of a prompt draws with its own seed, derived from the request's, so that seed + n gives
// the same n choices again (choice 0's is the seed itself: n = 1 draws what it always did).
uint64_t choice_seed(uint64_t seed, int j) {
  uint64_t x = seed + static_cast<uint64_t>(j) * 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return j == 0 ? seed : x ^ (x >> 31);
}

// Chat messages: content is a string, null, or text parts ({"type": "text", "text": ...}).
Status read_messages(const Json& messages, RequestBuilder& b) {
  if (!messages.is_array()) return wrong_type("messages", "an array", messages);
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string at = "messages[" + std::to_string(i) + "]";
    const Json& m = messages[i];
    if (!m.is_object()) return wrong_type(at, "an object", m);
    const Json* role = member(m, "role");
    if (role == nullptr) return invalid_argument(at + ".role is missing");
    BATON_ASSIGN_OR_RETURN(std::string role_name, as_string(*role, at + ".role"));
    // OpenAI's newer name for the system role.
    ChatMessage& message = out.emplace_back(ChatMessage{role_name == "developer" ? "system" : role_name, ""});
    const Json* content = member(m, "content");
    if (content == nullptr) continue;
    if (content->is_string()) {
      message.content = content->get<std::string>();
      continue;
    }
    if (!content->is_array()) return wrong_type(at + ".content", "a string or an array of text parts", *content);
    for (size_t j = 0; j < content->size(); ++j) {
      const std::string part_at = at + ".content[" + std::to_string(j) + "]";
      const Json& part = (*content)[j];
      if (!part.is_object()) return wrong_type(part_at, "an object", part);
      const Json* type = member(part, "type");
      if (type == nullptr || !type->is_string() || type->get<std::string>() != "text") {
        return invalid_argument(part_at + ".type must be 'text' (baton reads text only), got " +
                                (type == nullptr ? std::string("none") : type->dump().substr(0, kMaxEchoBytes)));
      }
      const Json* part_text = member(part, "text");
      if (part_text == nullptr) return invalid_argument(part_at + ".text is missing");
      BATON_ASSIGN_OR_RETURN(std::string piece, as_string(*part_text, part_at + ".text"));
      message.content += piece;
    }
  }
  return b.messages(out);
}

// nlohmann's message without the input it quotes ("; last read: '…'" can hold megabytes).
std::string json_error_reason(const std::string& what) {
  std::string reason = what;
  if (const size_t at = reason.find("] "); at != std::string::npos) reason.erase(0, at + 2);
  if (const size_t at = reason.find("; last read"); at != std::string::npos) reason.erase(at);
  if (reason.size() > 160) reason = reason.substr(0, 160) + "...";
  for (char& c : reason) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7F) c = '?';
  }
  return reason;
}

// With OpenAI's prompt_tokens_details.cached_tokens: the prompt tokens a prefix cache held.
Json usage_json(const PipelineOutcome& o) {
  return {{"prompt_tokens", o.n_prompt_tokens},
          {"completion_tokens", o.n_generated},
          {"total_tokens", o.n_prompt_tokens + o.n_generated},
          {"prompt_tokens_details", {{"cached_tokens", o.cached_prompt_tokens}}}};
}

// baton's extension: where the request's time went, and which workers served it.
Json baton_json(const PipelineOutcome& o) {
  return {{"timing",
           {{"queue_seconds", o.queue_seconds},
            {"prefill_seconds", o.prefill_seconds},
            {"kv_transfer_seconds", o.kv_transfer_seconds},
            {"decode_queue_seconds", o.decode_queue_seconds},
            {"ttft_seconds", o.ttft_seconds},
            {"e2e_seconds", o.e2e_seconds},
            {"failovers", o.failovers}}},
          {"prefill_worker", o.prefill_address},
          {"decode_worker", o.decode_address}};
}

Json object_header(const ResponseHeader& h, bool chunk) {
  const bool chat = h.endpoint == OpenAiEndpoint::kChat;
  return {{"id", h.id},
          {"object", chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
          {"created", h.created},
          {"model", h.model}};
}

Json model_json(const ServedModel& m, int64_t created) {
  return {{"id", m.name},
          {"object", "model"},
          {"created", created},
          {"owned_by", "baton"},
          {"baton",
           {{"architecture", m.config.arch},
            {"context_length", m.config.n_ctx},
            {"vocab_size", m.config.n_vocab},
            {"chat_template", m.chat_template ? m.chat_template->name() : ""},
            {"fingerprint", m.fingerprint}}}};
}

// The request field a message starts with, when it is one.
std::string param_of(const std::string& message) {
  static const char* const kFields[] = {
      "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
      "seed", "stop", "stream", "stream_options", "n", "best_of", "echo", "logprobs", "top_logprobs", "suffix",
      "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "tools", "functions", "response_format", "priority",
      "ignore_eos", "ttft_slo_seconds"};
  size_t n = 0;
  while (n < message.size() && (std::islower(static_cast<unsigned char>(message[n])) || message[n] == '_')) ++n;
  const std::string word = message.substr(0, n);
  for (const char* f : kFields) {
    if (word == f) return word;
  }
  return {};
}

}  // namespace

Result<OpenAiRequest> parse_openai_request(OpenAiEndpoint endpoint, std::string_view body, const ServedModel& model,
                                           RequestBuilder b) {
  if (body.empty()) return invalid_argument("the body is empty: send a JSON object");
  bool too_deep = false;
  const Json::parser_callback_t depth_limit = [&](int depth, Json::parse_event_t, Json&) {
    if (depth > kMaxJsonDepth) too_deep = true;
    return !too_deep;
  };
  Json j;
  try {
    j = Json::parse(body.begin(), body.end(), depth_limit);
  } catch (const Json::exception& e) {
    return invalid_argument("the body is not valid JSON: " + json_error_reason(e.what()));
  }
  if (too_deep) return invalid_argument("the body nests deeper than " + std::to_string(kMaxJsonDepth) + " levels");
  if (!j.is_object()) return wrong_type("the body", "a JSON object", j);

  OpenAiRequest req;
  if (const Json* m = member(j, "model")) {
    BATON_ASSIGN_OR_RETURN(const std::string name, as_string(*m, "model"));
    if (name != model.name) {
      return not_found("model " + quote_input(name) + " does not exist: this server serves '" + model.name +
                       "' (GET /v1/models)");
    }
  }
  BATON_RETURN_IF_ERROR(refuse_unsupported(j, endpoint));

  std::vector<const Json*> prompts;
  if (endpoint == OpenAiEndpoint::kCompletions) {
    const Json* prompt = member(j, "prompt");
    if (prompt == nullptr) return invalid_argument("prompt is missing");
    BATON_ASSIGN_OR_RETURN(prompts, read_prompts(*prompt));
  } else {
    const Json* messages = member(j, "messages");
    if (messages == nullptr) return invalid_argument("messages is missing");
    BATON_RETURN_IF_ERROR(read_messages(*messages, b));
  }
  int n = 1;
  if (const Json* v = member(j, "n")) {
    BATON_ASSIGN_OR_RETURN(n, as_int32(*v, "n"));
    if (n < 1 || n > kMaxChoices) {
      return invalid_argument("n must be in [1, " + std::to_string(kMaxChoices) + "], got " + std::to_string(n));
    }
  }
  const size_t n_prompts = std::max<size_t>(prompts.size(), 1);
  if (n_prompts * static_cast<size_t>(n) > kMaxChoices) {
    return invalid_argument("n = " + std::to_string(n) + " for " + std::to_string(n_prompts) + " prompts makes " +
                            std::to_string(n_prompts * n) + " choices; at most " + std::to_string(kMaxChoices) +
                            " per request");
  }

  // max_tokens: OpenAI's default is 16 for completions and the rest of the context for chat
  // (where max_completion_tokens is the newer name).
  const Json* max_tokens = member(j, "max_tokens");
  const char* max_tokens_name = "max_tokens";
  if (endpoint == OpenAiEndpoint::kChat) {
    if (const Json* mct = member(j, "max_completion_tokens")) {
      if (max_tokens != nullptr && *max_tokens != *mct) {
        return invalid_argument("max_tokens and max_completion_tokens differ: send one of them");
      }
      max_tokens = mct;
      max_tokens_name = "max_completion_tokens";
    }
  }
  if (max_tokens != nullptr) {
    BATON_ASSIGN_OR_RETURN(const int32_t n, as_int32(*max_tokens, max_tokens_name));
    b.max_tokens(n);
  } else if (endpoint == OpenAiEndpoint::kCompletions) {
    b.max_tokens(16);
  }  // chat without it: the rest of the context

  SamplingParams s;
  s.temperature = 1.0f;
  // The float fields: a number when present, else the default already in `s`.
  for (const auto& [name, field] : {std::pair<const char*, float*>{"temperature", &s.temperature},
                                    {"top_p", &s.top_p},
                                    {"presence_penalty", &s.presence_penalty},
                                    {"frequency_penalty", &s.frequency_penalty},
                                    {"repetition_penalty", &s.repetition_penalty}}) {
    if (const Json* v = member(j, name)) {
      BATON_ASSIGN_OR_RETURN(const double x, as_number(*v, name));
      *field = static_cast<float>(x);
    }
  }
  if (const Json* v = member(j, "top_k")) {
    BATON_ASSIGN_OR_RETURN(s.top_k, as_int32(*v, "top_k"));
  }
  BATON_ASSIGN_OR_RETURN(s.top_logprobs, read_logprobs(j, endpoint));
  if (const Json* v = member(j, "seed")) {
    BATON_ASSIGN_OR_RETURN(s.seed, as_seed(*v));
  } else {
    std::random_device rd;
    s.seed = (static_cast<uint64_t>(rd()) << 32) | rd();
  }
  BATON_RETURN_IF_ERROR(b.sampling(s, ""));

  if (const Json* v = member(j, "stop")) {
    std::vector<std::string> stop;
    if (v->is_string()) {
      stop.push_back(v->get<std::string>());
    } else if (v->is_array()) {
      for (size_t i = 0; i < v->size(); ++i) {
        BATON_ASSIGN_OR_RETURN(std::string one, as_string((*v)[i], "stop[" + std::to_string(i) + "]"));
        stop.push_back(std::move(one));
      }
    } else {
      return wrong_type("stop", "a string or an array of strings", *v);
    }
    BATON_RETURN_IF_ERROR(b.stop(stop));
  }
  if (const Json* v = member(j, "stream")) {
    BATON_ASSIGN_OR_RETURN(req.stream, as_bool(*v, "stream"));
  }
  if (const Json* v = member(j, "stream_options")) {
    if (!v->is_object()) return wrong_type("stream_options", "an object", *v);
    if (const Json* u = member(*v, "include_usage")) {
      BATON_ASSIGN_OR_RETURN(req.include_usage, as_bool(*u, "stream_options.include_usage"));
    }
  }
  if (const Json* v = member(j, "ignore_eos")) {
    BATON_ASSIGN_OR_RETURN(const bool ignore, as_bool(*v, "ignore_eos"));
    b.ignore_eos(ignore);
  }
  if (const Json* v = member(j, "priority")) {
    BATON_ASSIGN_OR_RETURN(const int32_t priority, as_int32(*v, "priority"));
    BATON_RETURN_IF_ERROR(b.priority(priority));
  }
  if (const Json* v = member(j, "ttft_slo_seconds")) {
    BATON_ASSIGN_OR_RETURN(const double seconds, as_number(*v, "ttft_slo_seconds"));
    BATON_RETURN_IF_ERROR(b.ttft_slo(seconds, "ttft_slo_seconds"));
  }
  // A choice per prompt and per n, in OpenAI's order: index = prompt · n + j.
  std::vector<ValidRequest> bases;
  if (prompts.empty()) {
    BATON_ASSIGN_OR_RETURN(ValidRequest v, std::move(b).build());
    bases.push_back(std::move(v));
  } else {
    for (size_t i = 0; i < prompts.size(); ++i) {
      RequestBuilder one = b;
      // One label for the request: the client's, or the one made up for the first prompt.
      if (!bases.empty()) BATON_RETURN_IF_ERROR(one.request_id(bases[0].pipeline.label));
      const std::string field = prompts.size() == 1 ? "prompt" : "prompt[" + std::to_string(i) + "]";
      BATON_RETURN_IF_ERROR(read_prompt(*prompts[i], field, one));
      Result<ValidRequest> v = std::move(one).build();
      if (!v.ok()) {
        return prompts.size() == 1 ? v.status() : Status(v.status().code(), field + ": " + v.status().message());
      }
      bases.push_back(std::move(*v));
    }
  }
  req.n = n;
  req.label = bases[0].pipeline.label;
  for (const ValidRequest& base : bases) {
    for (int c = 0; c < n; ++c) {
      ValidRequest v = base;
      v.pipeline.sampling.seed = choice_seed(base.pipeline.sampling.seed, c);
      if (bases.size() * n > 1) v.pipeline.label += "-" + std::to_string(req.choices.size());
      req.choices.push_back(std::move(v));
    }
  }
  return req;
}

std::string response_id(OpenAiEndpoint endpoint, const std::string& request_id) {
  return (endpoint == OpenAiEndpoint::kChat ? "chatcmpl-" : "cmpl-") + request_id;
}

namespace {

// The byte length of the UTF-8 sequence starting at s[i], or 0 when it is not a valid one.
size_t utf8_sequence(std::string_view s, size_t i) {
  const auto b = static_cast<unsigned char>(s[i]);
  size_t n = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
  if (n == 0 || i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((static_cast<unsigned char>(s[i + k]) >> 6) != 2) return 0;
  }
  return n;
}

// A token's text for JSON: itself when it is valid UTF-8, else OpenAI's "bytes:\xNN…".
std::string token_string(const std::string& bytes) {
  for (size_t i = 0; i < bytes.size();) {
    const size_t n = utf8_sequence(bytes, i);
    if (n == 0) {
      std::string out = "bytes:";
      char buf[5];
      for (unsigned char c : bytes) {
        std::snprintf(buf, sizeof buf, "\\x%02x", c);
        out += buf;
      }
      return out;
    }
    i += n;
  }
  return bytes;
}

Json bytes_json(const std::string& bytes) {
  Json a = Json::array();
  for (unsigned char c : bytes) a.push_back(static_cast<int>(c));
  return a;
}

Json logprobs_json(OpenAiEndpoint endpoint, const LogprobsOut& lp) {
  const Tokenizer& tok = *lp.tokenizer;
  const size_t n = std::min(lp.ids.size(), lp.logprobs.size());
  if (endpoint == OpenAiEndpoint::kChat) {
    Json content = Json::array();
    for (size_t i = 0; i < n; ++i) {
      const std::string& bytes = tok.token_bytes(lp.ids[i]);
      Json top = Json::array();
      for (int k = 0; k < lp.logprobs[i].n_top; ++k) {
        const std::string& alt = tok.token_bytes(lp.logprobs[i].top_ids[k]);
        top.push_back({{"token", token_string(alt)}, {"logprob", lp.logprobs[i].top_logprobs[k]}, {"bytes", bytes_json(alt)}});
      }
      content.push_back({{"token", token_string(bytes)},
                         {"logprob", lp.logprobs[i].logprob},
                         {"bytes", bytes_json(bytes)},
                         {"top_logprobs", std::move(top)}});
    }
    return {{"content", std::move(content)}, {"refusal", nullptr}};
  }
  Json tokens = Json::array(), token_logprobs = Json::array(), top_logprobs = Json::array(), offsets = Json::array();
  int64_t offset = lp.text_offset;
  for (size_t i = 0; i < n; ++i) {
    const std::string token = token_string(tok.token_bytes(lp.ids[i]));
    tokens.push_back(token);
    token_logprobs.push_back(lp.logprobs[i].logprob);
    // The alternatives and the sampled token, as OpenAI returns up to logprobs + 1 of them.
    Json top = Json::object();
    for (int k = 0; k < lp.logprobs[i].n_top; ++k) {
      const std::string alt = token_string(tok.token_bytes(lp.logprobs[i].top_ids[k]));
      if (!top.contains(alt)) top[alt] = lp.logprobs[i].top_logprobs[k];
    }
    if (!top.contains(token)) top[token] = lp.logprobs[i].logprob;
    top_logprobs.push_back(std::move(top));
    offsets.push_back(offset);
    offset += token_text_chars(tok, lp.ids[i]);
  }
  return {{"tokens", std::move(tokens)},
          {"token_logprobs", std::move(token_logprobs)},
          {"top_logprobs", std::move(top_logprobs)},
          {"text_offset", std::move(offsets)}};
}

}  // namespace

int64_t token_text_chars(const Tokenizer& tokenizer, int32_t id) {
  // Code points: every byte that does not continue a sequence starts a character.
  int64_t n = 0;
  for (unsigned char c : tokenizer.token_bytes(id)) n += (c >> 6) != 2;
  return n;
}

std::string completion_body(const ResponseHeader& h, const std::vector<ChoiceOut>& choices, const PipelineOutcome& usage) {
  Json array = Json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const ChoiceOut& c = choices[i];
    Json choice = {{"index", i},
                   {"logprobs", c.logprobs != nullptr ? logprobs_json(h.endpoint, *c.logprobs) : Json()},
                   {"finish_reason", c.outcome.finish_reason}};
    if (h.endpoint == OpenAiEndpoint::kChat) {
      choice["message"] = {{"role", "assistant"}, {"content", c.text}};
    } else {
      choice["text"] = c.text;
    }
    if (choices.size() > 1) choice["baton"] = baton_json(c.outcome);
    array.push_back(std::move(choice));
  }
  Json j = object_header(h, /*chunk=*/false);
  j["choices"] = std::move(array);
  j["usage"] = usage_json(usage);
  j["baton"] = baton_json(choices.empty() ? usage : choices[0].outcome);
  return dump(j);
}

std::string chunk_body(const ResponseHeader& h, int index, const std::string& text, bool first,
                       const PipelineOutcome* o, bool include_usage, const LogprobsOut* logprobs) {
  Json choice = {{"index", index},
                 {"logprobs", logprobs != nullptr ? logprobs_json(h.endpoint, *logprobs) : Json()},
                 {"finish_reason", o ? Json(o->finish_reason) : Json()}};
  if (h.endpoint == OpenAiEndpoint::kChat) {
    Json delta = Json::object();
    if (first) delta["role"] = "assistant";
    if (first || !text.empty()) delta["content"] = text;
    choice["delta"] = delta;
  } else {
    choice["text"] = text;
  }
  Json j = object_header(h, /*chunk=*/true);
  j["choices"] = Json::array({choice});
  if (include_usage) j["usage"] = nullptr;
  if (o != nullptr && !include_usage) j["baton"] = baton_json(*o);
  return dump(j);
}

std::string usage_chunk_body(const ResponseHeader& h, const PipelineOutcome& o) {
  Json j = object_header(h, /*chunk=*/true);
  j["choices"] = Json::array();
  j["usage"] = usage_json(o);
  j["baton"] = baton_json(o);
  return dump(j);
}

std::string sse_event(const std::string& json) { return "data: " + json + "\n\n"; }

std::vector<std::pair<std::string, std::string>> timing_headers(const PipelineOutcome& o) {
  auto seconds = [](double s) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.6f", s);
    return std::string(buf);
  };
  return {{"X-Baton-Queue-Seconds", seconds(o.queue_seconds)},
          {"X-Baton-Prefill-Seconds", seconds(o.prefill_seconds)},
          {"X-Baton-Kv-Transfer-Seconds", seconds(o.kv_transfer_seconds)},
          {"X-Baton-Decode-Queue-Seconds", seconds(o.decode_queue_seconds)},
          {"X-Baton-Ttft-Seconds", seconds(o.ttft_seconds)},
          {"X-Baton-E2e-Seconds", seconds(o.e2e_seconds)},
          {"X-Baton-Failovers", std::to_string(o.failovers)}};
}

std::string models_body(const ServedModel& model, int64_t created) {
  return dump({{"object", "list"}, {"data", Json::array({model_json(model, created)})}});
}

std::string model_body(const ServedModel& model, int64_t created) { return dump(model_json(model, created)); }

int http_status_of(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return 200;
    case StatusCode::kInvalidArgument:
    case StatusCode::kFailedPrecondition: return 400;
    case StatusCode::kUnauthenticated: return 401;
    case StatusCode::kPermissionDenied: return 403;
    case StatusCode::kNotFound: return 404;
    case StatusCode::kResourceExhausted: return 429;
    case StatusCode::kCancelled: return 499;
    case StatusCode::kUnimplemented: return 501;
    case StatusCode::kUnavailable: return 503;
    case StatusCode::kDeadlineExceeded: return 504;
    case StatusCode::kInternal:
    case StatusCode::kDataLoss: return 500;
  }
  return 500;
}

std::string error_body(int http_status, const Status& status) {
  const std::string& message = status.message();
  const std::string param = param_of(message);
  const char* type = http_status >= 400 && http_status < 499 ? "invalid_request_error" : "server_error";
  switch (http_status) {
    case 401: type = "authentication_error"; break;
    case 403: type = "permission_error"; break;
    case 429: type = "rate_limit_error"; break;
    default: break;
  }
  std::string code;
  if (http_status == 413) {
    code = "request_too_large";
  } else if (status.code() == StatusCode::kNotFound && param == "model") {
    code = "model_not_found";
  } else if (status.code() == StatusCode::kUnauthenticated) {
    code = "invalid_api_key";
  } else if (status.code() == StatusCode::kResourceExhausted) {
    code = "rate_limit_exceeded";
  } else {
    for (const char* c = status_code_name(status.code()); *c != 0; ++c) {
      code += static_cast<char>(std::tolower(static_cast<unsigned char>(*c)));
    }
  }
  return dump({{"error",
                {{"message", message},
                 {"type", type},
                 {"param", param.empty() ? Json() : Json(param)},
                 {"code", code}}}});
}

}  // namespace baton
