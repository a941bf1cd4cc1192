// Admission and placement of requests onto (prefill, decode) worker pairs.
//
// Lifecycle of one request (the frontend drives it; the scheduler never calls a worker):
//   submit ── refused at once (a non-OK Status; no callback), or admitted and queued
//   queued ── on_placed(Placement) once a decode worker can hold prompt + max_tokens: its blocks
//             are reserved and its prompt tokens counted on the prefill worker (WorkerRegistry)
//          └─ on_failed(DEADLINE_EXCEEDED | CANCELLED | UNAVAILABLE | INVALID_ARGUMENT) otherwise;
//             UNAVAILABLE also after no_worker_timeout with no healthy worker of a role
//   placed ── decode_admitted(id) when D.Admit returned OK (the worker now holds the blocks),
//             prefill_done(id) when the first token arrived (prompt no longer outstanding),
//             finished(id) / cancel(id) when it ends for any reason: frees its admission slot and
//             what it still holds in the registry.
// Every admitted request gets exactly one of on_placed / on_failed. Callbacks run without the
// scheduler's lock, on the thread that called submit / poll / finished / cancel (on_placed may run
// before submit returns), so they may call back into the scheduler. Because they run unlocked, a
// cancel() on another thread can overtake an on_placed already collected: the scheduler has then
// released the placement, and the frontend's on_placed must check its own cancelled flag and not
// Admit/Prefill.
//
// Order: priority descending, then arrival (FCFS), then submission order.
// Head-of-line policy (backfill with a bound): when the request at the head of the queue does not
// fit any decode worker, requests behind it that do fit are placed ahead of it, for at most
// SchedulerConfig::max_head_bypass after its arrival. Past that, nothing behind it is placed until
// it is, so blocks freed by finishing requests accumulate for it: small requests keep the workers
// busy while a large one waits, but cannot starve it. (Within a priority this is FCFS-fair;
// lower priorities can still wait indefinitely under sustained higher-priority load: that is
// what priority means.)
//
// Queue invariant: the queue holds only requests submit() would accept now; poll() fails the
// rest (deadline passed; all decode or prefill workers gone: UNAVAILABLE; no decode worker large
// enough any more: INVALID_ARGUMENT), and those that waited no_worker_timeout while a role had
// no healthy worker (UNAVAILABLE).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "scheduler/clock.h"
#include "scheduler/placement.h"
#include "scheduler/worker_registry.h"

namespace baton {

struct SchedulerConfig {
  // Requests admitted (queued or placed) and not yet finished. One more is refused with
  // RESOURCE_EXHAUSTED. >= 1.
  int32_t max_requests = 256;
  // Prompt tokens of admitted requests not yet placed. A request that would go over is refused
  // with RESOURCE_EXHAUSTED; a single prompt longer than this can never be admitted and is
  // refused with INVALID_ARGUMENT. >= 1.
  int64_t max_queued_prompt_tokens = 256 * 1024;
  // How long after its arrival the head of the queue may be overtaken by requests behind it that
  // fit when it does not (see the head-of-line policy above). 0 = strict head-of-line. >= 0.
  std::chrono::nanoseconds max_head_bypass = std::chrono::seconds(2);
  // A queued request fails UNAVAILABLE once it has waited this long while no decode worker, or
  // no prefill worker, is healthy (addresses known but none answering): a client without a
  // deadline must not hang through an outage. > 0.
  std::chrono::nanoseconds no_worker_timeout = std::chrono::seconds(5);
  // Prompts of at most this many tokens are prefilled by their decode worker itself, when its
  // load report says it takes prompts that long (local prefill: no prefill worker, no KV
  // transfer); longer ones go to a prefill worker. 0: always a prefill worker. With every prompt
  // local and no prefill workers, the deployment is a colocated server. >= 0.
  int64_t local_prefill_max_tokens = 0;
  // Prefix-aware prefill routing (PrefillPlacement): how many tokens of a prefill worker's queue
  // weigh as much as one prompt token its prefix cache saves. 1: the estimated time to the first
  // token; larger: shorter queues first; 0: the cache alone. >= 0.
  double prefill_queue_weight = 1.0;

  Status validate() const;
};

// A request as the scheduler sees it (tokenised and validated by the frontend).
struct PendingRequest {
  std::string id;                     // unique among admitted requests
  int64_t n_prompt_tokens = 0;        // tokens to prefill; > 0
  int64_t n_total_tokens = 0;         // prompt + max new tokens: KV positions decode must hold; >= prompt
  int32_t priority = 0;               // higher is placed first
  TimePoint arrival{};                // on the scheduler's Clock; FCFS order within a priority, and
                                      // the head's bypass allowance counts from here
  std::optional<TimePoint> deadline;  // still queued at this time → DEADLINE_EXCEEDED
  // Workers this request should not be placed on (a failover's attempt avoids those that just
  // failed it) while any other placeable worker of the role fits it.
  std::vector<std::string> avoid_decode, avoid_prefill;
  // The n_prompt_tokens tokens, for prefix-aware prefill routing (null: route by queue alone).
  std::shared_ptr<const std::vector<int32_t>> tokens;
};

// Where a request goes. The frontend Admits it on decode_address, then Prefills on prefill_address;
// an empty prefill_address means the decode worker prefills it itself (local prefill).
struct Placement {
  std::string request_id;
  std::string prefill_address;
  std::string decode_address;
  int64_t decode_blocks = 0;  // reserved on decode_address: blocks_for(n_total_tokens, its block_size)
};

class Scheduler {
 public:
  using PlacedFn = std::function<void(const Placement&)>;
  using FailedFn = std::function<void(const Status&)>;

