// The frontend's connections to its workers: gRPC stubs per address, worker discovery (a static
// list from flags, or a DNS name that resolves to many addresses — a Kubernetes headless
// Service — re-resolved periodically), and a poller that pulls every worker's load report into
// the WorkerRegistry (which is also the health check: a worker that stops answering, or serves
// another model, becomes unhealthy and receives no new work).
#pragma once

#include <grpcpp/security/credentials.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "baton/v1/worker.grpc.pb.h"
#include "scheduler/worker_registry.h"

namespace baton {

struct WorkerPoolConfig {
  std::vector<std::string> prefill_addresses;  // host:port list (--prefill-addresses)
  std::string prefill_dns;                     // host:port whose host resolves to every prefill worker
  std::vector<std::string> decode_addresses;   // host:port list (--decode-addresses)
  std::string decode_dns;                      // as prefill_dns, for decode workers
  std::chrono::milliseconds poll_interval{200};          // load report period
  std::chrono::milliseconds dns_refresh_interval{5000};  // DNS re-resolution period
  std::string model_fingerprint;               // workers serving another model are refused
  std::shared_ptr<grpc::ChannelCredentials> credentials;  // the internal plane's (common/tls.h); null = plaintext
  bool prefill_optional = false;  // decode workers may prefill every prompt themselves (colocated)
  // HTTP/2 keepalive on every worker channel: a ping after this long without one, and the
  // connection counts as broken (its calls fail UNAVAILABLE) when no answer comes within the
  // timeout. Finds a partitioned worker's connection dead even while no call is in flight.
  std::chrono::milliseconds keepalive{10000};
  std::chrono::milliseconds keepalive_timeout{5000};

  Status validate() const;
};

class WorkerPool {
 public:
  // `on_reports` runs after every polling round (the frontend retries queued placements).
  WorkerPool(WorkerPoolConfig config, WorkerRegistry& registry, std::function<void()> on_reports);
  ~WorkerPool();

  void start();
  void stop();
  // Polls once synchronously (start-up: know the workers before taking traffic).
  void poll_now();

  v1::PrefillWorker::Stub& prefill_stub(const std::string& address);
  v1::DecodeWorker::Stub& decode_stub(const std::string& address);

 private:
  std::shared_ptr<grpc::Channel> channel(const std::string& address);
  void resolve();
  void poll_role(WorkerRole role);
  // Logs a worker's up/down transitions once each (and a worker down from the start).
  void note_up(WorkerRole role, const std::string& address, bool up, const std::string& why);
  void run();

  WorkerPoolConfig config_;
  WorkerRegistry& registry_;
  std::function<void()> on_reports_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_;
  std::map<std::string, std::unique_ptr<v1::PrefillWorker::Stub>> prefill_stubs_;
  std::map<std::string, std::unique_ptr<v1::DecodeWorker::Stub>> decode_stubs_;
  std::map<std::string, bool> up_[2];  // by role: did its last load poll answer
  std::mutex run_mu_;
  std::condition_variable run_cv_;
  bool stopping_ = false;
  std::thread thread_;
  std::chrono::steady_clock::time_point last_resolve_{};
};

// "host:port" → every "ip:port" the host resolves to (IPv6 as [ip]:port). Empty on failure.
std::vector<std::string> resolve_host_port(const std::string& host_port);

}  // namespace baton
