#include "kernels/sampling.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
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

int32_t mask_logits(std::span<float> logits, const uint32_t* allowed) {
  constexpr float kLowest = std::numeric_limits<float>::lowest();
  int32_t n_allowed = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    if ((allowed[i / 32] >> (i % 32)) & 1u) {
      ++n_allowed;
    } else if (std::isfinite(logits[i])) {
      logits[i] = kLowest;
    }
  }
  return n_allowed;
}

namespace {

double log_sum_exp(std::span<const float> logits) {
  float mx = logits.empty() ? 0.0f : logits[0];
  for (float v : logits) mx = v > mx ? v : mx;
  double sum = 0.0;
  for (float v : logits) sum += std::exp(static_cast<double>(v) - mx);
  return mx + std::log(sum);
}

// The n_top best by (logit descending, index ascending), as log-probabilities.
void top_logprobs(std::span<const float> logits, double lse, int n_top, TokenLogprobs* out) {
  const int k = std::clamp(n_top, 0, std::min(kMaxTopLogprobs, static_cast<int>(logits.size())));
  out->n_top = k;
  if (k == 0) return;
  std::pair<float, int32_t> best[kMaxTopLogprobs];
  int n = 0;
  auto better = [](float v, int32_t i, const std::pair<float, int32_t>& b) { return v > b.first || (v == b.first && i < b.second); };
  for (size_t i = 0; i < logits.size(); ++i) {
    const float v = logits[i];
    const auto id = static_cast<int32_t>(i);
    if (n == k && !better(v, id, best[k - 1])) continue;
    int j = n < k ? n++ : k - 1;
    while (j > 0 && better(v, id, best[j - 1])) {
      best[j] = best[j - 1];
      --j;
    }
    best[j] = {v, id};
  }
  for (int j = 0; j < k; ++j) {
    out->top_ids[j] = best[j].second;
    out->top_logprobs[j] = static_cast<float>(best[j].first - lse);
  }
}

}  // namespace

void token_logprobs(std::span<const float> logits, int32_t token, int n_top, TokenLogprobs* out) {
  const double lse = log_sum_exp(logits);
  out->logprob = static_cast<float>(logits[static_cast<size_t>(token)] - lse);
  top_logprobs(logits, lse, n_top, out);
}

int32_t sample_row(std::span<float> logits, const SampleSpec& spec, std::span<const LogitAdjust> adjust,
                   TokenLogprobs* logprobs) {
  if (!all_finite(logits)) return kNonFiniteLogits;
  const bool want = spec.top_logprobs >= 0 && logprobs != nullptr;
  const double lse = want ? log_sum_exp(logits) : 0.0;
  if (want) top_logprobs(logits, lse, spec.top_logprobs, logprobs);
  // The raw values the penalties change: the sampled token's log-probability is the raw one's.
  thread_local std::vector<float> raw;
  raw.clear();
  for (const LogitAdjust& a : adjust) {
    float& l = logits[static_cast<size_t>(a.token)];
    raw.push_back(l);
    l = adjusted_logit(l, a.repetition, a.subtract);
  }
  int32_t token;
  if (spec.allowed != nullptr) {
    SampleSpec masked = spec;
    const int32_t n_allowed = mask_logits(logits, spec.allowed);
    const int32_t cap = std::max(n_allowed, 1);
    masked.top_k = spec.top_k > 0 ? std::min(spec.top_k, cap) : cap;
    token = sample_logits(logits, masked);
  } else {
    token = sample_logits(logits, spec);
  }
  if (want && token >= 0) {
    float value = logits[static_cast<size_t>(token)];
    for (size_t i = 0; i < adjust.size(); ++i) {
      if (adjust[i].token == token) value = raw[i];
    }
    logprobs->logprob = static_cast<float>(value - lse);
  }
  return token;
}

}  // namespace baton
