// client/slo.h: a request's ITL measure, SLO attainment and goodput against a naive reference
// on random requests, and the edge cases the definition names.
#include "client/slo.h"

#include <catch2/catch.hpp>
#include <random>

namespace baton::ctl {
namespace {

// The smallest gap with at least 99% of the gaps <= it (0 without gaps): the definition, literally.
double naive_p99(const std::vector<double>& gaps) {
  double best = 0;
  bool found = false;
  for (double x : gaps) {
    size_t n_le = 0;
    for (double y : gaps) n_le += y <= x;
    if (100.0 * static_cast<double>(n_le) >= 99.0 * static_cast<double>(gaps.size()) && (!found || x < best)) {
      best = x;
      found = true;
    }
  }
  return best;
}

TEST_CASE("a request's ITL is the p99 of its gaps: the max below 100 gaps") {
  CHECK(request_itl_seconds({}) == 0);
  CHECK(request_itl_seconds({0.3, 0.1, 0.2}) == 0.3);
  std::vector<double> gaps(200, 0.01);
  gaps[7] = 5;  // one stall in 200 gaps is above the p99 ...
  CHECK(request_itl_seconds(gaps) == 0.01);
  gaps[8] = 5;  // ... three are not: 197 / 200 < 99 %
  gaps[9] = 5;
  CHECK(request_itl_seconds(gaps) == 5);
  std::mt19937_64 rng(std::random_device{}());
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<double> g(std::uniform_int_distribution<size_t>(0, 400)(rng));
    for (double& x : g) x = std::uniform_int_distribution<int>(1, 40)(rng) * 1e-3;  // ties are common
    CHECK(request_itl_seconds(g) == naive_p99(g));
    if (!g.empty() && g.size() < 100) CHECK(request_itl_seconds(g) == *std::max_element(g.begin(), g.end()));
  }
}

TEST_CASE("SLO attainment and goodput match a naive count on random requests") {
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_real_distribution<double> u(0, 1);
  for (int trial = 0; trial < 500; ++trial) {
    const size_t n = std::uniform_int_distribution<size_t>(0, 200)(rng);
    std::vector<SloInput> requests(n);
    std::vector<std::vector<double>> gaps(n);
    for (size_t i = 0; i < n; ++i) {
      requests[i].ok = u(rng) < 0.9;
      // Whole milliseconds: some land exactly on the bound.
      requests[i].ttft_seconds = u(rng) < 0.05 ? -1 : std::uniform_int_distribution<int>(0, 400)(rng) * 1e-3;
      gaps[i].resize(std::uniform_int_distribution<size_t>(0, 150)(rng));
      for (double& g : gaps[i]) g = std::uniform_int_distribution<int>(1, 80)(rng) * 1e-3;
      requests[i].itl_seconds = request_itl_seconds(gaps[i]);
    }
    Slo slo;
    if (u(rng) < 0.8) slo.ttft_seconds = std::uniform_int_distribution<int>(0, 400)(rng) * 1e-3;
    if (u(rng) < 0.8) slo.itl_seconds = std::uniform_int_distribution<int>(1, 80)(rng) * 1e-3;
    const double wall = u(rng) < 0.05 ? 0 : 0.1 + 100 * u(rng);
    const SloSummary s = summarize_slo(requests, slo, wall);

    size_t met = 0, met_ttft = 0, met_itl = 0;
    for (size_t i = 0; i < n; ++i) {
      if (!requests[i].ok) continue;
      const double t = requests[i].ttft_seconds;
      const bool ttft_ok = !slo.ttft_seconds || (t >= 0 && t <= *slo.ttft_seconds);
      const bool itl_ok = !slo.itl_seconds || naive_p99(gaps[i]) <= *slo.itl_seconds;
      met_ttft += ttft_ok;
      met_itl += itl_ok;
      met += ttft_ok && itl_ok;
    }
    CHECK(s.n_total == n);
    CHECK(s.n_met == met);
    CHECK(s.n_met_ttft == met_ttft);
    CHECK(s.n_met_itl == met_itl);
    CHECK(s.attainment == Approx(n > 0 ? static_cast<double>(met) / n : 0.0));
    CHECK(s.goodput == Approx(wall > 0 ? static_cast<double>(met) / wall : 0.0));
  }
}

TEST_CASE("an impossible SLO gives no goodput, a generous one the throughput") {
  std::vector<SloInput> requests = {{true, 0.2, 0.01}, {true, 0.5, 0.03}, {false, 0.1, 0.0}, {true, -1, 0}};
  const SloSummary none = summarize_slo(requests, Slo{1e-9, 1e-9}, 2.0);
  CHECK(none.n_met == 0);
  CHECK(none.goodput == 0);
  const SloSummary all = summarize_slo({requests[0], requests[1]}, Slo{1e6, 1e6}, 2.0);
  CHECK(all.n_met == 2);
  CHECK(all.attainment == 1);
  CHECK(all.goodput == Approx(1.0));
  // A bound is inclusive; a failed request or one without a token misses the TTFT bound.
  CHECK(meets_slo(requests[0], Slo{0.2, 0.01}));
  CHECK(!meets_slo(requests[2], Slo{}));
  CHECK(!meets_ttft(requests[3], Slo{1e6, std::nullopt}));
  CHECK(meets_ttft(requests[3], Slo{}));
}

}  // namespace
}  // namespace baton::ctl
