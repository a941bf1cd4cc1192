// Durations as baton reports them (metrics, timings, logs): seconds as a double, on the steady
// clock.
#pragma once

#include <chrono>

namespace baton {

inline double seconds_between(std::chrono::steady_clock::time_point from, std::chrono::steady_clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

inline double seconds_since(std::chrono::steady_clock::time_point from) {
  return seconds_between(from, std::chrono::steady_clock::now());
}

}  // namespace baton
