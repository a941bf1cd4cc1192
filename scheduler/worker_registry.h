// The frontend's view of its workers: who they are (addresses from flags or DNS), what each last
// reported about its load, whether it is healthy, and the work this frontend has sent it that the
// last report cannot include yet. Thread-safe; it never calls out, so callers may hold their own
// lock while calling it (the scheduler does: scheduler lock, then registry lock).
//
// Load reports are pulled (GetLoad): the caller notes when it sent the request (`requested_at`)
// and hands the answer to report_load(). Between reports the registry keeps LOCAL adjustments so
// that two placements in a row do not both pick the same almost-full worker:
//
//   decode   reserve_decode(addr, id, blocks)  at placement (before D.Admit is sent)
//            confirm_decode(addr, id)          when D.Admit has returned OK: D now holds the blocks
//            release_decode(addr, id)          when the request is done (finished, cancelled, failed)
//   prefill  add_prefill_tokens(addr, id, n)   at placement (the Prefill call is sent right after)
//            remove_prefill_tokens(addr, id)   when its prefill is done (first token) or abandoned
//
// Accounting rule: an adjustment is "unreported" until a report arrives whose request was sent
// after the adjustment was confirmed (strictly: at equal times the order is unknown, and counting
// it twice is the safe error); such a report includes it (the worker applied it before
// answering), so the adjustment is dropped and the report alone is the truth. Unconfirmed decode
// reservations are never dropped by a report (the Admit may still be in flight), only released.
// Hence, with one frontend and in-order reports:
//   estimated free blocks = reported free - unreported reservations <= the worker's real free,
// so a placement that fits the estimate never overcommits a decode worker. Reports answered out of
// order (requested before the report already applied) are ignored. Releasing an unreported
// reservation gives its blocks back at once; releasing one a report has already included does
// nothing locally: the worker frees them, and the next report says so.
// Prefill has no acknowledgement before its first token, so prompt tokens count as confirmed when
// added: a report requested later is taken to include them. The error window is one network hop
// and only skews balancing, never capacity.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/status.h"
#include "scheduler/clock.h"

namespace baton {

enum class WorkerRole { kPrefill, kDecode };
const char* worker_role_name(WorkerRole role);  // "prefill" / "decode"

// One load report, as a worker sends it (worker.proto LoadReport, converted at the edge).
struct WorkerLoad {
  int64_t free_blocks = 0;           // decode: KV blocks neither in use nor reserved by Admit
  int64_t total_blocks = 0;          // decode: all KV blocks
  int32_t block_size = 0;            // decode: token positions per KV block (> 0 for decode)
  int64_t queued_prompt_tokens = 0;  // prefill: prompt tokens waiting or in progress
  int32_t n_running = 0;             // decode: sequences generating; prefill: prompts in progress
  bool draining = false;             // shutting down: route no new work here
  int32_t local_prefill_max_tokens = 0;  // decode: the longest prompt it prefills itself (0: none)
  // Its speed, for progress bounds (scheduler/progress_watch.h): the slowest recent step, and the
  // prompt tokens per second its steps compute (decode: local prefill; 0: not measured yet).
  // queued_prompt_tokens of a decode worker: those it prefills itself.
  double step_seconds = 0;
  double prefill_tokens_per_second = 0;
  // prefill: its step schedule (LoadReport; TtftPredictor predicts by it): the most prompt tokens
  // a step takes (0: not reported), a step's time as fixed + per token × its tokens (0, 0: not
  // fitted yet), and the step running when it reported (its tokens, 0 when none, which
  // queued_prompt_tokens include, and how long it had run).
  int32_t step_token_budget = 0;
  double step_fixed_seconds = 0;
  double step_seconds_per_token = 0;
  int64_t step_tokens_in_progress = 0;
  double step_elapsed_seconds = 0;
  // What its TLS certificate proved when the report was fetched ("" without mTLS): a prefill
  // worker's is what decode workers take its KV by.
  std::string certificate;
  // prefill: its prefix cache (kv/prefix_hash.h): the most blocks it caches (0: no cache), the
  // root of its block hash chain, and the hashes of the blocks it reported cached (null: none).
  // Shared: snapshots copy a pointer, not the set.
  int32_t prefix_cache_blocks = 0;
  uint64_t prefix_hash_seed = 0;
  std::shared_ptr<const std::unordered_set<uint64_t>> cached_blocks;
};

struct WorkerRegistryConfig {
  // A worker is unhealthy after this many consecutive failed calls (load polls or requests);
  // one successful load report makes it healthy again. >= 1.
  int32_t unhealthy_after_failures = 3;
  // A worker whose last load report is older than this is unhealthy (its numbers are too old to
  // place by). Should be a few load-poll periods. > 0.
  std::chrono::nanoseconds stale_after = std::chrono::seconds(10);