  // `registry` and `clock` must outlive the scheduler. config must validate().
  Scheduler(SchedulerConfig config, WorkerRegistry& registry, const Clock& clock);
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Admits and queues `req`, then does what poll() does. Refusals (no callback runs):
  //   INVALID_ARGUMENT    malformed request, duplicate id, prompt over max_queued_prompt_tokens,
  //                       or n_total_tokens more than the largest decode worker holds
  //   UNAVAILABLE         no decode or no prefill worker addresses known
  //   DEADLINE_EXCEEDED   deadline already passed
  //   RESOURCE_EXHAUSTED  over max_requests or max_queued_prompt_tokens (retry later)
  // Both callbacks must be set.
  Status submit(PendingRequest req, PlacedFn on_placed, FailedFn on_failed);
  // Fails queued requests that can no longer be served (see the queue invariant), then places
  // what fits, in order. Call after load reports and address updates, and periodically (deadlines).
  void poll();

  // The decode worker acknowledged the request's Admit: its blocks are now in the worker's own
  // free count, so a load report requested after this includes them. Call it: until then the
  // reservation is counted on top of every report.
  void decode_admitted(const std::string& id);
  // The request's prefill finished (first token received) or was abandoned: its prompt tokens
  // are no longer outstanding on the prefill worker.
  void prefill_done(const std::string& id);
  // The request ended (any reason). Frees its admission slot and what it holds in the registry,
  // then does what poll() does. A queued request is cancelled (on_failed(CANCELLED)). Unknown ids
  // (already finished) are ignored.
  void finished(const std::string& id);
  // Client cancellation: a queued request leaves the queue and gets on_failed(CANCELLED); a placed
  // one is treated like finished(). Unknown ids are ignored.
  void cancel(const std::string& id);

  // For metrics and tests.
  int32_t n_queued() const;              // admitted, not yet placed
  int32_t n_admitted() const;            // admitted, not finished (queued + placed)
  int64_t queued_prompt_tokens() const;  // prompt tokens of the queued requests

 private:
  struct Entry {
    PendingRequest req;
    uint64_t seq = 0;  // submission order: the last FCFS tie-break
    TimePoint queued_at{};  // when submit admitted it (no_worker_timeout counts from here)
    PlacedFn on_placed;
    FailedFn on_failed;
    bool placed = false;
    Placement placement;               // valid when placed
    bool prefill_outstanding = false;  // placed and prefill_done not yet called
  };
  // Queue order: priority descending, then arrival, then submission order.
  struct QueueKey {
    int32_t priority;
    TimePoint arrival;
    uint64_t seq;
    std::string id;
    bool operator<(const QueueKey& o) const;
  };
  // Callbacks collected under the lock, run after it is released.
  using Actions = std::vector<std::function<void()>>;

  static QueueKey key_of(const Entry& e) { return {e.req.priority, e.req.arrival, e.seq, e.req.id}; }
  // Why `req` cannot be served by the current workers (UNAVAILABLE / INVALID_ARGUMENT), or OK.
  Status check_servable(const PendingRequest& req, const std::vector<WorkerSnapshot>& decode,
                        const std::vector<WorkerSnapshot>& prefill) const;
  // Whether decode worker `d` may prefill `req` itself.
  bool local_on(const PendingRequest& req, const WorkerSnapshot& d) const;
  // Whether `req` needs a prefill worker: no decode worker of `decode` that may be placed (or, with
  // `or_unreported`, that has not reported yet) prefills it itself.
  bool needs_prefill_worker(const PendingRequest& req, const std::vector<WorkerSnapshot>& decode,
                            bool or_unreported) const;
  void fail_unservable_locked(TimePoint now, Actions& actions);
  void place_locked(TimePoint now, Actions& actions);
  // Removes a queued request and schedules on_failed(status).
  void fail_queued_locked(const std::string& id, Status status, Actions& actions);
  // Frees what a placed request holds and forgets it.
  void release_placed_locked(const std::string& id);
  static void run(Actions& actions);

  const SchedulerConfig config_;
  WorkerRegistry& registry_;
  const Clock& clock_;
  const std::unique_ptr<PlacementPolicy> decode_policy_;
  std::unique_ptr<PlacementPolicy> prefill_policy_;  // set once, in the constructor

  mutable std::mutex mu_;
  // Guarded by mu_. Invariants: requests_ holds every admitted, unfinished request; queue_ holds
  // exactly the keys of those not placed; queued_prompt_tokens_ is the sum of their prompts.
  std::unordered_map<std::string, Entry> requests_;
  std::set<QueueKey> queue_;
  int64_t queued_prompt_tokens_ = 0;
  uint64_t next_seq_ = 0;
};

}  // namespace baton
