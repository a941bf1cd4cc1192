// Drawing a token from a row of logits: the one definition every backend implements (the CPU
// runs this function; the CUDA backend mirrors it on the device). The random number is drawn by
// the caller's stream (model/sampler.h), so a seed gives the same tokens on every backend up to
// rounding at probability boundaries, and a greedy spec gives exactly the argmax.
#pragma once

#include <cstdint>
#include <span>

namespace baton {

struct SampleSpec {
  float temperature = 0.0f;  // 0: greedy (argmax, lowest index on ties)
  int top_k = 0;             // keep the k largest logits (0: all)
  float top_p = 1.0f;        // then the smallest prefix (by logit, descending) whose mass reaches top_p
  double u = 0.0;            // uniform in [0, 1): picks the token by cumulative probability
  int32_t top_logprobs = -1;  // >= 0: return the token's log-probability and this many alternatives' (TokenLogprobs)
  // Structured output: the tokens that may be drawn, a bit each (bit t % 32 of word t / 32) over
  // the row's logits, in host memory (a device backend copies it); null: every token. The others
  // are never drawn; log-probabilities stay those of the raw logits.
  const uint32_t* allowed = nullptr;
};

// A change to one logit before it is sampled (the penalties of model/sampler.h):
// l' = (l > 0 ? l / repetition : l * repetition) - subtract. A batch's (row, token) pairs are distinct.
struct LogitAdjust {
  int32_t row = 0;
  int32_t token = 0;
  float repetition = 1.0f;
  float subtract = 0.0f;
};

inline float adjusted_logit(float logit, float repetition, float subtract) {
  return (logit > 0.0f ? logit / repetition : logit * repetition) - subtract;
}

inline constexpr int kMaxTopLogprobs = 20;

// Log-probabilities under log_softmax of the raw logits: the model's distribution, before
// temperature, top-k/top-p and penalties. top_* hold the n_top most likely tokens, by logit
// descending (lower index on ties).
struct TokenLogprobs {
  float logprob = 0.0f;  // of the sampled token
  int32_t n_top = 0;
  int32_t top_ids[kMaxTopLogprobs] = {};
  float top_logprobs[kMaxTopLogprobs] = {};
};

// What sampling returns instead of a token when the row holds a NaN or an infinity: the step went
// wrong (overflow, broken weights), and no token may come of it. Every backend returns it.
inline constexpr int32_t kNonFiniteLogits = -1;

// Candidates are ordered by logit descending, ties by lower index; softmax at the temperature
// over the top_k, truncated to top_p, renormalised; the token is the first whose cumulative
// probability exceeds u · total. kNonFiniteLogits when a logit is not finite.
int32_t sample_logits(std::span<const float> logits, const SampleSpec& spec);

// One row as a backend samples it: the log-probabilities of the raw row when spec.top_logprobs
// >= 0 (into *logprobs), then `adjust` (this row's entries) applied to `logits` in place, then the
// tokens spec.allowed leaves out set to the lowest float (mask_logits), then sample_logits with
// top_k at most the number allowed (so that top-k and top-p choose among allowed tokens only).
// The reference every backend's sample() matches.
int32_t sample_row(std::span<float> logits, const SampleSpec& spec, std::span<const LogitAdjust> adjust,
                   TokenLogprobs* logprobs);

// Sets every finite logit whose token `allowed` leaves out to the lowest float, which no allowed
// token's logit is below and whose probability is 0 at any temperature; NaN and infinities stay,
// so that the step still fails on them. Returns the number of tokens allowed.
int32_t mask_logits(std::span<float> logits, const uint32_t* allowed);

// log_softmax(logits)[token] and the n_top most likely tokens' log-probabilities (n_top <= 20).
void token_logprobs(std::span<const float> logits, int32_t token, int n_top, TokenLogprobs* out);

// Whether every value is finite (vectorised: the exponent bits of NaN and infinity are all ones).
bool all_finite(std::span<const float> values);

// Index of the largest logit; the lowest index wins ties.
int32_t argmax(std::span<const float> logits);

}  // namespace baton
