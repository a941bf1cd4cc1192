// A public request, validated field by field against the served model, into the pipeline's own
// request. Each surface reads its wire format and hands each field to a RequestBuilder as it
// reads it (gRPC's GenerateRequest in generate_call.cpp, the OpenAI JSON in openai_json.cpp):
// there is no form in between, and no protobuf here. build() checks what spans fields (one
// prompt; max_tokens against the prompt's length) and returns the ValidRequest, which is then
// moved into the pipeline. Every bad field gives INVALID_ARGUMENT naming it (PERMISSION_DENIED
// for a priority above the caller's bound).
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/chat_template.h"
#include "model/config.h"
#include "model/sampler.h"
#include "model/tokenizer.h"
#include "scheduler/request_pipeline.h"

namespace baton {

struct ValidRequest {
  // label (the client's request id, or the one made up for it), prompt_ids, max_tokens,
  // sampling, ignore_eos, priority, and the served model's stop_ids and fingerprint; the call
  // adds its arrival and deadline.
  PipelineRequest pipeline;
  std::vector<std::string> stop;  // stop strings: the frontend's text layer applies them
};

// What validation needs to know: the served model, and the frontend's limit on priority.
struct ServedModel {
  std::string name;
  ModelConfig config;
  std::string fingerprint;
  const Tokenizer* tokenizer = nullptr;
  std::optional<ChatTemplate> chat_template;  // absent when the model has none baton knows
  // The highest priority a client may ask for (--max-priority). Clients may always lower theirs
  // (down to -kPriorityBound); raising it above this is refused, so an unauthenticated client
  // cannot starve the others. (Per-key privileges come with API keys.)
  int32_t max_priority = 0;
  // Prompt text (or message contents) longer than this cannot fit the context whatever it says:
  // n_ctx × the longest token's bytes. Refused before it is tokenised.
  size_t max_prompt_bytes = 0;
};

// n_ctx × the byte length of the longest token in the vocabulary.
size_t max_prompt_bytes(const Tokenizer& tokenizer, int64_t n_ctx);

// quote_input (common/status.h) quotes a client's string in an error message.

// |priority| is bounded whatever --max-priority says.
inline constexpr int32_t kPriorityBound = 1000;
// The longest cache_salt a request may give.
inline constexpr size_t kMaxCacheSaltBytes = 256;
// The longest TTFT target a request may ask for (seconds).
inline constexpr double kMaxTtftSloSeconds = 3600;

// One request's fields, checked as they arrive. Each call returns the error for its field (the
// surface stops there); `field` arguments are the surface's own name for the field, so that
// messages start with what the client sent (prompt_token_ids over gRPC, prompt over HTTP).
class RequestBuilder {
 public:
  // `key_max_priority`: the caller's API key's priority bound, when it has one (else the
  // frontend's --max-priority, model.max_priority). `tenant`: the caller's API key's identity
  // (ApiKey::tenant; empty without API keys).
  RequestBuilder(const ServedModel& model, std::optional<int32_t> key_max_priority, std::string tenant = {});

  // The client's id (printable ASCII, at most 128 bytes). Without one, build() makes one up.
  Status request_id(const std::string& id);

  // The prompt, in one of three forms; a second form is refused. Text and message contents over
  // model.max_prompt_bytes are refused before they are tokenised, ids past the context before
  // they are checked one by one.
  Status prompt_text(const std::string& text);
  Status prompt_ids(std::span<const int32_t> ids, std::string_view field);
  // Roles: system, user, assistant, tool. `tools_json`: the tools the template renders (empty: none).
  Status messages(const std::vector<ChatMessage>& messages, std::string_view tools_json = {});

  // At least 1; checked against the prompt in build(). Never set: the rest of the context.
  void max_tokens(int64_t n) { max_tokens_ = n; }
  // `prefix` goes before the range check's field name ("sampling." for gRPC).
  Status sampling(const SamplingParams& params, std::string_view prefix);
  Status stop(const std::vector<std::string>& stop);  // at most 16, each 1 to 256 bytes
  void ignore_eos(bool ignore) { valid_.pipeline.ignore_eos = ignore; }
  // In [-kPriorityBound, kPriorityBound], and at most the caller's bound.
  Status priority(int32_t priority);
  // The request's own TTFT target: in [0, 3600] seconds (0: the server's). `field` names it.
  Status ttft_slo(double seconds, std::string_view field);
  // The client's cache_salt (at most kMaxCacheSaltBytes). build() sets sampling.cache_scope from
  // it and the tenant: empty when both are, else "<tenant>:<salt>", so that requests share
  // prefix-cache blocks and automata only within one key and one salt.
  Status cache_salt(const std::string& salt, std::string_view field);

  Result<ValidRequest> build() &&;

 private:
  Status claim_prompt();  // the first prompt form set; a second is refused
  Status set_prompt(Result<std::vector<int32_t>> ids);
  Status check_prompt_bytes(size_t bytes) const;

  const ServedModel& model_;
  std::optional<int32_t> key_max_priority_;
  std::string tenant_, cache_salt_;
  bool has_prompt_ = false;
  std::optional<int64_t> max_tokens_;
  ValidRequest valid_;
};

}  // namespace baton
