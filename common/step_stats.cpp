#include "common/step_stats.h"

#include <cmath>

namespace baton {
namespace {

constexpr double kWeight = 0.2;  // of the newest prompt step in the averages

}  // namespace

void StepStats::add_step(Clock::time_point end, double seconds, int64_t prompt_tokens) {
  if (!(seconds >= 0)) return;
  if (seconds >= slowest_step_seconds(end)) {
    slowest_ = seconds;
    slowest_at_ = end;
  }
  if (prompt_tokens > 0 && seconds > 0) {
    const bool first = avg_seconds_ == 0;
    avg_tokens_ = first ? static_cast<double>(prompt_tokens) : (1 - kWeight) * avg_tokens_ + kWeight * prompt_tokens;
    avg_seconds_ = first ? seconds : (1 - kWeight) * avg_seconds_ + kWeight * seconds;
  }
}

double StepStats::slowest_step_seconds(Clock::time_point now) const {
  if (slowest_ == 0) return 0;
  const double age = std::chrono::duration<double>(now - slowest_at_).count();
  return age <= 0 ? slowest_ : slowest_ * std::exp2(-age / std::chrono::duration<double>(kHalfLife).count());
}

double StepStats::prompt_tokens_per_second() const { return avg_seconds_ > 0 ? avg_tokens_ / avg_seconds_ : 0; }

}  // namespace baton
