#include "server/serve_commands.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <string>
#include <vector>

#include "common/api_keys.h"
#include "common/cpu_set.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "common/progress.h"
#include "common/tls.h"
#include "decode_worker/decode_engine.h"
#include "decode_worker/decode_service.h"
#include "kv/kv_probe.h"
#include "kv/tcp/tcp_transport.h"
#include "server/admin_service.h"
#include "server/request_spec.h"
#if BATON_WITH_CUDA_KV
#include "kv/cuda_ipc/cuda_ipc_transport.h"
#include "kv/kv_device_service.h"
#include "kv/nccl/nccl_api.h"
#include "kv/nccl/nccl_transport.h"
#endif
#include "model/model.h"
#include "model/tokenizer.h"
#include "prefill_worker/kv_prober.h"
#include "prefill_worker/prefill_engine.h"
#include "prefill_worker/prefill_service.h"
#include "server/engine_commands.h"
#include "server/frontend.h"
#include "server/http_api.h"

namespace baton {
namespace {

struct ServeArgs {
  std::string role;
  std::string model;
  std::string listen = "0.0.0.0:50051";
  std::string metrics_listen;  // "" = no metrics endpoint
  int threads = 0;
  std::string cpus;  // serve: the engine's cores (CPU list; "" = any)
  // local: the decode and prefill engines' cores ("" = an automatic split, "all" = every core,
  // shared). The frontend, gRPC and KV sender threads run on the prefill cores.
  std::string decode_cpus, prefill_cpus;
  std::string device = "cpu";
  std::string dtype = "bf16";
  std::string kv_dtype;  // empty: f32 on CPU, bf16 on CUDA
  std::string kv_transport = "tcp";  // prefill: how KV reaches decode workers (tcp | cuda_ipc | nccl)
  std::string weights = "auto";      // auto | native | dense (engine_commands.h)
  int block_size = 16;
  int kv_blocks = 0;
  // frontend
  std::string prefill_addresses, prefill_dns, decode_addresses, decode_dns;
  int max_requests = 256;
  int max_priority = 0;
  int max_failovers = 2;
  int max_message_bytes = 4 << 20;  // public API: one request message (gRPC) or body (HTTP)
  std::string http_listen;  // "" = no OpenAI-compatible HTTP API
  int http_threads = 512;   // HTTP connections served at once
  double no_worker_timeout = 5.0;  // seconds
  int64_t max_queued_prompt_tokens = 256 * 1024;
  std::string chat_template;
  // prefill
  int prefill_token_budget = 2048;
  // decode
  int max_batch = 32;
  // frontend + decode: prompts up to this many tokens are prefilled by the decode worker itself (0: never)
  int local_prefill_max_tokens = 0;
  int local_prefill_token_budget = 512;  // decode: most prompt tokens one decode step prefills
  // prefill
  bool kv_stream = true;  // stream each layer's KV while the prompt is prefilled
  int prefix_cache_blocks = -1;  // most blocks of the prefix cache (-1: the whole KV pool; 0: off)
  // frontend: prefix-aware prefill routing, queue tokens per cached prompt token (SchedulerConfig)
  double prefill_queue_weight = 1.0;
  int max_request_seconds = 3600;  // a request's KV blocks are held at most this long
  // local
  int n_prefill_workers = 1;
  int n_decode_workers = 1;
  std::string log_level = "info";
  std::string log_format = "text";
  std::string name;  // metric `worker` label and log name; "" = the listen address
  int drain_timeout = 30;  // seconds in-flight work may take after SIGTERM
  int stall_timeout = 120;  // workers: seconds a step loop with work may not move before NOT_SERVING (0: off)
  // Security (common/tls.h, common/api_keys.h)
  TlsFiles public_tls;    // frontend: --tls-cert, --tls-key, --tls-client-ca
  TlsFiles internal_tls;  // every role: --internal-tls-cert, --internal-tls-key, --internal-tls-ca
  int tls_refresh_seconds = 60;  // how often certificate files are looked at again
  std::string api_key_file;      // frontend: "" = no API keys
  std::string health_listen;     // "" = health on the main listener only
  bool insecure = false;         // allow listening beyond loopback without authentication
};

// What a role's endpoints are secured with, made once from the flags.
struct Security {
  PlaneCredentials internal;                                 // worker servers and every channel to a worker
  std::shared_ptr<grpc::ServerCredentials> public_server;    // the frontend's listener
  std::shared_ptr<ApiKeys> api_keys;                         // null: none required
};

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

int fail(const Status& s) { return exit_with_error(s); }

// Flags are checked against the dtype names by CLI11 before this runs.
DType dtype_of(const std::string& s) { return dtype_from_name(s).value(); }

#if BATON_WITH_CUDA_KV
// The CUDA device the device KV transports stage and receive payloads on: --device's, else 0.
int kv_cuda_device(const std::string& device) { return cuda_device_ordinal(device).value_or(0); }
#endif

// --kv-transport against this build and host, before anything loads: cuda_ipc and nccl exist
// only in builds with CUDA and nccl.h, and nccl needs libnccl at run time.
Status check_kv_transport(const std::string& transport) {
#if BATON_WITH_CUDA_KV
  if (transport != "nccl") return {};
  std::string error;
  if (nccl_load(&error) != nullptr) return {};
  return failed_precondition("--kv-transport=nccl: " + error +
                             "; install NCCL, or use --kv-transport=tcp (or cuda_ipc on one node)");
#else
  if (transport == "tcp") return {};
  return invalid_argument("--kv-transport=" + transport +
                          " is not available: this build of baton has no CUDA KV transports (rebuild with the CUDA "
                          "toolkit, NCCL and -DBATON_CUDA=ON), or use --kv-transport=tcp");
#endif
}

// The prefill role's sender; check_kv_transport passed.
std::unique_ptr<KvTransport> make_kv_transport(const ServeArgs& a, const Security& sec) {
#if BATON_WITH_CUDA_KV
  if (a.kv_transport == "cuda_ipc") {
    CudaIpcKvConfig c;
    c.device = kv_cuda_device(a.device);
    c.credentials = sec.internal.channel;
    return std::make_unique<CudaIpcKvTransport>(c);
  }
  if (a.kv_transport == "nccl") {
    NcclKvConfig c;
    c.device = kv_cuda_device(a.device);
    c.credentials = sec.internal.channel;
    return std::make_unique<NcclKvTransport>(c);
  }
#endif
  return std::make_unique<TcpKvTransport>(sec.internal.channel);
}

// A loaded model with its own backend (Model::forward is not reentrant: one per engine).
struct LoadedModel {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<GgufFile> file;
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tokenizer;
  DType kv_dtype = DType::kF32;  // --kv-dtype, or the backend's default
};

// `decodes`: the model is a decode worker's (--weights auto keeps its weights quantised where that
// is faster; a prefill worker's GEMMs are large and stay dense).
// `cpus`: the cores the engine's step threads own (empty: any).
Result<LoadedModel> load_model(const ServeArgs& a, bool decodes, bool prefills, std::vector<int> cpus) {
  LoadedModel m;
  BackendOptions bo;
  bo.device = a.device;
  bo.dtype = dtype_of(a.dtype);
  bo.n_threads = a.threads;
  bo.cpus = std::move(cpus);
  std::string error;
  m.backend = make_backend(bo, &error);
  if (!m.backend) return invalid_argument(error);
  BATON_ASSIGN_OR_RETURN(m.kv_dtype, resolve_kv_dtype(*m.backend, a.kv_dtype));
  BATON_ASSIGN_OR_RETURN(m.file, GgufFile::open(a.model));
  BATON_ASSIGN_OR_RETURN(m.tokenizer, Tokenizer::from_gguf(*m.file));
  BATON_ASSIGN_OR_RETURN(m.model, Model::load(*m.file, *m.backend,
                                              load_progress_reporter(a.model, [](const std::string& line) {
                                                spdlog::info("{}", line);
                                              }),
                                              weights_plan(a.weights, *m.backend, decodes, prefills)));
  spdlog::info("weights: {} GEMM matrices quantised (native), {} dense ({}); weights checked finite in {:.1f} ms",
               m.model->n_native_matrices(), m.model->n_dense_matrices(), dtype_name(m.backend->compute_dtype()),
               m.model->finite_check_seconds() * 1e3);
  return m;
}

// The KV pool's size, where operators size --kv-blocks from (0: the default).
void log_kv_pool(const char* role, int64_t n_blocks, int block_size, int64_t block_bytes) {
  spdlog::info("{} KV pool: {} blocks of {} tokens = {} tokens, {:.1f} MiB", role, n_blocks, block_size,
               n_blocks * block_size, static_cast<double>(n_blocks * block_bytes) / (1 << 20));
}

// A gRPC server with health checking (grpc.health.v1) and reflection.
// Internal messages (worker calls, KV chunks) are bounded too, far above what they carry (a KV
// chunk is kept under 4 MiB by the prefill worker).
constexpr int kMaxInternalMessageBytes = 64 << 20;

class RpcServer {
 public:
  // `max_message_bytes` bounds what one received message may hold (gRPC refuses a larger one
  // with RESOURCE_EXHAUSTED before it is parsed).
  static Result<std::unique_ptr<RpcServer>> start(const std::string& listen, const std::vector<grpc::Service*>& services,
                                                  std::shared_ptr<grpc::ServerCredentials> credentials,
                                                  int max_message_bytes = kMaxInternalMessageBytes) {
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
    for (grpc::Service* svc : services) b.RegisterService(svc);
    s->server_ = b.BuildAndStart();
    if (!s->server_ || s->port_ == 0) return unavailable("cannot listen on '" + listen + "' (in use, or a bad address)");
    s->server_->GetHealthCheckService()->SetServingStatus(true);
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
    health_server_->GetHealthCheckService()->SetServingStatus(serving_);
    return {};
  }
  int port() const { return port_; }
  void set_not_serving() { set_serving(false); }
  void set_serving(bool serving) {
    std::lock_guard<std::mutex> lock(mu_);
    serving_ = serving;
    server_->GetHealthCheckService()->SetServingStatus(serving);
    if (health_server_) health_server_->GetHealthCheckService()->SetServingStatus(serving);
  }
  void shutdown(std::chrono::seconds grace) {
    const auto deadline = std::chrono::system_clock::now() + grace;
    server_->Shutdown(deadline);
    if (health_server_) health_server_->Shutdown(deadline);
  }

