// The receiving side's checks of one KV transfer, independent of the transport that carries it
// (tcp, cuda_ipc, nccl): a transfer is a header, then chunks, then an end. Every receiver runs
// its stream through one KvStreamCheck so they all refuse the same things with the same codes:
//
//   begin(header)        the header's shape is sane                                INVALID_ARGUMENT
//   check_chunk(desc)    layer within the header, token range next in its layer and inside
//                        n_tokens, K and V of exactly kv_chunk_bytes(header, token_count) each
//                        and at most kMaxKvChunkBytes                             INVALID_ARGUMENT
//   check_bytes(chunk)   the descriptor again, then the checksum of the bytes     DATA_LOSS
//   accept(chunk)        records a chunk the KvReceiver took
//   check_complete()     every layer covers [0, n_tokens)                         INVALID_ARGUMENT
//
// check_chunk needs only the descriptor, so a device transport checks a chunk before it moves
// (or posts a receive for) a single byte. Not thread-safe: one per transfer, driven in order.
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

class KvStreamCheck {
 public:
  // Checks the header's shape; the check is begun on success (a second begin is refused).
  Status begin(const KvTransferHeader& header);
  bool begun() const { return begun_; }
  // The header begin() accepted.
  const KvTransferHeader& header() const { return header_; }

  Status check_chunk(const KvChunkDesc& desc) const;
  Status check_bytes(const KvChunk& chunk) const;
  void accept(const KvChunk& chunk);
  Status check_complete() const;

  // K and V bytes of the accepted chunks.
  int64_t bytes() const { return bytes_; }

 private:
  KvTransferHeader header_;
  bool begun_ = false;
  std::vector<int32_t> next_token_;  // per layer: the next token its chunks must start at
  int64_t bytes_ = 0;
};

// "KV chunk (layer L, tokens S+N)", the prefix of every chunk refusal.
std::string kv_chunk_name(const KvChunkDesc& desc);

}  // namespace baton
