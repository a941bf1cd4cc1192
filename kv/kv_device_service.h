// The receiving side of the device KV transports: baton.v1.DecodeKvDevice, which a decode worker
// built with CUDA registers next to its DecodeWorker service (same server, same port). One
// TransferKvDevice call is one transfer (protocol in kv/kv_device_call.h); the payload comes
// through the transport the open names (CudaIpcReceiver, NcclReceiver) and lands in host memory,
// where the KvReceiver (the decode engine) takes it chunk by chunk, as it does from tcp.
//
// The checks are the tcp receiver's (one KvIncoming per transfer) with the same codes; a
// descriptor is checked before its payload moves, so a size the header does not allow never
// reaches an ncclRecv. kv_abort is called exactly once for a transfer whose kv_begin succeeded
// and that does not end in kv_end (refusal, cancellation, broken call, device failure).
//
// Synchronous gRPC API on purpose: a call waits on the device (copies, a receive whose sender is
// slow) and gets a server thread of its own to do it, where a callback reactor must not block.
//
// Lifetime: construct before the server starts; destroy after the server has shut down (the
// destructors close IPC mappings and abort communicators, which no call may be using) and
// before the KvReceiver.
#pragma once

#include <grpcpp/server_context.h>

#include <chrono>

#include "baton/v1/worker.grpc.pb.h"
#include "kv/cuda_ipc/cuda_ipc_transport.h"
#include "kv/kv_incoming.h"
#include "kv/kv_transfer.h"
#include "kv/nccl/nccl_transport.h"

namespace baton {

struct KvDeviceServiceConfig {
  int device = 0;  // CUDA device payloads are received on (the decode backend's --device=cuda:N, else 0)
  int n_cached_ipc_mappings = 128;  // cuda_ipc: unused IPC mappings kept open
  int max_nccl_sessions = 16;       // nccl: communicators held (about one per sending prefill worker)
  std::chrono::milliseconds nccl_init_timeout = std::chrono::seconds(60);  // nccl: rank 1 waits this long for rank 0
};

class KvDeviceService final : public baton::v1::DecodeKvDevice::Service {
 public:
  // `receiver` (and `probe_receiver`, when given) must outlive the service. Touches no GPU until
  // the first call. A transfer whose header is flagged `probe` goes to `probe_receiver` (the
  // decode worker's KvProbeSink, kv/kv_probe.h) after the same checks; without one it is refused.
  KvDeviceService(KvReceiver& receiver, const KvDeviceServiceConfig& config, KvReceiver* probe_receiver = nullptr);

  grpc::Status TransferKvDevice(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<baton::v1::KvDeviceAck, baton::v1::KvDeviceMessage>* stream) override;
  grpc::Status BootstrapNccl(grpc::ServerContext* context, const baton::v1::NcclBootstrapRequest* request,
                             baton::v1::NcclBootstrapResponse* response) override;

 private:
  // The transfer itself; `acked_open`: whether the open was acknowledged (the sender may have
  // posted payload from then on).
  Status transfer(grpc::ServerContext* context,
                  grpc::ServerReaderWriter<baton::v1::KvDeviceAck, baton::v1::KvDeviceMessage>* stream,
                  KvIncoming& incoming, std::unique_ptr<KvDeviceInbound>& inbound, bool& acked_open);

  KvReceiver& receiver_;
  KvReceiver* probe_;  // null: probes refused
  const KvDeviceServiceConfig config_;
  CudaIpcReceiver ipc_;
  NcclReceiver nccl_;
};

}  // namespace baton
