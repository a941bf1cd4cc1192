// Reading the OpenAI API's request bodies (server/openai_json.h).
#include <random>

#include "server/openai_json.h"
#include "common/json_parse.h"
#include "model/tool_calls.h"
#include "server/openai_json_util.h"
#include "server/openai_tools.h"

namespace baton {
namespace {

using namespace openai_internal;

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
  BATON_RETURN_IF_ERROR(off("best_of", is_one, "baton returns one choice per request (best_of = 1)"));
  BATON_RETURN_IF_ERROR(off("echo", is_false, "the prompt is not echoed"));
  BATON_RETURN_IF_ERROR(off("logit_bias", is_empty, "baton does not bias logits"));
  if (endpoint == OpenAiEndpoint::kCompletions) {
    BATON_RETURN_IF_ERROR(off("suffix", is_empty, "baton does not insert text"));
  } else {
    BATON_RETURN_IF_ERROR(off("functions", is_empty, "baton does not call functions"));
  }
  return {};
}

// response_format: {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema",
// "json_schema": {"name", "schema", "strict", "description"}} (both endpoints; OpenAI's
// completions have no response_format, vLLM's do). The schema goes on as JSON text in its own
// member order; the builder compiles it (refusing what the subset lacks).
Result<OutputFormat> read_response_format(const Json& body) {
  OutputFormat f;
  const Json* rf = member(body, "response_format");
  if (rf == nullptr) return f;
  if (!rf->is_object()) return wrong_type("response_format", "an object", *rf);
  const Json* type = member(*rf, "type");
  if (type == nullptr) return invalid_argument("response_format.type is missing: text, json_object or json_schema");
  BATON_ASSIGN_OR_RETURN(const std::string t, as_string(*type, "response_format.type"));
  if (t == "text") return f;
  if (t == "json_object") {
    f.kind = OutputFormat::Kind::kJsonObject;
    return f;
  }
  if (t != "json_schema") {
    return invalid_argument("response_format.type must be text, json_object or json_schema, got " + quote_input(t));
  }
  const Json* js = member(*rf, "json_schema");
  if (js == nullptr) return invalid_argument("response_format.json_schema is missing: {\"name\": ..., \"schema\": {...}}");
  if (!js->is_object()) return wrong_type("response_format.json_schema", "an object", *js);
  if (const Json* name = member(*js, "name")) {
    BATON_ASSIGN_OR_RETURN(const std::string n, as_string(*name, "response_format.json_schema.name"));
    if (n.empty() || n.size() > 64) return invalid_argument("response_format.json_schema.name must be 1 to 64 characters");
  }
  if (const Json* strict = member(*js, "strict")) {
    BATON_RETURN_IF_ERROR(as_bool(*strict, "response_format.json_schema.strict").status());
  }
  const Json* schema = member(*js, "schema");
  if (schema == nullptr) return invalid_argument("response_format.json_schema.schema is missing: the JSON Schema to follow");
  if (!schema->is_object() && !schema->is_boolean()) return wrong_type("response_format.json_schema.schema", "an object", *schema);
  f.kind = OutputFormat::Kind::kJsonSchema;
  f.schema = schema->dump();
  return f;
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
Status read_messages(const Json& messages, const std::string& tools_json, RequestBuilder& b) {
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
    BATON_RETURN_IF_ERROR(read_message_tools(m, at, &message));
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
  return b.messages(out, tools_json);
}

}  // namespace

Result<OpenAiRequest> parse_openai_request(OpenAiEndpoint endpoint, std::string_view body, const ServedModel& model,
                                           RequestBuilder b) {
  if (body.empty()) return invalid_argument("the body is empty: send a JSON object");
  BATON_RETURN_IF_ERROR(check_json_bounds(body, "the body"));
  Json j;
  std::string error;
  if (!parse_ordered_json(body, &j, &error)) {
    return invalid_argument("the body is not valid JSON: " + json_error_reason(error));
  }
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
  ToolRequest tools;
  if (endpoint == OpenAiEndpoint::kCompletions) {
    const Json* prompt = member(j, "prompt");
    if (prompt == nullptr) return invalid_argument("prompt is missing");
    BATON_ASSIGN_OR_RETURN(prompts, read_prompts(*prompt));
  } else {
    BATON_ASSIGN_OR_RETURN(tools, read_tools(j));
    const Json* messages = member(j, "messages");
    if (messages == nullptr) return invalid_argument("messages is missing");
    BATON_RETURN_IF_ERROR(read_messages(*messages, tools.choice == ToolRequest::Choice::kNone ? "" : tools.tools_json, b));
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
  BATON_ASSIGN_OR_RETURN(s.format, read_response_format(j));
  const ToolCallSyntax syntax = model.chat_template ? model.chat_template->tool_call_syntax() : ToolCallSyntax::kTagged;
  if (tools.choice == ToolRequest::Choice::kRequired || tools.choice == ToolRequest::Choice::kNamed) {
    // The call is forced: decoded under its function's parameters schema (in the template's syntax).
    if (s.format.kind != OutputFormat::Kind::kText) {
      return invalid_argument("response_format and a forced tool call (tool_choice " +
                              std::string(tools.choice == ToolRequest::Choice::kNamed ? "naming a function" : "required") +
                              ") cannot both constrain the output: send one");
    }
    BATON_ASSIGN_OR_RETURN(s.format, forced_tool_call_format(syntax, tools.tools_json, tools.name));
  }
  req.tool_calls = tools.choice != ToolRequest::Choice::kNone;
  req.tool_syntax = syntax;
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
  if (const Json* v = member(j, "cache_salt")) {
    BATON_ASSIGN_OR_RETURN(const std::string salt, as_string(*v, "cache_salt"));
    BATON_RETURN_IF_ERROR(b.cache_salt(salt, "cache_salt"));
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
    // The n choices of a prompt prefill it once and share its KV (scheduler/choice_group.h).
    const auto group = n > 1 ? std::make_shared<ChoiceGroup>(n) : nullptr;
    for (int c = 0; c < n; ++c) {
      ValidRequest v = base;
      v.pipeline.group = group;
      v.pipeline.choice = c;
      v.pipeline.sampling.seed = choice_seed(base.pipeline.sampling.seed, c);
      if (bases.size() * n > 1) v.pipeline.label += "-" + std::to_string(req.choices.size());
      req.choices.push_back(std::move(v));
    }
  }
  return req;
}

}  // namespace baton
