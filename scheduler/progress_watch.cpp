#include "scheduler/progress_watch.h"

#include <algorithm>
#include <cmath>

#include "scheduler/worker_registry.h"

namespace baton {

Status ProgressConfig::validate() const {
  if (!(grace_seconds > 0) || !std::isfinite(grace_seconds)) {
    return invalid_argument("--progress-grace-seconds must be a positive number of seconds");
  }
  if (!(slack >= 1) || !std::isfinite(slack)) return invalid_argument("--progress-slack must be at least 1");
  if (!(min_prefill_tokens_per_second > 0) || !std::isfinite(min_prefill_tokens_per_second)) {
    return invalid_argument("--progress-min-prefill-rate must be a positive number of tokens per second");
  }
  return {};
}

ProgressInputs progress_inputs(ProgressInputs::Phase phase, const WorkerSnapshot* prefill, const WorkerSnapshot* decode,
                               int64_t own_tokens, bool handoff_in_flight) {
  using Phase = ProgressInputs::Phase;
  ProgressInputs in;
  in.phase = phase;
  if (decode) in.decode_step_seconds = decode->load.step_seconds;
  if (prefill) in.prefill_step_seconds = prefill->load.step_seconds;
  switch (phase) {
    case Phase::kAdmitting: break;
    case Phase::kLocalPrefill:
      // Its own tokens, and the other prompts this decode worker prefills (they share its steps).
      in.tokens = own_tokens + (decode ? decode->load.queued_prompt_tokens : 0);
      if (decode) in.prefill_tokens_per_second = decode->load.prefill_tokens_per_second;
      break;
    case Phase::kPrefill:
      // Everything the worker has to compute, this prompt included (those behind it too: a
      // bound, not an estimate).
      in.tokens = std::max(own_tokens, prefill ? prefill->outstanding_prompt_tokens() : 0);
      if (prefill) in.prefill_tokens_per_second = prefill->load.prefill_tokens_per_second;
      break;
    case Phase::kDecoding:
      in.handoff_in_flight = handoff_in_flight;
      // Prompts the decode worker prefills itself share the steps that bring this request's tokens.
      if (decode) {
        in.tokens = decode->load.queued_prompt_tokens;
        in.prefill_tokens_per_second = decode->load.prefill_tokens_per_second;
      }
      break;
  }
  return in;
}

double progress_bound(const ProgressConfig& config, const ProgressInputs& in) {
  const double rate = std::max(in.prefill_tokens_per_second, config.min_prefill_tokens_per_second);
  const double tokens = static_cast<double>(std::max<int64_t>(in.tokens, 0));
  // A worker that has not stepped yet (cold: its first steps also build kernels) is given a step
  // of kUnmeasuredStepTokens prompt tokens at the floor rate.
  const double unmeasured = kUnmeasuredStepTokens / config.min_prefill_tokens_per_second;
  const double decode_step = in.decode_step_seconds > 0 ? in.decode_step_seconds : unmeasured;
  const double prefill_step = in.prefill_step_seconds > 0 ? in.prefill_step_seconds : unmeasured;
  double expected = 0;
  switch (in.phase) {
    case ProgressInputs::Phase::kAdmitting: break;
    case ProgressInputs::Phase::kPrefill:
      // The worker reports progress after every step: one step, or for a worker that has not
      // stepped yet, the whole prompt (and what is ahead of it) at the floor rate.
      expected = in.prefill_step_seconds > 0 ? in.prefill_step_seconds : std::max(tokens / rate, unmeasured);
      break;
    case ProgressInputs::Phase::kLocalPrefill: expected = tokens / rate + decode_step; break;
    case ProgressInputs::Phase::kDecoding:
      expected = decode_step + tokens / rate + (in.handoff_in_flight ? prefill_step : 0);
      break;
  }
  return config.grace_seconds + config.slack * expected;
}

std::string progress_phase_name(ProgressInputs::Phase phase) {
  switch (phase) {
    case ProgressInputs::Phase::kAdmitting: return "admitting";
    case ProgressInputs::Phase::kPrefill: return "prefill";
    case ProgressInputs::Phase::kLocalPrefill: return "local prefill";
    case ProgressInputs::Phase::kDecoding: return "decoding";
  }
  return "?";
}

void ProgressWatch::add(std::weak_ptr<ProgressWatched> w) {
  std::lock_guard<std::mutex> lock(mu_);
  watched_.push_back(std::move(w));
}

size_t ProgressWatch::check(TimePoint now) {
  std::vector<std::shared_ptr<ProgressWatched>> live;
  {
    std::lock_guard<std::mutex> lock(mu_);
    live.reserve(watched_.size());
    std::erase_if(watched_, [&](const std::weak_ptr<ProgressWatched>& w) {
      auto p = w.lock();
      if (!p) return true;
      live.push_back(std::move(p));
      return false;
    });
  }
  // Outside the lock: a check may fail an attempt over, which submits to the scheduler.
  for (const auto& p : live) p->check_progress(now);
  return live.size();
}

}  // namespace baton
