#include "kernels/sampling.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

namespace baton {

int32_t argmax(std::span<const float> logits) {
  // The first index of the largest value, in two passes that vectorise (a running index does not:
  // it was 0.2 ms of every row's 49,152 logits). Logits are finite here (sample_logits checks).
  float mx = logits.empty() ? 0.0f : logits[0];
#pragma omp simd reduction(max : mx)
  for (size_t i = 0; i < logits.size(); ++i) mx = logits[i] > mx ? logits[i] : mx;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (logits[i] == mx) return static_cast<int32_t>(i);
  }
  return 0;
}

bool all_finite(std::span<const float> values) {
  constexpr uint32_t kExp = 0x7f800000u;
  uint32_t any = 0;
  for (float v : values) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    any |= static_cast<uint32_t>((bits & kExp) == kExp);
  }
  return any == 0;
}

int32_t sample_logits(std::span<const float> logits, const SampleSpec& spec) {
  if (!all_finite(logits)) return kNonFiniteLogits;
  if (spec.temperature == 0.0f) return argmax(logits);
  const size_t n = logits.size();
  thread_local std::vector<std::pair<float, int32_t>> candidates;
  candidates.resize(n);
  for (size_t i = 0; i < n; ++i) candidates[i] = {logits[i], static_cast<int32_t>(i)};
  auto by_logit = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
  size_t keep = n;
  if (spec.top_k > 0 && static_cast<size_t>(spec.top_k) < n) {
    keep = static_cast<size_t>(spec.top_k);
    std::partial_sort(candidates.begin(), candidates.begin() + keep, candidates.end(), by_logit);
  } else {
    std::sort(candidates.begin(), candidates.end(), by_logit);
  }
  // Softmax over the kept candidates (sorted, so [0] is the max), at the temperature.
  const float mx = candidates[0].first;
  double total = 0.0;
  std::vector<double> probs(keep);
  for (size_t i = 0; i < keep; ++i) {
    probs[i] = std::exp(static_cast<double>(candidates[i].first - mx) / spec.temperature);
    total += probs[i];
  }
  if (spec.top_p < 1.0f) {
    double cum = 0.0;
    size_t cut = keep;
    for (size_t i = 0; i < keep; ++i) {
      cum += probs[i] / total;
      if (cum >= spec.top_p) {
        cut = i + 1;
        break;
      }
    }
    keep = cut;
    total = 0.0;
    for (size_t i = 0; i < keep; ++i) total += probs[i];
  }
  double r = spec.u * total;
  for (size_t i = 0; i < keep; ++i) {
    r -= probs[i];
    if (r < 0.0) return candidates[i].second;
  }
  return candidates[keep - 1].second;
}

}  // namespace baton
