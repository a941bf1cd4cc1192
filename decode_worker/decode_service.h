// The decode worker's gRPC service (baton.v1.DecodeWorker, callback API) over a DecodeEngine.
// This file and decode_service.cpp are the only decode-side code that sees protobuf: requests are
// converted to engine types on the way in and engine events to DecodeEvent on the way out.
//
//   Admit       reserve KV blocks                    → DecodeEngine::admit
//   Stream      one ServerWriteReactor per call       → DecodeEngine::attach; the call's deadline
//               becomes the request's; cancelling it  → DecodeEngine::cancel
//   Release     drop a reservation                    → DecodeEngine::release
//   TransferKv  the prefill worker's KV hand-off      → kv/tcp's receive reactor into the engine
//               (the cuda_ipc and nccl transports arrive over DecodeKvDevice instead: server/
//               registers kv/kv_device_service.h next to this service, into the same engine)
//               (a KV probe, KvHeader.probe, goes to the probe sink instead: no Admit, no blocks)
//   GetLoad     free blocks, running sequences, model; KV dtype and transports, wall clock, version
//
// Wiring (server/): build the engine with DecodeEngine::create, start() it, register this
// service, and on shutdown stop the gRPC server before the engine is destroyed (TransferKv calls
// copy into the engine's cache).
#pragma once

#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "baton/v1/worker.grpc.pb.h"
#include "decode_worker/decode_engine.h"
#include "model/model.h"

namespace baton {

class DecodeService final : public baton::v1::DecodeWorker::CallbackService {
 public:
  // Both (and `kv_probe`, when given) must outlive the service. A request's blocks are held at
  // most `max_request` from its Admit (whatever deadline the caller gives), and at most
  // min(60 s, max_request) until a Stream attaches: a caller cannot park a reservation.
  // `kv_probe` takes the KV probes that arrive over TransferKv (kv/kv_probe.h's KvProbeSink;
  // null: refused). `kv_transports`: the transports this worker receives KV over (for GetLoad).
  DecodeService(DecodeEngine& engine, const Model& model,
                std::chrono::seconds max_request = std::chrono::seconds(3600), KvReceiver* kv_probe = nullptr,
                std::vector<std::string> kv_transports = {"tcp"})
      : engine_(engine),
        model_(model),
        max_request_(max_request),
        kv_probe_(kv_probe),
        kv_transports_(std::move(kv_transports)) {}

  // Reported in GetLoad: the frontend routes no new work here while set (graceful shutdown).
  void set_draining(bool draining) { draining_ = draining; }

  grpc::ServerUnaryReactor* Admit(grpc::CallbackServerContext* context, const v1::AdmitRequest* request,
                                  v1::AdmitResponse* response) override;
  grpc::ServerWriteReactor<v1::DecodeEvent>* Stream(grpc::CallbackServerContext* context,
                                                    const v1::StreamRequest* request) override;
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* context, const v1::ReleaseRequest* request,
                                    v1::ReleaseResponse* response) override;
  grpc::ServerReadReactor<v1::KvMessage>* TransferKv(grpc::CallbackServerContext* context,
                                                     v1::KvAck* response) override;
  grpc::ServerUnaryReactor* GetLoad(grpc::CallbackServerContext* context, const v1::LoadRequest* request,
                                    v1::LoadReport* response) override;

 private:
  DecodeEngine& engine_;
  const Model& model_;
  const std::chrono::seconds max_request_;
  KvReceiver* const kv_probe_;
  const std::vector<std::string> kv_transports_;
  std::atomic<bool> draining_{false};
};

}  // namespace baton
