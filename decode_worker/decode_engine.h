// The decode worker's engine: a paged KV cache that prefill workers fill over a KvReceiver, and one
// thread that runs iteration-level (continuous) batching over every sequence whose KV has fully
// arrived — one token per sequence per step, one Model::forward per step. Protobuf-free: the gRPC
// service (decode_service.h) converts to and from these types.
//
// A request's life:
//   admit()                   reserve blocks for n_prompt_tokens + max_tokens  (state kWaitingKv)
//   kv_begin/chunk/end        the prefill worker's KV lands in the reserved blocks
//   kv_end(first_token)       runnable, next input = the first token  (state kRunning)
//   engine steps              tokens 2..N, sampled exactly as model/generator.cpp would
//   finish                    stop id / max_tokens / cancel / deadline / stop(): blocks freed,
//                             final event delivered when (or once) a sink is attached.
// attach() may come before or after generation starts: events are buffered until attached.
//
// Threads: every public method is thread-safe (called from gRPC threads). Sinks are only ever
// called on the engine thread (or by stop() after that thread has joined), never under the
// engine's lock, so a sink may call back into the engine; it must not block.
// kv_chunk copies into the cache with Backend::kv_import on the caller's thread, concurrently
// with the engine's forward over other blocks: a backend must allow that (the CPU backend's is a
// memcpy into blocks no running sequence owns).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "common/step_stats.h"
#include "kernels/backend.h"
#include "kv/block_pool.h"
#include "kv/kv_transfer.h"
#include "model/model.h"
#include "model/sampler.h"

namespace prometheus {
class Gauge;
}  // namespace prometheus

namespace baton {

class Metrics;

struct DecodeConfig {
  int max_batch = 32;            // most sequences in one decode step (--max-batch)
  int n_blocks = 0;              // KV cache blocks (each holds block_size positions of every layer)
  int block_size = 16;           // tokens per KV block
  DType kv_dtype = DType::kF32;  // KV cache element type; the prefill worker must send the same
  std::string name;              // this worker's name (its listen address): logs and metric labels
  // Local prefill (--local-prefill-max-tokens): a request admitted with its prompt of at most this
  // many tokens is prefilled here, in the decode steps, instead of its KV arriving from a prefill
  // worker (0: never). A colocated server is this with no limit.
  int local_prefill_max_tokens = 0;
  // Most prompt tokens one decode step prefills (chunked prefill, as Sarathi-Serve does): bounds how
  // long a step, and so every running sequence's next token, waits for prompts.
  int local_prefill_token_budget = 512;
};

// INVALID_ARGUMENT naming the field when a value is out of range (the one place it is checked).
Status validate_decode_config(const DecodeConfig& config);
// Bytes one KV block takes over all layers (K and V): divide a memory budget by it for n_blocks.
int64_t decode_kv_block_bytes(const ModelConfig& model, int block_size, DType kv_dtype);

using DecodeClock = std::chrono::steady_clock;

// What the frontend reserves before the prefill worker sends the KV (or, with prefill_tokens, what
// this worker prefills itself).
struct DecodeAdmit {
  std::string request_id;
  int32_t n_prompt_tokens = 0;  // tokens whose KV will arrive (prompt, plus earlier output on failover)
  // Non-empty: prefill these n_prompt_tokens tokens here (local prefill) and sample the first token;
  // no KV transfer comes. At most DecodeConfig::local_prefill_max_tokens of them.
  std::vector<int32_t> prefill_tokens;
  int32_t max_tokens = 0;       // tokens still to produce, counting the first (sampled by prefill)
  SamplingParams sampling;
  bool ignore_eos = false;                          // keep going past stop ids
  std::string model_fingerprint;                    // the frontend's view of the model: must be ours
  std::optional<DecodeClock::time_point> deadline;  // the request ends DEADLINE_EXCEEDED after it
  // Who admitted it (common/tls.h's peer_identity): when set, attach and release are honoured
  // only from the same owner. "" = no check (in-process callers).
  std::string owner;
  // The hosts ("ipv4:10.0.0.5") the KV may come from (the prefill worker Admit named); empty =
  // any. kv_begin from another host is PERMISSION_DENIED.
  std::vector<std::string> kv_senders;
  // The certificate (common/tls.h peer_certificate) the prefill worker proved to the frontend;
  // when set, the KV is taken from the peer proving it, wherever it connects from, and from no
  // other (mTLS). Empty: kv_senders decides (plaintext, --insecure).
  std::string kv_sender_certificate;
};

// One event of a request's stream. token_ids are new tokens (tokens 2..N: the first token reached
// the frontend from the prefill worker and is never repeated here), except for a request
// prefilled here: its first event starts with the first token (first_token_included).
struct DecodeOutput {
  std::vector<int32_t> token_ids;
  bool done = false;
  Status status;                    // on the final event: ok, or why it ended abnormally
  std::string finish_reason;        // on an ok final event: "stop" | "length"
  double decode_queue_seconds = 0;  // on the first event: KV complete → first decode step
  double kv_transfer_seconds = 0;   // on the first event: kv_begin → kv_end
  bool first_token_included = false;  // local prefill: token_ids[0] is the first token
  double queue_seconds = 0;           // local prefill, first event: admitted → its first chunk's step
  double prefill_seconds = 0;         // local prefill, first event: that step's start → the prompt done
};

using DecodeSink = std::function<void(const DecodeOutput&)>;

struct DecodeLoad {
  int64_t free_blocks = 0;
  int64_t total_blocks = 0;
  int32_t block_size = 0;
  int32_t n_running = 0;  // KV complete: generating (in the step, or waiting for one of max_batch slots)
  int32_t n_waiting = 0;  // admitted, KV not yet complete (or not yet prefilled here)
  int32_t local_prefill_max_tokens = 0;  // DecodeConfig's: the longest prompt this worker prefills
  int64_t queued_prompt_tokens = 0;      // local prefill: prompt tokens admitted here, not yet prefilled
  double step_seconds = 0;               // the slowest recent step (common/step_stats.h)
  double prefill_tokens_per_second = 0;  // local prefill: prompt tokens per second of its steps (0: none yet)
};

class DecodeEngine final : public KvReceiver {
 public:
  // `model` must outlive the engine and is used only by the engine thread (Model::forward is not
  // reentrant: give the decode role its own Model). `stop_ids` end generation (the tokenizer's
  // stop_ids()). `metrics` may be null. INVALID_ARGUMENT for a bad config.
  static Result<std::unique_ptr<DecodeEngine>> create(Model& model, std::vector<int32_t> stop_ids,
                                                      const DecodeConfig& config, Metrics* metrics = nullptr);
  ~DecodeEngine() override;  // stop()s
  DecodeEngine(const DecodeEngine&) = delete;
  DecodeEngine& operator=(const DecodeEngine&) = delete;

