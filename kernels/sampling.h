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
};

// What sampling returns instead of a token when the row holds a NaN or an infinity: the step went
// wrong (overflow, broken weights), and no token may come of it. Every backend returns it.
inline constexpr int32_t kNonFiniteLogits = -1;

// Candidates are ordered by logit descending, ties by lower index; softmax at the temperature
// over the top_k, truncated to top_p, renormalised; the token is the first whose cumulative
// probability exceeds u · total. kNonFiniteLogits when a logit is not finite.
int32_t sample_logits(std::span<const float> logits, const SampleSpec& spec);

// Whether every value is finite (vectorised: the exponent bits of NaN and infinity are all ones).
bool all_finite(std::span<const float> values);

// Index of the largest logit; the lowest index wins ties.
int32_t argmax(std::span<const float> logits);

}  // namespace baton