 private:
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::Server> health_server_;  // null without --health-listen
  std::mutex mu_;
  bool serving_ = true;  // guarded by mu_
};

// Adds --health-listen to a role's server when it is set.
Status add_health(RpcServer& server, const ServeArgs& a) {
  return a.health_listen.empty() ? Status{} : server.add_health_listener(a.health_listen);
}

// Blocks until SIGINT or SIGTERM.
void wait_for_signal() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  int sig = 0;
  sigwait(&set, &sig);
  spdlog::info("signal {}: shutting down", sig);
}

// Signals are taken by wait_for_signal() only: block them before any thread starts.
void block_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

// Each role drains the same way: report draining (frontends route around it) and NOT_SERVING,
// let in-flight calls finish within `grace` (new ones get UNAVAILABLE), then stop the engine.
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

// Health and the load report follow the engine: a stalled step loop makes the worker
// NOT_SERVING (the liveness probe restarts the pod) and `draining` in its load report (frontends
// send it nothing new) until it moves again. --stall-timeout 0: not watched.
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
      });
}

template <class WorkerRole>
void drain_worker(WorkerRole& r, std::chrono::seconds grace) {
  r.watch.reset();  // the drain decides health from here on
  r.service->set_draining(true);
  r.server->set_not_serving();
  r.server->shutdown(grace);
  r.engine->stop();
}

