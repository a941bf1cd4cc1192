// KV probes: synthetic KV hand-offs that measure a prefill → decode link over the transport real
// KV takes (`batonctl doctor`; PrefillWorker.ProbeKv in worker.proto). Both ends are here:
//
//   sender    kv_probe_header + KvProbeSource: KV of the model's shape in the worker's KV dtype,
//             random bytes, cut into chunks as real KV is (at most kv_chunk_bytes of K+V, layer
//             by layer, tokens in order), each with its checksum. run_kv_probe times
//             KvTransport::send of a minimal transfer (one token of every layer: latency) and of
//             a large one (bandwidth) per round.
//   receiver  KvProbeSink: the KvReceiver that a transfer flagged `probe` goes to instead of the
//             decode engine (the receive reactors choose by the header, once). The reactor has
//             already run the transfer through KvIncoming (shape, sizes, order, checksums), as
//             for any KV; the sink checks the header against its model as the engine does
//             (fingerprint, dtype, shape), bounds the size and the probes in flight, counts, and
//             drops the bytes: no Admit, no KV blocks, no request metrics.
//
// Abuse: only deployment peers reach either end (mutual TLS on the internal plane, or loopback);
// within the deployment a probe costs its receiver at most kMaxKvProbesInFlight transfers of
// kMaxKvProbeBytes, one chunk in memory at a time each, and its sender one probe at a time.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "kv/kv_transfer.h"

namespace prometheus {
class Counter;
}  // namespace prometheus

namespace baton {

class Metrics;

inline constexpr int64_t kMaxKvProbeBytes = int64_t{256} << 20;  // K and V of one probe transfer
inline constexpr int32_t kMaxKvProbeRounds = 32;                 // rounds of one ProbeKv call
inline constexpr int kMaxKvProbesInFlight = 2;                   // probe transfers a decode worker takes at once

// What a worker's KV looks like: the header fields a receiver checks against its model.
struct KvProbeShape {
  std::string model_fingerprint;
  std::string dtype;  // "f32" | "bf16" | "f16"
  int32_t n_layers = 0;
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;
};

// K and V bytes of a whole transfer with header `h` (every layer, every token).
int64_t kv_transfer_bytes(const KvTransferHeader& h);

// A probe header of `shape` (a fresh random request id, token ids 0) whose K and V are the most
// whole tokens that fit in `bytes`, and at least one token.
KvTransferHeader kv_probe_header(const KvProbeShape& shape, int64_t bytes);

// INVALID_ARGUMENT naming the field unless bytes is in [1, kMaxKvProbeBytes], rounds in
// [1, kMaxKvProbeRounds] and the address is given.
Status validate_kv_probe(const std::string& decode_address, int64_t bytes, int32_t rounds);

// The chunks of one probe transfer: for each layer, token ranges of at most `chunk_bytes` of K+V
// (at least one token), K and V copied out of `pattern` (random bytes, at least 2 × the largest
// chunk's K), checksummed. Once `*cancel` is set, next() ends early and first_token() abandons
// the transfer.
class KvProbeSource final : public KvSource {
 public:
  KvProbeSource(const KvTransferHeader& header, int64_t chunk_bytes, const std::string& pattern,
                const std::atomic<bool>& cancel);
  bool next(KvChunk* chunk) override;
  std::optional<int32_t> first_token() override;

 private:
  const KvTransferHeader& header_;
  const std::string& pattern_;
  const std::atomic<bool>& cancel_;
  int32_t tokens_per_chunk_ = 1;
  int32_t layer_ = 0;
  int32_t token_ = 0;  // next token of layer_
};

// What one ProbeKv measured.
struct KvProbeResult {
  std::string transport;                // KvTransport::name()
  int64_t bytes = 0;                    // K and V bytes of each large transfer
  std::vector<double> seconds;          // per round: the large transfer's send()
  int64_t latency_bytes = 0;            // K and V bytes of each minimal transfer
  std::vector<double> latency_seconds;  // per round: the minimal transfer's send()
};

// `rounds` times: a minimal transfer, then one of about `bytes` (kv_probe_header), each timed
// from the start of send() to its return (the receiver's acknowledgement). The first failure ends
// the probe with the transport's status; CANCELLED once `cancel` is set.
Result<KvProbeResult> run_kv_probe(KvTransport& transport, const std::string& decode_address, const KvProbeShape& shape,
                                   int64_t bytes, int32_t rounds, int64_t chunk_bytes, const std::atomic<bool>& cancel);

// The decode worker's receiver of probes (see the top of this file). Thread-safe: transfers of
// several calls may run at once (at most kMaxKvProbesInFlight get past kv_begin).
class KvProbeSink final : public KvReceiver {
 public:
  // `expected`: the decode worker's own model and KV dtype. `metrics` (may be null) gets
  // baton_kv_probes_total and baton_kv_probe_bytes_total with role="decode", worker=`name`.
  KvProbeSink(KvProbeShape expected, const std::string& name, Metrics* metrics);

  // FAILED_PRECONDITION when the header's model fingerprint, dtype or shape differ from
  // `expected` (the engine's refusals, with the same fixes named), INVALID_ARGUMENT when it is
  // not a probe or holds more than kMaxKvProbeBytes, RESOURCE_EXHAUSTED when
  // kMaxKvProbesInFlight probes are in progress.
  Status kv_begin(const KvTransferHeader& header) override;
  Status kv_chunk(const std::string& request_id, const KvChunk& chunk) override;
  Status kv_end(const std::string& request_id, int32_t first_token) override;
  void kv_abort(const std::string& request_id) override;

  int n_in_flight() const { return in_flight_.load(); }
  int64_t n_received() const { return n_received_.load(); }  // probes that ended complete

 private:
  const KvProbeShape expected_;
  std::atomic<int> in_flight_{0};
  std::atomic<int64_t> n_received_{0};
  prometheus::Counter* ok_ = nullptr;
  prometheus::Counter* failed_ = nullptr;
  prometheus::Counter* bytes_ = nullptr;
};

}  // namespace baton
