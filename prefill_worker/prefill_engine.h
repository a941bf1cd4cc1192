// The prefill worker's step loop (DESIGN.md "Prefill worker"): one engine thread runs batched,
// chunked prefill over a paged KV cache; finished prompts get their first token sampled at once,
// and their KV is handed to a decode worker by kv/kv_sender.h (a job's KvOutbox, which its steps
// fill; the KvSender's threads send it), off the engine thread. Protobuf-free:
// prefill_service.cpp adapts it to gRPC.
//
// A job's life: queued (no blocks) → running (blocks for its whole prompt, prefilled over one or
// more steps) → sending (first token out; the rest of the KV and the first token sent) → done
// (blocks released, on_done). With stream_kv its transfer starts when it starts running: a sender
// exports each layer of each step as soon as the forward has written it, so by the first token
// only the last layer's KV is left to send. The blocks are freed once both the engine and the
// transfer are done with them.
//
// Prefix cache (kv/prefix_cache.h): a job that starts reuses the longest cached block prefix of
// its tokens — at most all its blocks but the one holding its last token, whose logits give the
// first token, so a prompt made only of cached blocks recomputes its last block — and prefills
// only the rest: it starts with n_done = kv_done = the cached tokens, so its transfer can send
// their KV at once. It writes only its own fresh blocks; each of them joins the cache after the
// step that completed it, for the jobs that start after. The KV sent is always the whole
// prompt's, the cached part read from the shared blocks.
//
// A step: the running job left mid-prompt by the previous step goes first, then queued jobs in
// FIFO order, each taking as many of its remaining tokens as the token budget has left (a prompt
// longer than that is chunked; its later chunks attend to the earlier chunks' KV, which stays in
// its blocks). A queued job starts only when the pool can hold its whole prompt, and not in a step
// that completes the next block of its prefix for another job (it starts in the step after,
// reusing it); the jobs behind it wait too (FIFO, no overtaking). All the step's tokens go through
// ONE Model::forward.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/metrics.h"
#include "common/status.h"
#include "common/step_stats.h"
#include "kv/kv_sender.h"
#include "kv/kv_transfer.h"
#include "kv/prefix_cache.h"
#include "model/model.h"
#include "model/sampler.h"
#include "prefill_worker/prefill_job.h"

namespace baton {

class PrefillEngine {
 public:
  // `model` and `transport` (and `metrics`, when given) must outlive the engine. The sender's
  // threads start here; the engine thread starts with start(). `config` must be valid.
  PrefillEngine(Model& model, KvTransport& transport, const PrefillConfig& config, Metrics* metrics = nullptr);
  ~PrefillEngine();  // stop()
  PrefillEngine(const PrefillEngine&) = delete;
  PrefillEngine& operator=(const PrefillEngine&) = delete;

  void start();
  // Fails the jobs not yet prefilled (UNAVAILABLE), lets the senders finish the transfers
  // already started, and joins every thread. Idempotent.
  void stop();

  // Queues a job. INVALID_ARGUMENT (PrefillJob::validate_against, or a prompt the KV pool can
  // never hold), FAILED_PRECONDITION (the
  // id is already in progress here), RESOURCE_EXHAUSTED (queue full), UNAVAILABLE (stopped). On
  // error neither callback is ever called.
  Status submit(PrefillJob job);
  // Drops a job: a queued one at once (on_done(CANCELLED) before cancel returns), a running one
  // at the next step boundary (its blocks freed then), a sending one by ending its transfer early
  // (the receiver refuses the incomplete KV). Unknown or finished ids are ignored.
  void cancel(const std::string& request_id);

  PrefillLoad load() const;
  const PrefillConfig& config() const { return config_; }
  // True when the step loop has prompts it could run and has not finished a step (or woken) for
  // `limit`: a hung kernel or a deadlock. The server turns health NOT_SERVING while it holds.
  bool stalled(std::chrono::steady_clock::time_point now, std::chrono::nanoseconds limit) const;

  // For tests: steps run so far, and one step on the caller's thread (only while the engine
  // thread is not running). Returns false when there was nothing to do.
  int64_t n_steps() const { return n_steps_.load(); }
  bool run_step_for_test();