// What KV of this model and KV dtype looks like on the wire (the KV probes' shape).
KvProbeShape kv_probe_shape(const LoadedModel& m) {
  const ModelConfig& c = m.model->config();
  return KvProbeShape{m.model->fingerprint(), dtype_name(m.kv_dtype), c.n_layers, c.n_kv_heads, c.head_dim};
}

// The KV transports a decode worker of this build receives over.
std::vector<std::string> received_kv_transports() {
#if BATON_WITH_CUDA_KV
  return {"tcp", "cuda_ipc", "nccl"};
#else
  return {"tcp"};
#endif
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
                                                 const std::string& name, std::vector<int> cpus, Metrics* metrics) {
  auto r = std::make_unique<DecodeRole>();
  // A decode worker that prefills prompts itself keeps dense weights for them too.
  BATON_ASSIGN_OR_RETURN(r->m, load_model(a, /*decodes=*/true, /*prefills=*/a.local_prefill_max_tokens > 0,
                                          std::move(cpus)));
  DecodeConfig dc;
  dc.max_batch = a.max_batch;
  dc.block_size = a.block_size;
  dc.kv_dtype = r->m.kv_dtype;
  const int64_t ctx = r->m.model->config().n_ctx;
  // Default: room for 8 full-context sequences.
  dc.n_blocks = a.kv_blocks > 0 ? a.kv_blocks : static_cast<int>(8 * ((ctx + a.block_size - 1) / a.block_size));
  dc.name = name;
  dc.local_prefill_max_tokens = a.local_prefill_max_tokens;
  dc.local_prefill_token_budget = a.local_prefill_token_budget;
  BATON_ASSIGN_OR_RETURN(r->engine, DecodeEngine::create(*r->m.model, r->m.tokenizer->stop_ids(), dc, metrics));
  log_kv_pool("decode", dc.n_blocks, dc.block_size, decode_kv_block_bytes(r->m.model->config(), dc.block_size, dc.kv_dtype));
  r->engine->start();
  r->kv_probe = std::make_unique<KvProbeSink>(kv_probe_shape(r->m), name, metrics);
  r->service = std::make_unique<DecodeService>(*r->engine, *r->m.model, std::chrono::seconds(a.max_request_seconds),
                                               r->kv_probe.get(), received_kv_transports());
  std::vector<grpc::Service*> services = {r->service.get()};
#if BATON_WITH_CUDA_KV
  KvDeviceServiceConfig kc;
  kc.device = kv_cuda_device(a.device);
  r->kv_device = std::make_unique<KvDeviceService>(*r->engine, kc, r->kv_probe.get());
  services.push_back(r->kv_device.get());
#endif
  BATON_ASSIGN_OR_RETURN(r->server, RpcServer::start(listen, services, sec.internal.server));
  return r;
}

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
                                                   const std::string& name, std::vector<int> cpus, Metrics* metrics) {
  auto r = std::make_unique<PrefillRole>();
  BATON_ASSIGN_OR_RETURN(r->m, load_model(a, /*decodes=*/false, /*prefills=*/true, std::move(cpus)));
  PrefillConfig pc;
  pc.token_budget = a.prefill_token_budget;
  pc.block_size = a.block_size;
  pc.kv_dtype = r->m.kv_dtype;
  pc.n_blocks = a.kv_blocks;
  pc.name = name;
  // The device transports hold one communicator (nccl) or staging window per decode worker for a
  // whole transfer: a transfer open across a prompt's prefill would hold up the next one, so they
  // send after the prefill.
  pc.stream_kv = a.kv_stream && a.kv_transport == "tcp";
  pc.prefix_cache_blocks = a.prefix_cache_blocks;
  BATON_RETURN_IF_ERROR(validate_prefill_config(pc));
  r->transport = make_kv_transport(a, sec);
  r->engine = std::make_unique<PrefillEngine>(*r->m.model, *r->transport, pc, metrics);
  const PrefillConfig& resolved = r->engine->config();
  log_kv_pool("prefill", resolved.n_blocks, resolved.block_size,
              decode_kv_block_bytes(r->m.model->config(), resolved.block_size, resolved.kv_dtype));
  spdlog::info("prefill worker {}: prefix cache {}", name,
               resolved.prefix_cache_blocks > 0 ? "of up to " + std::to_string(resolved.prefix_cache_blocks) + " blocks"
                                                : std::string("off"));
  r->engine->start();
  r->prober = std::make_unique<KvProber>(*r->transport, kv_probe_shape(r->m), pc.kv_chunk_bytes, name, metrics);
  r->service = std::make_unique<PrefillService>(*r->engine, *r->m.model, r->prober.get(), r->transport->name());
  BATON_ASSIGN_OR_RETURN(r->server, RpcServer::start(listen, {r->service.get()}, sec.internal.server));
  return r;
}

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
                                                     std::vector<std::string> decode, Metrics* metrics) {
  FrontendConfig fc;
  fc.model_path = a.model;
  fc.name = name;
  fc.chat_template = a.chat_template;
  fc.max_priority = a.max_priority;
  fc.workers.prefill_addresses = std::move(prefill);
  fc.workers.prefill_dns = a.prefill_dns;
  fc.workers.decode_addresses = std::move(decode);
  fc.workers.decode_dns = a.decode_dns;
  fc.workers.credentials = sec.internal.channel;
  fc.api_keys = sec.api_keys;
  fc.scheduler.max_requests = a.max_requests;
  fc.scheduler.no_worker_timeout = std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::duration<double>(a.no_worker_timeout));
  fc.pipeline.max_failovers = a.max_failovers;
  fc.scheduler.max_queued_prompt_tokens = a.max_queued_prompt_tokens;
  fc.scheduler.local_prefill_max_tokens = a.local_prefill_max_tokens;
  fc.scheduler.prefill_queue_weight = a.prefill_queue_weight;
  fc.workers.prefill_optional = a.local_prefill_max_tokens > 0;
  auto r = std::make_unique<FrontendRole>();
  BATON_ASSIGN_OR_RETURN(r->frontend, Frontend::create(fc, metrics));
  r->frontend->start();
  r->admin = std::make_unique<AdminService>(*r->frontend);
  BATON_ASSIGN_OR_RETURN(r->server, RpcServer::start(listen, {r->frontend.get(), r->admin.get()}, sec.public_server,
                                                     a.max_message_bytes));
  // Health follows the workers: NOT_SERVING while a role has no healthy worker, or draining.
  r->frontend->set_health_reporter([server = r->server.get()](bool serving) { server->set_serving(serving); });
  if (!a.http_listen.empty()) {
    HttpApiConfig hc;
    hc.listen = a.http_listen;
    hc.n_threads = a.http_threads;
    hc.max_body_bytes = static_cast<size_t>(a.max_message_bytes);
    hc.tls = a.public_tls;
    hc.tls_refresh = std::chrono::seconds(a.tls_refresh_seconds);
    BATON_ASSIGN_OR_RETURN(r->http, HttpApi::start(hc, *r->frontend));
  }
  return r;
}

