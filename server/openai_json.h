// The OpenAI-compatible HTTP API's JSON ↔ baton's types, in one place: request bodies of
// POST /v1/completions and /v1/chat/completions are read field by field into a RequestBuilder
// (which validates them, as for gRPC) and become a ValidRequest, and a request's text, usage and timing become the
// response objects (text_completion, chat.completion, their streamed chunks), the model list and
// errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
//
// Checked here, because only JSON has them: the body is a JSON object of at most kMaxJsonDepth
// levels, each known field has its JSON type, the model is the served one (404 otherwise), and
// features baton does not implement (echo, tools, logit_bias, best_of > 1, ...) are refused by name
// instead of being silently ignored. Fields OpenAI does not define are ignored, except baton's
// own: top_k, repetition_penalty, ignore_eos, priority, ttft_slo_seconds, cache_salt (vLLM's name). Everything else (ranges, the prompt's size, stop
// strings, priority bounds) is the builder's, so each field is validated once.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/json_bounds.h"
#include "common/status.h"
#include "model/chat_template.h"
#include "scheduler/request_pipeline.h"
#include "server/request_validation.h"

namespace baton {

enum class OpenAiEndpoint { kCompletions, kChat };

// Choices one request may ask for: prompts (completions' prompt list) times n.
inline constexpr int kMaxChoices = 64;

// A parsed request body: a request per choice (index = prompt · n + j; each of a prompt's n
// choices draws with its own seed, derived from the request's), sharing everything else. Their
// labels are the request's, with "-<index>" when there is more than one.
struct OpenAiRequest {
  std::vector<ValidRequest> choices;
  int n = 1;
  std::string label;  // the request's: the client's id, or the one made up for it
  bool stream = false;
  bool include_usage = false;    // stream_options.include_usage: a last chunk with usage
  // Chat with tools (tool_choice other than none): the output is read for calls in tool_syntax.
  bool tool_calls = false;
  ToolCallSyntax tool_syntax = ToolCallSyntax::kTagged;
};

// `body` as a request to `endpoint` of `model`, read into `builder` (which may hold the request id
// already). Errors: INVALID_ARGUMENT naming the field in OpenAI's name for it (a message starting
// with it), NOT_FOUND for another model, the builder's errors. OpenAI's defaults: max_tokens 16
// for completions and the rest of the context for chat; temperature 1; without a seed, a random
// one (sampled text differs between requests).
Result<OpenAiRequest> parse_openai_request(OpenAiEndpoint endpoint, std::string_view body, const ServedModel& model,
                                           RequestBuilder builder);

// ---- responses ---------------------------------------------------------------------------------

// What every object of one response carries.
struct ResponseHeader {
  OpenAiEndpoint endpoint = OpenAiEndpoint::kCompletions;
  std::string id;       // "cmpl-…" / "chatcmpl-…"
  int64_t created = 0;  // Unix seconds
  std::string model;
};
// The id of a response to request `request_id`.
std::string response_id(OpenAiEndpoint endpoint, const std::string& request_id);

// The log-probabilities of the tokens a response or chunk covers, in OpenAI's shape for the
// endpoint: completions {tokens, token_logprobs, top_logprobs (a token → logprob map of the
// alternatives and the sampled token), text_offset}; chat {content: [{token, logprob, bytes,
// top_logprobs: [{token, logprob, bytes}]}]}. A token that is not valid UTF-8 on its own (part of
// a character) is named "bytes:\xNN…"; chat's `bytes` has its exact bytes.
struct LogprobsOut {
  const Tokenizer* tokenizer = nullptr;
  std::vector<int32_t> ids;
  std::vector<TokenLogprobs> logprobs;  // one per id
  int64_t text_offset = 0;              // completions: characters of output before ids[0] (earlier chunks)
};
// The characters (code points) of token `id`'s text, as text_offset counts them.
int64_t token_text_chars(const Tokenizer& tokenizer, int32_t id);

// One choice of a whole response.
struct ChoiceOut {
  std::string text;  // chat with calls: the content beside them ("" with calls: null)
  PipelineOutcome outcome;
  const LogprobsOut* logprobs = nullptr;  // null when the request asked for none
  const std::vector<ToolCall>* tool_calls = nullptr;  // chat: the calls made (null or empty: none)
};

// An id for a tool call ("call_" and 24 random letters and digits, as OpenAI names them; for a
// Mistral template 9 letters and digits, the only ids its template renders back).
std::string tool_call_id(ToolCallSyntax syntax);

// The whole response (stream false): the choices (index = their position) with all their text,
// `usage` (the choices' sum), and the "baton" extension (timing breakdown, workers) of the first
// choice; with several choices each carries its own as well.
std::string completion_body(const ResponseHeader& h, const std::vector<ChoiceOut>& choices, const PipelineOutcome& usage);

// One streamed chunk of choice `index` with `text` (chat: a choice's first carries the assistant
// role). `outcome`: on the choice's last chunk, its finish_reason (and the extension when
// `include_usage` is false, since then no usage chunk follows). `include_usage`: chunks carry
// "usage": null, as OpenAI's do. `logprobs`: those of the chunk's tokens (null: none).
// `tool_calls`: calls this chunk completes (delta.tool_calls, each whole in one delta).
std::string chunk_body(const ResponseHeader& h, int index, const std::string& text, bool first,
                       const PipelineOutcome* outcome, bool include_usage, const LogprobsOut* logprobs,
                       const std::vector<ToolCall>* tool_calls = nullptr);
// The usage chunk that ends a stream with include_usage: no choices, usage, the extension.
std::string usage_chunk_body(const ResponseHeader& h, const PipelineOutcome& outcome);
// One Server-Sent Event: "data: <json>\n\n".
std::string sse_event(const std::string& json);
inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";

// The timing breakdown as response headers (X-Baton-Queue-Seconds, ...).
std::vector<std::pair<std::string, std::string>> timing_headers(const PipelineOutcome& outcome);

// GET /v1/models (every served model) and GET /v1/models/{id}. `created`: Unix seconds.
std::string models_body(const ServedModel& model, int64_t created);
std::string model_body(const ServedModel& model, int64_t created);

// ---- errors ------------------------------------------------------------------------------------

// The HTTP status for a baton status: INVALID_ARGUMENT / FAILED_PRECONDITION 400,
// UNAUTHENTICATED 401, PERMISSION_DENIED 403, NOT_FOUND 404, RESOURCE_EXHAUSTED 429, CANCELLED
// 499 (the client closed the request), INTERNAL / DATA_LOSS 500, UNIMPLEMENTED 501, UNAVAILABLE
// 503, DEADLINE_EXCEEDED 504.
int http_status_of(StatusCode code);
// {"error": {"message", "type", "param", "code"}} for `status` answered with `http_status`.
// `param` is the request field the message starts with, or null.
std::string error_body(int http_status, const Status& status);

}  // namespace baton
