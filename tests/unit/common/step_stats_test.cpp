// StepStats' fit of a prompt step's time (fixed + per token × tokens) against steps drawn from a
// known line with noise; steps too alike to separate the two parts.
#include "common/step_stats.h"

#include <catch2/catch.hpp>
#include <cstdio>
#include <random>

using namespace baton;

namespace {

uint32_t seed_for(const char* name) {
  const uint32_t seed = std::random_device{}();
  std::printf("%s seed %u\n", name, seed);
  return seed;
}

}  // namespace

TEST_CASE("step stats: a prompt step's time is fitted as fixed + per token", "[common][step_stats]") {
  std::mt19937 rng(seed_for("step time fit"));
  const double fixed = std::uniform_real_distribution<double>(0.01, 0.8)(rng);
  const double per_token = std::uniform_real_distribution<double>(1e-4, 5e-3)(rng);
  std::uniform_int_distribution<int64_t> tokens(16, 512);
  std::normal_distribution<double> noise(1.0, 0.03);
  StepStats s;
  CHECK(s.step_time_fit().seconds_per_token == 0);  // nothing yet
  auto t = StepStats::Clock::now();
  for (int i = 0; i < 200; ++i) {
    const int64_t n = tokens(rng);
    t += std::chrono::milliseconds(100);
    s.add_step(t, (fixed + per_token * static_cast<double>(n)) * noise(rng), n);
  }
  const StepStats::Fit fit = s.step_time_fit();
  INFO("true " << fixed << " + " << per_token << "/token, fitted " << fit.fixed_seconds << " + "
               << fit.seconds_per_token);
  // Predicted steps of every size within a few per cent of the line (3 % noise per step). The
  // noise is a share of each step, so the fitted intercept is as uncertain as the largest steps'
  // few per cent: a small step's prediction is held to that, not to a share of its own time.
  const double largest = fixed + per_token * 512.0;
  for (int64_t n : {16, 128, 256, 512}) {
    const double truth = fixed + per_token * static_cast<double>(n);
    CHECK(fit.fixed_seconds + fit.seconds_per_token * static_cast<double>(n) ==
          Approx(truth).epsilon(0.06).margin(0.03 * largest));
  }
  // Pure decode steps (no prompt tokens) say nothing about it.
  s.add_step(t, 5.0, 0);
  CHECK(s.step_time_fit().fixed_seconds == fit.fixed_seconds);
}

TEST_CASE("step stats: steps all of one size keep the fixed share last fitted, at their mean", "[common][step_stats]") {
  StepStats s;
  auto t = StepStats::Clock::now();
  // Every step the same size: nothing separates the parts yet; a step is taken as all per-token.
  for (int i = 0; i < 10; ++i) s.add_step(t, 1.0, 500);
  CHECK(s.step_time_fit().fixed_seconds == 0);
  CHECK(s.step_time_fit().seconds_per_token == Approx(1.0 / 500));
  // Sizes that vary: 0.5 s + 1 ms a token.
  for (int i = 0; i < 100; ++i) {
    const int64_t n = 100 + 40 * (i % 10);
    s.add_step(t, 0.5 + 0.001 * static_cast<double>(n), n);
  }
  StepStats::Fit fit = s.step_time_fit();
  CHECK(fit.fixed_seconds == Approx(0.5).epsilon(0.01));
  CHECK(fit.seconds_per_token == Approx(0.001).epsilon(0.01));
  // Then only full 512-token steps on the same line: the fixed share of a step stays what was
  // fitted last.
  for (int i = 0; i < 300; ++i) s.add_step(t, 0.5 + 0.001 * 512, 512);
  fit = s.step_time_fit();
  CHECK(fit.fixed_seconds == Approx(0.5).epsilon(0.01));
  CHECK(fit.seconds_per_token == Approx(0.001).epsilon(0.01));
  // Twice as slow (another process took half the core): the line goes through the new steps.
  for (int i = 0; i < 300; ++i) s.add_step(t, 2 * (0.5 + 0.001 * 512), 512);
  fit = s.step_time_fit();
  CHECK(fit.fixed_seconds + fit.seconds_per_token * 512 == Approx(2 * (0.5 + 0.001 * 512)).epsilon(0.01));
  CHECK(fit.fixed_seconds > 0);
}
