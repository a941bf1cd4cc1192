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

bool TtftPredictor::has_schedule(const WorkerSnapshot& w) {
  return w.load.step_token_budget > 0 && w.load.step_seconds_per_token > 0;
}

TtftPrediction TtftPredictor::by_schedule(const WorkerLoad& load, int64_t n_compute, Ahead ahead) {
  const int64_t budget = load.step_token_budget;
  const auto step_time = [&load](int64_t tokens) {
    return load.step_fixed_seconds + load.step_seconds_per_token * static_cast<double>(tokens);
  };
  const double full = step_time(budget);
  const double age = std::max(0.0, ahead.report_age_seconds);
  const int64_t reported = std::max<int64_t>(ahead.reported, 0);
  // From the report on (time 0): the step running then is free at `free`; the stream behind it.
  const int64_t in_step = std::clamp<int64_t>(load.step_tokens_in_progress, 0, reported);
  double free = in_step > 0 ? std::max(0.0, step_time(in_step) - load.step_elapsed_seconds) : 0;
  int64_t stream = reported - in_step + std::max<int64_t>(ahead.other, 0);
  // The steps started by now: full ones while the stream holds a budget's worth, then its rest.
  if (stream > 0 && free <= age) {
    const double started = std::floor((age - free) / full) + 1;
    const int64_t n_full = static_cast<int64_t>(std::min(static_cast<double>(stream / budget), started));
    free += static_cast<double>(n_full) * full;
    stream -= n_full * budget;
    if (stream > 0 && stream < budget && free <= age) {
      free += step_time(stream);
      stream = 0;
    }
  }
  // From now on: the next step starts when the one running now ends (now, when none does); the
  // prompt's tokens follow the stream's.
  const double start = std::max(free - age, 0.0);
  const int64_t own = std::max<int64_t>(n_compute, 1);
  const int64_t first_step = stream / budget;             // steps before the one with its first token
  const int64_t last_step = (stream + own - 1) / budget;  // and before the one with its last
  // Its last step holds the rest of its tokens, and what is sent before that step starts.
  const double last_start = start + static_cast<double>(last_step) * full;
  const double joining = std::max(0.0, ahead.arriving_tokens_per_second) * last_start;
  const int64_t in_last = stream + own - last_step * budget;
  const auto filled =
      static_cast<int64_t>(std::min(static_cast<double>(budget), static_cast<double>(in_last) + joining));
  TtftPrediction p;
  p.tokens_ahead = stream;
  p.wait_seconds = start + static_cast<double>(first_step) * full;
  const double end = last_start + step_time(filled);
  p.compute_seconds = end - p.wait_seconds;
  p.rate = static_cast<double>(own) / p.compute_seconds;
  return p;
}

std::optional<TtftPrediction> TtftPredictor::predict(const WorkerSnapshot& w, int64_t n_compute, Ahead ahead,
                                                     double prior_rate) const {
  if (has_schedule(w)) return by_schedule(w.load, n_compute, ahead);
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
