#include "kv/kv_device_service.h"

#include <spdlog/spdlog.h>

#include "common/grpc_status.h"
#include "common/tls.h"
#include "kv/kv_cuda_status.h"
#include "kv/kv_incoming.h"
#include "kv/tcp/tcp_transport.h"

namespace baton {
namespace {

// This worker's device, current on the calling (server) thread.
Status use_device(int device) {
  const Status s = kv_cuda_status(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
  if (s.ok()) return s;
  return failed_precondition("this decode worker cannot receive KV on CUDA device " + std::to_string(device) + ": " +
                             s.message());
}

}  // namespace

KvDeviceService::KvDeviceService(KvReceiver& receiver, const KvDeviceServiceConfig& config, KvReceiver* probe_receiver)
    : receiver_(receiver),
      probe_(probe_receiver),
      config_(config),
      ipc_(CudaIpcReceiverConfig{config.device, config.n_cached_ipc_mappings}),
      nccl_(NcclReceiverConfig{config.device, config.max_nccl_sessions, config.nccl_init_timeout}) {}

grpc::Status KvDeviceService::TransferKvDevice(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<baton::v1::KvDeviceAck, baton::v1::KvDeviceMessage>* stream) {
  KvIncoming incoming(receiver_, probe_);
  std::unique_ptr<KvDeviceInbound> inbound;
  bool acked_open = false;
  const Status s = transfer(context, stream, incoming, inbound, acked_open);
  if (!s.ok()) {
    spdlog::warn("req={} KV transfer refused: {}", incoming.request_id(), s.to_string());
    incoming.abort();
  }
  // Before the open's ack the sender posts nothing, so a refusal up to there leaves the device
  // state both ends share intact.
  if (inbound) inbound->finish(s.ok() || !acked_open);
  return to_grpc(s);
}

Status KvDeviceService::transfer(grpc::ServerContext* context,
                                 grpc::ServerReaderWriter<baton::v1::KvDeviceAck, baton::v1::KvDeviceMessage>* stream,
                                 KvIncoming& incoming, std::unique_ptr<KvDeviceInbound>& inbound, bool& acked_open) {
  auto broken = [&] { return cancelled("the KV transfer was cancelled or its stream broke"); };
  baton::v1::KvDeviceMessage message;
  if (!stream->Read(&message)) {
    if (context->IsCancelled()) return broken();
    return invalid_argument("the KV stream ended before its header");
  }
  if (!message.has_open()) return invalid_argument("the first KV message must be the open (header)");
  const baton::v1::KvDeviceOpen& open = message.open();
  KvTransferHeader header = kv_header_from_proto(open.header());
  header.sender = peer_host(context->peer());
  header.sender_certificate = peer_certificate(*context);
  BATON_RETURN_IF_ERROR(incoming.begin(header));

  BATON_RETURN_IF_ERROR(use_device(config_.device));
  if (open.transport() == "cuda_ipc") {
    BATON_ASSIGN_OR_RETURN(inbound, ipc_.open(open));
  } else if (open.transport() == "nccl") {
    BATON_ASSIGN_OR_RETURN(inbound,
                           nccl_.open(open, context->deadline(), [context] { return context->IsCancelled(); }));
  } else {
    return invalid_argument("unknown device KV transport '" + open.transport() + "' (expected cuda_ipc or nccl)");
  }

  baton::v1::KvDeviceAck ack;
  ack.set_chunk(-1);
  if (!stream->Write(ack)) return broken();
  acked_open = true;

  std::optional<int32_t> first_token;  // the end arrived
  for (int32_t n = 0; stream->Read(&message); ++n) {
    if (first_token) return invalid_argument("a KvDeviceMessage after the transfer's end");
    if (message.has_end()) {
      first_token = message.end().first_token();
      continue;
    }
    if (!message.has_chunk()) {
      return invalid_argument(message.has_open() ? "a second KV header in one transfer"
                                                 : "a KvDeviceMessage carries neither an open, a chunk nor an end");
    }
    const baton::v1::KvDeviceChunk& desc = message.chunk();
    // Before a single byte moves (nccl: before the ncclRecv is posted).
    BATON_RETURN_IF_ERROR(incoming.check_chunk(kv_chunk_desc(desc)));
    KvChunk chunk;
    chunk.layer = desc.layer();
    chunk.token_start = desc.token_start();
    chunk.token_count = desc.token_count();
    chunk.checksum = desc.checksum();
    BATON_RETURN_IF_ERROR(inbound->fetch(desc, &chunk));
    BATON_RETURN_IF_ERROR(incoming.chunk(chunk));
    ack.set_chunk(n);
    if (!stream->Write(ack)) return broken();
  }
  // A failed read is the sender's WritesDone, or a cancelled or broken call: only a stream whose
  // every layer is covered reaches kv_end.
  if (context->IsCancelled()) return broken();
  if (!first_token) return invalid_argument("the KV stream ended without its end (the first token)");
  return incoming.end(*first_token);
}

grpc::Status KvDeviceService::BootstrapNccl(grpc::ServerContext* context,
                                            const baton::v1::NcclBootstrapRequest* request,
                                            baton::v1::NcclBootstrapResponse* response) {
  // The device first: a reservation is this worker's promise that it can take part.
  if (Status s = use_device(config_.device); !s.ok()) return to_grpc(s);
  Result<std::string> session = nccl_.bootstrap(*request, context->deadline());
  if (!session.ok()) {
    spdlog::warn("NCCL bootstrap refused: {}", session.status().to_string());
    return to_grpc(session.status());
  }
  response->set_device(config_.device);
  response->set_session(*session);
  return grpc::Status::OK;
}

}  // namespace baton
