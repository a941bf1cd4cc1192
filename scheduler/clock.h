// The scheduler's source of time. Everything in scheduler/ that compares times (deadlines, stale
// load reports, how long the queue head has waited) reads it through a Clock, so tests drive time
// with a FakeClock instead of sleeping.
#pragma once

#include <atomic>
#include <chrono>

#include "common/check.h"

namespace baton {

using TimePoint = std::chrono::steady_clock::time_point;

class Clock {
 public:
  virtual ~Clock() = default;
  // Monotonic: never goes backwards. Safe to call from any thread.
  virtual TimePoint now() const = 0;
};

// The real monotonic clock (std::chrono::steady_clock).
class SteadyClock final : public Clock {
 public:
  TimePoint now() const override { return std::chrono::steady_clock::now(); }
};

// A clock that moves only when told to. Thread-safe; starts at an arbitrary fixed, non-epoch
// time so that "time zero" bugs do not hide.
class FakeClock final : public Clock {
 public:
  FakeClock() : ticks_(std::chrono::duration_cast<TimePoint::duration>(kStart).count()) {}
  explicit FakeClock(TimePoint start) : ticks_(start.time_since_epoch().count()) {}

  TimePoint now() const override { return TimePoint(TimePoint::duration(ticks_.load(std::memory_order_acquire))); }
  // Moves time forward by `d` (must be >= 0: a Clock never goes backwards).
  void advance(std::chrono::nanoseconds d) {
    BATON_CHECK(d.count() >= 0, "FakeClock::advance by a negative duration (%lld ns)",
                static_cast<long long>(d.count()));
    ticks_.fetch_add(std::chrono::duration_cast<TimePoint::duration>(d).count(), std::memory_order_acq_rel);
  }
  // Sets the time; the caller keeps it monotonic.
  void set(TimePoint t) { ticks_.store(t.time_since_epoch().count(), std::memory_order_release); }

 private:
  static constexpr std::chrono::nanoseconds kStart = std::chrono::hours(1000);
  std::atomic<TimePoint::rep> ticks_;  // steady_clock ticks since its epoch
};

}  // namespace baton