// The credentials the flags ask for; every file is checked first, so a mistake stops the role
// before it listens.
Result<Security> make_security(const ServeArgs& a) {
  Security sec;
  const std::chrono::seconds refresh(a.tls_refresh_seconds);
  sec.internal = insecure_plane();
  if (a.internal_tls.any()) {
    BATON_RETURN_IF_ERROR(check_tls_files(a.internal_tls, kInternalTlsFlags, /*need_ca=*/true));
    sec.internal = internal_mtls_plane(a.internal_tls, refresh);
  }
  if (a.public_tls.any()) {
    if (a.public_tls.cert.empty()) {
      return invalid_argument("--tls-client-ca needs --tls-cert and --tls-key (client certificates are checked over TLS)");
    }
    BATON_RETURN_IF_ERROR(check_tls_files(a.public_tls, kPublicTlsFlags, /*need_ca=*/false));
  }
  sec.public_server = public_server_credentials(a.public_tls, refresh);
  if (!a.api_key_file.empty()) {
    BATON_ASSIGN_OR_RETURN(std::unique_ptr<ApiKeys> keys, ApiKeys::load(a.api_key_file));
    sec.api_keys = std::move(keys);
  }
  return sec;
}

// Safe by default: a role reachable from beyond this host refuses to start without
// authentication, and says how to fix it, unless --insecure says the operator means it.
// `role`: frontend | prefill | decode | local (local's workers listen on loopback only).
Status check_exposure(const ServeArgs& a, const std::string& role, const Security& sec) {
  const std::string internal_fix =
      "give --internal-tls-cert, --internal-tls-key and --internal-tls-ca (mutual TLS between baton's roles; "
      "deploy/README.md says how cert-manager provides them)";
  std::vector<std::string> problems;
  if ((role == "prefill" || role == "decode") && !sec.internal.authenticated && !is_loopback_address(a.listen)) {
    problems.push_back("the " + role + " worker would listen on " + a.listen +
                       " with an unauthenticated internal plane, so anyone who reaches the port could admit, stream "
                       "or cancel requests: " + internal_fix + ", or listen on loopback (--listen=127.0.0.1:PORT)");
  }
  if ((role == "frontend" || role == "local") && a.public_tls.cert.empty() && !is_loopback_address(a.listen)) {
    problems.push_back("the public API would be served in plaintext on " + a.listen +
                       ": give --tls-cert and --tls-key (and --api-key-file), or listen on loopback "
                       "(--listen=127.0.0.1:PORT)");
  }
  if ((role == "frontend" || role == "local") && !a.http_listen.empty() && a.public_tls.cert.empty() &&
      !is_loopback_address(a.http_listen)) {
    problems.push_back("the HTTP API would be served in plaintext on " + a.http_listen +
                       ": give --tls-cert and --tls-key (and --api-key-file), or listen on loopback "
                       "(--http-listen=127.0.0.1:PORT)");
  }
  if (role == "frontend" && !sec.internal.authenticated) {
    std::vector<std::string> remote;
    for (const auto& list : {split_list(a.prefill_addresses), split_list(a.decode_addresses)}) {
      for (const auto& addr : list) {
        if (!is_loopback_address(addr)) remote.push_back(addr);
      }
    }
    for (const auto* dns : {&a.prefill_dns, &a.decode_dns}) {
      if (!dns->empty() && !is_loopback_address(*dns)) remote.push_back(*dns);
    }
    if (!remote.empty()) {
      problems.push_back("the frontend would reach workers beyond this host (" + remote.front() +
                         (remote.size() > 1 ? ", ..." : "") + ") over an unauthenticated internal plane: " +
                         internal_fix);
    }
  }
  if (problems.empty()) return {};
  if (a.insecure) {
    for (const auto& p : problems) spdlog::warn("--insecure: {}", p);
    return {};
  }
  std::string message = "refusing to start insecurely: " + problems.front();
  for (size_t i = 1; i < problems.size(); ++i) message += "; and " + problems[i];
  return failed_precondition(message + ". Pass --insecure to run like this anyway (e.g. a private network, or TLS "
                                       "ended by a proxy in front of baton)");
}

