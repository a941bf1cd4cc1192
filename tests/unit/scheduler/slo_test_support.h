// Shared by the TTFT predictor's and the TTFT-target admission's tests: workers reported by hand,
// requests, the scheduler's predicted-vs-seen samples and refusals recorded.
#pragma once

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "scheduler/ttft_predictor.h"
#include "tests/unit/scheduler/scheduler_harness.h"

namespace baton::scheduler_test {

using std::chrono::duration_cast;
using std::chrono::nanoseconds;

inline nanoseconds secs(double s) {
  return duration_cast<nanoseconds>(std::chrono::duration<double>(s));
}

// Reports a worker's load as given (registering it first when new).
inline void report(Harness& h, WorkerRole role, const std::string& address, WorkerLoad l) {
  auto& list = role == kDecode ? h.decode_addresses : h.prefill_addresses;
  if (std::find(list.begin(), list.end(), address) == list.end()) {
    list.push_back(address);
    h.registry.set_addresses(role, list);
  }
  if (role == kDecode) l.block_size = kBlockSize;
  REQUIRE(h.registry.report_load(role, address, l, h.clock.now()).ok());
}

inline WorkerLoad decode_load(int64_t free_blocks, int32_t n_running = 0, double local_rate = 0,
                              int32_t local_max = 0) {
  WorkerLoad l;
  l.free_blocks = free_blocks;
  l.total_blocks = std::max<int64_t>(free_blocks, 100);
  l.n_running = n_running;
  l.prefill_tokens_per_second = local_rate;
  l.local_prefill_max_tokens = local_max;
  return l;
}

inline WorkerLoad prefill_load(int64_t queued, double rate) {
  WorkerLoad l;
  l.queued_prompt_tokens = queued;
  l.prefill_tokens_per_second = rate;
  return l;
}

inline PendingRequest request(Harness& h, const std::string& id, int64_t n_prompt, int64_t n_blocks,
                              int32_t priority = 0, double slo = 0) {
  PendingRequest r;
  r.id = id;
  r.n_prompt_tokens = n_prompt;
  r.n_total_tokens = std::max(n_blocks * kBlockSize, n_prompt);  // at least the prompt's blocks
  r.priority = priority;
  r.arrival = h.clock.now();
  r.ttft_slo_seconds = slo;
  return r;
}

inline TtftPredictor::Ahead ahead(int64_t other, int64_t reported = 0, double age = 0) {
  TtftPredictor::Ahead a;
  a.reported = reported;
  a.other = other;
  a.report_age_seconds = age;
  return a;
}

struct Recorded {
  std::vector<std::pair<double, double>> ttft;  // predicted, actual
  std::map<SloRejection, int> rejected;
};

inline void record(Harness& h, Recorded& rec) {
  SchedulerEvents ev;
  ev.ttft = [&rec](double p, double a) { rec.ttft.emplace_back(p, a); };
  ev.slo_rejected = [&rec](SloRejection r) { ++rec.rejected[r]; };
  h.sched.set_events(std::move(ev));
}

// The predictions' relative errors, sorted, of a few hundred requests but the first 30 (which
// teach the predictor the rates).
inline std::vector<double> relative_errors(const Recorded& rec) {
  REQUIRE(rec.ttft.size() > 200);
  std::vector<double> errors;
  for (size_t i = 30; i < rec.ttft.size(); ++i) {
    const auto [predicted, actual] = rec.ttft[i];
    errors.push_back(std::abs(predicted - actual) / actual);
  }
  std::sort(errors.begin(), errors.end());
  return errors;
}

inline SchedulerConfig with_slo(double seconds) {
  SchedulerConfig cfg;
  cfg.ttft_slo_seconds = seconds;
  return cfg;
}

// A decode worker d:1 with `free_blocks` free, and a prefill worker p:1 at 1000 tokens/s with
// `queued` tokens; the scheduler's events recorded in `rec`.
inline void two_workers(Harness& h, Recorded& rec, int64_t free_blocks, int64_t queued) {
  record(h, rec);
  report(h, kDecode, "d:1", decode_load(free_blocks));
  report(h, kPrefill, "p:1", prefill_load(queued, 1000));
}

}  // namespace baton::scheduler_test
