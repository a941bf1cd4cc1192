// The frontend's prediction of a request's time to first token (TTFT), per placement, from what
// the workers report (WorkerSnapshot) and what the frontend measures itself (each first token's
// prefill time, by worker and prompt length). The scheduler asks it at admission (--ttft-slo)
// and at placement (where to prefill), and feeds it every first token.
//
// For a prompt of n tokens of which c should be in the worker's prefix cache, with the work ahead
// of it there = the worker's reported queue, + tokens sent to it since the report, + tokens
// queued ahead at the frontend:
//
// By the step schedule, where the worker reports one (a prefill worker: WorkerLoad's step_*).
// Its steps take the queue FIFO, up to the budget B each, and a step of k tokens takes
// fixed + per_token × k. The worker is replayed from its report to now: the step running then ends
// first; each next step is planned from what is queued when the last one ends (the queue behind it,
// and the prompts sent since the report, each from when it was sent), or when a prompt comes to an
// idle worker. The step running now is not joined; the tokens queued now, those queued ahead at the
// frontend, then the new prompt's n − c tokens form a stream cut into steps of B, and its first token
// comes at the end of the step holding its last token. Prompts that arrive while a step runs thus
// share the next step, as the worker packs them: the per-prompt model below, which drains the queue
// prompt after prompt, over-predicts them (by up to 2× at 1 req/s of 256-token prompts in a
// 512-token budget on a slow core: bench/RESULTS.md). Prompts sent after this one, before its last
// step starts, fill that step too (up to the budget), which makes it longer: at the rate prompt
// tokens were sent to the worker lately (their expected number: whether one comes is a coin the
// prediction cannot see, the error that remains).
//   wait    = until the step holding its first token starts
//   compute = from then to the end of the step holding its last
//
// Otherwise per prompt (a decode worker prefilling locally, or a worker that reports no schedule):
//   wait    = (the work ahead, less what it computed since the report) / throughput(W)
//   compute = (n − c) / rate(W, n)
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
#include <utility>
#include <vector>

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
    int64_t other = 0;     // tokens sent since (those not in `sent`), and those queued ahead at the frontend
    double report_age_seconds = 0;  // how old that report is
    // The prompts sent to it since the report: (seconds after the report, tokens), in that order.
    std::vector<std::pair<double, int64_t>> sent;
    // Prompt tokens sent to the worker per second lately (by schedule only): those sent before the
    // step holding the prompt's last token starts join that step, up to its budget.
    double arriving_tokens_per_second = 0;
  };
  // nullopt when `w`'s rate is not known yet. `n_compute` tokens of its own to prefill (the
  // prompt less its expected prefix-cache hit). `prior_rate` (tokens/s, 0: none) stands in for a
  // worker not measured at all yet (a decode worker that has not prefilled: the same model on a
  // like core, until it has).
  std::optional<TtftPrediction> predict(const WorkerSnapshot& w, int64_t n_compute, const Ahead& ahead,
                                        double prior_rate = 0) const;
  // A prefill on `address` computed `n_computed` tokens in `seconds` (from its first token).
  void observe(const std::string& address, int64_t n_computed, double seconds);
  // The measured or reported prefill rate of `w` for prompts of n tokens (0: unknown).
  double rate(const WorkerSnapshot& w, int64_t n) const;
  // Whether `w` reports a step schedule the prediction can follow.
  static bool has_schedule(const WorkerSnapshot& w);

 private:
  struct Rates {
    std::array<double, kBuckets> by_bucket{};  // tokens/s (0: none measured)
    double all = 0;                            // EWMA over every length
  };
  static int bucket_of(int64_t n);
  double rate_locked(const WorkerSnapshot& w, int64_t n) const;
  double queue_rate_locked(const WorkerSnapshot& w) const;
  static TtftPrediction by_schedule(const WorkerLoad& load, int64_t n_compute, const Ahead& ahead);

  mutable std::mutex mu_;
  std::map<std::string, Rates> rates_;  // guarded by mu_; by worker address
};

}  // namespace baton
