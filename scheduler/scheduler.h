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
// Where to prefill (SchedulerConfig::prefill_choice): kStatic prefills a prompt of at most
// local_prefill_max_tokens on its decode worker (when the worker takes prompts that long) and
// every other on a prefill worker: 0 is disaggregated, a large N with no prefill workers is
// colocated. kAdaptive chooses per request between the decode worker (up to the same bound) and
// the prefill worker PrefillPlacement picks, by TtftPredictor's TTFT each way: the decode worker
// when the TTFT it saves is more than local_prefill_itl_weight × the time it adds to the decode
// batch (its running sequences each wait for the local prefill's compute), and, with a TTFT
// target, only when the prefill worker is predicted to miss the target and the decode worker to
// meet it. A worker not measured yet is predicted at the fastest
// measured worker's rate (so each side gets tried); with nothing measured, the prefill worker.
//
// Admission to a TTFT target (ttft_slo_seconds, or the request's own, whichever is tighter): at
// submit, the TTFT is predicted on every placement: the decode side's wait for KV blocks (none
// while a decode worker has room; else the blocks short over the rate this frontend's requests
// have freed them at recently, infinite when none were freed) plus the best prefill side
// (TtftPredictor, counting the prompts queued here ahead of it: same or higher priority, earlier).
// The prediction is compared with the target after multiplying it by the p99 of the predictor's
// recent misses (slo_margin_locked: seen over predicted TTFT, 1 to 2), so that the admitted meet
// the target at p99 where the predictor errs low.
// A request predicted to miss the target everywhere is refused at once: RESOURCE_EXHAUSTED with
// a retry-after, and a message naming the side (decode KV when its wait alone misses the target,
// else the prefill queue) and the prediction. Requests whose TTFT cannot be predicted yet (no
// rate measured) are admitted. While a target is set, workers are handed prompts only up to
// slo_hold_fraction of it (see SchedulerConfig), so the queue here, in priority order, holds the
// rest: a higher priority sees less work ahead of it, and lower priorities are refused first.
// (The predictions, the admission and the choice of where to prefill are in slo_admission.cpp;
// the queue and placement in scheduler.cpp.)
//
// Queue invariant: the queue holds only requests submit() would accept now; poll() fails the
// rest (deadline passed; all decode or prefill workers gone: UNAVAILABLE; no decode worker large
// enough any more: INVALID_ARGUMENT), and those that waited no_worker_timeout while a role had
// no healthy worker (UNAVAILABLE).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "scheduler/clock.h"
#include "scheduler/placement.h"
#include "scheduler/ttft_predictor.h"
#include "scheduler/worker_registry.h"

namespace baton {

enum class PrefillChoice { kStatic, kAdaptive };

struct SchedulerConfig {
  // Requests admitted (queued or placed) and not yet finished, each counted with the choices that
  // will fork its KV (PendingRequest::n_followers). One more is refused with RESOURCE_EXHAUSTED.
  // >= 1.
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
  // Where each prompt is prefilled (see "Where to prefill" above).
  PrefillChoice prefill_choice = PrefillChoice::kStatic;
  // The TTFT target in seconds (0: none: admission is by the bounds above alone). See "Admission
  // to a TTFT target" above. >= 0.
  double ttft_slo_seconds = 0;
  // With a TTFT target: a worker is handed a new prompt only while the work it already holds is
  // predicted to take less than this fraction of the target (or it holds none), so that the rest
  // waits in this queue, in priority order, rather than in the worker's FCFS one. In (0, 1].
  double slo_hold_fraction = 0.5;
  // kAdaptive without a TTFT target: prefill locally when the TTFT it saves exceeds this weight
  // times the time it adds to the decode batch (its running sequences × its local prefill
  // seconds). >= 0.
  double local_prefill_itl_weight = 1.0;

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
  // The n_prompt_tokens tokens, for prefix-aware prefill routing (null: route by queue alone),
  // and the tenant scope their blocks are hashed in (SamplingParams::cache_scope).
  std::shared_ptr<const std::vector<int32_t>> tokens;
  std::string cache_scope;
  // The client's own TTFT target in seconds (0: the server's); the tighter of the two applies.
  double ttft_slo_seconds = 0;
  // The other choices of its prompt that will fork its KV on the decode worker (an n-choice
  // request's leader, first attempt: n - 1). They never pass through the scheduler themselves, so
  // they count here against max_requests while this request is admitted. (Their KV blocks are
  // the decode worker's to admit, fork by fork.)
  int32_t n_followers = 0;
  // A follower whose fork was refused, admitted with its own KV: the id of the leader attempt
  // whose n_followers counted it. While that leader is admitted with a follower left to count, the
  // follower's count moves to this request (no bound check: it was admitted with the leader);
  // otherwise it counts as any request.
  std::string counted_by;