// Scripts and tests read the ports from these stdout lines (useful with --listen HOST:0): the
// HTTP API's first, when there is one, then the gRPC port, which says the role is up.
void print_listening(int port, const HttpApi* http = nullptr) {
  if (http != nullptr) std::printf("http listening on port %d\n", http->port());
  std::printf("listening on port %d\n", port);
  std::fflush(stdout);
}

// Graceful drain on SIGTERM (all roles): health turns NOT_SERVING and the role reports
// `draining` in its load report (frontends route around it), new calls are refused with
// UNAVAILABLE, and in-flight calls get up to --drain-timeout seconds to finish before the server
// cancels them; then the engines stop and the process exits 0.
int run_serve(const ServeArgs& a) {
  block_signals();
  if (Status s = init_logging(a.log_level, a.log_format); !s.ok()) return fail(s);
  if (Status s = check_kv_transport(a.kv_transport); !s.ok()) return fail(s);
  if (a.role != "frontend" && !a.http_listen.empty()) {
    return fail(invalid_argument("--http-listen serves the public API: give it to the frontend (or baton local), not "
                                 "to a " + a.role + " worker"));
  }
  auto sec = make_security(a);
  if (!sec.ok()) return fail(sec.status());
  if (Status s = check_exposure(a, a.role, *sec); !s.ok()) return fail(s);
  Result<std::vector<int>> cpus = std::vector<int>{};
  if (!a.cpus.empty()) cpus = parse_cpu_list(a.cpus, "--cpus");
  if (!cpus.ok()) return fail(cpus.status());
  const auto grace = std::chrono::seconds(a.drain_timeout);
  Metrics metrics;
  std::unique_ptr<MetricsServer> metrics_server;
  if (!a.metrics_listen.empty()) {
    auto ms = MetricsServer::start(a.metrics_listen, metrics.registry());
    if (!ms.ok()) return fail(ms.status());
    metrics_server = std::move(*ms);
  }
  if (a.role == "decode") {
    auto r = start_decode(a, *sec, a.listen, a.name.empty() ? a.listen : a.name, *cpus, &metrics);
    if (!r.ok()) return fail(r.status());
    watch_worker(**r, a.stall_timeout, "decode worker");
    spdlog::info("decode worker serving on port {}", (*r)->server->port());
    if (Status s = add_health(*(*r)->server, a); !s.ok()) return fail(s);
    print_listening((*r)->server->port());
    wait_for_signal();
    (*r)->drain(grace);
  } else if (a.role == "prefill") {
    auto r = start_prefill(a, *sec, a.listen, a.name.empty() ? a.listen : a.name, *cpus, &metrics);
    if (!r.ok()) return fail(r.status());
    watch_worker(**r, a.stall_timeout, "prefill worker");
    spdlog::info("prefill worker serving on port {}", (*r)->server->port());
    if (Status s = add_health(*(*r)->server, a); !s.ok()) return fail(s);
    print_listening((*r)->server->port());
    wait_for_signal();
    (*r)->drain(grace);
  } else {
    auto r = start_frontend(a, *sec, a.listen, a.name.empty() ? a.listen : a.name, split_list(a.prefill_addresses),
                            split_list(a.decode_addresses), &metrics);
    if (!r.ok()) return fail(r.status());
    spdlog::info("frontend serving on port {}{}", (*r)->server->port(),
                 (*r)->http ? ", HTTP API on port " + std::to_string((*r)->http->port()) : std::string());
    if (Status s = add_health(*(*r)->server, a); !s.ok()) return fail(s);
    print_listening((*r)->server->port(), (*r)->http.get());
    wait_for_signal();
    (*r)->drain(grace);
  }
  spdlog::info("drained; exiting");
  return 0;
}

// Which cores each engine of `baton local` owns. Decode steps are memory-bound and prefill steps
// compute-bound: by default the decode engines get the first half of the allowed cores (at least
// one) and the prefill engines, with everything else, the rest. Engines of one kind split their
// part when it has a core for each, and share it otherwise. One core: everything shares it.
struct LocalCores {
  std::vector<int> decode_all, prefill_all;
  std::vector<std::vector<int>> decode, prefill;  // per engine
};

Result<LocalCores> local_cores(const ServeArgs& a) {
  const std::vector<int> allowed = allowed_cpus();
  // Colocated (no prefill workers): the decode engines get every core.
  const CpuSplit split = a.n_prefill_workers == 0 ? CpuSplit{allowed, allowed} : split_cpus(allowed, allowed.size() / 2);
  auto pick = [&](const std::string& flag, const std::string& value,
                  const std::vector<int>& automatic) -> Result<std::vector<int>> {
    if (value.empty()) return automatic;
    if (value == "all") return allowed;
    return parse_cpu_list(value, flag);
  };
  LocalCores c;
  BATON_ASSIGN_OR_RETURN(c.decode_all, pick("--decode-cpus", a.decode_cpus, split.first));
  BATON_ASSIGN_OR_RETURN(c.prefill_all, pick("--prefill-cpus", a.prefill_cpus, split.second));
  auto per_engine = [](const std::vector<int>& cpus, int n) {
    std::vector<std::vector<int>> out(static_cast<size_t>(n), cpus);
    if (static_cast<int>(cpus.size()) < n || n <= 1) return out;
    const size_t each = cpus.size() / static_cast<size_t>(n);
    for (int i = 0; i < n; ++i) {
      const auto begin = cpus.begin() + static_cast<std::ptrdiff_t>(i * each);
      out[static_cast<size_t>(i)].assign(begin, i + 1 == n ? cpus.end() : begin + static_cast<std::ptrdiff_t>(each));
    }
    return out;
  };
  c.decode = per_engine(c.decode_all, a.n_decode_workers);
  c.prefill = per_engine(c.prefill_all, a.n_prefill_workers);
  return c;
}