  // Starts the engine thread (once).
  void start();
  // Joins the engine thread and fails every live request with UNAVAILABLE (blocks freed, final
  // events delivered to attached sinks). Afterwards every call is refused with UNAVAILABLE.
  void stop();

  // Reserves blocks for n_prompt_tokens + max_tokens. INVALID_ARGUMENT: empty or duplicate id, bad
  // sizes or sampling, beyond the model's context; FAILED_PRECONDITION: another model;
  // RESOURCE_EXHAUSTED: the free blocks cannot hold it. `*reserved_blocks` = blocks taken.
  Status admit(const DecodeAdmit& request, int64_t* reserved_blocks = nullptr);
  // Subscribes the request's stream. `deadline` (the Stream call's) replaces the admitted one when
  // set. NOT_FOUND for an unknown (or already finished and delivered) id, FAILED_PRECONDITION when
  // a sink is attached already, PERMISSION_DENIED when `owner` is not who admitted it.
  Status attach(const std::string& request_id, DecodeSink sink,
                std::optional<DecodeClock::time_point> deadline = std::nullopt, const std::string& owner = "");
  // Ends the request with `why` (CANCELLED / DEADLINE_EXCEEDED): a running sequence leaves the
  // batch at the next step boundary; its blocks are freed; an attached sink gets a final event.
  // Unknown ids are ignored.
  void cancel(const std::string& request_id, const Status& why);
  // Drops a reservation whose KV will never arrive (prefill failed); no final event. Unknown ids
  // are ignored; a request already generating is cancelled instead. PERMISSION_DENIED (and nothing
  // done) when `owner` is not who admitted it.
  Status release(const std::string& request_id, const std::string& owner = "");

