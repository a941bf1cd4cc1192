// What a worker's load report says about its speed, for the frontend's progress bounds
// (scheduler/progress_watch.h): its slowest recent step, and the prompt tokens per second its
// steps compute. Not thread-safe: the engine updates and reads it under its own mutex.
#pragma once

#include <chrono>
#include <cstdint>

namespace baton {

class StepStats {
 public:
  using Clock = std::chrono::steady_clock;

  // A step that ended at `end`, took `seconds` and computed `prompt_tokens` prompt positions
  // (0 for a pure decode step).
  void add_step(Clock::time_point end, double seconds, int64_t prompt_tokens);
  // The slowest step, decayed by half every kHalfLife since it was seen: one slow step (a long
  // prompt chunk) keeps the bound loose for a while, not forever. 0 before the first step.
  double slowest_step_seconds(Clock::time_point now) const;
  // Prompt tokens per second over recent prompt-computing steps (an exponential average of
  // tokens over one of seconds, so that short steps do not dominate). 0 before the first.
  double prompt_tokens_per_second() const;
  // A prompt step's time as fixed + per token × its prompt tokens, fitted by least squares over
  // recent prompt steps (exponentially weighted, about kFitSteps of them). Meaningful where every
  // step computes prompt tokens only (a prefill worker's). While the recent steps are too alike in
  // size to separate the two (every step full, say), the fixed share of a step is kept from the
  // last fit that could, at today's mean; before any could, a step is taken as all per-token.
  // {0, 0} before the first prompt step.
  struct Fit {
    double fixed_seconds = 0;
    double seconds_per_token = 0;
  };
  Fit step_time_fit() const { return fit_; }

  static constexpr std::chrono::seconds kHalfLife{10};
  static constexpr int kFitSteps = 20;

 private:
  double slowest_ = 0;
  Clock::time_point slowest_at_{};
  double avg_tokens_ = 0, avg_seconds_ = 0;
  // The fit's weighted sums over prompt steps (x: tokens, y: seconds), and the fit itself.
  double w_ = 0, wx_ = 0, wy_ = 0, wxx_ = 0, wxy_ = 0;
  double fixed_share_ = 0;  // of a mean step, from the last fit that could separate it
  Fit fit_;
  void refit();
};

}  // namespace baton
