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

void Sampler::skip(int n) {
  if (params_.temperature == 0.0f) return;
  for (int i = 0; i < n; ++i) (void)uniform();
}

double Sampler::uniform() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }

SampleSpec Sampler::next_spec() {
  SampleSpec spec;
  spec.temperature = params_.temperature;
  spec.top_k = params_.top_k;
  spec.top_p = params_.top_p;
  spec.u = params_.temperature == 0.0f ? 0.0 : uniform();  // greedy draws nothing
  return spec;
}

int32_t Sampler::sample(std::span<const float> logits) { return sample_logits(logits, next_spec()); }

}  // namespace baton
