// The KV hand-off ("the baton") in baton's own types: what a prefill worker sends and a decode
// worker receives, independent of the transport. Wire layout (DESIGN.md): a header, then per
// layer K then V for the request's tokens as [tokens, kv_heads, head_dim] in the KV dtype, each
// chunk with a checksum (kv_checksum: FNV-1a 64 over 8-byte words of K then V), then the end
// mark with the first token. The first token comes last so that the chunks can stream while the
// prompt is still being prefilled (layer by layer as the forward writes them): the decode worker
// has all but the last layer's KV when the first token is sampled.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
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
  std::vector<int32_t> token_ids;  // the n_tokens tokens whose KV this is
  std::string sender;              // receiving side: the sending peer's host (common/tls.h peer_identity's first part)
  std::string sender_certificate;  // receiving side: what its TLS certificate proves ("" without mTLS)
  // A synthetic transfer that measures the link (kv/kv_probe.h): receivers check it like any KV
  // and hand it to their probe sink instead of the engine.
  bool probe = false;
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
// Most layers a KV header may announce, checked before anything is sized by it (the deepest
// models have a few hundred).
constexpr int32_t kMaxKvLayers = 4096;

// The receiving side (the decode engine, the probe sink implement it), only ever driven through a
// KvIncoming (kv/kv_incoming.h), which has checked the stream first. Contract: begin() once, then
// chunk() for every layer covering tokens [0, n_tokens) (layers interleaved in any order, each
// layer's token ranges in order; each chunk of the header's size, its checksum verified), then
// end() with the first token once every layer is complete. Each call returns a non-ok Status to
// refuse the transfer (the header does not match the model or the admission, a first token
// outside the vocabulary); after a refusal, or when the stream breaks or the sender abandons it,
// abort() is called and the receiver forgets the partial KV (its reservation stays until
// released or cancelled).
class KvReceiver {
 public:
  virtual ~KvReceiver() = default;
  virtual Status kv_begin(const KvTransferHeader& header) = 0;
  virtual Status kv_chunk(const std::string& request_id, const KvChunk& chunk) = 0;
  virtual Status kv_end(const std::string& request_id, int32_t first_token) = 0;
  virtual void kv_abort(const std::string& request_id) = 0;
};

// What one transfer sends, as the transport asks for it. A prefill worker's source hands out
// chunks as the forward writes them, so next() may wait.
class KvSource {
 public:
  virtual ~KvSource() = default;
  // The next chunk, once it is in the cache; false when there is none left to send.
  virtual bool next(KvChunk* chunk) = 0;
  // After next() returned false: the first token, which ends the transfer complete; nullopt to
  // abandon it (the request was cancelled or failed): the transport then cancels the transfer
  // and the receiver aborts it.
  virtual std::optional<int32_t> first_token() = 0;
};

// A source over chunks already made (tests and tools).
class KvVectorSource final : public KvSource {
 public:
  KvVectorSource(std::vector<KvChunk> chunks, std::optional<int32_t> first_token)
      : chunks_(std::move(chunks)), first_token_(first_token) {}
  bool next(KvChunk* chunk) override {
    if (i_ == chunks_.size()) return false;
    *chunk = chunks_[i_++];
    return true;
  }
  std::optional<int32_t> first_token() override { return first_token_; }

 private:
  std::vector<KvChunk> chunks_;
  std::optional<int32_t> first_token_;
  size_t i_ = 0;
};

// The sending side of one transport. send() delivers the header, the source's chunks and its
// first token to the decode worker at `address`, and returns when the receiver acknowledged
// everything or refused; CANCELLED when the source abandoned the transfer. Thread-safe.
class KvTransport {
 public:
  virtual ~KvTransport() = default;
  virtual std::string name() const = 0;
  virtual Status send(const std::string& address, const KvTransferHeader& header, KvSource& source,
                      int64_t* bytes_sent) = 0;
};

}  // namespace baton
