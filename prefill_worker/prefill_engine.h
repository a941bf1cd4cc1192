// The prefill worker's step loop (DESIGN.md "Prefill worker"): one engine thread runs batched,
// chunked prefill over a paged KV cache; finished prompts get their first token sampled at once,
// and their KV is handed to a decode worker by a small pool of sender threads, off the engine
// thread. Protobuf-free: prefill_service.cpp adapts it to gRPC.
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

#include "common/status.h"
#include "common/step_stats.h"
#include "kv/prefix_cache.h"
#include "kv/kv_transfer.h"
#include "model/model.h"
#include "model/sampler.h"

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
}  // namespace prometheus

namespace baton {

class Metrics;

struct PrefillConfig {
  int token_budget = 512;            // --prefill-token-budget: most prompt tokens in one step (one forward)
  int n_blocks = 0;                  // KV blocks in the worker's cache; 0: enough for max(4 × token_budget,
                                     // the model's context) tokens
  int block_size = 16;               // tokens per KV block
  DType kv_dtype = DType::kF32;      // KV cache element type, also the dtype on the wire
  int max_queued_tokens = 65536;     // bound on prompt tokens waiting to start; a submit beyond it is
                                     // RESOURCE_EXHAUSTED (a job is always accepted into an empty queue)
  int n_senders = 4;                 // threads exporting and sending KV (each blocks on one transfer)
  bool stream_kv = true;             // a job's transfer starts with its prefill: each layer's KV of a step
                                     // leaves as soon as the forward wrote it (else after the first token)
  int64_t kv_chunk_bytes = 2 << 20;  // most K+V bytes in one KvChunk: chunks stay well below gRPC's
                                     // default 4 MiB message limit; at least one token per chunk
  std::string name;                  // this worker's name (its listen address): metric label, logs
  // --prefix-cache-blocks: most blocks the prefix cache holds (in use or idle); -1: the whole pool
  // (cached blocks are taken back whenever work in flight needs room); 0: no prefix cache.
  // Larger than the pool: the pool.
  int prefix_cache_blocks = -1;
  int prefix_report_blocks = 4096;   // most cached block hashes in a load report (8 bytes each)
};

// INVALID_ARGUMENT naming the field when a value is out of range.
Status validate_prefill_config(const PrefillConfig& config);

struct PrefillJob {
  std::string request_id;       // unique among this worker's jobs in progress
  std::vector<int32_t> tokens;  // the prompt, then the tokens generated before a failover
  int n_generated = 0;          // how many of `tokens` were generated before a failover (the first
                                // token is drawn at position tokens.size(), as the decode worker would)
  SamplingParams sampling;
  std::string decode_address;     // the decode worker that receives the KV
  std::string model_fingerprint;  // copied into the KV header (the receiver refuses a mismatch)
  // Called once, on the engine thread, as soon as the first token is sampled (before any KV moves).
  // queue_seconds: submit → the step that starts its prefill; prefill_seconds: that step's start →
  // the end of the forward that finished the prompt; n_cached_tokens: the leading tokens whose KV
  // came from the prefix cache (not computed).
  std::function<void(int32_t first_token, double queue_seconds, double prefill_seconds, int32_t n_cached_tokens)>
      on_first_token;
  // Called on the engine thread after each step while the prompt is not finished: with the
  // positions done so far after a chunk of it (a long prompt), with 0 while it waits for a step.
  // The frontend's progress watchdog (scheduler/progress_watch.h) hears that the worker moves.
  // May be empty.
  std::function<void(int32_t n_done)> on_progress;
  // Called exactly once for every accepted job, last: ok when the decode worker acknowledged the
  // whole KV; otherwise the transport's error, CANCELLED, or UNAVAILABLE at shutdown. Runs on the
  // engine thread, a sender thread, or (cancel of a queued job) the thread calling cancel().
  std::function<void(const Status& status, double transfer_seconds, int64_t bytes)> on_done;
};

// What the worker reports to the frontend's scheduler.
struct PrefillLoad {
  // Prompt tokens still to compute: those of running jobs not prefilled yet, and those of waiting
  // jobs but the part the prefix cache holds now.
  int64_t queued_prompt_tokens = 0;
  int n_queued = 0;                  // jobs waiting to start
  int n_running = 0;                 // jobs being prefilled (hold blocks, prompt not finished)
  int n_sending = 0;                 // jobs whose KV is being exported or sent
  int free_blocks = 0;               // blocks no job holds: empty, or cached and idle (taken on demand)
  int total_blocks = 0;
  double step_seconds = 0;               // the slowest recent step (common/step_stats.h)
  double prefill_tokens_per_second = 0;  // prompt tokens its steps computed per second (0: none yet)
  // The prefix cache: its bound (0: none), blocks in it, its hash chain's root
  // (kv/prefix_hash.h), and the hashes of up to prefix_report_blocks cached blocks, in use first,
  // then most recently used first.
  int prefix_cache_blocks = 0;
  int n_cached_blocks = 0;
  uint64_t prefix_hash_seed = 0;
  std::vector<uint64_t> cached_block_hashes;
};

class PrefillEngine {
 public:
  // `model` and `transport` (and `metrics`, when given) must outlive the engine. The sender
  // threads start here; the engine thread starts with start(). `config` must be valid.
  PrefillEngine(Model& model, KvTransport& transport, const PrefillConfig& config, Metrics* metrics = nullptr);
  ~PrefillEngine();  // stop()
  PrefillEngine(const PrefillEngine&) = delete;
  PrefillEngine& operator=(const PrefillEngine&) = delete;