int run_local(const ServeArgs& a) {
  block_signals();
  if (a.n_prefill_workers == 0 && a.local_prefill_max_tokens == 0) {
    return fail(invalid_argument("baton local --prefill-workers 0 leaves no one to prefill: give "
                                 "--local-prefill-max-tokens N so the decode workers prefill prompts themselves"));
  }
  if (Status s = init_logging(a.log_level, a.log_format); !s.ok()) return fail(s);
  auto cores = local_cores(a);
  if (!cores.ok()) return fail(cores.status());
  // Everything but the engines' step loops (loading, the frontend, gRPC's threads, KV senders)
  // runs on the prefill cores: threads inherit the set of the thread that makes them, so this
  // comes before anything starts a thread (gRPC's among them).
  if (Status s = pin_current_thread(cores->prefill_all); !s.ok()) return fail(s);
  spdlog::info("baton local: decode engines on CPUs {}, prefill engines and the rest on CPUs {}",
               format_cpu_list(cores->decode_all), format_cpu_list(cores->prefill_all));
  if (Status s = check_kv_transport(a.kv_transport); !s.ok()) return fail(s);
  auto sec = make_security(a);
  if (!sec.ok()) return fail(sec.status());
  if (Status s = check_exposure(a, "local", *sec); !s.ok()) return fail(s);
  if (a.kv_transport != "tcp") {
    // A CUDA IPC handle cannot be opened by the process that made it, and NCCL refuses two ranks
    // on one device: the device transports connect separate prefill and decode processes.
    return fail(invalid_argument("baton local runs every role in one process: --kv-transport=" + a.kv_transport +
                                 " needs separate prefill and decode processes (baton serve --role=...); use tcp"));
  }
  const auto grace = std::chrono::seconds(a.drain_timeout);
  Metrics metrics;
  std::unique_ptr<MetricsServer> metrics_server;
  if (!a.metrics_listen.empty()) {
    auto ms = MetricsServer::start(a.metrics_listen, metrics.registry());
    if (!ms.ok()) return fail(ms.status());
    metrics_server = std::move(*ms);
  }
  std::vector<std::unique_ptr<DecodeRole>> decoders;
  std::vector<std::unique_ptr<PrefillRole>> prefillers;
  std::vector<std::string> decode_addrs, prefill_addrs;
  for (int i = 0; i < a.n_decode_workers; ++i) {
    auto r = start_decode(a, *sec, "127.0.0.1:0", "decode-" + std::to_string(i), cores->decode[i], &metrics);
    if (!r.ok()) return fail(r.status());
    decode_addrs.push_back("127.0.0.1:" + std::to_string((*r)->server->port()));
    decoders.push_back(std::move(*r));
  }
  for (int i = 0; i < a.n_prefill_workers; ++i) {
    auto r = start_prefill(a, *sec, "127.0.0.1:0", "prefill-" + std::to_string(i), cores->prefill[i], &metrics);
    if (!r.ok()) return fail(r.status());
    prefill_addrs.push_back("127.0.0.1:" + std::to_string((*r)->server->port()));
    prefillers.push_back(std::move(*r));
  }
  auto fe = start_frontend(a, *sec, a.listen, a.name.empty() ? "frontend" : a.name, prefill_addrs, decode_addrs, &metrics);
  if (!fe.ok()) return fail(fe.status());
  spdlog::info("baton local: frontend on port {}{}, {} prefill and {} decode workers", (*fe)->server->port(),
               (*fe)->http ? ", HTTP API on port " + std::to_string((*fe)->http->port()) : std::string(),
               prefillers.size(), decoders.size());
  if (Status s = add_health(*(*fe)->server, a); !s.ok()) return fail(s);
  print_listening((*fe)->server->port(), (*fe)->http.get());
  wait_for_signal();
  // The frontend drains first (its in-flight requests still need the workers), then the workers.
  (*fe)->drain(grace);
  for (auto& p : prefillers) p->drain(std::chrono::seconds(5));
  for (auto& d : decoders) d->drain(std::chrono::seconds(5));
  spdlog::info("drained; exiting");
  return 0;
}

// The engines of `baton local` share the cores: with OpenMP's default spin-waiting, a thread of
// one engine's team burns the core another engine's team needs. libgomp reads its wait policy
// when the program starts, so `local` re-executes itself once with OMP_WAIT_POLICY=PASSIVE.
void ensure_passive_openmp(int argc, char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
  std::vector<char*> args(argv, argv + argc);
  args.push_back(nullptr);
  execv("/proc/self/exe", args.data());
  // execv failed: carry on with spinning threads (slower, still correct).
}

