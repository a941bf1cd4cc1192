// The request pipeline's WorkerClient over gRPC (the client callback API), and every protobuf ↔
// baton conversion of the frontend → worker boundary.
#pragma once

#include <atomic>
#include <memory>

#include "scheduler/worker_client.h"
#include "server/worker_pool.h"

namespace baton {

class GrpcWorkerClient final : public WorkerClient {
 public:
  explicit GrpcWorkerClient(WorkerPool& pool) : pool_(pool) {}

  void admit(const std::string& decode_address, const AdmitCall& call, CallDeadline deadline, Done done) override;
  WorkerCall* prefill(const std::string& prefill_address, const PrefillCall& call, CallDeadline deadline,
                      std::function<void(const PrefillUpdate&)> on_update, Done done) override;
  WorkerCall* stream(const std::string& decode_address, const std::string& request_id, CallDeadline deadline,
                     std::function<void(const DecodeUpdate&)> on_update, Done done) override;
  void release(const std::string& decode_address, const std::string& request_id) override;

  // Calls started and not yet done (the frontend waits for zero before it goes).
  int64_t n_in_flight() const { return in_flight_->load(); }

 private:
  WorkerPool& pool_;
  // Shared with the calls, which may finish after the client is gone.
  std::shared_ptr<std::atomic<int64_t>> in_flight_ = std::make_shared<std::atomic<int64_t>>(0);
};

}  // namespace baton
