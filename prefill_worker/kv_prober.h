// The prefill worker's KV probes (PrefillWorker.ProbeKv, kv/kv_probe.h): synthetic transfers over
// the worker's own KvTransport to a decode worker, timed. One probe at a time, on a thread of its
// own: a probe blocks on its transfers for as long as they take, which gRPC's callback threads
// must not. Apart from the step loop and its senders: a probe takes no KV blocks, queues behind no
// request and shows in no request metric (baton_kv_probes_total{role="prefill"} counts it).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "common/status.h"
#include "kv/kv_probe.h"

namespace prometheus {
class Counter;
}  // namespace prometheus

namespace baton {

class Metrics;

class KvProber {
 public:
  using Done = std::function<void(Result<KvProbeResult>)>;

  // `transport` (and `metrics`, when given) must outlive the prober. `shape`: this worker's model
  // and KV dtype; `chunk_bytes`: the most K+V bytes of one chunk, as real KV is cut
  // (PrefillConfig::kv_chunk_bytes). `name` labels the metrics.
  KvProber(KvTransport& transport, KvProbeShape shape, int64_t chunk_bytes, const std::string& name,
           Metrics* metrics = nullptr);
  ~KvProber();  // stop()
  KvProber(const KvProber&) = delete;
  KvProber& operator=(const KvProber&) = delete;

  // Starts a probe (run_kv_probe's arguments, checked first: INVALID_ARGUMENT) for `caller` (any
  // pointer that names it to cancel(), e.g. its RPC's reactor); `done` is called exactly once, on
  // the prober's thread, with the result, possibly before start() returns. RESOURCE_EXHAUSTED
  // while another probe runs, UNAVAILABLE once stopped; on error `done` is never called.
  Status start(const void* caller, const std::string& decode_address, int64_t bytes, int32_t rounds, Done done);
  // Abandons `caller`'s probe if it still runs: its transfer ends at the next chunk and `done`
  // gets CANCELLED. Anything else is ignored.
  void cancel(const void* caller);
  // Cancels the running probe, waits for its `done` and joins the thread. Idempotent.
  void stop();

 private:
  struct Job {
    const void* caller = nullptr;
    std::string decode_address;
    int64_t bytes = 0;
    int32_t rounds = 0;
    Done done;
  };

  void loop();

  KvTransport& transport_;
  const KvProbeShape shape_;
  const int64_t chunk_bytes_;
  prometheus::Counter* ok_ = nullptr;
  prometheus::Counter* failed_ = nullptr;
  prometheus::Counter* bytes_ = nullptr;

  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<Job> job_;       // queued or running; guarded by mu_
  bool stopping_ = false;        // guarded by mu_
  std::atomic<bool> cancel_{false};  // the running probe's (set under mu_, read by the transfer)
  std::thread thread_;
};

}  // namespace baton
