// One request on the frontend, from admission to its last token, as an explicit state machine:
//
//   kNew ─start→ kQueued ─placed→ kAdmitting ─D.Admit ok→ kPrefilling ─first token→ kDecoding ─done→ kEnded
//                  ↑                  │                      │                      │
//                  └──── failover ────┴──────────────────────┴──────────────────────┘
//
// Each pass through kQueued is an *attempt*, with its own worker-facing request id (128 random
// bits: unguessable, never shown to clients) and its own placement. When a worker fails the
// attempt (a transport error, a stream that breaks, a worker's internal error), the pipeline
// abandons it — cancels its calls, releases its decode reservation, gives its placement back to
// the scheduler — and starts the next attempt, avoiding the failed workers: the prompt plus every
// token already streamed is prefilled again and decoding continues from there. Draws are keyed by
// position (model/sampler.h), so greedy and seeded output is the same as without the failure; the
// client sees one stream with no token twice and none missing. After max_failovers the request
// ends UNAVAILABLE with the history of what failed.
//
// What the client reads of a status: every status the pipeline ends with, and the failover history,
// name the request by its label (attempt ids are replaced by it) and workers by role ("the decode
// worker"): worker addresses and IP literals in workers' and gRPC's messages become "<address>".
// The frontend's log has the attempt ids and the addresses.
//
// A decode worker that refuses the Admit for lack of blocks (its last load report was too
// optimistic: another frontend got there first) sends the request back to the queue as a new
// attempt, not a failover.
//
// The n choices of one prompt (scheduler/choice_group.h): the first (the leader) runs as above and
// publishes where its prompt KV is held; each other choice (a follower) waits in kQueued for that,
// not handed to the scheduler, and then admits a fork of the leader's KV on the same decode worker
// (no prefill worker: its stream brings its first token, as a local prefill's does). A fork the
// worker refuses, or a leader that publishes nothing, sends the follower to the scheduler as an
// ordinary request (not a failover); a fork's failure after it was admitted fails over as usual.
//
// Other endings: a stop string (the sink says so), an end-of-sequence token, the decode worker's
// last event, max_tokens reached, cancel() (client gone, deadline), a worker's refusal (INVALID_ARGUMENT,
// RESOURCE_EXHAUSTED, …: not a fault, no failover), the scheduler failing the queued attempt.
//
// Threading: events arrive on worker-client threads and the scheduler's; one mutex orders them.
// The sink is called with that mutex held (so it sees one ordered stream) and must not call back
// into the pipeline from inside a callback. Scheduler calls are made after the mutex is released
// (its callbacks take the mutex). Events of an abandoned attempt are recognised and dropped.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/random_id.h"
#include "model/sampler.h"
#include "scheduler/choice_group.h"
#include "scheduler/clock.h"
#include "scheduler/progress_watch.h"
#include "scheduler/scheduler.h"
#include "scheduler/worker_client.h"

