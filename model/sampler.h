// Token sampling from logits: greedy, temperature, top-k, top-p, seeded (same seed, same
// logits → same tokens on every run and machine).
#pragma once

#include <cstdint>
#include <random>
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
  explicit Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {}
  int32_t sample(std::span<const float> logits);
  // The spec for the next draw (advancing the stream as sample() would), for sampling on the
  // device: Backend::sample(logits, {next_spec()}) picks what sample(logits) would.
  SampleSpec next_spec();
  // Advances the random stream past `n` samples, as if sample() had been called n times (one
  // draw each when temperature > 0, none when greedy). A decode worker continuing a request whose
  // first token the prefill worker sampled calls skip(1), so disaggregated and single-process
  // generation give the same text for a seed.
  void skip(int n);

 private:
  double uniform();  // in [0, 1), from 53 random bits (portable, unlike std distributions)

  SamplingParams params_;
  std::mt19937_64 rng_;
};

}  // namespace baton