  void start();
  // Fails the jobs not yet prefilled (UNAVAILABLE), lets the senders finish the transfers
  // already started, and joins every thread. Idempotent.
  void stop();

  // Queues a job. INVALID_ARGUMENT (empty, out-of-vocabulary or over-context tokens, bad
  // sampling, no decode address, a prompt the KV pool can never hold), FAILED_PRECONDITION (the
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

  class JobSource;  // a job's KvSource: its chunks as the steps write them (prefill_engine.cpp)

  void engine_loop();
  void sender_loop();
  // Picks the step's slices (allocating blocks to jobs it starts) and takes abandoned running
  // jobs out; those that can be finished at once go to `dropped`. Called with mu_ held.
  std::vector<Slice> plan_step_locked(std::vector<std::shared_ptr<Job>>* dropped);
  // Runs one planned step (without mu_): forward, first tokens, hand-off to the senders.
  void run_step(std::vector<Slice> slices);
  // Queues the job's transfer.
  void hand_to_sender_locked(const std::shared_ptr<Job>& job);
  // The engine is done with the job; true when its transfer is too (the caller then finishes it).
  bool leave_engine_locked(const std::shared_ptr<Job>& job);
  // Runs the job's transfer (a sender thread); finishes the job if the engine is done with it.
  void send_kv(const std::shared_ptr<Job>& job);
  // Frees a job's blocks, forgets it and calls on_done with its outcome. Without mu_ held; once
  // neither the engine nor a sender uses the job.
  void finish(const std::shared_ptr<Job>& job);
  int n_sending_locked() const;  // prefilled jobs whose transfer has not returned
  // Most leading blocks a job may reuse: all but the one holding its last token.
  int max_reused_blocks(const Job& job) const;
  bool has_work_locked() const;
  void update_gauges_locked();

  Model& model_;
  KvTransport& transport_;
  const PrefillConfig config_;
  std::unique_ptr<KvCache> cache_;
  Metrics* metrics_;
  // This worker's series (role="prefill", worker=name), when metrics_ is set.
  prometheus::Histogram* step_tokens_hist_ = nullptr;
  prometheus::Histogram* prefill_seconds_hist_ = nullptr;
  prometheus::Gauge* queue_depth_gauge_ = nullptr;
  prometheus::Gauge* running_gauge_ = nullptr;
  prometheus::Gauge* blocks_free_gauge_ = nullptr;
  prometheus::Gauge* cached_blocks_gauge_ = nullptr;
  prometheus::Counter* lookup_tokens_counter_ = nullptr;
  prometheus::Counter* hit_tokens_counter_ = nullptr;
  prometheus::Counter* inserted_blocks_counter_ = nullptr;
  prometheus::Counter* evicted_blocks_counter_ = nullptr;
  int64_t n_inserted_counted_ = 0;  // the cache's counts already added to the counters; guarded by mu_
  int64_t n_evicted_counted_ = 0;
  int n_vocab_ = 0;
  int n_ctx_ = 0;
  uint64_t hash_seed_ = 0;  // prefix_hash_seed(model fingerprint, KV dtype, block size)

  mutable std::mutex mu_;
  std::condition_variable work_cv_;                             // engine: new job, cancel, freed blocks, stop
  std::condition_variable send_cv_;                             // senders: a job to send, stop
  std::condition_variable kv_cv_;                               // senders: KV written, a job ended
  PrefixCache blocks_;                                          // the KV blocks and the prefix cache; guarded by mu_
  std::deque<std::shared_ptr<Job>> waiting_;                    // FIFO, no blocks yet; guarded by mu_
  std::vector<std::shared_ptr<Job>> running_;                   // hold blocks, prompt unfinished; guarded by mu_
  std::deque<std::shared_ptr<Job>> to_send_;                    // first token out, KV to send; guarded by mu_
  std::unordered_map<std::string, std::shared_ptr<Job>> jobs_;  // every job in progress, by id; guarded by mu_
  int64_t waiting_tokens_ = 0;                                  // sum of waiting_ prompts; guarded by mu_
  bool stopping_ = false;                                       // guarded by mu_
  bool senders_stop_ = false;                                   // guarded by mu_
  Clock::time_point beat_ = Clock::now();                       // the loop's last turn; guarded by mu_
  StepStats step_stats_;                                        // guarded by mu_
  bool in_wait_ = false;                                        // the loop waits for work; guarded by mu_

  std::atomic<int64_t> n_steps_{0};
  std::atomic<bool> engine_running_{false};
  std::thread engine_thread_;
  std::vector<std::thread> sender_threads_;

  // Reused across steps (engine thread only).
  StepBatch batch_;
};

}  // namespace baton