  DecodeLoad load() const;
  const DecodeConfig& config() const { return config_; }
  // True when the step loop has sequences to step and has not finished a step (or woken) for
  // `limit`: a hung kernel or a deadlock. The server turns health NOT_SERVING while it holds.
  bool stalled(DecodeClock::time_point now, std::chrono::nanoseconds limit) const;
  const Model& model() const { return model_; }

  // ---- KvReceiver (the prefill worker's hand-off; contract in kv/kv_transfer.h) ----
  Status kv_begin(const KvTransferHeader& header) override;
  Status kv_chunk(const std::string& request_id, const KvChunk& chunk) override;
  Status kv_end(const std::string& request_id, int32_t first_token) override;
  void kv_abort(const std::string& request_id) override;

 private:
  struct Sequence;
  using SeqPtr = std::shared_ptr<Sequence>;
  using Delivery = std::pair<SeqPtr, DecodeOutput>;

  DecodeEngine(Model& model, std::vector<int32_t> stop_ids, const DecodeConfig& config, Metrics* metrics);

  void run();
  // A prompt chunk of a sequence prefilled here: its tokens [start, start + n).
  struct PrefillSlice {
    SeqPtr seq;
    int32_t start = 0;
    int32_t n = 0;
  };
  // One forward over `batch` (one token each) and the prompt chunks `prefills`; a sample per
  // sequence of `batch`, then per prompt the chunk finishes, into `*sampled`. Runs without the
  // lock: touches only the sequences' engine-owned fields.
  void step(const std::vector<SeqPtr>& batch, const std::vector<PrefillSlice>& prefills, std::vector<int32_t>* sampled);
  // Under mu_: the step's prompt chunks, first come first served, within the token budget.
  std::vector<PrefillSlice> plan_prefills_locked() const;
  // Under mu_, after a step: a prompt prefilled here, its first token `first` sampled.
  void prefilled_locked(const SeqPtr& seq, int32_t first, DecodeClock::time_point step_end);
  // Under mu_: ends `seq` (frees or schedules freeing of its blocks, buffers the final event).
  void finish_locked(const SeqPtr& seq, const Status& status, const std::string& finish_reason);
  void free_blocks_locked(Sequence& seq);
  // Under mu_: finished-and-attached events ready to hand to sinks; forgets delivered requests.
  void collect_deliveries_locked(std::vector<Delivery>* out);
  // Under mu_: ends sequences whose deadline passed; returns the earliest deadline still ahead.
  std::optional<DecodeClock::time_point> expire_locked(DecodeClock::time_point now);
  void update_gauges_locked();
  bool is_stop(int32_t id) const;
  SeqPtr find_locked(const std::string& request_id) const;
  static void deliver(std::vector<Delivery>& deliveries);

  Model& model_;
  const std::vector<int32_t> stop_ids_;
  const DecodeConfig config_;
  std::unique_ptr<KvCache> cache_;

  mutable std::mutex mu_;
  std::condition_variable cv_;          // wakes the engine thread: runnable work, events, stop
  BlockPool pool_;                      // guarded by mu_
  std::map<std::string, SeqPtr> seqs_;  // every live or undelivered request, by id (guarded)
  std::vector<SeqPtr> running_;         // KV complete, generating, in join order (guarded)
  std::vector<SeqPtr> prefilling_;      // prefilled here, in admission order (guarded)
  int n_waiting_ = 0;                   // sequences in kWaitingKv or kPrefilling (guarded)
  bool work_ = false;                   // something changed that the engine thread must look at (guarded)
  DecodeClock::time_point beat_ = DecodeClock::now();  // the loop's last turn (guarded)
  StepStats step_stats_;                                // (guarded)
  bool in_wait_ = false;                                // the loop waits for work (guarded)
  bool started_ = false;
  bool stopping_ = false;  // stop() called: refuse new work
  std::thread thread_;
  std::vector<SampleSpec> specs_;  // engine thread: the current step's sampling, one per sequence

  // Metrics (null when no registry).
  prometheus::Gauge* g_running_ = nullptr;
  prometheus::Gauge* g_waiting_ = nullptr;
  prometheus::Gauge* g_blocks_free_ = nullptr;
  prometheus::Gauge* g_blocks_total_ = nullptr;
};

}  // namespace baton
