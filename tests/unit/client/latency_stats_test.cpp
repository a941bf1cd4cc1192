// latency_stats.h against a naive nearest-rank reference on random sample sets.
#include "client/latency_stats.h"

#include <catch2/catch.hpp>
#include <random>

namespace baton::ctl {
namespace {

// The definition, literally: the smallest sample with at least p% of the samples <= it.
double naive_percentile(const std::vector<double>& samples, double p) {
  double best = 0;
  bool found = false;
  for (double x : samples) {
    size_t n_le = 0;
    for (double y : samples) n_le += y <= x;
    if (100.0 * static_cast<double>(n_le) >= p * static_cast<double>(samples.size()) && (!found || x < best)) {
      best = x;
      found = true;
    }
  }
  return best;
}

TEST_CASE("nearest-rank percentiles on known samples") {
  std::vector<double> ten = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  CHECK(percentile_nearest_rank(ten, 50) == 5);
  CHECK(percentile_nearest_rank(ten, 90) == 9);
  CHECK(percentile_nearest_rank(ten, 99) == 10);
  CHECK(percentile_nearest_rank(ten, 100) == 10);
  CHECK(percentile_nearest_rank({42}, 1) == 42);
  LatencySummary s = summarize({3, 1, 2});
  CHECK(s.n == 3);
  CHECK(s.mean == Approx(2));
  CHECK(s.p50 == 2);
  CHECK(s.p99 == 3);
  CHECK(summarize({}).n == 0);
}

TEST_CASE("nearest-rank percentiles match the naive definition on random samples") {
  std::mt19937_64 rng(std::random_device{}());
  for (int trial = 0; trial < 200; ++trial) {
    const size_t n = std::uniform_int_distribution<size_t>(1, 300)(rng);
    std::vector<double> samples(n);
    // Few distinct values, so ties are common.
    for (double& x : samples) x = static_cast<double>(std::uniform_int_distribution<int>(0, 50)(rng));
    LatencySummary s = summarize(samples);
    CHECK(s.p50 == naive_percentile(samples, 50));
    CHECK(s.p90 == naive_percentile(samples, 90));
    CHECK(s.p99 == naive_percentile(samples, 99));
    CHECK(s.p50 <= s.p90);
    CHECK(s.p90 <= s.p99);
    CHECK(s.p99 <= s.max);
  }
}

}  // namespace
}  // namespace baton::ctl