 private:
  using Clock = std::chrono::steady_clock;
  struct Job;
  struct Slice {  // a job's part of one step
    std::shared_ptr<Job> job;
    int32_t start = 0;
    int32_t n = 0;
  };

  void engine_loop();
  // One step: planned under `lock` (held), then, without it, the jobs that left are finished and
  // the step runs.
  void step(std::unique_lock<std::mutex> lock);
  // Picks the step's slices (allocating blocks to jobs it starts) and takes abandoned running
  // jobs out; those that can be finished at once go to `dropped`. Called with mu_ held.
  std::vector<Slice> plan_step_locked(std::vector<std::shared_ptr<Job>>* dropped);
  // Runs one planned step (without mu_): forward, first tokens, hand-off to the senders.
  void run_step(std::vector<Slice> slices);
  // The outbox of a job that starts: its KV header, and the export from this engine's cache.
  std::shared_ptr<KvOutbox> make_outbox(const std::shared_ptr<Job>& job);
  // Queues the job's transfer.
  void hand_to_sender_locked(const std::shared_ptr<Job>& job);
  // The engine is done with the job; true when its transfer is too (the caller then finishes it).
  bool leave_engine_locked(const std::shared_ptr<Job>& job);
  // The job's transfer returned (a sender thread); finishes the job if the engine is done with it.
  void transfer_done(const std::shared_ptr<Job>& job, const Status& status, double seconds, int64_t bytes);
  // Frees a job's blocks, forgets it and calls on_done with its outcome. Without mu_ held; once
  // neither the engine nor a sender uses the job.
  void finish(const std::shared_ptr<Job>& job);
  int n_sending_locked() const;  // prefilled jobs whose transfer has not returned
  // Most leading blocks a job may reuse: all but the one holding its last token.
  int max_reused_blocks(const Job& job) const;
  bool has_work_locked() const;
  void update_gauges_locked();

  Model& model_;
  const PrefillConfig config_;
  std::unique_ptr<KvCache> cache_;
  Metrics* metrics_;
  // This worker's series (role="prefill", worker=name), when metrics_ is set.
  prometheus::Histogram* step_tokens_hist_ = nullptr;
  prometheus::Histogram* prefill_seconds_hist_ = nullptr;
  uint64_t hash_seed_ = 0;  // prefix_hash_seed(model fingerprint, KV dtype, block size)

  mutable std::mutex mu_;
  std::condition_variable work_cv_;                             // engine: new job, cancel, freed blocks, stop
  PrefixCache blocks_;                                          // the KV blocks and the prefix cache; guarded by mu_
  std::deque<std::shared_ptr<Job>> waiting_;                    // FIFO, no blocks yet; guarded by mu_
  std::vector<std::shared_ptr<Job>> running_;                   // hold blocks, prompt unfinished; guarded by mu_
  std::unordered_map<std::string, std::shared_ptr<Job>> jobs_;  // every job in progress, by id; guarded by mu_
  int64_t waiting_tokens_ = 0;                                  // sum of waiting_ prompts; guarded by mu_
  bool stopping_ = false;                                       // guarded by mu_
  Clock::time_point beat_ = Clock::now();                       // the loop's last turn; guarded by mu_
  StepStats step_stats_;                                        // guarded by mu_
  int64_t step_tokens_ = 0;                                     // of the step running now (0: none); guarded by mu_
  Clock::time_point step_started_{};                            // when it was planned; guarded by mu_
  bool in_wait_ = false;                                        // the loop waits for work; guarded by mu_

  std::atomic<int64_t> n_steps_{0};
  std::atomic<bool> engine_running_{false};
  std::thread engine_thread_;
  EngineGauges gauges_;  // this worker's (role="prefill"); nothing without a registry
  PrefixCacheSeries prefix_series_;  // guarded by mu_ (update_gauges_locked)
  // Declared last: its threads call back into the engine (stop() joins them first).
  KvSender sender_;

  // Reused across steps (engine thread only).
  StepBatch batch_;
};

}  // namespace baton
