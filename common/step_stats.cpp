#include "common/step_stats.h"

#include <algorithm>
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
    const double keep = 1 - 1.0 / kFitSteps;
    const auto x = static_cast<double>(prompt_tokens);
    w_ = keep * w_ + 1;
    wx_ = keep * wx_ + x;
    wy_ = keep * wy_ + seconds;
    wxx_ = keep * wxx_ + x * x;
    wxy_ = keep * wxy_ + x * seconds;
    refit();
  }
}

void StepStats::refit() {
  const double mx = wx_ / w_, my = wy_ / w_;
  const double var = wxx_ / w_ - mx * mx;
  const double cov = wxy_ / w_ - mx * my;
  // Sizes that vary by at least a tenth of their mean, and time that grows with them, separate
  // the fixed part from the per-token part.
  if (var > 0.01 * mx * mx && cov > 0) {
    const double per_token = cov / var;
    const double fixed = my - per_token * mx;
    fixed_share_ = fixed > 0 ? std::min(fixed / my, 1.0) : 0;
  }
  fit_.fixed_seconds = fixed_share_ * my;
  fit_.seconds_per_token = (1 - fixed_share_) * my / mx;
}

double StepStats::slowest_step_seconds(Clock::time_point now) const {
  if (slowest_ == 0) return 0;
  const double age = std::chrono::duration<double>(now - slowest_at_).count();
  return age <= 0 ? slowest_ : slowest_ * std::exp2(-age / std::chrono::duration<double>(kHalfLife).count());
}

double StepStats::prompt_tokens_per_second() const { return avg_seconds_ > 0 ? avg_tokens_ / avg_seconds_ : 0; }

}  // namespace baton
