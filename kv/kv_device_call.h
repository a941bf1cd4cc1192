// The control plane the device transports (kv/cuda_ipc, kv/nccl) share: one
// DecodeKvDevice.TransferKvDevice call per transfer (worker.proto), both ends.
//
//   sender                                              receiver (KvDeviceService)
//   open{header, transport, node_id | nccl_session} ──▶ KvIncoming::begin (checks, kv_begin),
//                                                      open the payload side (KvDeviceInbound)
//                                                 ◀── ack{-1}
//   per chunk i: stage K|V in device memory (nccl:
//   post its ncclSend), then chunk{desc} ──────────▶ check_chunk (before a byte moves),
//                                                      fetch the bytes to the host, chunk
//                                                      (checksum, kv_chunk)
//                                                 ◀── ack{i}: chunk i's staging memory is free
//   end{first_token}, WritesDone ─────────────────▶ end (every layer covered, kv_end), OK
//
// Flow control: the sender keeps at most `window` chunks unacknowledged, so it needs `window`
// staging slots per transfer and reuses slot i % window only after ack{i - window}. Any refusal
// ends the call with the receiver's status (kv_abort after a successful kv_begin, exactly once);
// the sender stops at its next write or read and returns that status.
#pragma once

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "baton/v1/worker.grpc.pb.h"
#include "kv/kv_channel_cache.h"
#include "kv/kv_incoming.h"
#include "kv/kv_transfer.h"

namespace baton {

// The size to allocate for a staging buffer of `bytes`: the least power of two >= both `bytes`
// and `min_bytes` (a power of two), so a buffer also fits later chunks of similar size.
int64_t kv_staging_bytes(int64_t bytes, int64_t min_bytes);

// The sender's end of one TransferKvDevice call, on the sending thread (synchronous gRPC).
// Every method returns false once the call is over; finish() then says why.
class KvDeviceCall {
 public:
  KvDeviceCall(const std::shared_ptr<grpc::Channel>& channel, std::chrono::system_clock::time_point deadline);

  bool open(const baton::v1::KvDeviceOpen& open);
  // Blocks until the receiver accepted the open (ack{-1}).
  bool wait_opened();
  bool opened() const { return opened_; }
  // Blocks until at most `max_unacked` written chunks are unacknowledged.
  bool wait_window(int max_unacked);
  bool write_chunk(const baton::v1::KvDeviceChunk& chunk);
  // The end mark, after the last chunk.
  bool write_end(int32_t first_token);
  int n_written() const { return n_written_; }
  // Ends the call: WritesDone, reads the remaining acks, Finish. OK only when the receiver
  // acknowledged every chunk and the transfer; otherwise its status (or the transport's:
  // UNAVAILABLE, DEADLINE_EXCEEDED), the message naming the request and `address`.
  Status finish(const std::string& request_id, const std::string& address);
  // Ends the call with a failure of the sender's own (a CUDA error): cancels it so the receiver
  // aborts, and returns `why` with the request and `address` named.
  Status fail(const Status& why, const std::string& request_id, const std::string& address);

 private:
  bool read_ack();

  grpc::ClientContext context_;
  std::unique_ptr<baton::v1::DecodeKvDevice::Stub> stub_;
  std::unique_ptr<grpc::ClientReaderWriter<baton::v1::KvDeviceMessage, baton::v1::KvDeviceAck>> stream_;
  bool live_ = true;     // neither a write nor a read has failed
  bool opened_ = false;  // ack{-1} arrived
  int n_written_ = 0;    // chunk descriptors written
  int n_acked_ = 0;      // chunk acks read (they arrive in order)
  std::string broken_;   // set when the receiver broke the protocol (the call was cancelled)
};

// The payload side of one device transfer at the receiver, made by the transport's receiver
// (CudaIpcReceiver, NcclReceiver) when the open arrives; driven by KvDeviceService on the call's
// thread, one chunk at a time.
class KvDeviceInbound {
 public:
  virtual ~KvDeviceInbound() = default;
  // Moves the bytes of chunk `desc` (which KvIncoming::check_chunk accepted) into chunk->k
  // and chunk->v (host memory).
  virtual Status fetch(const baton::v1::KvDeviceChunk& desc, KvChunk* chunk) = 0;
  // Called once, last. `intact`: both ends agree on the device state (the transfer succeeded,
  // or it was refused before the open was acknowledged, so the sender posted nothing); when
  // false an nccl communicator has operations only one side issued and must be torn down.
  virtual void finish(bool intact) = 0;
};

KvChunkDesc kv_chunk_desc(const baton::v1::KvDeviceChunk& chunk);

}  // namespace baton