  // What a placement policy sees of it.
  PlacementRequest placement() const {
    std::span<const int32_t> t;
    if (tokens) t = *tokens;
    return {n_prompt_tokens, n_total_tokens, t, cache_scope};
  }
};

// Why admission to a TTFT target refused a request: the side predicted to make it late.
enum class SloRejection { kPrefillQueue, kDecodeKv };
const char* slo_rejection_name(SloRejection reason);  // "prefill_queue" / "decode_kv"

// What the scheduler tells the frontend's metrics (each may be empty; called without its lock).
struct SchedulerEvents {
  // A first token arrived: the TTFT predicted at admission, and the TTFT seen (both from arrival).
  std::function<void(double predicted_seconds, double actual_seconds)> ttft;
  // A request was refused for its TTFT target.
  std::function<void(SloRejection reason)> slo_rejected;
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
  // The request's first token arrived after `prefill_seconds` of prefill compute with
  // `cached_tokens` of its prompt from a prefix cache: feeds the predictor (the worker's rate, and
  // the predicted-vs-seen TTFT to SchedulerEvents), then does what prefill_done does.
  void first_token(const std::string& id, double prefill_seconds, int64_t cached_tokens);
  // Set once, before the first submit.
  void set_events(SchedulerEvents events) { events_ = std::move(events); }
  // The request ended (any reason). Frees its admission slot and what it holds in the registry,
  // then does what poll() does. A queued request is cancelled (on_failed(CANCELLED)). Unknown ids
  // (already finished) are ignored.
  void finished(const std::string& id);
  // Client cancellation: a queued request leaves the queue and gets on_failed(CANCELLED); a placed
  // one is treated like finished(). Unknown ids are ignored.
  void cancel(const std::string& id);

  // For metrics and tests.
  int32_t n_queued() const;              // admitted, not yet placed
  int32_t n_admitted() const;            // admitted, not finished (queued + placed), with their followers
  int64_t queued_prompt_tokens() const;  // prompt tokens of the queued requests

