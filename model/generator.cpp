#include "model/generator.h"

#include <algorithm>

#include "common/seconds.h"
#include "model/stop_rule.h"
#include "model/token_checks.h"

namespace baton {

Result<GenerateResult> Generator::generate(const std::vector<int32_t>& prompt, const GenerateOptions& opt,
                                           const std::function<bool(int32_t)>& on_token) {
  const ModelConfig& c = model_.config();
  if (prompt.empty()) return invalid_argument("the prompt is empty: give at least one token");
  BATON_RETURN_IF_ERROR(check_token_ids(prompt, c, "prompt"));
  if (opt.max_tokens < 0) return invalid_argument("max_tokens must be >= 0");
  const int64_t n_total = static_cast<int64_t>(prompt.size()) + opt.max_tokens;
  // The prompt alone first: lowering max_tokens would not help then, and the message says so.
  BATON_RETURN_IF_ERROR(check_context(static_cast<int64_t>(prompt.size()), c, "the prompt"));
  BATON_RETURN_IF_ERROR(check_context(n_total, c,
                                      "prompt (" + std::to_string(prompt.size()) + " tokens) + max_tokens (" +
                                          std::to_string(opt.max_tokens) + ")"));
  if (opt.prefill_chunk < 0) return invalid_argument("prefill chunk must be >= 0");
  BATON_RETURN_IF_ERROR(validate_sampling(opt.sampling));

  BlockPool pool(static_cast<int>((n_total + opt.block_size - 1) / opt.block_size), opt.block_size);
  auto cache = model_.make_kv_cache(pool.n_total(), opt.block_size, opt.kv_dtype);
  std::vector<int32_t> table;
  BATON_CHECK(pool.grow_to(table, n_total), "pool sized for the request cannot hold it");

  GenerateResult res;
  res.n_prompt = static_cast<int>(prompt.size());
  StepBatch batch;
  std::vector<float> logits;
  const int64_t n_prompt = res.n_prompt;
  const int64_t chunk = opt.prefill_chunk > 0 ? opt.prefill_chunk : n_prompt;

  auto t0 = std::chrono::steady_clock::now();
  for (int64_t s = 0; s < n_prompt; s += chunk) {
    const int64_t n = std::min(chunk, n_prompt - s);
    const bool last = s + n == n_prompt;
    batch.clear();
    batch.add(std::span(prompt).subspan(s, n), static_cast<int32_t>(s), table,
              opt.all_prompt_logits ? Logits::kAll : (last ? Logits::kLast : Logits::kNone));
    model_.forward(batch, *cache, &logits);
    if (opt.all_prompt_logits) res.prompt_logits.insert(res.prompt_logits.end(), logits.begin(), logits.end());
  }
  res.last_logits.assign(logits.end() - c.n_vocab, logits.end());
  res.prefill_seconds = seconds_since(t0);

  auto t1 = std::chrono::steady_clock::now();
  Sampler sampler(opt.sampling);
  sampler.set_history(prompt, {});
  res.finish_reason = "length";
  const bool want_logprobs = opt.sampling.top_logprobs >= 0;
  TokenLogprobs first_logprobs;
  int32_t id = sampler.sample(res.last_logits, n_prompt, &first_logprobs);
  if (want_logprobs) res.logprobs.push_back(first_logprobs);
  auto non_finite = [&](int64_t position) {
    pool.release(table);
    return internal_error("the logits at position " + std::to_string(position) +
                          " are not finite (NaN or infinity): the forward pass overflowed; no token was produced");
  };
  if (id == kNonFiniteLogits) return non_finite(n_prompt);
  std::vector<int32_t> sampled;
  std::vector<TokenLogprobs> sampled_logprobs;
  std::vector<LogitAdjust> adjust;
  const StopRule rule{opt.stop_ids, opt.ignore_eos, opt.max_tokens};
  for (int i = 0; i < opt.max_tokens; ++i) {
    res.tokens.push_back(id);
    sampler.observe(id);
    FinishReason end = rule.after(id, i + 1);
    // The caller sees every token, the one that ends generation too.
    const bool keep_going = on_token ? on_token(id) : true;
    if (!keep_going) end = FinishReason::kStop;  // the caller ended it (a stop string, say)
    if (end != FinishReason::kNone) {
      res.finish_reason = finish_reason_name(end);
      break;
    }
    batch.clear();
    batch.add(std::span(&res.tokens.back(), 1), static_cast<int32_t>(n_prompt + i), table, Logits::kLast);
    // Decode steps sample where the logits are (on a GPU only the results come back).
    const SampleSpec spec = sampler.spec_at(n_prompt + i + 1);
    adjust.clear();
    sampler.adjustments(0, &adjust);
    model_.forward_sample(batch, *cache, std::span(&spec, 1), adjust, &sampled, &sampled_logprobs);
    id = sampled[0];
    if (id == kNonFiniteLogits) return non_finite(n_prompt + i + 1);
    if (want_logprobs) res.logprobs.push_back(sampled_logprobs[0]);
  }
  res.decode_seconds = seconds_since(t1);
  pool.release(table);
  return res;
}

}  // namespace baton