void add_common_flags(CLI::App* c, ServeArgs& a) {
  c->add_option("--model", a.model, "GGUF model file")->required()->envname("BATON_MODEL");
  c->add_option("--listen", a.listen, "gRPC listen address host:port")->envname("BATON_LISTEN");
  c->add_option("--metrics-listen", a.metrics_listen, "Prometheus /metrics address host:port")
      ->envname("BATON_METRICS_LISTEN");
  c->add_option("--threads", a.threads, "CPU threads per engine (0: one per core it owns, or all cores)")
      ->envname("BATON_THREADS");
  c->add_option("--device", a.device, "cpu, or cuda[:N] for the CUDA backend (bf16)")->envname("BATON_DEVICE");
  c->add_option("--dtype", a.dtype, "GEMM compute type")->check(CLI::IsMember({"f32", "bf16"}))->envname("BATON_DTYPE");
  c->add_option("--kv-dtype", a.kv_dtype, "KV cache type (default: f32 on CPU, bf16 on CUDA)")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}))
      ->envname("BATON_KV_DTYPE");
  c->add_option("--weights", a.weights, kWeightsHelp)
      ->check(CLI::IsMember({"auto", "native", "dense"}))
      ->envname("BATON_WEIGHTS");
  c->add_option("--kv-transport", a.kv_transport,
                "Prefill: how KV reaches decode workers: tcp (gRPC, anywhere), cuda_ipc (same node), nccl")
      ->check(CLI::IsMember({"tcp", "cuda_ipc", "nccl"}))
      ->envname("BATON_KV_TRANSPORT");
  c->add_option("--block-size", a.block_size, "KV block size in tokens")->check(CLI::Range(1, 4096))->envname("BATON_BLOCK_SIZE");
  c->add_option("--kv-blocks", a.kv_blocks, "KV blocks per worker (0: automatic)")
      ->check(CLI::NonNegativeNumber)
      ->envname("BATON_KV_BLOCKS");
  c->add_option("--prefill-addresses", a.prefill_addresses, "Frontend: prefill workers, host:port,...")
      ->envname("BATON_PREFILL_ADDRESSES");
  c->add_option("--prefill-dns", a.prefill_dns, "Frontend: host:port resolving to every prefill worker")
      ->envname("BATON_PREFILL_DNS");
  c->add_option("--decode-addresses", a.decode_addresses, "Frontend: decode workers, host:port,...")
      ->envname("BATON_DECODE_ADDRESSES");
  c->add_option("--decode-dns", a.decode_dns, "Frontend: host:port resolving to every decode worker")
      ->envname("BATON_DECODE_DNS");
  c->add_option("--max-requests", a.max_requests, "Frontend: admitted requests bound")
      ->check(CLI::PositiveNumber)
      ->envname("BATON_MAX_REQUESTS");
  c->add_option("--max-queued-prompt-tokens", a.max_queued_prompt_tokens, "Frontend: queued prompt tokens bound")
      ->check(CLI::PositiveNumber)
      ->envname("BATON_MAX_QUEUED_PROMPT_TOKENS");
  c->add_option("--max-priority", a.max_priority,
                "Frontend: highest request priority a client may ask for (lower is always allowed)")
      ->check(CLI::Range(-kPriorityBound, kPriorityBound))
      ->envname("BATON_MAX_PRIORITY");
  c->add_option("--max-message-bytes", a.max_message_bytes,
                "Frontend: largest request message (gRPC; RESOURCE_EXHAUSTED above) or body (HTTP; 413 above) "
                "the public API accepts")
      ->check(CLI::Range(1024, 256 << 20))
      ->envname("BATON_MAX_MESSAGE_BYTES");
  c->add_option("--http-listen", a.http_listen,
                "Frontend: also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                "/v1/models, /health) on host:port (off unless set)")
      ->envname("BATON_HTTP_LISTEN");
  c->add_option("--http-threads", a.http_threads,
                "Frontend: HTTP connections served at once (a streamed response holds one for its whole life)")
      ->check(CLI::Range(4, 65536))
      ->envname("BATON_HTTP_THREADS");
  c->add_option("--max-failovers", a.max_failovers,
                "Frontend: times a request is re-prefilled on other workers after a worker fails it")
      ->check(CLI::Range(0, 16))
      ->envname("BATON_MAX_FAILOVERS");
  c->add_option("--no-worker-timeout", a.no_worker_timeout,
                "Frontend: seconds a queued request waits while no prefill or no decode worker is healthy, "
                "then fails UNAVAILABLE")
      ->check(CLI::Range(0.001, 86400.0))
      ->envname("BATON_NO_WORKER_TIMEOUT");
  c->add_option("--chat-template", a.chat_template, "chatml | llama3 (default: from the model)")
      ->envname("BATON_CHAT_TEMPLATE");
  c->add_option("--prefill-token-budget", a.prefill_token_budget, "Prefill: most prompt tokens per step")
      ->check(CLI::Range(1, 1 << 20))
      ->envname("BATON_PREFILL_TOKEN_BUDGET");
  c->add_option("--max-request-seconds", a.max_request_seconds,
                "Decode: longest a request may hold KV blocks, whatever deadline it asks for (DEADLINE_EXCEEDED after)")
      ->check(CLI::Range(1, 7 * 24 * 3600))
      ->envname("BATON_MAX_REQUEST_SECONDS");
  c->add_option("--max-batch", a.max_batch, "Decode: most sequences per step")
      ->check(CLI::Range(1, 4096))
      ->envname("BATON_MAX_BATCH");
  c->add_option("--local-prefill-max-tokens", a.local_prefill_max_tokens,
                "Frontend and decode: prompts of up to N tokens are prefilled by the decode worker itself, "
                "without a prefill worker or KV transfer (0: never; a large N with no prefill workers: colocated)")
      ->check(CLI::Range(0, 1 << 30))
      ->envname("BATON_LOCAL_PREFILL_MAX_TOKENS");
  c->add_option("--local-prefill-token-budget", a.local_prefill_token_budget,
                "Decode: most prompt tokens one decode step prefills (chunked prefill)")
      ->check(CLI::Range(1, 1 << 20))
      ->envname("BATON_LOCAL_PREFILL_TOKEN_BUDGET");
  c->add_option("--kv-stream", a.kv_stream,
                "Prefill: send each layer's KV while the prompt is prefilled (true), or after the first token (false)")
      ->envname("BATON_KV_STREAM");
  c->add_option("--prefix-cache-blocks", a.prefix_cache_blocks,
                "Prefill: most KV blocks the prefix cache keeps for later prompts sharing a prefix (-1: every block "
                "of the pool that work in flight does not need; 0: no prefix cache)")
      ->check(CLI::Range(-1, 1 << 30))
      ->envname("BATON_PREFIX_CACHE_BLOCKS");
  c->add_option("--prefill-queue-weight", a.prefill_queue_weight,
                "Frontend: prefill routing weighs W tokens of a worker's queue as one prompt token its prefix cache "
                "saves (1: the soonest first token; larger: shorter queues first; 0: the cache alone)")
      ->check(CLI::Range(0.0, 1e9))
      ->envname("BATON_PREFILL_QUEUE_WEIGHT");
  c->add_option("--log-level", a.log_level, "trace|debug|info|warn|error")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error"}))
      ->envname("BATON_LOG_LEVEL");
  c->add_option("--log-format", a.log_format, "text | json (one JSON object per line, for log collectors)")
      ->check(CLI::IsMember({"text", "json"}))
      ->envname("BATON_LOG_FORMAT");
  c->add_option("--name", a.name, "This role's name in metrics (worker label) and logs (default: --listen)")
      ->envname("BATON_NAME");
  c->add_option("--drain-timeout", a.drain_timeout, "Seconds in-flight requests may take after SIGTERM")
      ->check(CLI::Range(0, 3600))
      ->envname("BATON_DRAIN_TIMEOUT");
  c->add_option("--stall-timeout", a.stall_timeout,
                "Workers: seconds a step loop that has work may make no progress before the worker reports "
                "NOT_SERVING (0: never)")
      ->check(CLI::Range(0, 86400))
      ->envname("BATON_STALL_TIMEOUT");
  c->add_option("--tls-cert", a.public_tls.cert, "Frontend: PEM certificate chain of the public API (TLS)")
      ->envname("BATON_TLS_CERT");
  c->add_option("--tls-key", a.public_tls.key, "Frontend: PEM private key of --tls-cert")->envname("BATON_TLS_KEY");
  c->add_option("--tls-client-ca", a.public_tls.ca,
                "Frontend: PEM CA bundle; clients must present a certificate it signed (mutual TLS)")
      ->envname("BATON_TLS_CLIENT_CA");
  c->add_option("--internal-tls-cert", a.internal_tls.cert,
                "Every role: PEM certificate for the internal plane (mutual TLS between frontend, prefill and decode)")
      ->envname("BATON_INTERNAL_TLS_CERT");
  c->add_option("--internal-tls-key", a.internal_tls.key, "Every role: PEM private key of --internal-tls-cert")
      ->envname("BATON_INTERNAL_TLS_KEY");
  c->add_option("--internal-tls-ca", a.internal_tls.ca,
                "Every role: PEM CA that signed every internal certificate; peers it did not sign are refused")
      ->envname("BATON_INTERNAL_TLS_CA");
  c->add_option("--tls-refresh-seconds", a.tls_refresh_seconds,
                "Seconds between looks at the certificate files (rotated files apply to new connections)")
      ->check(CLI::Range(1, 86400))
      ->envname("BATON_TLS_REFRESH_SECONDS");
  c->add_option("--api-key-file", a.api_key_file,
                "Frontend: file of API keys, one per line; clients send 'authorization: Bearer <key>' "
                "(re-read when it changes)")
      ->envname("BATON_API_KEY_FILE");
  c->add_option("--health-listen", a.health_listen,
                "Also serve grpc.health.v1 alone, in plaintext, on host:port (for probes that speak no TLS)")
      ->envname("BATON_HEALTH_LISTEN");
  c->add_flag("--insecure", a.insecure,
              "Allow listening beyond loopback without TLS / an authenticated internal plane")
      ->envname("BATON_INSECURE");
}

}  // namespace

