// Progress, not just liveness. A worker that dies breaks its connection and the pipeline fails
// the attempt over; a worker that hangs (SIGSTOP, a stuck driver call, a page-faulting host), or
// that the network cuts off, breaks nothing: its calls simply go quiet. So every attempt carries
// a bound on how long it may go without progress, derived from what its workers report, and a
// ProgressWatch checks every live request against its bound a few times a second. An attempt past
// its bound fails over exactly as a broken stream does.
//
// Progress is any event of the attempt: the Admit's answer, a prefill worker's progress (sent
// after each of its steps while the prompt waits or is part done: PrefillUpdate::kProgress), its
// first token or kv_sent, any decode event. The silence allowed until the next one
// (progress_bound):
//
//   admitting      grace
//   prefill        grace + slack × the prefill worker's step time (a worker that has not stepped
//                  yet: its prompt tokens and those ahead of it / the floor rate)
//   local prefill  grace + slack × ((its tokens + the worker's other local prompts) / the decode
//                  worker's prefill rate + its step time)
//   decoding       grace + slack × (the decode worker's step time + its local prompts / its
//                  prefill rate, + the prefill worker's step time while the KV hand-off is in flight)
//
// grace (--progress-grace-seconds) absorbs what no report covers: a network round trip, a
// scheduling hiccup. slack (--progress-slack) is how many times slower than reported a worker
// may be before it counts as stuck. Step times are each worker's slowest recent step (a max that
// decays), rates its measured prompt tokens per second; a worker that has measured nothing yet is
// assumed to prefill at --progress-min-prefill-rate, and to take a step of kUnmeasuredStepTokens
// prompt tokens at that rate (its first steps are slow: they build their kernels).
//
// With no other worker of the stuck role to move to (a deployment of one decode worker), the
// attempt keeps waiting for the stuck one rather than fail over onto it again, and moves once
// another can take work.
//
// A decode sequence waiting for one of --max-batch slots (more sequences running than the batch
// holds: the n choices of one prompt may be many) waits for another to finish, which no report
// bounds; the decode worker sends it an empty event every DecodeConfig::slot_wait_beat (0.5 s)
// meanwhile, which is progress: a worker that steps is not stuck.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "scheduler/clock.h"

namespace baton {

inline constexpr double kUnmeasuredStepTokens = 64;

struct ProgressConfig {
  bool enabled = true;                  // false: no watchdog (an attempt waits as long as its deadline)
  double grace_seconds = 1.5;           // --progress-grace-seconds, > 0
  double slack = 3.0;                   // --progress-slack, >= 1
  double min_prefill_tokens_per_second = 50;  // --progress-min-prefill-rate, > 0: for workers not measured yet
  Status validate() const;
};

// What the bound is computed from: the figures of the workers an attempt uses (0 = unknown).
struct ProgressInputs {
  enum class Phase { kAdmitting, kPrefill, kLocalPrefill, kDecoding };
  Phase phase = Phase::kAdmitting;
  // kPrefill: its tokens and those ahead (used only while the worker has no step time);
  // kLocalPrefill: its own and the decode worker's other local prompts; kDecoding: those others.
  int64_t tokens = 0;
  double prefill_tokens_per_second = 0;  // of the worker that prefills
  double prefill_step_seconds = 0;   // the prefill worker's slowest recent step
  double decode_step_seconds = 0;    // the decode worker's slowest recent step
  bool handoff_in_flight = false;    // kDecoding: the prefill worker has not reported kv_sent yet
};

struct WorkerSnapshot;  // scheduler/worker_registry.h

// The inputs for an attempt in `phase`, from its workers' last load reports (null: the registry
// does not know it). `own_tokens`: its prompt and the tokens generated so far (a failover
// prefills both); `handoff_in_flight`: see ProgressInputs.
ProgressInputs progress_inputs(ProgressInputs::Phase phase, const WorkerSnapshot* prefill, const WorkerSnapshot* decode,
                               int64_t own_tokens, bool handoff_in_flight);

// Seconds of silence allowed before the attempt counts as stuck.
double progress_bound(const ProgressConfig& config, const ProgressInputs& in);
// "admitting", "prefill", "local prefill", "decoding": for the failover message.
std::string progress_phase_name(ProgressInputs::Phase phase);

// Something with a progress bound (a RequestPipeline).
class ProgressWatched {
 public:
  virtual ~ProgressWatched() = default;
  // Fails the current attempt over when it has been silent longer than its bound at `now`.
  virtual void check_progress(TimePoint now) = 0;
};

// The live requests of a frontend, checked against their bounds (check() from one thread, a few
// times a second; add() from any). Holds them weakly: a request that ended drops out.
class ProgressWatch {
 public:
  void add(std::weak_ptr<ProgressWatched> w);
  // Calls check_progress(now) on each live request; returns how many are live.
  size_t check(TimePoint now);

 private:
  std::mutex mu_;
  std::vector<std::weak_ptr<ProgressWatched>> watched_;  // guarded by mu_
};

}  // namespace baton
