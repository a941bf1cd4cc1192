// Latency summaries for `batonctl bench`: mean and nearest-rank percentiles of a sample set.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <numeric>
#include <vector>

namespace baton::ctl {

// Nearest-rank percentile: the smallest sample x such that at least p% of the samples are <= x,
// i.e. sorted[ceil(p/100 * n) - 1]. `sorted` is ascending and non-empty; p in (0, 100].
// Always one of the samples (no interpolation), so p50 <= p90 <= p99 <= max holds by construction.
inline double percentile_nearest_rank(const std::vector<double>& sorted, double p) {
  const size_t n = sorted.size();
  // p * n first: exact for integer p, so p90 of 10 samples is rank 9, not ceil(9.000000000000002).
  size_t rank = static_cast<size_t>(std::ceil(p * static_cast<double>(n) / 100.0));
  rank = std::clamp<size_t>(rank, 1, n);
  return sorted[rank - 1];
}

struct LatencySummary {
  size_t n = 0;  // samples; 0: every other field is 0
  double mean = 0;
  double p50 = 0;
  double p90 = 0;
  double p99 = 0;
  double max = 0;
};

inline LatencySummary summarize(std::vector<double> samples) {
  LatencySummary s;
  s.n = samples.size();
  if (samples.empty()) return s;
  std::sort(samples.begin(), samples.end());
  s.mean = std::accumulate(samples.begin(), samples.end(), 0.0) / static_cast<double>(s.n);
  s.p50 = percentile_nearest_rank(samples, 50);
  s.p90 = percentile_nearest_rank(samples, 90);
  s.p99 = percentile_nearest_rank(samples, 99);
  s.max = samples.back();
  return s;
}

}  // namespace baton::ctl