 private:
  // What admission predicted of a request's TTFT, and of what (the frontend's debug log compares
  // it with what happened at the first token).
  struct TtftForecast {
    double seconds = 0;      // from arrival: elapsed + decode_wait + the site's wait and compute
    double elapsed = 0;      // arrival → admission
    double decode_wait = 0;  // for a decode worker's KV blocks
    TtftPrediction site;     // on the soonest placement
    bool local = false;      // that placement is a decode worker prefilling itself
    int64_t n_compute = 0;   // prompt tokens it would compute there (less the expected cache hit)
  };
  struct Entry {
    PendingRequest req;
    uint64_t seq = 0;  // submission order: the last FCFS tie-break
    TimePoint queued_at{};  // when submit admitted it (no_worker_timeout counts from here)
    PlacedFn on_placed;
    FailedFn on_failed;
    bool placed = false;
    Placement placement;               // valid when placed
    bool prefill_outstanding = false;  // placed and prefill_done not yet called
    std::optional<TtftForecast> predicted;  // at admission
    int64_t local_tokens = 0;              // prefilled by its decode worker: its prompt, until done
  };
  // One way to prefill a request: on a prefill worker, or locally on its decode worker.
  struct PrefillSite {
    const WorkerSnapshot* worker = nullptr;  // null: none
    bool local = false;
    int64_t n_compute = 0;  // prompt tokens it would compute (less the expected prefix-cache hit)
    std::shared_ptr<const std::vector<uint64_t>> prefix;  // the prompt's routing hashes there
    std::optional<TtftPrediction> ttft;
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
  // `address`'s entries of `logs` (released_ or sent_) in the last kReleaseWindow before `now`
  // (older ones dropped).
  using RecentLog = std::deque<std::pair<TimePoint, int64_t>>;
  static RecentLog& recent_log_locked(std::unordered_map<std::string, RecentLog>& logs, const std::string& address,
                                      TimePoint now);
  // The prompt tokens sent to prefill worker `address` in the last kReleaseWindow before `now`, per second.
  double sent_rate_locked(const std::string& address, TimePoint now) const;
  // The prompts sent to prefill worker `w` that its last report does not include (the registry's
  // count), as (seconds after the report, tokens), oldest first; *rest: tokens among them that
  // the log does not time.
  std::vector<std::pair<double, int64_t>> sent_since_report_locked(const WorkerSnapshot& w, int64_t* rest) const;
  // The TTFT target that applies to `req` (0: none).
  double slo_of(const PendingRequest& req) const;
  // The rate a worker not measured yet is predicted at: the fastest measured one's for prompts
  // this long (the same model on a like core), so that each side of the adaptive choice gets tried.
  double prior_rate(const std::vector<WorkerSnapshot>& decode, const std::vector<WorkerSnapshot>& prefill,
                    int64_t n_prompt_tokens) const;
  // Prefill on `w` (a prefill worker, or decode worker `w` itself with `local`), predicted with
  // `extra_ahead` tokens queued here ahead of it, and `prior` (prior_rate) if `w` is not measured.
  PrefillSite site_locked(const PendingRequest& req, const WorkerSnapshot& w, bool local, int64_t extra_ahead,
                          double prior) const;
  // The decode side's predicted wait for `req`'s blocks (0 when a worker has room now).
  double decode_wait_locked(const PendingRequest& req, const std::vector<WorkerSnapshot>& decode,
                            int64_t blocks_ahead, TimePoint now);
  // With a TTFT target: refuses `req` (a non-OK status) when it is predicted to miss it on every
  // placement; sets *predicted to the best prediction when there is one.
  Status admit_to_slo_locked(const PendingRequest& req, const std::vector<WorkerSnapshot>& decode,
                             const std::vector<WorkerSnapshot>& prefill, TimePoint now,
                             std::optional<TtftForecast>* predicted, std::optional<SloRejection>* rejected);
  // Adaptive: whether prefilling on decode worker `d` saves more TTFT than it costs its batch.
  bool local_worth_it(const WorkerSnapshot& d, const TtftPrediction& local, const TtftPrediction& remote) const;
  // Whether a worker holding `site`'s predicted wait may be handed one more prompt now.
  bool may_hand_over(const PendingRequest& req, const PrefillSite& site) const;
  // Where `e`'s prompt should be prefilled, given decode worker `d` (nullopt: nowhere yet).
  std::optional<PrefillSite> choose_prefill_locked(const Entry& e, const WorkerSnapshot& d,
                                                   const std::vector<WorkerSnapshot>& decode,
                                                   const std::vector<WorkerSnapshot>& prefill, TimePoint now) const;
  void fail_unservable_locked(TimePoint now, Actions& actions);
  void place_locked(TimePoint now, Actions& actions);
  // Removes a queued request and schedules on_failed(status).
  void fail_queued_locked(const std::string& id, Status status, Actions& actions);
  // Frees what a placed request holds and forgets it.
  void release_placed_locked(const std::string& id, TimePoint now);
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
  int64_t admitted_weight_ = 0;  // requests_ counted with their followers (PendingRequest::n_followers)
  uint64_t next_seq_ = 0;
  TtftPredictor predictor_;
  SchedulerEvents events_;
  std::unordered_map<std::string, int64_t> local_outstanding_;  // decode address → local prompt tokens placed
  // Decode blocks released here (finished requests), by worker: (when, blocks) of the last
  // kReleaseWindow, for the decode side's wait.
  std::unordered_map<std::string, RecentLog> released_;
  // Prompt tokens sent to each prefill worker: (when, tokens) of the last kReleaseWindow, for the
  // prediction of the steps they join (TtftPredictor::Ahead::arriving_tokens_per_second).
  std::unordered_map<std::string, RecentLog> sent_;
  static constexpr std::chrono::seconds kReleaseWindow{10};
  // The TTFT seen over the TTFT predicted at admission, of the last kErrorSamples first tokens.
  std::deque<double> seen_over_predicted_;
  static constexpr size_t kErrorSamples = 200;
  static constexpr size_t kMinErrorSamples = 10;
  // What admission multiplies a prediction by before comparing it with the target: the 99th
  // percentile of seen_over_predicted_, within [1, 2] (1 until kMinErrorSamples were seen), so
  // that the admitted meet the target at p99 even where the predictor errs low.
  double slo_margin_locked() const;
};

}  // namespace baton
