// Token sampling from logits: greedy, temperature, top-k, top-p, seeded (same seed, same
// logits → same tokens on every run and machine).
//
// The random number of a draw is a function of (seed, position) alone, where position is the
// index in the sequence of the token being drawn (the number of tokens before it). So whichever
// process samples a position — the single-process Generator, the prefill worker (the first
// token), a decode worker, or a prefill worker re-prefilling prompt + earlier output after a
// failover — draws the same number, with no stream state to hand over.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "kernels/sampling.h"

namespace baton {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy (argmax); > 0: softmax(logits / temperature)
  int top_k = 0;             // keep the k most likely tokens (0: all)
  float top_p = 1.0f;        // keep the smallest set whose probability reaches top_p, in (0, 1]
  uint64_t seed = 0;         // random stream seed
};

// INVALID_ARGUMENT naming the field when a value is out of range.
Status validate_sampling(const SamplingParams& params);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params) : params_(params) {}
  // Draws the token at sequence index `position` from that position's logits.
  int32_t sample(std::span<const float> logits, int64_t position) const;
  // The spec of that draw, for sampling on the device: Backend::sample(logits, {spec_at(p)})
  // picks what sample(logits, p) would.
  SampleSpec spec_at(int64_t position) const;

 private:
  SamplingParams params_;
};

// The uniform number in [0, 1) of the draw at `position` for `seed` (53 random bits).
double sample_uniform(uint64_t seed, int64_t position);

}  // namespace baton
