#include "server/request_validation.h"

#include "model/output_constraints.h"

#include "model/token_checks.h"

#include <algorithm>
#include <cmath>
#include <span>

namespace baton {
namespace {

constexpr size_t kMaxRequestIdBytes = 128;
constexpr size_t kMaxStopStrings = 16;
constexpr size_t kMaxStopBytes = 256;

bool printable_ascii(const std::string& s) {
  for (unsigned char c : s) {
    if (c < 0x21 || c > 0x7E) return false;
  }
  return true;
}

}  // namespace

size_t max_prompt_bytes(const Tokenizer& tokenizer, int64_t n_ctx) {
  size_t longest = 1;
  for (int32_t id = 0; id < tokenizer.n_vocab(); ++id) longest = std::max(longest, tokenizer.token_bytes(id).size());
  return static_cast<size_t>(n_ctx) * longest;
}

RequestBuilder::RequestBuilder(const ServedModel& model, std::optional<int32_t> key_max_priority, std::string tenant)
    : model_(model), key_max_priority_(key_max_priority), tenant_(std::move(tenant)) {}

Status RequestBuilder::request_id(const std::string& id) {
  if (id.size() > kMaxRequestIdBytes || !printable_ascii(id)) {
    return invalid_argument("request_id must be at most 128 printable ASCII characters without spaces");
  }
  valid_.pipeline.label = id;
  return {};
}

// Every token stands for at most the longest token's bytes: text over n_ctx times that cannot
// fit, and is refused before tokenising it costs anything.
Status RequestBuilder::check_prompt_bytes(size_t bytes) const {
  if (model_.max_prompt_bytes == 0 || bytes <= model_.max_prompt_bytes) return {};
  return invalid_argument("the prompt is " + std::to_string(bytes) + " bytes: more than the context of " +
                          std::to_string(model_.config.n_ctx) + " tokens can hold (at most " +
                          std::to_string(model_.max_prompt_bytes) + " bytes); shorten it");
}

Status RequestBuilder::claim_prompt() {
  if (has_prompt_) return invalid_argument("set only one of prompt, prompt_token_ids and messages (the request sets several)");
  has_prompt_ = true;
  return {};
}

Status RequestBuilder::set_prompt(Result<std::vector<int32_t>> ids) {
  if (!ids.ok()) return ids.status();
  if (ids->empty()) return invalid_argument("the prompt is empty after tokenization");
  valid_.pipeline.prompt_ids = std::move(*ids);
  return {};
}

Status RequestBuilder::prompt_text(const std::string& text) {
  BATON_RETURN_IF_ERROR(claim_prompt());
  if (text.empty()) return invalid_argument("the prompt is empty: send text, token ids or messages");
  BATON_RETURN_IF_ERROR(check_prompt_bytes(text.size()));
  auto ids = model_.tokenizer->encode(text, /*parse_special=*/true);
  if (!ids.ok()) return invalid_argument("prompt: " + ids.status().message());
  if (model_.tokenizer->add_bos()) ids->insert(ids->begin(), model_.tokenizer->bos_id());
  return set_prompt(std::move(ids));
}

Status RequestBuilder::prompt_ids(std::span<const int32_t> ids, std::string_view field) {
  BATON_RETURN_IF_ERROR(claim_prompt());
  // Counted before any is checked or copied.
  BATON_RETURN_IF_ERROR(check_context(static_cast<int64_t>(ids.size()) + 1, model_.config,
                                      std::string(field) + " (" + std::to_string(ids.size()) + " ids) + one new token"));
  BATON_RETURN_IF_ERROR(check_token_ids(ids, model_.config, field));
  return set_prompt(std::vector<int32_t>(ids.begin(), ids.end()));
}

Status RequestBuilder::messages(const std::vector<ChatMessage>& messages, std::string_view tools_json) {
  BATON_RETURN_IF_ERROR(claim_prompt());
  if (messages.empty()) return invalid_argument("messages is empty: send at least one message");
  size_t bytes = 0;
  for (const ChatMessage& m : messages) bytes += m.content.size();
  BATON_RETURN_IF_ERROR(check_prompt_bytes(bytes));
  if (!model_.chat_template) {
    return invalid_argument("messages: this model has no chat template baton knows; send prompt text instead");
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& role = messages[i].role;
    if (role != "system" && role != "user" && role != "assistant" && role != "tool") {
      return invalid_argument("messages[" + std::to_string(i) + "].role must be system, user, assistant or tool, got " +
                              quote_input(role));
    }
  }
  auto text = model_.chat_template->render(messages, /*add_generation_prompt=*/true, tools_json);
  if (!text.ok()) return invalid_argument("messages: " + text.status().message());
  auto ids = model_.tokenizer->encode(*text, /*parse_special=*/true);
  if (!ids.ok()) return invalid_argument("messages: " + ids.status().message());
  return set_prompt(std::move(ids));
}

Status RequestBuilder::sampling(const SamplingParams& params, std::string_view prefix) {
  if (Status st = validate_sampling(params); !st.ok()) return invalid_argument(std::string(prefix) + st.message());
  // The schema compiled here too, so that one outside the subset is refused before any work.
  if (Status st = validate_output_format(params.format); !st.ok()) {
    return invalid_argument(std::string(prefix) + "response_format: " + st.message());
  }
  valid_.pipeline.sampling = params;
  return {};
}

Status RequestBuilder::stop(const std::vector<std::string>& stop) {
  if (stop.size() > kMaxStopStrings) {
    return invalid_argument("stop: at most " + std::to_string(kMaxStopStrings) + " stop strings");
  }
  for (size_t i = 0; i < stop.size(); ++i) {
    if (stop[i].empty() || stop[i].size() > kMaxStopBytes) {
      return invalid_argument("stop[" + std::to_string(i) + "] must be 1 to 256 bytes");
    }
  }
  valid_.stop = stop;
  return {};
}

Status RequestBuilder::priority(int32_t priority) {
  if (priority < -kPriorityBound || priority > kPriorityBound) {
    return invalid_argument("priority must be in [" + std::to_string(-kPriorityBound) + ", " +
                            std::to_string(kPriorityBound) + "], got " + std::to_string(priority));
  }
  const int32_t bound = key_max_priority_.value_or(model_.max_priority);
  if (priority > bound) {
    return permission_denied("priority " + std::to_string(priority) + " is above " + std::to_string(bound) +
                             (key_max_priority_ ? ", the highest this API key may ask for (its max-priority in "
                                                  "--api-key-file)"
                                                : ", the highest this frontend lets clients ask for (--max-priority, "
                                                  "or an API key's max-priority)") +
                             "; lower priorities are always allowed");
  }
  valid_.pipeline.priority = priority;
  return {};
}

Status RequestBuilder::ttft_slo(double seconds, std::string_view field) {
  if (!(seconds >= 0 && seconds <= kMaxTtftSloSeconds)) {
    return invalid_argument(std::string(field) + " must be a number of seconds in [0, " +
                            std::to_string(static_cast<int>(kMaxTtftSloSeconds)) + "] (0: the server's target), got " +
                            std::to_string(seconds));
  }
  valid_.pipeline.ttft_slo_seconds = seconds;
  return {};
}

Status RequestBuilder::cache_salt(const std::string& salt, std::string_view field) {
  BATON_RETURN_IF_ERROR(check_length(salt, field, kMaxCacheSaltBytes));
  cache_salt_ = salt;
  return {};
}

Result<ValidRequest> RequestBuilder::build() && {
  PipelineRequest& spec = valid_.pipeline;
  if (!has_prompt_) return invalid_argument("the prompt is empty: set one of prompt, prompt_token_ids or messages");
  const int64_t n_prompt = static_cast<int64_t>(spec.prompt_ids.size());
  if (max_tokens_) {
    if (*max_tokens_ < 1) return invalid_argument("max_tokens must be >= 1, got " + std::to_string(*max_tokens_));
    // Named max_tokens first: that is the field a client lowers.
    BATON_RETURN_IF_ERROR(check_context(n_prompt + *max_tokens_, model_.config,
                                        "max_tokens (" + std::to_string(*max_tokens_) + ") + prompt (" +
                                            std::to_string(n_prompt) + " tokens)"));
    spec.max_tokens = static_cast<int32_t>(*max_tokens_);
  } else {
    // Not set (chat's default): the rest of the context, which must hold one token at least.
    BATON_RETURN_IF_ERROR(check_context(n_prompt + 1, model_.config,
                                        "the prompt (" + std::to_string(n_prompt) + " tokens) + one new token"));
    spec.max_tokens = static_cast<int32_t>(model_.config.n_ctx - n_prompt);
  }
  // A client that names no request gets a random public id (the workers see other ids).
  if (spec.label.empty()) spec.label = "req-" + random_request_id().substr(0, 16);
  spec.stop_ids = model_.tokenizer->stop_ids();
  // Whatever the client put in sampling: the scope is the frontend's to set.
  spec.sampling.cache_scope = tenant_.empty() && cache_salt_.empty() ? std::string() : tenant_ + ":" + cache_salt_;
  spec.model_fingerprint = model_.fingerprint;
  return std::move(valid_);
}

}  // namespace baton
