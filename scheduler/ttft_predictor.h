// The frontend's prediction of a request's time to first token (TTFT), per placement, from what
// the workers report (WorkerSnapshot) and what the frontend measures itself (each first token's
// prefill time, by worker and prompt length). The scheduler asks it at admission (--ttft-slo)
// and at placement (where to prefill), and feeds it every first token.
//
// Via a prefill worker P, for a prompt of n tokens of which c should be in P's prefix cache:
//   wait    = (P's reported queue less what it computed since the report, + tokens sent to it
//              since, + tokens queued ahead at the frontend) / throughput(P)
//   compute = (n − c) / rate(P, n)
// Locally on decode worker D: the same with D's local prefill queue and rate.
//   rate(W, n)   the EWMA of (computed tokens / prefill seconds) of W's recent prompts in n's
//                length bucket (powers of two: attention makes long prompts slower per token),
//                else of its nearest measured bucket, else W's reported prefill_tokens_per_second,
//                else the caller's prior (the scheduler's: the fastest measured worker's rate),
//                else unknown (no prediction: the request is admitted, and nothing is recorded).
//   throughput(W) the prompt tokens per second W's steps compute, as W reports it (several
//                prompts share a step), else the EWMA of rate(W, ·) over every length.
// The KV hand-off is not in the TTFT (the first token is sent before the KV moves), and neither
// is decode: a request waits for decode KV only when no decode worker has its blocks, which the
// scheduler predicts apart (Scheduler::decode_wait_locked).
// Thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "scheduler/worker_registry.h"

namespace baton {

struct TtftPrediction {
  double wait_seconds = 0;     // the work ahead of it on that worker
  double compute_seconds = 0;  // its own prefill
  int64_t tokens_ahead = 0;    // prompt tokens ahead of it there
  double rate = 0;             // tokens/s its own prefill is predicted at
  double seconds() const { return wait_seconds + compute_seconds; }
};

class TtftPredictor {
 public:
  // Prompt length buckets: [1, 2), [2, 4), … up to 2^20 and beyond.
  static constexpr int kBuckets = 21;
  // The weight of a new measurement in the EWMA of its bucket.
  static constexpr double kEwmaWeight = 0.3;

  // What is ahead of a new prompt on a worker.
  struct Ahead {
    int64_t reported = 0;  // tokens its last load report said it had (drained since, at its throughput)
    int64_t other = 0;     // tokens sent since, and those queued ahead at the frontend
    double report_age_seconds = 0;  // how old that report is
  };
  // nullopt when `w`'s rate is not known yet. `n_compute` tokens of its own to prefill (the
  // prompt less its expected prefix-cache hit). `prior_rate` (tokens/s, 0: none) stands in for a
  // worker not measured at all yet (a decode worker that has not prefilled: the same model on a
  // like core, until it has).
  std::optional<TtftPrediction> predict(const WorkerSnapshot& w, int64_t n_compute, Ahead ahead,
                                        double prior_rate = 0) const;
  // A prefill on `address` computed `n_computed` tokens in `seconds` (from its first token).
  void observe(const std::string& address, int64_t n_computed, double seconds);
  // The measured or reported prefill rate of `w` for prompts of n tokens (0: unknown).
  double rate(const WorkerSnapshot& w, int64_t n) const;

 private:
  struct Rates {
    std::array<double, kBuckets> by_bucket{};  // tokens/s (0: none measured)
    double all = 0;                            // EWMA over every length
  };
  static int bucket_of(int64_t n);
  double rate_locked(const WorkerSnapshot& w, int64_t n) const;
  double queue_rate_locked(const WorkerSnapshot& w) const;

  mutable std::mutex mu_;
  std::map<std::string, Rates> rates_;  // guarded by mu_; by worker address
};

}  // namespace baton
