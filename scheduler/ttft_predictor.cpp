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

TtftPrediction TtftPredictor::by_schedule(const WorkerLoad& load, int64_t n_compute, const Ahead& ahead) {
  const int64_t budget = load.step_token_budget;
  const auto step_time = [&load](int64_t tokens) {
    return load.step_fixed_seconds + load.step_seconds_per_token * static_cast<double>(tokens);
  };
  const double full = step_time(budget);
  const double age = std::max(0.0, ahead.report_age_seconds);
  const int64_t reported = std::max<int64_t>(ahead.reported, 0);
  // The worker replayed from its report (time 0) to now (`age`): the step running then ends at
  // `free`, when the worker plans its next step from what is queued by then: the queue behind that
  // step, and the prompts sent since, each from when it was sent. Steps planned by now are not
  // joined.
  const int64_t in_step = std::clamp<int64_t>(load.step_tokens_in_progress, 0, reported);
  double free = in_step > 0 ? std::max(0.0, step_time(in_step) - load.step_elapsed_seconds) : 0;
  int64_t queued = reported - in_step;
  const auto& sent = ahead.sent;
  size_t next = 0;  // of `sent`, the first not queued yet
  // Each turn takes an arrival, a run of full steps or one partial step: a few turns a prompt sent.
  for (size_t turn = 0; turn < 4 * sent.size() + 4; ++turn) {
    while (next < sent.size() && sent[next].first <= free) queued += sent[next++].second;
    if (free > age) break;  // its next step is planned after now
    if (queued == 0) {
      if (next == sent.size() || sent[next].first > age) break;  // idle now
      free = sent[next].first;                                   // idle until that one came
    } else if (queued >= budget) {
      const double started = std::floor((age - free) / full) + 1;  // full steps planned by now
      const auto n_full = static_cast<int64_t>(std::min(static_cast<double>(queued / budget), started));
      free += static_cast<double>(n_full) * full;
      queued -= n_full * budget;
    } else {
      free += step_time(queued);
      queued = 0;
    }
  }
  for (; next < sent.size(); ++next) queued += sent[next].second;
  const int64_t stream = queued + std::max<int64_t>(ahead.other, 0);
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

std::optional<TtftPrediction> TtftPredictor::predict(const WorkerSnapshot& w, int64_t n_compute, const Ahead& ahead,
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
  int64_t sent = 0;
  for (const auto& [when, n] : ahead.sent) sent += n;
  p.tokens_ahead = reported + std::max<int64_t>(ahead.other, 0) + sent;
  p.rate = own;
  p.wait_seconds = static_cast<double>(p.tokens_ahead) / queue;
  p.compute_seconds = static_cast<double>(std::max<int64_t>(n_compute, 1)) / own;
  return p;
}

}  // namespace baton