namespace baton {

enum class PipelineState { kNew, kQueued, kAdmitting, kPrefilling, kDecoding, kEnded };
const char* pipeline_state_name(PipelineState state);

// A validated request (the public surfaces validate and tokenise; the pipeline trusts this).
struct PipelineRequest {
  // The client's request id, or empty: in logs, and in statuses in place of attempt ids.
  std::string label;
  std::vector<int32_t> prompt_ids;  // non-empty
  int32_t max_tokens = 1;           // >= 1
  SamplingParams sampling;
  bool ignore_eos = false;
  // End-of-sequence ids: unless ignore_eos, the request is complete once one is streamed (the
  // decode worker stops there too; the pipeline must know it for a worker that died right after).
  std::vector<int32_t> stop_ids;
  int32_t priority = 0;
  double ttft_slo_seconds = 0;  // the client's own TTFT target (0: the server's; PendingRequest)
  std::string model_fingerprint;
  TimePoint arrival{};                       // on the scheduler's clock
  std::optional<TimePoint> deadline;         // on the scheduler's clock
  CallDeadline call_deadline = CallDeadline::max();  // the same instant, for worker calls
  // One of the n choices of a prompt (choice_group.h): choice 0 leads, the others fork its KV.
  // Null: a request of its own.
  std::shared_ptr<ChoiceGroup> group;
  int32_t choice = 0;
};

struct PipelineConfig {
  int32_t max_failovers = 2;  // attempts after the first; >= 0
  ProgressConfig progress;    // how long an attempt may go without progress (progress_watch.h)
};

// What the final message reports.
struct PipelineOutcome {
  std::string finish_reason;  // "stop" | "length" (when OK)
  int32_t n_prompt_tokens = 0;
  int32_t n_generated = 0;
  double queue_seconds = 0;         // arrival → prefill compute start (first attempt)
  double prefill_seconds = 0;       // prefill compute (first attempt)
  int32_t cached_prompt_tokens = 0;  // prompt tokens the prefill worker's prefix cache held (first attempt)
  double kv_transfer_seconds = 0;   // the hand-off after the first token (last attempt that moved KV)
  double decode_queue_seconds = 0;  // KV arrived → first decode step (last attempt)
  double ttft_seconds = 0;          // arrival → the first token handed to the sink
  double e2e_seconds = 0;           // arrival → the end
  int32_t failovers = 0;
  std::vector<std::string> failover_history;    // "decode: UNAVAILABLE: the decode worker: …", oldest first
  std::string prefill_address, decode_address;  // of the last attempt
};

// Where the pipeline's output goes (the gRPC stream, an HTTP response).
class ResponseSink {
 public:
  struct Accepted {
    size_t n = 0;       // how many of the offered tokens were taken (the rest are dropped)
    bool stop = false;  // a stop string matched: no more tokens; the request ends OK ("stop")
  };
  virtual ~ResponseSink() = default;
  // New tokens in order; over the whole request (failovers included) each position is offered
  // once. `logprobs`: one per id when the request's sampling asks (top_logprobs >= 0), else
  // empty. Called with the pipeline's mutex held.
  virtual Accepted on_tokens(std::span<const int32_t> ids, std::span<const TokenLogprobs> logprobs) = 0;
  // The current attempt failed and the request is starting another (for metrics and logs; `cause`
  // is in the client's terms, as on_end's status).
  virtual void on_failover(const std::string& reason, const Status& cause) {}
  // Exactly once, last. OK: the outcome is complete; otherwise `status` says why.
  virtual void on_end(const Status& status, const PipelineOutcome& outcome) = 0;
};

// What every pipeline of one frontend shares. All must outlive the pipelines.
struct PipelineDeps {
  Scheduler* scheduler = nullptr;
  WorkerRegistry* registry = nullptr;
  WorkerClient* client = nullptr;
  const Clock* clock = nullptr;
  PipelineConfig config;
  ProgressWatch* watch = nullptr;  // null: no progress watchdog (only deadlines end a silent attempt)
};

class RequestPipeline : public ProgressWatched, public std::enable_shared_from_this<RequestPipeline> {
 public:
  static std::shared_ptr<RequestPipeline> create(const PipelineDeps& deps, PipelineRequest request,
                                                 std::shared_ptr<ResponseSink> sink);
  RequestPipeline(const RequestPipeline&) = delete;
  RequestPipeline& operator=(const RequestPipeline&) = delete;

  // Submits the first attempt. Call once.
  void start();
  // Ends the request with `why` (not OK) unless it has ended already.
  void cancel(const Status& why);

  PipelineState state() const;
  // The current attempt's worker-facing id (tests and logs).
  std::string attempt_id() const;
  // ProgressWatched: fails the attempt over (as its worker's fault) when it has been silent
  // longer than its progress bound.
  void check_progress(TimePoint now) override;

 private:
  struct Attempt {
    int32_t number = -1;
    std::string id;
    bool handed_to_scheduler = false;
    Placement placement;
    bool admitted = false;            // the decode worker holds a reservation under `id`
    WorkerCall* prefill = nullptr;    // open calls (valid until their done runs)
    WorkerCall* decode = nullptr;
    bool fork = false;                // admitted as a fork of the leader's KV (no prefill worker)
    std::string fork_of;              // the leader attempt's id, for a fork
    bool first_token = false;         // this attempt's prefill delivered its token
    std::vector<int32_t> early;       // decode tokens that overtook the first token
    std::vector<TokenLogprobs> early_logprobs;  // theirs, when asked for
    bool decode_done = false;
    TimePoint last_progress{};        // its last event (placement counts as one)
    bool stuck_logged = false;        // past its progress bound with nowhere else to go (logged once)
  };
  class Guard;  // the mutex, plus scheduler calls to make once it is released

  RequestPipeline(const PipelineDeps& deps, PipelineRequest request, std::shared_ptr<ResponseSink> sink);

