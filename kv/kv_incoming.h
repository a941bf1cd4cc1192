// The receiving half of the KV hand-off, whatever transport carries it (tcp, cuda_ipc, nccl):
// one KvIncoming per transfer makes every check a receiver needs and calls the KvReceiver (the
// decode engine, or the probe sink) in order. A transport reads its wire format and drives it:
//
//   begin(header)      the header's shape is sane (at most kMaxKvLayers layers, one token's
//                      K within kMaxKvChunkBytes)                                 INVALID_ARGUMENT
//                      chooses the receiver (a probe never reaches the engine), then kv_begin;
//                      only after it is anything sized by the header
//   check_chunk(desc)  layer within the header, token range next in its layer and inside
//                      n_tokens, K and V of exactly kv_chunk_bytes(header, token_count) each and
//                      at most kMaxKvChunkBytes                                   INVALID_ARGUMENT
//   chunk(chunk)       the descriptor again, the checksum of the bytes (DATA_LOSS), then kv_chunk
//   end(first_token)   every layer covers [0, n_tokens) (INVALID_ARGUMENT), then kv_end
//   abort()            kv_abort, exactly once, and only after a kv_begin that succeeded and
//                      before a kv_end that did; the destructor aborts what is not settled
//
// So a receiver only ever sees chunks that are in place, of the header's size and intact, and
// kv_end only when every layer is complete: it checks the header against its model and its
// admission, and nothing of the stream. check_chunk needs only the descriptor, so a device
// transport checks a chunk before it moves (or posts a receive for) a single byte. Not
// thread-safe: one per transfer, driven in order. A refusal does not abort by itself: the
// transport ends the transfer and calls abort() (or lets the destructor).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "kv/kv_transfer.h"

namespace baton {

// What a chunk claims to be, before its bytes are looked at.
struct KvChunkDesc {
  int32_t layer = 0;
  int32_t token_start = 0;
  int32_t token_count = 0;
  int64_t k_bytes = 0;
  int64_t v_bytes = 0;
};

class KvIncoming {
 public:
  // `engine` takes real KV; `probe` takes probes (null: probes are refused). Both outlive this.
  KvIncoming(KvReceiver& engine, KvReceiver* probe);
  ~KvIncoming();
  KvIncoming(const KvIncoming&) = delete;
  KvIncoming& operator=(const KvIncoming&) = delete;

  // Checks the header's shape, then hands it to its receiver; a second begin is refused.
  Status begin(const KvTransferHeader& header);
  bool begun() const { return begun_; }
  // The header begin() checked ("?" as its request id before that, for logs).
  const KvTransferHeader& header() const { return header_; }
  const std::string& request_id() const;

  Status check_chunk(const KvChunkDesc& desc) const;
  Status chunk(const KvChunk& chunk);
  Status end(int32_t first_token);
  void abort();

  // K and V bytes of the chunks the receiver took.
  int64_t bytes() const { return bytes_; }

 private:
  KvReceiver& engine_;
  KvReceiver* probe_;
  KvReceiver* receiver_ = nullptr;  // set once its kv_begin succeeded
  bool settled_ = false;            // kv_end succeeded, or kv_abort was called
  KvTransferHeader header_;
  bool begun_ = false;  // the header passed its checks and its receiver's kv_begin
  std::vector<int32_t> next_token_;  // per layer: the next token its chunks must start at
  int64_t bytes_ = 0;
};

// "KV chunk (layer L, tokens S+N)", the prefix of every chunk refusal.
std::string kv_chunk_name(const KvChunkDesc& desc);

}  // namespace baton
