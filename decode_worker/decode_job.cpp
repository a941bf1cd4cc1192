#include "decode_worker/decode_job.h"

#include "model/token_checks.h"

namespace baton {

Status validate_decode_config(const DecodeConfig& c) {
  if (c.max_batch < 1) return invalid_argument("max_batch must be >= 1 (got " + std::to_string(c.max_batch) + ")");
  if (c.local_prefill_max_tokens < 0) {
    return invalid_argument("local_prefill_max_tokens must be >= 0 (got " + std::to_string(c.local_prefill_max_tokens) + ")");
  }
  if (c.local_prefill_token_budget < 1) {
    return invalid_argument("local_prefill_token_budget must be >= 1 (got " + std::to_string(c.local_prefill_token_budget) +
                            ")");
  }
  if (c.block_size < 1) return invalid_argument("block_size must be >= 1 (got " + std::to_string(c.block_size) + ")");
  if (c.fork_hold.count() < 1) {
    return invalid_argument("fork_hold must be >= 1 ms (got " + std::to_string(c.fork_hold.count()) + ")");
  }
  if (c.slot_wait_beat.count() < 1) {
    return invalid_argument("slot_wait_beat must be >= 1 ms (got " + std::to_string(c.slot_wait_beat.count()) + ")");
  }
  if (c.n_blocks < 1) return invalid_argument("n_blocks must be >= 1 (got " + std::to_string(c.n_blocks) + ")");
  return {};
}

int64_t decode_kv_block_bytes(const ModelConfig& m, int block_size, DType kv_dtype) {
  return int64_t{2} * m.n_layers * block_size * m.n_kv_heads * m.head_dim * static_cast<int64_t>(dtype_size(kv_dtype));
}

Status DecodeAdmit::validate_against(const ModelConfig& model) const {
  BATON_RETURN_IF_ERROR(check_length(request_id, "request_id"));
  BATON_RETURN_IF_ERROR(check_length(model_fingerprint, "model_fingerprint"));
  BATON_RETURN_IF_ERROR(check_length(fork_of, "fork_of"));
  BATON_RETURN_IF_ERROR(check_length(kv_sender_certificate, "kv_sender_certificate"));
  for (const std::string& s : kv_senders) BATON_RETURN_IF_ERROR(check_length(s, "kv_sender"));
  if (n_prompt_tokens < 1) return invalid_argument("n_prompt_tokens must be >= 1 (got " + std::to_string(n_prompt_tokens) + ")");
  if (max_tokens < 1) return invalid_argument("max_tokens must be >= 1 (got " + std::to_string(max_tokens) + ")");
  BATON_RETURN_IF_ERROR(check_context(int64_t{n_prompt_tokens} + max_tokens, model,
                                      "prompt (" + std::to_string(n_prompt_tokens) + " tokens) + max_tokens (" +
                                          std::to_string(max_tokens) + ")"));
  if (n_output_tokens < 0 || n_output_tokens >= n_prompt_tokens) {
    return invalid_argument("n_output_tokens must be in [0, n_prompt_tokens) (got " + std::to_string(n_output_tokens) +
                            " of " + std::to_string(n_prompt_tokens) + ")");
  }
  BATON_RETURN_IF_ERROR(validate_sampling(sampling));
  if (n_forks < 0 || n_forks > kMaxForks) {
    return invalid_argument("n_forks must be in [0, " + std::to_string(kMaxForks) + "] (got " +
                            std::to_string(n_forks) + ")");
  }
  if (!fork_of.empty() && (n_forks != 0 || n_output_tokens != 0 || !prefill_tokens.empty())) {
    return invalid_argument("request " + request_id + " forks " + fork_of +
                            ": a fork takes that request's prompt KV, so it has no n_forks, n_output_tokens or "
                            "prefill tokens of its own");
  }
  if (prefill_tokens.empty()) return {};
  if (static_cast<int64_t>(prefill_tokens.size()) != n_prompt_tokens) {
    return invalid_argument("request " + request_id + " has " + std::to_string(static_cast<int64_t>(prefill_tokens.size())) +
                            " tokens to prefill but n_prompt_tokens " + std::to_string(n_prompt_tokens));
  }
  return check_token_ids(prefill_tokens, model, "request " + request_id + ": prefill_tokens");
}

}  // namespace baton