  void on_submitted(int32_t attempt, const std::string& id, const Status& status);
  void on_placed(int32_t attempt, const Placement& placement);
  void on_queue_failed(int32_t attempt, const Status& status);
  // False when the attempt is no longer current (the caller releases what Admit reserved).
  bool on_admitted(int32_t attempt, const Status& status);
  void on_prefill_update(int32_t attempt, const PrefillUpdate& update);
  // The attempt's first token (from its prefill worker, or a decode worker that prefilled it).
  void first_token_locked(Guard& g, int32_t token, const TokenLogprobs* logprobs, double queue_seconds,
                          double prefill_seconds, int32_t cached_tokens);
  void on_prefill_done(int32_t attempt, const Status& status);
  void on_decode_update(int32_t attempt, const DecodeUpdate& update);
  void on_decode_done(int32_t attempt, const Status& status);
  // A follower: its leader's KV is held at `source` (a fork attempt), or nothing is (an ordinary one).
  void on_fork_source(const std::optional<ChoiceGroup::Source>& source);
  bool is_leader() const { return req_.group != nullptr && req_.choice == 0; }
  bool is_follower() const { return req_.group != nullptr && req_.choice != 0; }
  // Leader: tells the followers where its prompt KV is (nullopt: nowhere), once.
  void publish_locked(Guard& g, std::optional<ChoiceGroup::Source> source);
  // The current attempt's prompt KV is on its decode worker now: a leader publishes it.
  void kv_placed_locked(Guard& g);
  void send_admit_locked(const AdmitCall& call);
  // The queue time's first part ends: the first prefill (or local Admit) is sent.
  void mark_prefill_sent_locked();

  bool current(int32_t attempt) const { return state_ != PipelineState::kEnded && attempt == attempt_.number; }
  // Every token must come with its log-probabilities (a worker that sends none fails over).
  bool wants_logprobs() const { return req_.sampling.top_logprobs >= 0; }
  void submit_attempt_locked(Guard& g);
  void open_worker_calls_locked();
  void emit_locked(Guard& g, std::span<const int32_t> ids, std::span<const TokenLogprobs> logprobs);
  // What the current attempt's progress bound is computed from (registry reports).
  ProgressInputs progress_inputs_locked() const;
  // Whether a worker of `role` other than `address` may take work now.
  bool another_worker(WorkerRole role, const std::string& address) const;
  void maybe_complete_locked(Guard& g);
  // A worker failed the attempt: another attempt, or the end when none is left. `who`: the
  // role at fault as the client reads it ("the decode worker"); `cause`: what it said.
  void failover_locked(Guard& g, const std::string& reason, const std::string& who, const Status& cause);
  // Lets go of everything the current attempt holds (calls, reservation, placement).
  void abandon_attempt_locked(Guard& g);
  void end_locked(Guard& g, const Status& status);
  void report_fault(WorkerRole role, const std::string& address, const Status& status);
  // `status` with the failed attempts before it, when there were any.
  Status with_history(const Status& status) const;
  // `text` as a client may read it: attempt ids replaced by the label, addresses by "<address>".
  std::string for_client(std::string text) const;
  // The current attempt for the log: label, attempt number, id and workers.
  std::string log_name() const;
  double since_arrival(TimePoint t) const;

  const PipelineDeps deps_;
  const PipelineRequest req_;
  mutable std::mutex mu_;
  std::shared_ptr<ResponseSink> sink_;  // dropped after on_end
  PipelineState state_ = PipelineState::kNew;
  Attempt attempt_;
  std::vector<int32_t> emitted_;  // every token the sink took
  std::vector<std::string> avoid_decode_, avoid_prefill_;
  std::vector<std::string> history_;           // client-facing (for_client), oldest first
  std::vector<std::string> attempt_ids_;       // every attempt's id so far
  std::vector<std::string> worker_addresses_;  // every worker an attempt was placed on
  std::string finish_reason_;
  TimePoint prefill_sent_{}, first_token_at_{};
  bool have_first_token_ = false;
  double queue_s_ = 0, prefill_s_ = 0, kv_transfer_s_ = 0, decode_queue_s_ = 0;
  int32_t cached_prompt_tokens_ = 0;  // of the attempt whose first token was streamed
  bool kv_sent_reported_ = false;  // the prefill worker's KV-sent report arrived
  bool prefill_sent_marked_ = false;
  bool group_published_ = false;  // leader: the followers were told
  std::string counted_by_;        // follower, refused fork: the leader attempt that counted it (once)
};

}  // namespace baton
