#include "server/openai_json.h"

#include "server/openai_json_util.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <limits>
#include <random>

namespace baton {
namespace {

using namespace openai_internal;

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

}  // namespace


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

// OpenAI's tool_calls: [{(index,) id, type: "function", function: {name, arguments}}].
Json tool_calls_json(const std::vector<ToolCall>& calls, bool with_index) {
  Json out = Json::array();
  for (size_t i = 0; i < calls.size(); ++i) {
    Json c = Json::object();
    if (with_index) c["index"] = i;
    c["id"] = calls[i].id;
    c["type"] = "function";
    c["function"] = {{"name", calls[i].name}, {"arguments", calls[i].arguments}};
    out.push_back(std::move(c));
  }
  return out;
}

}  // namespace

std::string tool_call_id(ToolCallSyntax syntax) {
  static constexpr char kAlphabet[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  thread_local std::mt19937_64 rng(std::random_device{}());
  // Mistral's templates refuse a call id in the history that is not 9 letters and digits.
  const bool mistral = syntax == ToolCallSyntax::kMistral;
  std::string id = mistral ? "" : "call_";
  for (int i = 0; i < (mistral ? 9 : 24); ++i) id += kAlphabet[rng() % (sizeof kAlphabet - 1)];
  return id;
}

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
      const bool calls = c.tool_calls != nullptr && !c.tool_calls->empty();
      choice["message"] = {{"role", "assistant"}, {"content", calls && c.text.empty() ? Json() : Json(c.text)}};
      if (calls) choice["message"]["tool_calls"] = tool_calls_json(*c.tool_calls, /*with_index=*/false);
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
                       const PipelineOutcome* o, bool include_usage, const LogprobsOut* logprobs,
                       const std::vector<ToolCall>* tool_calls) {
  Json choice = {{"index", index},
                 {"logprobs", logprobs != nullptr ? logprobs_json(h.endpoint, *logprobs) : Json()},
                 {"finish_reason", o ? Json(o->finish_reason) : Json()}};
  if (h.endpoint == OpenAiEndpoint::kChat) {
    Json delta = Json::object();
    if (first) delta["role"] = "assistant";
    if (first || !text.empty()) delta["content"] = text;
    if (tool_calls != nullptr && !tool_calls->empty()) delta["tool_calls"] = tool_calls_json(*tool_calls, true);
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
