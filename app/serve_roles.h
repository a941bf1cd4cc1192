// The roles `baton serve` and `baton local` run — decode worker, prefill worker, frontend — each
// as its engine, its gRPC service and its server, started from the flags (app/serve_flags.h)
// and drained the same way; the credentials a role's endpoints use; and the refusal to listen
// beyond loopback unauthenticated.
#pragma once

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/api_keys.h"
#include "common/metrics.h"
#include "common/status.h"
#include "common/tls.h"
#include "decode_worker/decode_engine.h"
#include "decode_worker/decode_service.h"
#include "kv/kv_transfer.h"
#include "model/model_files.h"
#if BATON_WITH_CUDA_KV
#include "kv/kv_device_service.h"
#endif
#include "model/model.h"
#include "model/model_files.h"
#include "prefill_worker/kv_prober.h"
#include "prefill_worker/prefill_engine.h"
#include "prefill_worker/prefill_service.h"
#include "server/admin_service.h"
#include "server/frontend.h"
#include "server/http_api.h"
#include "app/serve_flags.h"

namespace baton {

// What a role's endpoints are secured with, made once from the flags.
struct Security {
  PlaneCredentials internal;                                 // worker servers and every channel to a worker
  std::shared_ptr<grpc::ServerCredentials> public_server;    // the frontend's listener
  std::shared_ptr<ApiKeys> api_keys;                         // null: none required
};

// --kv-transport against this build and host, before anything loads: cuda_ipc and nccl exist
// only in builds with CUDA and nccl.h, and nccl needs libnccl at run time.
Status check_kv_transport(const std::string& transport);
// The prefill role's sender; check_kv_transport passed.
std::unique_ptr<KvTransport> make_kv_transport(const ServeArgs& a, const Security& sec);

// A loaded model with its own backend (Model::forward is not reentrant: one per engine).
struct LoadedModel {
  std::unique_ptr<Backend> backend;
  ModelFiles files;  // what --model names: config, weights, tokenizer (files.tokenizer)
  std::unique_ptr<Model> model;
  DType kv_dtype = DType::kF32;  // --kv-dtype, or the backend's default
};

// `decodes`: the model is a decode worker's (--weights auto keeps its weights quantised where that
// is faster; a prefill worker's GEMMs are large and stay dense); `prefills`: it prefills too (a
// prefill worker, or a decode worker with local prefill: dense weights are kept for that).
// `cpus`: the cores the engine's step threads own (empty: any).
Result<LoadedModel> load_model(const ServeArgs& a, bool decodes, bool prefills, std::vector<int> cpus);

// grpc.health.v1 names the two questions a role answers (probes ask them; batonctl health too):
//   ""                 readiness: it takes new work. NOT_SERVING before the model is loaded, while
//                      draining, while a worker's step loop is stalled, and for a frontend while a
//                      role has no healthy worker.
//   kLivenessService   the process works. NOT_SERVING only while a worker's step loop is stalled:
//                      a restart helps then, and not when a frontend's workers are down or a role
//                      drains (a liveness probe on "" would restart frontends for their workers).
inline constexpr const char* kLivenessService = "liveness";

// A gRPC server with health checking (grpc.health.v1) and reflection.
// Internal messages (worker calls, KV chunks) are bounded too, far above what they carry (a KV
// chunk is kept under 4 MiB by the prefill worker).
constexpr int kMaxInternalMessageBytes = 64 << 20;

// A server's HTTP/2 keepalive (a worker's, from --worker-keepalive-seconds and its timeout; zero:
// gRPC's default of two hours): the server pings each caller's connection after `time` without a
// ping, and a caller that does not answer within `timeout` has its connection closed and every
// call on it cancelled. A worker cut off from its frontend by the network then ends the calls the
// frontend has given up on, and frees what they hold (a decode worker's sequences and KV blocks),
// instead of computing them to the end.
struct ServerKeepalive {
  std::chrono::milliseconds time{0}, timeout{0};
};

class RpcServer {
 public:
  // `max_message_bytes` bounds what one received message may hold (gRPC refuses a larger one
  // with RESOURCE_EXHAUSTED before it is parsed).
  // `keepalive`: see ServerKeepalive.
  static Result<std::unique_ptr<RpcServer>> start(const std::string& listen, const std::vector<grpc::Service*>& services,
                                                  std::shared_ptr<grpc::ServerCredentials> credentials,
                                                  int max_message_bytes = kMaxInternalMessageBytes,
                                                  ServerKeepalive keepalive = {}) {
    static const bool plugins = [] {
      grpc::EnableDefaultHealthCheckService(true);
      grpc::reflection::InitProtoReflectionServerBuilderPlugin();
      return true;
    }();
    (void)plugins;
    auto s = std::unique_ptr<RpcServer>(new RpcServer());
    grpc::ServerBuilder b;
    b.AddListeningPort(listen, std::move(credentials), &s->port_);
    b.SetMaxReceiveMessageSize(max_message_bytes);
    b.SetMaxSendMessageSize(kMaxInternalMessageBytes);
    // Clients (the frontend's worker channels) ping every --worker-keepalive-seconds (>= 1 s), with
    // or without calls: allow it, rather than answer with GOAWAY "too_many_pings".
    b.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
    b.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    if (keepalive.time.count() > 0) {
      b.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, static_cast<int>(keepalive.time.count()));
      b.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, static_cast<int>(keepalive.timeout.count()));
    }
    for (grpc::Service* svc : services) b.RegisterService(svc);
    s->server_ = b.BuildAndStart();
    if (!s->server_ || s->port_ == 0) return unavailable("cannot listen on '" + listen + "' (in use, or a bad address)");
    s->server_->GetHealthCheckService()->SetServingStatus("", true);
    s->server_->GetHealthCheckService()->SetServingStatus(kLivenessService, true);
    return s;
  }
  // A second, plaintext server at `address` that serves grpc.health.v1 only, reporting what this
  // one reports: kubelet's native gRPC probes speak no TLS, and the status is all it shows.
  Status add_health_listener(const std::string& address) {
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort(address, grpc::InsecureServerCredentials(), &port);
    health_server_ = b.BuildAndStart();
    if (!health_server_ || port == 0) return unavailable("--health-listen: cannot listen on '" + address + "'");
    std::lock_guard<std::mutex> lock(mu_);
    health_server_->GetHealthCheckService()->SetServingStatus("", serving_);
    health_server_->GetHealthCheckService()->SetServingStatus(kLivenessService, live_);
    return {};
  }
  int port() const { return port_; }
  void set_not_serving() { set_serving(false); }
  // Readiness (""), on this server and the health listener.
  void set_serving(bool serving) { set_status("", serving, &serving_); }
  // Liveness (kLivenessService), on this server and the health listener.
  void set_live(bool live) { set_status(kLivenessService, live, &live_); }
  void shutdown(std::chrono::seconds grace) {
    const auto deadline = std::chrono::system_clock::now() + grace;
    server_->Shutdown(deadline);
    if (health_server_) health_server_->Shutdown(deadline);
  }

 private:
  // The per-service calls only: SetServingStatus(bool) would set every service, liveness too.
  void set_status(const char* service, bool serving, bool* kept) {
    std::lock_guard<std::mutex> lock(mu_);
    *kept = serving;
    server_->GetHealthCheckService()->SetServingStatus(service, serving);
    if (health_server_) health_server_->GetHealthCheckService()->SetServingStatus(service, serving);
  }

  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::Server> health_server_;  // null without --health-listen
  std::mutex mu_;
  bool serving_ = true;  // readiness, guarded by mu_
  bool live_ = true;     // liveness, guarded by mu_
};

