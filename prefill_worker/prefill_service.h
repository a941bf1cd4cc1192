// The prefill worker's gRPC service (baton.v1.PrefillWorker, callback API) over a PrefillEngine.
// Protobuf ↔ engine types are converted here and nowhere else; the engine never sees protobuf.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <string>

#include "baton/v1/worker.grpc.pb.h"
#include "model/model.h"
#include "prefill_worker/kv_prober.h"
#include "prefill_worker/prefill_engine.h"

namespace baton {

class PrefillService final : public baton::v1::PrefillWorker::CallbackService {
 public:
  // `engine` and `model` (the engine's model), and `prober` when given, must outlive the service
  // and every call on it. `kv_transport`: the name of the engine's transport (for GetLoad). Without
  // a prober ProbeKv is UNIMPLEMENTED.
  PrefillService(PrefillEngine& engine, const Model& model, KvProber* prober = nullptr,
                 std::string kv_transport = "tcp")
      : engine_(engine), model_(model), prober_(prober), kv_transport_(std::move(kv_transport)) {}

  // Validates the request (INVALID_ARGUMENT naming the field), queues it, streams FirstToken as
  // soon as it is sampled, then KvSent and OK once the decode worker acknowledged the KV — or
  // the engine's error. Cancelling the call (or its deadline) cancels the job.
  grpc::ServerWriteReactor<baton::v1::PrefillEvent>* Prefill(grpc::CallbackServerContext* context,
                                                             const baton::v1::PrefillRequest* request) override;
  grpc::ServerUnaryReactor* GetLoad(grpc::CallbackServerContext* context, const baton::v1::LoadRequest* request,
                                    baton::v1::LoadReport* response) override;
  // Runs the probe on the prober's thread (kv_prober.h); the call ends when it is done.
  grpc::ServerUnaryReactor* ProbeKv(grpc::CallbackServerContext* context, const baton::v1::KvProbeRequest* request,
                                    baton::v1::KvProbeResponse* response) override;

  // Shutting down: GetLoad reports draining and new Prefill calls get UNAVAILABLE; calls in
  // progress finish.
  void set_draining(bool draining) { draining_ = draining; }

 private:
  PrefillEngine& engine_;
  const Model& model_;
  KvProber* prober_;
  const std::string kv_transport_;
  std::atomic<bool> draining_{false};
};

}  // namespace baton
