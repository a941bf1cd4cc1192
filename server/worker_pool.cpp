#include "server/worker_pool.h"

#include <arpa/inet.h>
#include <grpcpp/create_channel.h>
#include <netdb.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <set>

#include "common/grpc_status.h"
#include "common/tls.h"

namespace baton {

Status WorkerPoolConfig::validate() const {
  if (prefill_addresses.empty() && prefill_dns.empty() && !prefill_optional) {
    return invalid_argument(
        "no prefill workers: give --prefill-addresses or --prefill-dns (or --local-prefill-max-tokens, for decode "
        "workers that prefill prompts themselves)");
  }
  if (decode_addresses.empty() && decode_dns.empty()) {
    return invalid_argument("no decode workers: give --decode-addresses or --decode-dns");
  }
  if (poll_interval.count() <= 0 || dns_refresh_interval.count() <= 0) {
    return invalid_argument("worker poll and DNS refresh intervals must be positive");
  }
  if (keepalive < std::chrono::seconds(1) || keepalive_timeout < std::chrono::milliseconds(100)) {
    return invalid_argument("--worker-keepalive-seconds must be >= 1 and --worker-keepalive-timeout-seconds >= 0.1");
  }
  return {};
}

std::vector<std::string> resolve_host_port(const std::string& host_port) {
  const size_t colon = host_port.rfind(':');
  if (colon == std::string::npos || colon == 0) return {};
  std::string host = host_port.substr(0, colon);
  const std::string port = host_port.substr(colon + 1);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host.pop_back();
    host.erase(host.begin());
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0) return {};
  std::set<std::string> out;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    char buf[INET6_ADDRSTRLEN] = {};
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, buf, sizeof(buf));
      out.insert(std::string(buf) + ":" + port);
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, buf, sizeof(buf));
      std::string a6 = "[";  // (built piecewise: GCC 12 misreports "[" + s + "]" as -Wrestrict)
      a6.append(buf).append("]:").append(port);
      out.insert(a6);
    }
  }
  freeaddrinfo(res);
  return {out.begin(), out.end()};
}

WorkerPool::WorkerPool(WorkerPoolConfig config, WorkerRegistry& registry, std::function<void()> on_reports)
    : config_(std::move(config)), registry_(registry), on_reports_(std::move(on_reports)) {
  registry_.set_addresses(WorkerRole::kPrefill, config_.prefill_addresses);
  registry_.set_addresses(WorkerRole::kDecode, config_.decode_addresses);
}

WorkerPool::~WorkerPool() { stop(); }

void WorkerPool::start() {
  std::lock_guard<std::mutex> lock(run_mu_);
  if (thread_.joinable()) return;
  stopping_ = false;
  thread_ = std::thread([this] { run(); });
}

void WorkerPool::stop() {
  {
    std::lock_guard<std::mutex> lock(run_mu_);
    stopping_ = true;
  }
  run_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<grpc::Channel> WorkerPool::channel(const std::string& address) {
  auto it = channels_.find(address);
  if (it != channels_.end()) return it->second;
  grpc::ChannelArguments args;
  // Worker answers are small (events, load reports); prefill requests carry a prompt.
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  // A worker back after an outage of any length is reconnected within about a second (gRPC's
  // default backoff grows to 120 s: a restarted worker would sit unused for minutes).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, static_cast<int>(config_.keepalive.count()));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, static_cast<int>(config_.keepalive_timeout.count()));
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  auto ch = grpc::CreateCustomChannel(
      address, config_.credentials ? config_.credentials : grpc::InsecureChannelCredentials(), args);
  channels_.emplace(address, ch);
  return ch;
}

v1::PrefillWorker::Stub& WorkerPool::prefill_stub(const std::string& address) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& stub = prefill_stubs_[address];
  if (!stub) stub = v1::PrefillWorker::NewStub(channel(address));
  return *stub;
}

v1::DecodeWorker::Stub& WorkerPool::decode_stub(const std::string& address) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& stub = decode_stubs_[address];
  if (!stub) stub = v1::DecodeWorker::NewStub(channel(address));
  return *stub;
}

