// The `tcp` KV transport: the hand-off as a client-streaming gRPC call into the decode worker
// (DecodeWorker.TransferKv): one KvMessage{header}, then one KvMessage{chunk} per KvChunk. Host
// memory on both sides; works everywhere (CI, CPU-only machines). Both ends live here: the
// sender (TcpKvTransport) and the receiving reactor the decode worker's service returns.
//
// Message size: every chunk is one gRPC message. A server built with gRPC's defaults accepts
// messages up to 4 MiB, so senders keep K+V of a chunk well under that (the prefill worker's
// PrefillConfig::kv_chunk_bytes) or the decode worker's server raises its limit
// (ServerBuilder::SetMaxReceiveMessageSize).
#pragma once

#include <grpcpp/channel.h>
#include <grpcpp/server_context.h>
#include <grpcpp/support/server_callback.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "baton/v1/worker.pb.h"
#include "kv/kv_channel_cache.h"
#include "kv/kv_transfer.h"

namespace baton {

// Sends a transfer over DecodeWorker.TransferKv with the synchronous gRPC API (send() runs on a
// sender thread and blocks until the decode worker acknowledges or refuses). Channels are cached
// per address and shared by concurrent sends. Thread-safe.
class TcpKvTransport final : public KvTransport {
 public:
  // `credentials`: the internal plane's (null = plaintext). `deadline` bounds one whole transfer
  // (connect, header, every chunk, the ack); a streamed transfer starts with its prompt's prefill,
  // so the bound covers that prefill too.
  explicit TcpKvTransport(std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr,
                          std::chrono::milliseconds deadline = std::chrono::seconds(300));

  std::string name() const override { return "tcp"; }
  // Errors: the decode worker's refusal as sent (FAILED_PRECONDITION, INVALID_ARGUMENT,
  // DATA_LOSS, ...), UNAVAILABLE when it cannot be reached, DEADLINE_EXCEEDED past the deadline;
  // the message names `address`. `*bytes_sent` counts the K and V bytes written.
  Status send(const std::string& address, const KvTransferHeader& header, KvSource& source,
              int64_t* bytes_sent) override;

 private:
  std::chrono::milliseconds deadline_;
  KvChannelCache channels_;
};

// Internal ↔ proto, the one place the KV types are converted (chunk conversions move the bytes).
void kv_header_to_proto(const KvTransferHeader& header, baton::v1::KvHeader* proto);
KvTransferHeader kv_header_from_proto(const baton::v1::KvHeader& proto);
void kv_chunk_to_proto(KvChunk&& chunk, baton::v1::KvLayerChunk* proto);
KvChunk kv_chunk_from_proto(baton::v1::KvLayerChunk&& proto);

// The receiving side of TransferKv, for DecodeWorker::CallbackService::TransferKv:
//
//   grpc::ServerReadReactor<KvMessage>* TransferKv(grpc::CallbackServerContext* ctx, KvAck* ack) override {
//     return make_kv_receive_reactor(ctx, ack, receiver_);
//   }
//
// The reactor drives one KvIncoming (kv/kv_incoming.h: the same checks and codes as every other
// transport's receiver), which calls `receiver` (which must outlive the call):
// - the first message must be a header with a sane shape (INVALID_ARGUMENT otherwise) →
//   kv_begin;
// - every chunk: checksum (DATA_LOSS on mismatch), layer within the header, K and V of exactly
//   kv_chunk_bytes(header, token_count) each and at most kMaxKvChunkBytes, token ranges of a
//   layer arriving in order without gaps or overlaps (INVALID_ARGUMENT) → kv_chunk;
// - the end (KvEnd, the first token), then the end of the stream: every layer must cover
//   [0, n_tokens) and the end must have come, with nothing after it (INVALID_ARGUMENT) → kv_end →
//   OK with ack->bytes = K and V bytes received.
// Any refusal (its own or the receiver's) finishes the call with that status and calls
// kv_abort; so does a cancelled or broken stream. kv_abort is called at most once, and only
// after kv_begin succeeded. The reactor deletes itself when gRPC is done with it.
// A header flagged `probe` goes to `probe_receiver` instead (kv/kv_probe.h's KvProbeSink), for the
// whole transfer, after the same checks; without one it is refused (FAILED_PRECONDITION).
grpc::ServerReadReactor<baton::v1::KvMessage>* make_kv_receive_reactor(grpc::CallbackServerContext* context,
                                                                       baton::v1::KvAck* response,
                                                                       KvReceiver& receiver,
                                                                       KvReceiver* probe_receiver = nullptr);

}  // namespace baton
