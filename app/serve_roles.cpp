#include "app/serve_roles.h"

#include <algorithm>
#include <limits>
#include <optional>

#include "common/memory_limit.h"
#include "common/progress.h"
#include "kv/kv_probe.h"
#include "kv/tcp/tcp_transport.h"
#if BATON_WITH_CUDA_KV
#include "kv/cuda_ipc/cuda_ipc_transport.h"
#include "kv/nccl/nccl_api.h"
#include "kv/nccl/nccl_transport.h"
#endif
#include "app/engine_commands.h"
#include "server/request_validation.h"

namespace baton {
namespace {

// Flags are checked against the dtype names by CLI11 before this runs.
DType dtype_of(const std::string& s) { return dtype_from_name(s).value(); }

#if BATON_WITH_CUDA_KV
// The CUDA device the device KV transports stage and receive payloads on: --device's, else 0.
int kv_cuda_device(const std::string& device) { return cuda_device_ordinal(device).value_or(0); }
#endif

// The KV pool's size, where operators size --kv-blocks from (0: the default).
void log_kv_pool(const char* role, int64_t n_blocks, int block_size, int64_t block_bytes) {
  spdlog::info("{} KV pool: {} blocks of {} tokens = {} tokens, {:.1f} MiB", role, n_blocks, block_size,
               n_blocks * block_size, static_cast<double>(n_blocks * block_bytes) / (1 << 20));
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

}  // namespace

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

Result<LoadedModel> load_model(const ServeArgs& a, bool decodes, bool prefills, std::vector<int> cpus) {
  LoadedModel m;
  BackendOptions bo;
  bo.device = a.device;
  bo.dtype = a.dtype == "auto" ? DType::kBF16 : dtype_of(a.dtype);
  bo.measure_dtype = a.dtype == "auto" && prefills && !decodes;
  bo.n_threads = a.threads;
  bo.cpus = std::move(cpus);
  // A prefill engine's steps are throughput work; a decode engine's are the latency it serves.
  bo.nice = prefills && !decodes ? a.prefill_nice : 0;
  std::string error;
  m.backend = make_backend(bo, &error);
  if (!m.backend) return invalid_argument(error);
  if (const std::string why = m.backend->dtype_reason(); !why.empty()) {
    spdlog::info("prefill computes in {}: {}", dtype_name(m.backend->compute_dtype()), why);
  }
  BATON_ASSIGN_OR_RETURN(m.kv_dtype, resolve_kv_dtype(*m.backend, a.kv_dtype));
  BATON_ASSIGN_OR_RETURN(m.files, open_model_files(a.model));
  if (const std::string& note = m.files.source->config().context_note; !note.empty()) spdlog::info("{}", note);
  BATON_ASSIGN_OR_RETURN(m.model, Model::load(*m.files.source, *m.backend,
                                              load_progress_reporter(a.model, [](const std::string& line) {
                                                spdlog::info("{}", line);
                                              }),
                                              weights_plan(a.weights, *m.backend, decodes, prefills)));
  spdlog::info("weights: {} GEMM matrices quantised (native), {} dense ({}); weights checked finite in {:.1f} ms",
               m.model->n_native_matrices(), m.model->n_dense_matrices(), dtype_name(m.backend->compute_dtype()),
               m.model->finite_check_seconds() * 1e3);
  return m;
}

namespace {

// What a host-memory KV pool leaves for everything else a worker allocates once its model is
// loaded: a step's activations and logits, gRPC's and the KV hand-off's buffers, the allocator's
// slack. A decode worker of SmolLM2 at batch 32 stays within a fifth of it.
constexpr int64_t kKvReserveBytes = int64_t{256} << 20;

// --kv-memory as blocks of `block_bytes` (0 where it is not given): a share is of the host memory
// still available, so it needs a pool in host memory.
Result<int64_t> kv_memory_blocks(const ServeArgs& a, const LoadedModel& m, int64_t block_bytes) {
  if (a.kv_memory.empty()) return int64_t{0};
  BATON_ASSIGN_OR_RETURN(const MemoryAmount amount, parse_memory_amount(a.kv_memory));
  if (amount.fraction > 0 && !m.backend->host_memory()) {
    return invalid_argument("--kv-memory " + a.kv_memory + ": a share of free memory sizes host-memory KV pools; " +
                            "this backend keeps KV on its device: give bytes (e.g. 4GiB)");
  }
  const int64_t bytes = memory_amount_bytes(amount, available_memory());
  const int64_t blocks = std::min<int64_t>(bytes / block_bytes, std::numeric_limits<int>::max());
  if (blocks < 1) {
    return invalid_argument("--kv-memory " + a.kv_memory + " (" + std::to_string(bytes) + " bytes) holds no KV block: " +
                            "a block of " + std::to_string(a.block_size) + " tokens is " + std::to_string(block_bytes) +
                            " bytes of " + dtype_name(m.kv_dtype) + " KV");
  }
  spdlog::info("--kv-memory {}: {} KV blocks of {} bytes", a.kv_memory, blocks, block_bytes);
  return blocks;
}

Result<int> decode_kv_blocks(const ServeArgs& a, const LoadedModel& m) {
  const int64_t blocks_per_context = (m.model->config().n_ctx + a.block_size - 1) / a.block_size;
  const int64_t block_bytes = decode_kv_block_bytes(m.model->config(), a.block_size, m.kv_dtype);
  BATON_ASSIGN_OR_RETURN(const int64_t from_memory, kv_memory_blocks(a, m, block_bytes));
  const int64_t asked = from_memory > 0 ? from_memory : a.kv_blocks;
  const std::string asked_flag = from_memory > 0 ? "--kv-memory " + a.kv_memory : "--kv-blocks " + std::to_string(asked);
  // Default: room for 8 full-context sequences, as far as the memory limit allows.
  const int64_t wanted = asked > 0 ? asked : 8 * blocks_per_context;
  const std::optional<int64_t> limit = cgroup_memory_limit();
  if (!m.backend->host_memory() || !limit) return static_cast<int>(wanted);
  const int64_t resident = resident_bytes();
  const int64_t fits = blocks_within(*limit, resident, kKvReserveBytes, block_bytes);
  if (wanted <= fits) return static_cast<int>(wanted);
  const auto mib = [](int64_t bytes) { return std::to_string(bytes >> 20) + " MiB"; };
  const std::string budget = "the memory limit (" + mib(*limit) + ") leaves " +
                             mib(std::max<int64_t>(0, *limit - resident - kKvReserveBytes)) + " after the loaded model (" +
                             mib(resident) + " resident) and a " + mib(kKvReserveBytes) + " reserve";
  if (asked > 0) {
    return resource_exhausted(asked_flag + " needs " + mib(wanted * block_bytes) + " of " + dtype_name(m.kv_dtype) +
                              " KV, but " + budget + ": give --kv-blocks " + std::to_string(fits) + " (--kv-memory " +
                              mib(fits * block_bytes) + ") or less, a smaller --kv-dtype, or a higher memory limit");
  }
  if (fits < blocks_per_context) {
    return resource_exhausted("the decode KV pool would not hold one full context (" +
                              std::to_string(m.model->config().n_ctx) + " tokens, " +
                              mib(blocks_per_context * block_bytes) + " of " + dtype_name(m.kv_dtype) + " KV): " +
                              budget + "; raise the memory limit or use a smaller --kv-dtype");
  }
  spdlog::info("decode KV pool: {} blocks instead of the default {} (8 full contexts): {}", fits, wanted, budget);
  return static_cast<int>(fits);
}

std::chrono::milliseconds to_ms(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

// A worker pings its callers as the frontend pings its workers (ServerKeepalive).
ServerKeepalive worker_keepalive(const ServeArgs& a) {
  return {to_ms(a.worker_keepalive_seconds), to_ms(a.worker_keepalive_timeout_seconds)};
}

}  // namespace

Status add_health(RpcServer& server, const ServeArgs& a) {
  return a.health_listen.empty() ? Status{} : server.add_health_listener(a.health_listen);
}

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
  BATON_ASSIGN_OR_RETURN(dc.n_blocks, decode_kv_blocks(a, r->m));
  dc.name = name;
  dc.local_prefill_max_tokens = a.local_prefill_max_tokens;
  dc.local_prefill_token_budget = a.local_prefill_token_budget;
  dc.constraints = std::make_shared<OutputConstraints>(*r->m.files.tokenizer, r->m.model->config().n_vocab);
  BATON_ASSIGN_OR_RETURN(r->engine, DecodeEngine::create(*r->m.model, r->m.files.tokenizer->stop_ids(), dc, metrics));
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
  BATON_ASSIGN_OR_RETURN(r->server, RpcServer::start(listen, services, sec.internal.server, kMaxInternalMessageBytes,
                                                     worker_keepalive(a)));
  return r;
}

Result<std::unique_ptr<PrefillRole>> start_prefill(const ServeArgs& a, const Security& sec, const std::string& listen,
                                                   const std::string& name, std::vector<int> cpus, Metrics* metrics) {
  auto r = std::make_unique<PrefillRole>();
  BATON_ASSIGN_OR_RETURN(r->m, load_model(a, /*decodes=*/false, /*prefills=*/true, std::move(cpus)));
  PrefillConfig pc;
  pc.token_budget = a.prefill_token_budget;
  pc.block_size = a.block_size;
  pc.kv_dtype = r->m.kv_dtype;
  BATON_ASSIGN_OR_RETURN(const int64_t from_memory,
                         kv_memory_blocks(a, r->m, decode_kv_block_bytes(r->m.model->config(), a.block_size, r->m.kv_dtype)));
  pc.n_blocks = from_memory > 0 ? static_cast<int>(from_memory) : a.kv_blocks;
  pc.name = name;
  // The device transports hold one communicator (nccl) or staging window per decode worker for a
  // whole transfer: a transfer open across a prompt's prefill would hold up the next one, so they
  // send after the prefill.
  pc.stream_kv = a.kv_stream && a.kv_transport == "tcp";
  pc.prefix_cache_blocks = a.prefix_cache_blocks;
  pc.constraints = std::make_shared<OutputConstraints>(*r->m.files.tokenizer, r->m.model->config().n_vocab);
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
  BATON_ASSIGN_OR_RETURN(r->server, RpcServer::start(listen, {r->service.get()}, sec.internal.server,
                                                     kMaxInternalMessageBytes, worker_keepalive(a)));
  return r;
}

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
  fc.pipeline.progress.enabled = a.progress_grace_seconds > 0;
  if (fc.pipeline.progress.enabled) fc.pipeline.progress.grace_seconds = a.progress_grace_seconds;
  fc.pipeline.progress.slack = a.progress_slack;
  fc.pipeline.progress.min_prefill_tokens_per_second = a.progress_min_prefill_rate;
  fc.max_request = std::chrono::seconds(a.max_request_seconds);
  fc.workers.keepalive = to_ms(a.worker_keepalive_seconds);
  fc.workers.keepalive_timeout = to_ms(a.worker_keepalive_timeout_seconds);
  fc.scheduler.max_queued_prompt_tokens = a.max_queued_prompt_tokens;
  fc.scheduler.local_prefill_max_tokens = a.local_prefill_max_tokens;
  fc.scheduler.prefill_queue_weight = a.prefill_queue_weight;
  fc.scheduler.ttft_slo_seconds = a.ttft_slo;
  fc.scheduler.prefill_choice = a.prefill_placement == "adaptive" ? PrefillChoice::kAdaptive : PrefillChoice::kStatic;
  fc.scheduler.slo_hold_fraction = a.slo_hold_fraction;
  fc.scheduler.local_prefill_itl_weight = a.local_prefill_itl_weight;
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

}  // namespace baton
