// The prefill worker's gRPC service (baton.v1.PrefillWorker, callback API) over a PrefillEngine.
// Protobuf ↔ engine types are converted here and nowhere else; the engine never sees protobuf.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>

#include "baton/v1/worker.grpc.pb.h"
#include "model/model.h"
#include "prefill_worker/prefill_engine.h"

namespace baton {

class PrefillService final : public baton::v1::PrefillWorker::CallbackService {
 public:
  // `engine` and `model` (the engine's model) must outlive the service and every call on it.
  PrefillService(PrefillEngine& engine, const Model& model) : engine_(engine), model_(model) {}

  // Validates the request (INVALID_ARGUMENT naming the field), queues it, streams FirstToken as
  // soon as it is sampled, then KvSent and OK once the decode worker acknowledged the KV — or
  // the engine's error. Cancelling the call (or its deadline) cancels the job.
  grpc::ServerWriteReactor<baton::v1::PrefillEvent>* Prefill(grpc::CallbackServerContext* context,
                                                             const baton::v1::PrefillRequest* request) override;
  grpc::ServerUnaryReactor* GetLoad(grpc::CallbackServerContext* context, const baton::v1::LoadRequest* request,
                                    baton::v1::LoadReport* response) override;

  // Shutting down: GetLoad reports draining and new Prefill calls get UNAVAILABLE; calls in
  // progress finish.
  void set_draining(bool draining) { draining_ = draining; }

 private:
  PrefillEngine& engine_;
  const Model& model_;
  std::atomic<bool> draining_{false};
};

// INVALID_ARGUMENT naming the offending field of `request` for this model.
Status validate_prefill_request(const baton::v1::PrefillRequest& request, const ModelConfig& model);

}  // namespace baton
