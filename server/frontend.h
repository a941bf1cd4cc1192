// The frontend role: the public Generation service over a scheduler and the worker pool. It
// reads only the model file's metadata (tokenizer, chat template, shapes), never its weights.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "baton/v1/generate.grpc.pb.h"
#include "common/api_keys.h"
#include "common/metrics.h"
#include "model/model_files.h"
#include "scheduler/scheduler.h"
#include "server/public_call.h"
#include "server/grpc_worker_client.h"
#include "server/request_validation.h"
#include "server/worker_pool.h"

namespace baton {

struct FrontendConfig {
  std::string model_path;     // GGUF file (metadata only)
  std::string name;           // listen address, for metrics labels and logs
  std::string chat_template;  // "" (the model's) | a built-in template's name | a Jinja file
  int32_t max_priority = 0;   // highest priority a client may ask for (ServedModel::max_priority)
  WorkerPoolConfig workers;   // where the workers are
  SchedulerConfig scheduler;  // admission bounds
  PipelineConfig pipeline;    // failover and progress bounds
  // The longest a request may run, whatever deadline it asks (gRPC and HTTP alike); > 0.
  std::chrono::seconds max_request{3600};
  WorkerRegistryConfig registry;
  std::shared_ptr<ApiKeys> api_keys;  // null: the public API needs no key
};

// One Generate RPC (generate_call.cpp): the reactor that Frontend::Generate returns. Generate is
// the raw callback method: the request arrives as bytes and the responses leave as bytes, so that
// the frontend parses the request itself and a malformed one (bad wire format, a string field
// that is not UTF-8) gets INVALID_ARGUMENT with a message instead of gRPC's bare UNIMPLEMENTED.
grpc::ServerWriteReactor<grpc::ByteBuffer>* start_generate_call(FrontendContext& fc, grpc::CallbackServerContext* context,
                                                                const grpc::ByteBuffer* request);

// The served model as ListModels and the admin API describe it.
v1::ModelInfo model_info(const ServedModel& model);

class Frontend final : public v1::Generation::WithRawCallbackMethod_Generate<v1::Generation::CallbackService> {
 public:
  // `metrics` may be null; it must outlive the frontend.
  static Result<std::unique_ptr<Frontend>> create(FrontendConfig config, Metrics* metrics);
  ~Frontend() override;

  // Polls the workers once (so the first requests find them), then keeps polling; starts the
  // progress watchdog.
  void start();
  // Waits (up to 10 s) for every request's pipeline to let go of the frontend, then stops polling.
  // Call after the gRPC server has shut down (no new requests).
  void stop();
  // New requests get UNAVAILABLE; requests in flight continue. Health turns NOT_SERVING.
  void set_draining();
  // Called with true/false whenever the frontend can / cannot serve (a healthy worker of each
  // role, not draining), and once at once with the current state.
  void set_health_reporter(std::function<void(bool)> report);
  int64_t n_in_flight() const { return live_calls_.load(); }
  // OK while the frontend can serve; UNAVAILABLE saying why not (draining, no healthy prefill or
  // decode worker). What grpc.health.v1 reports, for the HTTP API's /health.
  Status health() const;
  // What every public call shares (the HTTP API's calls are made over it too).
  FrontendContext& context() { return context_; }
  // For the Admin service: the workers as the registry sees them now, the model, the API keys
  // (null: none), the local prefill bound.
  std::vector<WorkerSnapshot> workers(WorkerRole role) const { return registry_->snapshot(role); }
  const ServedModel& served_model() const { return model_; }
  ApiKeys* api_keys() const { return api_keys_.get(); }
  int64_t local_prefill_max_tokens() const { return local_prefill_max_tokens_; }

  grpc::ServerWriteReactor<grpc::ByteBuffer>* Generate(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context, const v1::ListModelsRequest* request,
                                       v1::ListModelsResponse* response) override;

 private:
  explicit Frontend(Metrics* metrics) : metrics_(metrics) {}
  // After every load poll: gauges, and health when it changed.
  void on_poll();
  void update_gauges();
  void update_health_locked();
  void watch_loop();

  Metrics* metrics_;
  int64_t local_prefill_max_tokens_ = 0;  // SchedulerConfig's: decode workers may prefill prompts
  ModelFiles files_;  // what --model names: the tokenizer, the chat template, the fingerprint
  ServedModel model_;
  SteadyClock clock_;
  std::unique_ptr<WorkerRegistry> registry_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<WorkerPool> pool_;
  std::unique_ptr<GrpcWorkerClient> client_;
  std::shared_ptr<ApiKeys> api_keys_;
  std::atomic<int64_t> live_calls_{0};
  std::atomic<bool> draining_{false};
  ProgressWatch watch_;  // every live request's progress bound, checked by watch_thread_
  std::thread watch_thread_;
  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  bool watch_stopping_ = false;  // guarded by watch_mu_
  FrontendContext context_;
  std::mutex health_mu_;
  std::function<void(bool)> health_reporter_;  // guarded by health_mu_
  std::optional<bool> serving_;                // last reported
};

}  // namespace baton