  Status validate() const;
};

// A copy of one worker's state, with health evaluated at the time of the snapshot.
struct WorkerSnapshot {
  std::string address;  // "host:port"
  WorkerRole role = WorkerRole::kDecode;
  bool has_report = false;               // false until the first load report: capacity unknown
  WorkerLoad load;                       // the last report applied (zeros before the first)
  TimePoint last_report_at{};            // when it was applied (the registry's clock)
  int32_t n_consecutive_failures = 0;    // reset by a load report
  bool healthy = false;                  // has_report, few enough failures, report not stale
  int64_t reserved_blocks = 0;           // decode: blocks reserved here that `load` does not include
  int64_t unreported_prompt_tokens = 0;  // prefill: prompt tokens sent here that `load` does not include
  int32_t n_unreported_requests = 0;     // requests behind the two numbers above
  // prefill: the block hashes (prefix_routing_hashes) of prompts this frontend sent here that
  // `load` may not include yet: expected in its prefix cache (add_prefill_prefix).
  std::vector<std::shared_ptr<const std::vector<uint64_t>>> sent_prefixes;

  // Whether new work may be routed here.
  bool can_place() const { return healthy && !load.draining; }
  // Decode: free blocks after this frontend's unreported reservations (may be < 0 when a
  // report shows the worker fuller than expected, e.g. another frontend's requests).
  int64_t available_blocks() const { return load.free_blocks - reserved_blocks; }
  // Prefill: prompt tokens ahead of a new request.
  int64_t outstanding_prompt_tokens() const { return load.queued_prompt_tokens + unreported_prompt_tokens; }
};

// Whether any of `workers` may take new work (WorkerSnapshot::can_place).
bool any_placeable(const std::vector<WorkerSnapshot>& workers);

class WorkerRegistry {
 public:
  WorkerRegistry(WorkerRegistryConfig config, const Clock& clock);  // config must validate()
  WorkerRegistry(const WorkerRegistry&) = delete;
  WorkerRegistry& operator=(const WorkerRegistry&) = delete;

  // Makes `addresses` the workers of `role` (from flags, or each DNS re-resolution): adds new
  // ones (unhealthy until their first report), keeps the state of those already known, and drops
  // those no longer listed together with their local adjustments. Duplicates are ignored.
  void set_addresses(WorkerRole role, const std::vector<std::string>& addresses);
  // The workers of `role`, sorted by address (whom to poll for load).
  std::vector<std::string> addresses(WorkerRole role) const;

  // Applies a load report whose GetLoad was sent at `requested_at` and marks the worker healthy.
  // NOT_FOUND when the worker is not (or no longer) registered for `role`; INVALID_ARGUMENT when
  // the report is malformed (negative counts, free > total, decode block_size <= 0). A report
  // requested before the one already applied is ignored (OK).
  Status report_load(WorkerRole role, const std::string& address, const WorkerLoad& load, TimePoint requested_at);
  // A call to the worker failed (unreachable, timed out). Unknown addresses are ignored.
  void report_failure(WorkerRole role, const std::string& address);
  // A call saw the worker's connection break (the process died, or the network between us):
  // unhealthy at once, until a load report requested after this says otherwise. A request
  // failing over must not be placed back onto it. Unknown addresses are ignored.
  void report_down(WorkerRole role, const std::string& address);
  // A decode worker refused an Admit for lack of blocks (another frontend, or a caller outside
  // this frontend, holds more than its last report says): treated as full until a load report
  // requested after this one arrives, so the request is not placed there again at once.
  void report_exhausted(const std::string& decode_address);