// Adds --health-listen to a role's server when it is set.
Status add_health(RpcServer& server, const ServeArgs& a);

// Watches a worker's step loop: when it has work and has not moved for the stall timeout (a hung
// kernel, a deadlock) in two looks a second apart, `on_change(true)`; when it moves again,
// `on_change(false)`. Stops (and joins) when destroyed.
class StallWatch {
 public:
  StallWatch(std::chrono::seconds limit, std::function<bool(std::chrono::nanoseconds)> stalled,
             std::function<void(bool)> on_change)
      : thread_([this, limit, stalled = std::move(stalled), on_change = std::move(on_change)] {
          bool reported = false;
          int looks = 0;
          std::unique_lock<std::mutex> lock(mu_);
          while (!cv_.wait_for(lock, std::chrono::seconds(1), [this] { return stop_; })) {
            looks = stalled(limit) ? looks + 1 : 0;
            if ((looks >= 2) != reported) {
              reported = looks >= 2;
              on_change(reported);
            }
          }
        }) {}
  ~StallWatch() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;  // guarded by mu_
  std::thread thread_;
};

// Health and the load report follow the engine: a stalled step loop makes the worker NOT_SERVING,
// readiness and liveness both (the liveness probe restarts the pod), and `draining` in its load
// report (frontends send it nothing new) until it moves again. --stall-timeout 0: not watched.
template <class WorkerRole>
void watch_worker(WorkerRole& r, int stall_timeout_s, const std::string& name) {
  if (stall_timeout_s <= 0) return;
  r.watch = std::make_unique<StallWatch>(
      std::chrono::seconds(stall_timeout_s),
      [engine = r.engine.get()](std::chrono::nanoseconds limit) {
        return engine->stalled(std::chrono::steady_clock::now(), limit);
      },
      [&r, name, stall_timeout_s](bool stalled) {
        if (stalled) {
          spdlog::error("{}: the step loop has had work and made no progress for over {} s; reporting NOT_SERVING",
                        name, stall_timeout_s);
        } else {
          spdlog::warn("{}: the step loop moves again; reporting SERVING", name);
        }
        r.service->set_draining(stalled);
        r.server->set_serving(!stalled);
        r.server->set_live(!stalled);
      });
}

