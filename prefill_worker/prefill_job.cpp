#include "prefill_worker/prefill_job.h"

#include <span>

#include "common/check.h"
#include "kv/kv_transfer.h"
#include "model/token_checks.h"

namespace baton {

Status validate_prefill_config(const PrefillConfig& c) {
  if (c.token_budget < 1)
    return invalid_argument("prefill token budget must be >= 1, got " + std::to_string(c.token_budget));
  if (c.n_blocks < 0)
    return invalid_argument("prefill n_blocks must be >= 0 (0: sized from the model), got " +
                            std::to_string(c.n_blocks));
  if (c.block_size < 1) return invalid_argument("prefill block_size must be >= 1, got " + std::to_string(c.block_size));
  if (c.max_queued_tokens < 1) {
    return invalid_argument("prefill max_queued_tokens must be >= 1, got " + std::to_string(c.max_queued_tokens));
  }
  if (c.n_senders < 1) return invalid_argument("prefill n_senders must be >= 1, got " + std::to_string(c.n_senders));
  if (c.prefix_cache_blocks < -1) {
    return invalid_argument("prefix cache blocks must be >= 0 (0: no prefix cache), or -1 (the whole pool), got " +
                            std::to_string(c.prefix_cache_blocks));
  }
  if (c.prefix_report_blocks < 0) {
    return invalid_argument("prefix_report_blocks must be >= 0, got " + std::to_string(c.prefix_report_blocks));
  }
  if (c.kv_chunk_bytes < 1 || c.kv_chunk_bytes > kMaxKvChunkBytes) {
    return invalid_argument("prefill kv_chunk_bytes must be in [1, " + std::to_string(kMaxKvChunkBytes) + "], got " +
                            std::to_string(c.kv_chunk_bytes));
  }
  return {};
}

// Checks the config (an invalid one is a bug in the caller, which validates flags first) and
// resolves n_blocks = 0 against the model: room for a few steps' prompts, and at least one prompt
// of the model's full context.
PrefillConfig resolve_prefill_config(PrefillConfig c, const ModelConfig& model) {
  const Status s = validate_prefill_config(c);
  BATON_CHECK(s.ok(), "invalid PrefillConfig: %s", s.to_string().c_str());
  if (c.n_blocks == 0) {
    const int64_t tokens = std::max<int64_t>(int64_t{4} * c.token_budget, model.n_ctx);
    c.n_blocks = static_cast<int>((tokens + c.block_size - 1) / c.block_size);
  }
  if (c.prefix_cache_blocks < 0 || c.prefix_cache_blocks > c.n_blocks) c.prefix_cache_blocks = c.n_blocks;
  return c;
}

Status PrefillJob::validate_against(const ModelConfig& model) const {
  if (request_id.empty()) return invalid_argument("request_id is empty");
  BATON_RETURN_IF_ERROR(check_length(request_id, "request_id"));
  BATON_RETURN_IF_ERROR(check_length(decode_address, "decode_address"));
  BATON_RETURN_IF_ERROR(check_length(model_fingerprint, "model_fingerprint"));
  const int64_t n_prompt = static_cast<int64_t>(tokens.size()) - n_generated;
  if (n_generated < 0 || n_prompt < 1) {
    return invalid_argument("prompt_token_ids is empty (" + std::to_string(tokens.size()) + " tokens, " +
                            std::to_string(n_generated) + " of them generated): give at least one token");
  }
  const std::span<const int32_t> ids(tokens);
  BATON_RETURN_IF_ERROR(check_token_ids(ids.first(static_cast<size_t>(n_prompt)), model, "prompt_token_ids"));
  BATON_RETURN_IF_ERROR(check_token_ids(ids.subspan(static_cast<size_t>(n_prompt)), model, "generated_token_ids"));
  // The first token goes after them: one position more.
  BATON_RETURN_IF_ERROR(check_context(static_cast<int64_t>(tokens.size()) + 1, model,
                                      "prompt_token_ids (" + std::to_string(n_prompt) + ") + generated_token_ids (" +
                                          std::to_string(n_generated) + ") + one new token"));
  if (const Status s = validate_sampling(sampling); !s.ok()) return invalid_argument("sampling." + s.message());
  if (decode_address.empty()) return invalid_argument("decode_address is empty");
  return {};
}

}  // namespace baton
