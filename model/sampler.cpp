#include "model/sampler.h"

#include <cmath>
#include <cstdio>
#include <string>

namespace baton {
namespace {

// %g: "1e-45" and "inf" rather than std::to_string's "0.000000".
std::string format_float(float x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", static_cast<double>(x));
  return buf;
}

}  // namespace

Status validate_sampling(const SamplingParams& p) {
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature)) {
    return invalid_argument("temperature must be a finite number >= 0 (0 means greedy), got " + format_float(p.temperature));
  }
  if (p.top_k < 0) return invalid_argument("top_k must be >= 0 (0 keeps every token), got " + std::to_string(p.top_k));
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
    return invalid_argument("top_p must be in (0, 1], got " + format_float(p.top_p));
  }
  return {};
}

namespace {

// SplitMix64's finaliser: a bijection on 64 bits with full avalanche.
uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

}  // namespace

double sample_uniform(uint64_t seed, int64_t position) {
  // Two rounds, the position entering after the seed is mixed: nearby seeds and nearby
  // positions give unrelated numbers.
  const uint64_t x = mix64(mix64(seed + 0x9e3779b97f4a7c15ULL) ^ (static_cast<uint64_t>(position) * 0xd1b54a32d192ed03ULL));
  return static_cast<double>(x >> 11) * 0x1.0p-53;
}

SampleSpec Sampler::spec_at(int64_t position) const {
  SampleSpec spec;
  spec.temperature = params_.temperature;
  spec.top_k = params_.top_k;
  spec.top_p = params_.top_p;
  spec.u = params_.temperature == 0.0f ? 0.0 : sample_uniform(params_.seed, position);  // greedy draws nothing
  return spec;
}

int32_t Sampler::sample(std::span<const float> logits, int64_t position) const {
  return sample_logits(logits, spec_at(position));
}

}  // namespace baton