void add_serve_commands(CLI::App& app, std::function<int()>* run, int argc, char** argv) {
  auto serve = std::make_shared<ServeArgs>();
  CLI::App* s = app.add_subcommand("serve", "Run one role: frontend, prefill or decode worker");
  s->add_option("--role", serve->role, "frontend | prefill | decode")
      ->required()
      ->check(CLI::IsMember({"frontend", "prefill", "decode"}))
      ->envname("BATON_ROLE");
  add_common_flags(s, *serve);
  s->add_option("--cpus", serve->cpus, "CPUs the engine's step threads own, e.g. 0-3 (default: any)")
      ->envname("BATON_CPUS");
  s->callback([serve, run] { *run = [serve] { return run_serve(*serve); }; });

  auto local = std::make_shared<ServeArgs>();
  local->listen = "127.0.0.1:50051";
  CLI::App* l = app.add_subcommand("local", "All roles in one process over loopback gRPC (one /metrics)");
  add_common_flags(l, *local);
  l->add_option("--prefill-workers", local->n_prefill_workers,
                "Prefill workers (0: every prompt is prefilled by a decode worker: needs --local-prefill-max-tokens)")
      ->check(CLI::Range(0, 64));
  l->add_option("--decode-workers", local->n_decode_workers, "Decode workers")->check(CLI::Range(1, 64));
  l->add_option("--decode-cpus", local->decode_cpus,
                "CPUs of the decode engines, e.g. 0-1, or all (default: the first half of the allowed CPUs)")
      ->envname("BATON_DECODE_CPUS");
  l->add_option("--prefill-cpus", local->prefill_cpus,
                "CPUs of the prefill engines and everything else, or all (default: the CPUs decode does not own)")
      ->envname("BATON_PREFILL_CPUS");
  l->callback([local, run, argc, argv] {
    ensure_passive_openmp(argc, argv);
    *run = [local] { return run_local(*local); };
  });
}

}  // namespace baton
