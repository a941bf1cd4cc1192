// The sending half of the KV hand-off: the prefill engine only prefills, and hands each job's KV
// over here as its steps write it.
//
//   KvOutbox  one job's KV as the engine writes it (which tokens and layers are in the cache, the
//             first token, or that the job was abandoned), read as a KvSource by its transfer:
//             for each stretch of tokens the engine has taken up (a step's, or everything done
//             before the transfer got to the job), layer 0's chunks, then layer 1's, ..., each
//             sent as soon as the forward has written its layer; then the end with the first token.
//   KvSender  a small pool of threads, each running one transfer at a time over a KvTransport
//             (tcp, cuda_ipc, nccl: kv/tcp, kv/cuda_ipc, kv/nccl), with the per-link metrics.
//
// Concurrency: the engine thread writes the KV while a sender thread exports the positions whose
// layer the forward has already written; no step writes those again, and the job's blocks are not
// freed before its transfer has returned. On CPU (plain memory) the copies cannot race; the CUDA
// backend writes asynchronously, so there the forward reports no layer early (a step's KV is
// complete when forward returns) and copies go on its own stream under its lock.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "kv/kv_transfer.h"

namespace baton {

class Metrics;

class KvOutbox final : public KvSource {
 public:
  using Clock = std::chrono::steady_clock;
  // Copies K and V of `n` tokens from `start` of one layer out of the cache (the engine's
  // backend and the job's block table), into buffers of kv_chunk_bytes(header, n) each.
  using Export = std::function<void(int32_t layer, int32_t start, int32_t n, char* k, char* v)>;

  // `n_cached`: the leading tokens whose KV is in the cache already (the prefix cache's part): it
  // leaves first, on its own. `chunk_bytes`: most K+V bytes in one chunk (at least one token).
  KvOutbox(KvTransferHeader header, int32_t n_cached, int64_t chunk_bytes, Export export_kv);

  // ---- the engine's side
  // A step over [done, step_end) begins (done: what earlier steps completed); no layer of it is
  // written yet.
  void step_begins(int32_t step_end);
  void layer_written(int32_t n_layers);  // layers [0, n_layers) of the step are in the cache
  void step_done();                       // the whole step is in the cache
  // The prompt is complete and `first_token` sampled: the transfer may end once all is sent.
  void prefilled(int32_t first_token, Clock::time_point at);
  // The job ends without a hand-off (cancelled, failed, shutting down): the transfer stops and
  // the receiver refuses what it got. Idempotent.
  void abandon();
  bool abandoned() const;

  const KvTransferHeader& header() const { return header_; }
  // When the prompt was complete (nullopt before).
  std::optional<Clock::time_point> prefilled_at() const;

  // ---- the transfer's side (KvSource)
  bool next(KvChunk* chunk) override;
  std::optional<int32_t> first_token() override;

 private:
  const KvTransferHeader header_;
  const int32_t n_cached_;
  const Export export_;
  const int64_t row_bytes_;  // K (or V) bytes of one token of one layer
  int32_t tokens_per_chunk_ = 1;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  // Tokens [0, done_) have every layer in the cache; the step in flight covers [done_, step_end_)
  // and has written layers [0, layers_) of it.
  int32_t done_ = 0, step_end_ = 0, layers_ = 0;
  std::optional<int32_t> first_token_;
  std::optional<Clock::time_point> prefilled_at_;
  bool abandoned_ = false;

  // The reader's place (the transfer's thread only): the stretch [stretch_start_, stretch_end_)
  // being sent, `layer_`'s chunks from `start_` on; layer_ == n_layers: the stretch is out
  // (initially the empty stretch [0, 0)).
  int32_t stretch_start_ = 0, stretch_end_ = 0, start_ = 0;
  int32_t layer_ = 0;
};

struct KvSenderConfig {
  int n_threads = 4;  // transfers that run at once (each thread blocks on one)
  std::string name;   // this worker's name: the src label of the per-link metrics, logs
};

class KvSender {
 public:
  // (status, seconds, bytes): OK once the decode worker acknowledged the whole KV; else the
  // transport's error, or CANCELLED when the outbox was abandoned. `seconds`: what the hand-off
  // adds to the request, from the first token (or the transfer's start, when later) to the
  // acknowledgement.
  using Done = std::function<void(const Status& status, double seconds, int64_t bytes)>;

  // `transport` (and `metrics`, when given) must outlive the sender.
  KvSender(KvTransport& transport, KvSenderConfig config, Metrics* metrics = nullptr);
  ~KvSender();  // stop()
  KvSender(const KvSender&) = delete;
  KvSender& operator=(const KvSender&) = delete;

  // Queues the transfer of `outbox` to the decode worker at `address`; `done` is called exactly
  // once, on a sender thread, when it has returned (also for one queued when stop() begins).
  void send(std::shared_ptr<KvOutbox> outbox, std::string address, Done done);
  // Runs the transfers queued, then joins the threads. Idempotent.
  void stop();
  const std::string& transport_name() const { return transport_name_; }

 private:
  struct Transfer {
    std::shared_ptr<KvOutbox> outbox;
    std::string address;
    Done done;
  };
  void loop();
  void run(Transfer& t);

  KvTransport& transport_;
  const KvSenderConfig config_;
  const std::string transport_name_;
  Metrics* const metrics_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Transfer> queue_;  // guarded by mu_
  bool stopping_ = false;       // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace baton
