// The KV hand-off ("the baton") in baton's own types: what a prefill worker sends and a decode
// worker receives, independent of the transport. Wire layout (DESIGN.md): a header, then per
// layer K then V for the request's tokens as [tokens, kv_heads, head_dim] in the KV dtype, each
// chunk with a checksum (kv_checksum: FNV-1a 64 over 8-byte words of K then V).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace baton {

struct KvTransferHeader {
  std::string request_id;
  std::string model_fingerprint;
  std::string dtype;  // "f32" | "bf16" | "f16"
  int32_t n_layers = 0;
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t n_tokens = 0;
  int32_t first_token = 0;         // sampled by the prefill worker
  std::vector<int32_t> token_ids;  // the n_tokens tokens whose KV this is
  std::string sender;              // receiving side: the sending peer's host (common/tls.h peer_identity's first part)
};

struct KvChunk {
  int32_t layer = 0;
  int32_t token_start = 0;
  int32_t token_count = 0;
  std::string k;  // token_count × n_kv_heads × head_dim elements of the dtype
  std::string v;
  uint64_t checksum = 0;  // kv_checksum(k, v)
};

uint64_t kv_checksum(const std::string& k, const std::string& v);
// Bytes of K (or V) for `n_tokens` tokens of one layer.
int64_t kv_chunk_bytes(const KvTransferHeader& h, int32_t n_tokens);
// Largest chunk a receiver accepts before allocating (bounds a lying sender).
constexpr int64_t kMaxKvChunkBytes = int64_t{256} << 20;

// The receiving side (the decode worker implements it). Contract: begin() once, then chunk()
// for every layer (in any order) covering tokens [0, n_tokens), then end(). Each call returns a
// non-ok Status to refuse the transfer (model or shape mismatch, not admitted, bad checksum,
// oversized); after a refusal, or when the stream breaks, abort() is called and the receiver
// forgets the partial KV (its reservation stays until released or cancelled).
class KvReceiver {
 public:
  virtual ~KvReceiver() = default;
  virtual Status kv_begin(const KvTransferHeader& header) = 0;
  virtual Status kv_chunk(const std::string& request_id, const KvChunk& chunk) = 0;
  virtual Status kv_end(const std::string& request_id) = 0;
  virtual void kv_abort(const std::string& request_id) = 0;
};

// The sending side of one transport. send() delivers the header and the chunks that `next`
// yields (it returns false when there are no more) to the decode worker at `address`, and
// returns when the receiver acknowledged everything or refused. Thread-safe.
class KvTransport {
 public:
  virtual ~KvTransport() = default;
  virtual std::string name() const = 0;
  virtual Status send(const std::string& address, const KvTransferHeader& header,
                      const std::function<bool(KvChunk*)>& next, int64_t* bytes_sent) = 0;
};

}  // namespace baton