void WorkerPool::resolve() {
  auto update = [this](WorkerRole role, const std::string& dns, const std::vector<std::string>& fixed) {
    if (dns.empty()) return;
    std::vector<std::string> addrs = fixed;
    std::vector<std::string> found = resolve_host_port(dns);
    if (found.empty()) {
      spdlog::warn("cannot resolve {} workers from '{}'; keeping the previous list", worker_role_name(role), dns);
      return;
    }
    addrs.insert(addrs.end(), found.begin(), found.end());
    registry_.set_addresses(role, addrs);
  };
  update(WorkerRole::kPrefill, config_.prefill_dns, config_.prefill_addresses);
  update(WorkerRole::kDecode, config_.decode_dns, config_.decode_addresses);
  last_resolve_ = std::chrono::steady_clock::now();
}

void WorkerPool::poll_role(WorkerRole role) {
  for (const std::string& address : registry_.addresses(role)) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
    v1::LoadRequest req;
    v1::LoadReport rep;
    const TimePoint sent = std::chrono::steady_clock::now();
    grpc::Status s = role == WorkerRole::kPrefill ? prefill_stub(address).GetLoad(&ctx, req, &rep)
                                                  : decode_stub(address).GetLoad(&ctx, req, &rep);
    if (!s.ok()) {
      registry_.report_failure(role, address);
      note_up(role, address, false, s.error_message());
      continue;
    }
    if (rep.model_fingerprint() != config_.model_fingerprint) {
      spdlog::error("{} worker {} serves model {} ({}), not this frontend's {}: refusing it", worker_role_name(role),
                    address, rep.model().name(), rep.model_fingerprint(), config_.model_fingerprint);
      registry_.report_failure(role, address);
      continue;
    }
    WorkerLoad load;
    load.free_blocks = rep.free_blocks();
    load.total_blocks = rep.total_blocks();
    load.block_size = rep.block_size();
    load.queued_prompt_tokens = rep.queued_prompt_tokens();
    load.n_running = rep.running();
    load.draining = rep.draining();
    load.local_prefill_max_tokens = rep.local_prefill_max_tokens();
    load.step_seconds = rep.step_seconds();
    load.prefill_tokens_per_second = rep.prefill_tokens_per_second();
    load.step_token_budget = rep.step_token_budget();
    load.step_fixed_seconds = rep.step_fixed_seconds();
    load.step_seconds_per_token = rep.step_seconds_per_token();
    load.step_tokens_in_progress = rep.step_tokens_in_progress();
    load.step_elapsed_seconds = rep.step_elapsed_seconds();
    load.certificate = peer_certificate(ctx);
    load.prefix_cache_blocks = rep.prefix_cache_blocks();
    load.prefix_hash_seed = rep.prefix_hash_seed();
    if (rep.cached_block_hashes_size() > 0) {
      load.cached_blocks = std::make_shared<const std::unordered_set<uint64_t>>(rep.cached_block_hashes().begin(),
                                                                                 rep.cached_block_hashes().end());
    }
    if (Status st = registry_.report_load(role, address, load, sent); !st.ok()) {
      spdlog::warn("load report of {} worker {} not applied: {}", worker_role_name(role), address, st.message());
    }
    note_up(role, address, true, "");
  }
}

void WorkerPool::note_up(WorkerRole role, const std::string& address, bool up, const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, inserted] = up_[static_cast<int>(role)].try_emplace(address, up);
  if (!inserted && it->second == up) return;
  it->second = up;
  if (up && !inserted) {
    spdlog::info("{} worker {} answers again", worker_role_name(role), address);
  } else if (!up) {
    spdlog::warn("{} worker {} does not answer its load poll: {}", worker_role_name(role), address, why);
  }
}

void WorkerPool::poll_now() {
  if (last_resolve_ == std::chrono::steady_clock::time_point{}) resolve();
  poll_role(WorkerRole::kPrefill);
  poll_role(WorkerRole::kDecode);
  if (on_reports_) on_reports_();
}

void WorkerPool::run() {
  std::unique_lock<std::mutex> lock(run_mu_);
  while (!stopping_) {
    lock.unlock();
    if (std::chrono::steady_clock::now() - last_resolve_ >= config_.dns_refresh_interval) resolve();
    poll_role(WorkerRole::kPrefill);
    poll_role(WorkerRole::kDecode);
    if (on_reports_) on_reports_();
    lock.lock();
    run_cv_.wait_for(lock, config_.poll_interval, [this] { return stopping_; });
  }
}

}  // namespace baton