  // All workers of `role` sorted by address.
  std::vector<WorkerSnapshot> snapshot(WorkerRole role) const;
  std::optional<WorkerSnapshot> find(WorkerRole role, const std::string& address) const;

  // Decode reservations (see the accounting rule above). reserve_decode is false (and changes
  // nothing) when the worker is not registered; `request_id` must not already hold a
  // reservation there. confirm/release of an unknown worker or id do nothing (the worker may
  // have been dropped, or a report already included the reservation).
  bool reserve_decode(const std::string& address, const std::string& request_id, int64_t n_blocks);
  void confirm_decode(const std::string& address, const std::string& request_id);
  void release_decode(const std::string& address, const std::string& request_id);

  // Prefill outstanding tokens, with the same contract as the decode reservations.
  bool add_prefill_tokens(const std::string& address, const std::string& request_id, int64_t n_tokens);
  void remove_prefill_tokens(const std::string& address, const std::string& request_id);

  // The frontend's own map of where it sent which prefix, between a prefill worker's reports: the
  // block hashes of a prompt placed on `address` count as cached there (sent_prefixes) from the
  // placement on, also for the prompts placed behind it, until a report requested after its
  // prefill finished (confirm_prefill_prefix) — that report includes the blocks, as far as the
  // worker still holds them. remove_prefill_prefix drops a prompt that will not be prefilled
  // there after all. add is false (no change) when the worker is not registered; confirm and
  // remove of unknown workers or ids do nothing.
  bool add_prefill_prefix(const std::string& address, const std::string& request_id,
                          std::shared_ptr<const std::vector<uint64_t>> hashes);
  void confirm_prefill_prefix(const std::string& address, const std::string& request_id);
  void remove_prefill_prefix(const std::string& address, const std::string& request_id);

 private:
  // Work sent to a worker that its last applied report does not include.
  struct Unreported {
    int64_t amount = 0;                     // decode: blocks; prefill: prompt tokens
    std::optional<TimePoint> confirmed_at;  // set once the worker is known to hold it
  };
  struct Worker {
    bool has_report = false;
    WorkerLoad load;
    TimePoint requested_at{};    // of the applied report; older reports are ignored
    TimePoint last_report_at{};  // when the applied report arrived
    int32_t n_consecutive_failures = 0;
    std::optional<TimePoint> down_at;  // report_down: reports requested before this do not heal it
    std::unordered_map<std::string, Unreported> unreported;  // by request id
    int64_t n_unreported = 0;                                // sum of unreported[*].amount
    struct SentPrefix {
      std::shared_ptr<const std::vector<uint64_t>> hashes;
      std::optional<TimePoint> confirmed_at;  // its prefill finished (the blocks are cached) then
    };
    std::unordered_map<std::string, SentPrefix> sent_prefixes;  // prefill; by request id
  };

  Worker* find_locked(WorkerRole role, const std::string& address);
  const Worker* find_locked(WorkerRole role, const std::string& address) const;
  WorkerSnapshot snapshot_locked(WorkerRole role, const std::string& address, const Worker& w, TimePoint now) const;
  bool add_unreported(WorkerRole role, const std::string& address, const std::string& request_id, int64_t amount,
                      bool confirmed);
  void remove_unreported(WorkerRole role, const std::string& address, const std::string& request_id);

  const WorkerRegistryConfig config_;
  const Clock& clock_;
  mutable std::mutex mu_;
  std::map<std::string, Worker> workers_[2];  // guarded by mu_; indexed by role, keyed by address
};

}  // namespace baton
