// The decode worker's engine: a paged KV cache that prefill workers fill over a KvReceiver, and one
// thread that runs iteration-level (continuous) batching over every sequence whose KV has fully
// arrived — one token per sequence per step, one Model::forward per step. Protobuf-free: the gRPC
// service (decode_service.h) converts to and from these types.
//
// A request's life:
//   admit()                   reserve blocks for n_prompt_tokens + max_tokens  (state kWaitingKv)
//   admit(fork_of)            n choices of one prompt: share its blocks (DecodeAdmit::n_forks, below)
//   kv_begin/chunk/end        the prefill worker's KV lands in the reserved blocks
//   kv_end(first_token)       runnable, next input = the first token  (state kRunning)
//   engine steps              tokens 2..N, sampled exactly as model/generator.cpp would
//   finish                    stop id / max_tokens / cancel / deadline / stop(): blocks freed,
//                             final event delivered when (or once) a sink is attached.
// attach() may come before or after generation starts: events are buffered until attached.
//
// Forks (the n choices of one prompt): a request admitted with n_forks > 0 holds, once its KV is
// complete (or prefilled here), the blocks of its first n_prompt_tokens - 1 positions in a fork
// hold for at most DecodeConfig::fork_hold. A fork's admit shares the hold's full blocks (BlockPool::share),
// reserves the rest of its own, and starts as a one-token prefill of the prompt's last position;
// its first step first copies the positions of the hold's last partial block into its own (the
// source goes on writing into that block past the prompt). So n choices of an L-token prompt hold
// the prompt's full blocks once, and each its own blocks from the last partial one on.
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

#include "common/metrics.h"
#include "common/status.h"
#include "decode_worker/decode_job.h"
#include "common/step_stats.h"
#include "kernels/backend.h"
#include "kv/block_pool.h"
#include "kv/kv_transfer.h"
#include "model/model.h"
#include "model/sampler.h"
#include "model/stop_rule.h"

namespace baton {

class Metrics;

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
  void step(const std::vector<SeqPtr>& batch, const std::vector<PrefillSlice>& prefills, std::vector<int32_t>* sampled,
            std::vector<TokenLogprobs>* logprobs);
  // Under mu_: the step's prompt chunks, first come first served, within the token budget.
  std::vector<PrefillSlice> plan_prefills_locked() const;
  // Under mu_, after a step: a prompt prefilled here, its first token `first` sampled.
  void prefilled_locked(const SeqPtr& seq, int32_t first, const TokenLogprobs* logprobs, DecodeClock::time_point step_end);
  // Under mu_: ends `seq` (frees or schedules freeing of its blocks, buffers the final event).
  void finish_locked(const SeqPtr& seq, const Status& status, const std::string& finish_reason);
  void free_blocks_locked(Sequence& seq);
  // Under mu_: finished-and-attached events ready to hand to sinks; forgets delivered requests.
  void collect_deliveries_locked(std::vector<Delivery>* out);
  // Under mu_: ends sequences whose deadline passed; returns the earliest deadline still ahead.
  std::optional<DecodeClock::time_point> expire_locked(DecodeClock::time_point now);
  void update_gauges_locked();
  // Where `admit`'s generation ends (model/stop_rule.h): this engine's stop ids, its limits.
  StopRule stop_rule(const DecodeAdmit& admit) const { return {stop_ids_, admit.ignore_eos, admit.max_tokens}; }
  SeqPtr find_locked(const std::string& request_id) const;
  // A fork of `r.fork_of`'s prompt (the lock held, `r` validated).
  Status admit_fork_locked(const DecodeAdmit& r, int64_t* reserved_blocks);
  // Under mu_: `seq`'s prompt KV (`tokens`) is complete: hold it for the forks it announced.
  void hold_for_forks_locked(const Sequence& seq, std::vector<int32_t> tokens);
  // Engine thread, without the lock: a fork's copy of its source's last partial prompt block.
  void copy_fork_prefix(const Sequence& seq);
  // Under mu_: gives back a fork's hold on the block it copies from (once copied, or never).
  void release_fork_copy_locked(Sequence& seq);
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
  // A request's prompt blocks kept for the forks it announced (guarded), by its id.
  struct ForkHold {
    std::string owner;            // who admitted it: forks are honoured only from the same peer
    std::vector<int32_t> tokens;  // its prompt (the KV's token ids)
    std::vector<int32_t> blocks;  // held: positions [0, tokens.size() - 1)
    int32_t n_left = 0;           // forks still to come
    DecodeClock::time_point expires;
  };
  std::map<std::string, ForkHold> fork_holds_;
  void drop_fork_hold_locked(std::map<std::string, ForkHold>::iterator it);
  int n_waiting_ = 0;                   // sequences in kWaitingKv or kPrefilling (guarded)
  bool work_ = false;                   // something changed that the engine thread must look at (guarded)
  DecodeClock::time_point beat_ = DecodeClock::now();  // the loop's last turn (guarded)
  StepStats step_stats_;                                // (guarded)
  bool in_wait_ = false;                                // the loop waits for work (guarded)
  bool started_ = false;
  bool stopping_ = false;  // stop() called: refuse new work
  std::thread thread_;
  std::vector<SampleSpec> specs_;     // engine thread: the current step's sampling, one per sequence
  std::vector<LogitAdjust> adjust_;  // engine thread: the current step's penalties

  EngineGauges gauges_;  // this worker's (role="decode"); nothing without a registry
};

}  // namespace baton