// Each role drains the same way: report draining (frontends route around it) and NOT_SERVING,
// let in-flight calls finish within `grace` (new ones get UNAVAILABLE), then stop the engine.
template <class WorkerRole>
void drain_worker(WorkerRole& r, std::chrono::seconds grace) {
  r.watch.reset();  // the drain decides health from here on
  r.service->set_draining(true);
  r.server->set_not_serving();
  r.server->shutdown(grace);
  r.engine->stop();
}

struct DecodeRole {
  LoadedModel m;
  std::unique_ptr<DecodeEngine> engine;
  std::unique_ptr<KvProbeSink> kv_probe;  // takes KV probes (batonctl doctor) instead of the engine
  std::unique_ptr<DecodeService> service;
#if BATON_WITH_CUDA_KV
  // Receives every device transport this build has (cuda_ipc, nccl); destroyed after the server.
  std::unique_ptr<KvDeviceService> kv_device;
#endif
  std::unique_ptr<RpcServer> server;
  std::unique_ptr<StallWatch> watch;  // null when --stall-timeout is 0

  void drain(std::chrono::seconds grace) { drain_worker(*this, grace); }
};

// `name` labels metrics and logs: the listen address, or "decode-N" in `baton local` where the
// port is only known once the server runs.
Result<std::unique_ptr<DecodeRole>> start_decode(const ServeArgs& a, const Security& sec, const std::string& listen,
                                                 const std::string& name, std::vector<int> cpus, Metrics* metrics);

struct PrefillRole {
  LoadedModel m;
  std::unique_ptr<KvTransport> transport;
  std::unique_ptr<PrefillEngine> engine;
  std::unique_ptr<KvProber> prober;  // KV probes (batonctl doctor) over `transport`, apart from the engine
  std::unique_ptr<PrefillService> service;
  std::unique_ptr<RpcServer> server;
  std::unique_ptr<StallWatch> watch;  // null when --stall-timeout is 0

  void drain(std::chrono::seconds grace) { drain_worker(*this, grace); }
};

Result<std::unique_ptr<PrefillRole>> start_prefill(const ServeArgs& a, const Security& sec, const std::string& listen,
                                                   const std::string& name, std::vector<int> cpus, Metrics* metrics);

struct FrontendRole {
  std::unique_ptr<Frontend> frontend;
  std::unique_ptr<AdminService> admin;  // on the public port, for privileged callers only
  std::unique_ptr<RpcServer> server;
  std::unique_ptr<HttpApi> http;  // null without --http-listen

  // The listener stays open while requests in flight finish (up to `grace`), and a second
  // longer, so a call that arrives meanwhile hears why it is refused ("this frontend is shutting
  // down; retry on another replica", UNAVAILABLE) instead of gRPC's CANCELLED from a server
  // already shutting down, or a refused connection that looks like a crash.
  void drain(std::chrono::seconds grace) {
    const auto deadline = std::chrono::steady_clock::now() + grace;
    frontend->set_draining();
    server->set_not_serving();
    while (frontend->n_in_flight() > 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::this_thread::sleep_until(std::min(deadline, std::chrono::steady_clock::now() + std::chrono::seconds(1)));
    const auto left = std::chrono::duration_cast<std::chrono::seconds>(deadline - std::chrono::steady_clock::now());
    if (http) http->stop();  // HTTP requests still in flight end UNAVAILABLE
    server->shutdown(std::max(left, std::chrono::seconds(0)));
    frontend->stop();
  }
};

Result<std::unique_ptr<FrontendRole>> start_frontend(const ServeArgs& a, const Security& sec, const std::string& listen,
                                                     const std::string& name, std::vector<std::string> prefill,
                                                     std::vector<std::string> decode, Metrics* metrics);

// The credentials the flags ask for; every file is checked first, so a mistake stops the role
// before it listens.
Result<Security> make_security(const ServeArgs& a);
// Safe by default: a role reachable from beyond this host refuses to start without
// authentication, and says how to fix it, unless --insecure says the operator means it.
// `role`: frontend | prefill | decode | local (local's workers listen on loopback only).
Status check_exposure(const ServeArgs& a, const std::string& role, const Security& sec);

}  // namespace baton
