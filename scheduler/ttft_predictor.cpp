#include "scheduler/ttft_predictor.h"

#include <algorithm>
#include <bit>
#include <cmath>

namespace baton {

int TtftPredictor::bucket_of(int64_t n) {
  if (n < 1) return 0;
  return std::min(kBuckets - 1, static_cast<int>(std::bit_width(static_cast<uint64_t>(n))) - 1);
}

void TtftPredictor::observe(const std::string& address, int64_t n_computed, double seconds) {
  // A prompt served from the prefix cache but for its last block, or a clock that did not move,
  // says nothing about the rate.
  if (n_computed < 1 || !(seconds > 0) || !std::isfinite(seconds)) return;
  const double r = static_cast<double>(n_computed) / seconds;
  std::lock_guard lock(mu_);
  Rates& rates = rates_[address];
  double& b = rates.by_bucket[static_cast<size_t>(bucket_of(n_computed))];
  b = b == 0 ? r : (1 - kEwmaWeight) * b + kEwmaWeight * r;
  rates.all = rates.all == 0 ? r : (1 - kEwmaWeight) * rates.all + kEwmaWeight * r;
}

double TtftPredictor::rate_locked(const WorkerSnapshot& w, int64_t n) const {
  if (auto it = rates_.find(w.address); it != rates_.end()) {
    const auto& by = it->second.by_bucket;
    const int b = bucket_of(n);
    // The nearest measured bucket; shorter first at equal distance (a shorter prompt's rate,
    // higher per token, errs towards admitting).
    for (int d = 0; d < kBuckets; ++d) {
      if (b - d >= 0 && by[static_cast<size_t>(b - d)] > 0) return by[static_cast<size_t>(b - d)];
      if (b + d < kBuckets && by[static_cast<size_t>(b + d)] > 0) return by[static_cast<size_t>(b + d)];
    }
  }
  return w.load.prefill_tokens_per_second;
}

double TtftPredictor::queue_rate_locked(const WorkerSnapshot& w) const {
  // The work ahead drains at the worker's step throughput (several prompts share a step), which
  // it reports; the frontend's per-prompt rates stand in before its first report of one.
  if (w.load.prefill_tokens_per_second > 0) return w.load.prefill_tokens_per_second;
  if (auto it = rates_.find(w.address); it != rates_.end()) return it->second.all;
  return 0;
}

double TtftPredictor::rate(const WorkerSnapshot& w, int64_t n) const {
  std::lock_guard lock(mu_);
  return rate_locked(w, n);
}

std::optional<TtftPrediction> TtftPredictor::predict(const WorkerSnapshot& w, int64_t n_compute, Ahead ahead,
                                                     double prior_rate) const {
  std::lock_guard lock(mu_);
  double own = rate_locked(w, std::max<int64_t>(n_compute, 1));
  double queue = queue_rate_locked(w);
  if (own == 0 && queue == 0) own = queue = prior_rate;
  if (!(own > 0) || !(queue > 0)) return std::nullopt;
  TtftPrediction p;
  // The report is a poll period old or so: the worker has computed since (when it had work).
  const double drained = std::max(0.0, ahead.report_age_seconds) * queue;
  const auto reported = static_cast<int64_t>(std::max(0.0, static_cast<double>(ahead.reported) - drained));
  p.tokens_ahead = reported + std::max<int64_t>(ahead.other, 0);
  p.rate = own;
  p.wait_seconds = static_cast<double>(p.tokens_ahead) / queue;
  p.compute_seconds = static_cast<double>(std::max<int64_t>(n_compute, 1)) / own;
  return p;
}

}  // namespace baton
