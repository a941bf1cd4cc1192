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

  static constexpr std::chrono::seconds kHalfLife{10};

 private:
  double slowest_ = 0;
  Clock::time_point slowest_at_{};
  double avg_tokens_ = 0, avg_seconds_ = 0;
};

}  // namespace baton
