// A public Generate request validated against the served model, into the pipeline's own request
// (protobuf stops here: the scheduler and the pipeline see only PipelineRequest). Built once, then
// moved into the pipeline. Every bad field gives INVALID_ARGUMENT naming it.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "baton/v1/generate.pb.h"
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

// A client's string as an error message quotes it: bytes outside printable ASCII as \xNN, at
// most kMaxEchoBytes characters of that between the quotes (so 16 bytes of a string that is all
// escapes), and the length when cut. (Echoed whole, a 5 MB model name made a 5 MB message and
// log line, and past 16 KB of metadata the client saw RESOURCE_EXHAUSTED instead.)
inline constexpr size_t kMaxEchoBytes = 64;
std::string quote_input(const std::string& s);

// |priority| is bounded whatever --max-priority says.
inline constexpr int32_t kPriorityBound = 1000;

// What differs between the surfaces a request comes in on.
struct ValidationOptions {
  // The caller's API key's priority bound, when it has one (else model.max_priority, the
  // frontend's --max-priority).
  std::optional<int32_t> key_max_priority;
  // max_tokens 0 means the rest of the context (OpenAI's chat default) instead of an error.
  bool max_tokens_zero_fills_context = false;
};

// `generated_id` is used when the request carries no id.
Result<ValidRequest> validate_request(const v1::GenerateRequest& request, const ServedModel& model,
                                        const std::string& generated_id, const ValidationOptions& options = {});

v1::ModelInfo model_info(const ServedModel& model);

}  // namespace baton
