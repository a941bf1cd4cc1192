#include "kv/nccl/nccl_transport.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "common/grpc_status.h"
#include "kv/kv_cuda_status.h"
#include "kv/tcp/tcp_transport.h"

namespace baton {
namespace {

using SysClock = std::chrono::system_clock;

Status nccl_status(ncclResult_t r, ncclComm_t comm, const std::string& what) {
  if (r == ncclSuccess) return {};
  std::string message = what + ": " + ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last && *last) message += " (" + std::string(last) + ")";
  return unavailable(message);
}

Status cancelled_status(const std::string& what) {
  return cancelled(what + ": the transfer was cancelled");
}

// Polls with a short spin, then sleeps: a chunk's payload takes from microseconds (NVLink) to
// milliseconds (network), and a sleeping poller costs nothing while it waits.
class Backoff {
 public:
  void pause() {
    if (n_++ < 256) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  int n_ = 0;
};

// Waits until a non-blocking communicator's pending call (init, or an ncclSend/ncclRecv that
// returned ncclInProgress) has completed.
Status wait_comm(ncclComm_t comm, SysClock::time_point deadline, const std::function<bool()>& cancelled,
                 const std::string& what) {
  Backoff backoff;
  for (;;) {
    ncclResult_t state = ncclSuccess;
    BATON_RETURN_IF_ERROR(nccl_status(ncclCommGetAsyncError(comm, &state), comm, what));
    if (state == ncclSuccess) return {};
    if (state != ncclInProgress) return nccl_status(state, comm, what);
    if (SysClock::now() >= deadline) return deadline_exceeded(what + ": not done before the deadline");
    if (cancelled && cancelled()) return cancelled_status(what);
    backoff.pause();
  }
}

// Waits for `event` (recorded after an NCCL operation) while watching the communicator for errors.
Status wait_event(cudaEvent_t event, ncclComm_t comm, SysClock::time_point deadline,
                  const std::function<bool()>& cancelled, const std::string& what) {
  Backoff backoff;
  for (;;) {
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return {};
    if (e != cudaErrorNotReady) return kv_cuda_status(e, what);
    ncclResult_t state = ncclSuccess;
    BATON_RETURN_IF_ERROR(nccl_status(ncclCommGetAsyncError(comm, &state), comm, what));
    if (state != ncclSuccess && state != ncclInProgress) return nccl_status(state, comm, what);
    if (SysClock::now() >= deadline) return deadline_exceeded(what + ": not done before the deadline");
    if (cancelled && cancelled()) return cancelled_status(what);
    backoff.pause();
  }
}

int64_t staging_size(int64_t bytes) {
  int64_t size = int64_t{1} << 20;
  while (size < bytes) size *= 2;
  return size;
}

std::string random_session_name() {
  std::random_device rd;
  char buf[33];
  std::snprintf(buf, sizeof(buf), "%08x%08x%08x%08x", rd(), rd(), rd(), rd());
  return buf;
}

ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

}  // namespace

// ---- sender ------------------------------------------------------------------------------------

struct NcclKvTransport::Peer {
  // Held for a whole transfer, bootstrap included: NCCL matches a communicator's sends to its
  // receives in issue order. Everything below is guarded by it.
  std::timed_mutex busy;
  std::string session;  // "" = no communicator (bootstrap on the next send)
  ncclComm_t comm = nullptr;
  cudaStream_t copy_stream = nullptr;  // host → staging copies, staging (re)allocation and frees
  cudaStream_t send_stream = nullptr;  // ncclSend
  struct Slot {
    char* ptr = nullptr;  // stream-ordered allocation (copy_stream)
    int64_t bytes = 0;
    cudaEvent_t copied = nullptr;  // recorded on copy_stream after the slot's copy
    cudaEvent_t sent = nullptr;    // recorded on send_stream after the slot's ncclSend
  };
  std::vector<Slot> slots;

  // Aborts the communicator (which ends its pending sends) and releases everything, without
  // waiting on the host: the frees are ordered after the sends on the streams.
  void teardown() {
    if (comm) {
      const ncclResult_t r = ncclCommAbort(comm);
      if (r != ncclSuccess && r != ncclInProgress) spdlog::warn("nccl: ncclCommAbort: {}", ncclGetErrorString(r));
      comm = nullptr;
    }
    for (Slot& s : slots) {
      if (s.ptr && copy_stream) {
        if (s.sent) (void)cudaStreamWaitEvent(copy_stream, s.sent, 0);
        (void)cudaFreeAsync(s.ptr, copy_stream);
      }
      if (s.copied) (void)cudaEventDestroy(s.copied);
      if (s.sent) (void)cudaEventDestroy(s.sent);
    }
    slots.clear();
    if (copy_stream) (void)cudaStreamDestroy(copy_stream);
    if (send_stream) (void)cudaStreamDestroy(send_stream);
    copy_stream = send_stream = nullptr;
    session.clear();
    (void)cudaGetLastError();
  }
};

namespace {

// Joins a new communicator with the decode worker at `address` as rank 0. On failure the peer
// may hold partial state: the caller tears it down.
Status bootstrap_peer(NcclKvTransport::Peer& p, const std::shared_ptr<grpc::Channel>& channel, int device, int window,
                      SysClock::time_point deadline) {
  // ncclGetUniqueId starts a root thread that waits for both ranks: only against a peer that answers.
  BATON_RETURN_IF_ERROR(kv_wait_connected(*channel, deadline));
  ncclUniqueId id;
  BATON_RETURN_IF_ERROR(nccl_status(ncclGetUniqueId(&id), nullptr, "ncclGetUniqueId"));
  const std::string session = random_session_name();
  {
    auto stub = baton::v1::DecodeKvDevice::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(deadline);
    baton::v1::NcclBootstrapRequest request;
    request.set_unique_id(std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
    request.set_session(session);
    baton::v1::NcclBootstrapResponse response;
    const grpc::Status status = stub->BootstrapNccl(&context, request, &response);
    if (!status.ok()) {
      const Status s = from_grpc(status);
      return {s.code(), "NCCL bootstrap: " + s.message()};
    }
  }
  BATON_RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&p.copy_stream, cudaStreamNonBlocking),
                             "nccl: cudaStreamCreate");
  BATON_RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&p.send_stream, cudaStreamNonBlocking),
                             "nccl: cudaStreamCreate");
  p.slots.resize(static_cast<size_t>(window));
  for (NcclKvTransport::Peer::Slot& s : p.slots) {
    BATON_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&s.copied, cudaEventDisableTiming), "nccl: cudaEventCreate");
    BATON_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&s.sent, cudaEventDisableTiming), "nccl: cudaEventCreate");
  }
  ncclConfig_t config = nonblocking_config();
  const ncclResult_t r = ncclCommInitRankConfig(&p.comm, 2, id, 0, &config);
  if (r != ncclSuccess && r != ncclInProgress) return nccl_status(r, p.comm, "ncclCommInitRankConfig (rank 0)");
  BATON_RETURN_IF_ERROR(
      wait_comm(p.comm, deadline, nullptr, "ncclCommInitRankConfig (rank 0, device " + std::to_string(device) + ")"));
  p.session = session;
  return {};
}

// Stages chunk `c` in slot `s` and posts its ncclSend.
Status post_chunk(NcclKvTransport::Peer& p, NcclKvTransport::Peer::Slot& s, const KvChunk& c,
                  SysClock::time_point deadline) {
  const int64_t k_bytes = static_cast<int64_t>(c.k.size());
  const int64_t n = k_bytes + static_cast<int64_t>(c.v.size());
  // The slot's previous ncclSend has finished (its chunk was acknowledged); ordering the copy
  // after it makes that a guarantee of the streams, not of the receiver's ack.
  BATON_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(p.copy_stream, s.sent, 0), "nccl: cudaStreamWaitEvent");
  if (s.bytes < n) {
    if (s.ptr) BATON_RETURN_IF_CUDA_ERROR(cudaFreeAsync(s.ptr, p.copy_stream), "nccl: cudaFreeAsync");
    s.ptr = nullptr;
    s.bytes = 0;
    void* ptr = nullptr;
    const int64_t size = staging_size(n);
    BATON_RETURN_IF_CUDA_ERROR(cudaMallocAsync(&ptr, static_cast<size_t>(size), p.copy_stream),
                               "nccl: cudaMallocAsync of " + std::to_string(size) + " bytes of staging");
    s.ptr = static_cast<char*>(ptr);
    s.bytes = size;
  }
  BATON_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(s.ptr, c.k.data(), c.k.size(), cudaMemcpyHostToDevice, p.copy_stream),
                             "nccl: staging K");
  BATON_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(s.ptr + k_bytes, c.v.data(), c.v.size(), cudaMemcpyHostToDevice, p.copy_stream),
      "nccl: staging V");
  BATON_RETURN_IF_CUDA_ERROR(cudaEventRecord(s.copied, p.copy_stream), "nccl: cudaEventRecord");
  BATON_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(p.send_stream, s.copied, 0), "nccl: cudaStreamWaitEvent");
  const ncclResult_t r = ncclSend(s.ptr, static_cast<size_t>(n), ncclUint8, /*peer=*/1, p.comm, p.send_stream);
  if (r == ncclInProgress) {
    BATON_RETURN_IF_ERROR(wait_comm(p.comm, deadline, nullptr, "ncclSend"));
  } else {
    BATON_RETURN_IF_ERROR(nccl_status(r, p.comm, "ncclSend"));
  }
  BATON_RETURN_IF_CUDA_ERROR(cudaEventRecord(s.sent, p.send_stream), "nccl: cudaEventRecord");
  return {};
}

// Refusals of the open itself: the receiver posted nothing and neither did the sender, so the
// communicator stays usable.
bool refused_at_open(const Status& s) {
  return s.code() == StatusCode::kFailedPrecondition || s.code() == StatusCode::kInvalidArgument ||
         s.code() == StatusCode::kResourceExhausted || s.code() == StatusCode::kUnimplemented;
}

}  // namespace

NcclKvTransport::NcclKvTransport(const NcclKvConfig& config) : config_(config) {
  BATON_CHECK(config_.window >= 1, "nccl window must be at least 1, got %d", config_.window);
}

NcclKvTransport::~NcclKvTransport() {
  std::lock_guard<std::mutex> lock(mu_);
  bool any = false;
  for (auto& [address, p] : peers_) any = any || !p->session.empty() || p->comm;
  if (!any) return;
  (void)cudaSetDevice(config_.device);
  for (auto& [address, p] : peers_) p->teardown();
}

NcclKvTransport::Peer& NcclKvTransport::peer(const std::string& address) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& p = peers_[address];
  if (!p) p = std::make_unique<Peer>();
  return *p;
}

Status NcclKvTransport::send(const std::string& address, const KvTransferHeader& header,
                             const std::function<bool(KvChunk*)>& next, int64_t* bytes_sent) {
  if (bytes_sent) *bytes_sent = 0;
  const auto deadline = SysClock::now() + config_.deadline;
  const std::string what = "KV transfer of request " + header.request_id + " to decode worker " + address + ": ";
  Peer& p = peer(address);
  std::unique_lock<std::timed_mutex> lock(p.busy, std::defer_lock);
  if (!lock.try_lock_until(std::chrono::steady_clock::now() + config_.deadline)) {
    return deadline_exceeded(what + "an earlier transfer to the same decode worker still holds its communicator");
  }
  BATON_RETURN_IF_ERROR(
      kv_cuda_status(cudaSetDevice(config_.device), what + "cudaSetDevice(" + std::to_string(config_.device) + ")"));
  std::shared_ptr<grpc::Channel> channel = channels_.get(address);
  for (int attempt = 0;; ++attempt) {
    if (p.session.empty()) {
      const Status s = bootstrap_peer(p, channel, config_.device, config_.window, deadline);
      if (!s.ok()) {
        p.teardown();
        return {s.code(), what + s.message()};
      }
    }
    KvDeviceCall call(channel, deadline);
    baton::v1::KvDeviceOpen open;
    kv_header_to_proto(header, open.mutable_header());
    open.set_transport("nccl");
    open.set_nccl_session(p.session);
    // Nothing is posted before the receiver accepted the open.
    if (!call.open(open) || !call.wait_opened()) {
      const Status s = call.finish(header.request_id, address);
      if (s.code() == StatusCode::kNotFound && attempt == 0) {
        // The receiver does not hold this session (it restarted or tore it down): start over once.
        spdlog::info("nccl: {}; bootstrapping a new communicator", s.message());
        p.teardown();
        continue;
      }
      if (!refused_at_open(s)) p.teardown();
      return s;
    }
    int64_t bytes = 0;
    Status local;
    KvChunk chunk;
    while (next(&chunk)) {
      if (!call.wait_window(config_.window - 1)) break;
      Peer::Slot& slot = p.slots[static_cast<size_t>(call.n_written() % config_.window)];
      local = post_chunk(p, slot, chunk, deadline);
      if (!local.ok()) break;
      baton::v1::KvDeviceChunk desc;
      desc.set_layer(chunk.layer);
      desc.set_token_start(chunk.token_start);
      desc.set_token_count(chunk.token_count);
      desc.set_k_bytes(static_cast<int64_t>(chunk.k.size()));
      desc.set_v_bytes(static_cast<int64_t>(chunk.v.size()));
      desc.set_checksum(chunk.checksum);
      if (!call.write_chunk(desc)) break;
      bytes += static_cast<int64_t>(chunk.k.size() + chunk.v.size());
    }
    const Status s =
        local.ok() ? call.finish(header.request_id, address) : call.fail(local, header.request_id, address);
    if (!s.ok()) {
      // Either side may hold an operation the other never posts.
      p.teardown();
      return s;
    }
    if (bytes_sent) *bytes_sent = bytes;
    return {};
  }
}

// ---- receiver ----------------------------------------------------------------------------------

struct NcclReceiver::Session {
  std::string name;
  std::mutex mu;
  std::condition_variable cv;
  enum class State { kInitializing, kReady, kFailed };
  State state = State::kInitializing;  // guarded by mu
  Status init_status;                  // guarded by mu
  std::atomic<bool> abandon{false};    // the init thread gives up at its next poll
  // Guarded by NcclReceiver::mu_.
  bool busy = false;
  std::chrono::steady_clock::time_point last_used = std::chrono::steady_clock::now();
  // Written by the init thread before kReady; then used by the one transfer holding the session.
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t received = nullptr;
  char* staging = nullptr;  // stream-ordered allocation (stream)
  int64_t staging_bytes = 0;
  std::thread init_thread;

  void init(int device, ncclUniqueId id, std::chrono::milliseconds timeout) {
    const auto deadline = SysClock::now() + timeout;
    Status s = kv_cuda_status(cudaSetDevice(device), "nccl: cudaSetDevice(" + std::to_string(device) + ")");
    if (s.ok()) s = kv_cuda_status(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "nccl: cudaStreamCreate");
    if (s.ok())
      s = kv_cuda_status(cudaEventCreateWithFlags(&received, cudaEventDisableTiming), "nccl: cudaEventCreate");
    if (s.ok()) {
      ncclConfig_t config = nonblocking_config();
      const ncclResult_t r = ncclCommInitRankConfig(&comm, 2, id, 1, &config);
      if (r != ncclSuccess && r != ncclInProgress) s = nccl_status(r, comm, "ncclCommInitRankConfig (rank 1)");
    }
    if (s.ok()) {
      s = wait_comm(
          comm, deadline, [this] { return abandon.load(); },
          "ncclCommInitRankConfig (rank 1, device " + std::to_string(device) + ")");
    }
    if (!s.ok() && comm) {
      // A half-joined communicator holds sockets and memory until someone aborts it: now.
      (void)ncclCommAbort(comm);
      comm = nullptr;
    }
    std::lock_guard<std::mutex> lock(mu);
    state = s.ok() ? State::kReady : State::kFailed;
    init_status = s;
    cv.notify_all();
  }

  // On the device the session lives on. Joins the init thread; frees after the aborted receive.
  void teardown() {
    abandon = true;
    if (init_thread.joinable()) init_thread.join();
    if (comm) {
      const ncclResult_t r = ncclCommAbort(comm);
      if (r != ncclSuccess && r != ncclInProgress) spdlog::warn("nccl: ncclCommAbort: {}", ncclGetErrorString(r));
      comm = nullptr;
    }
    if (staging) (void)cudaFreeAsync(staging, stream);
    staging = nullptr;
    if (received) (void)cudaEventDestroy(received);
    if (stream) (void)cudaStreamDestroy(stream);
    received = nullptr;
    stream = nullptr;
    (void)cudaGetLastError();
  }
};

namespace {

class NcclInbound final : public KvDeviceInbound {
 public:
  NcclInbound(NcclReceiver& receiver, std::shared_ptr<NcclReceiver::Session> session, SysClock::time_point deadline,
              std::function<bool()> cancelled)
      : receiver_(receiver), session_(std::move(session)), deadline_(deadline), cancelled_(std::move(cancelled)) {}

  Status fetch(const baton::v1::KvDeviceChunk& desc, KvChunk* chunk) override {
    NcclReceiver::Session& s = *session_;
    const std::string where = kv_chunk_name(kv_chunk_desc(desc));
    const int64_t n = desc.k_bytes() + desc.v_bytes();  // checked against the header before this
    if (s.staging_bytes < n) {
      if (s.staging) BATON_RETURN_IF_CUDA_ERROR(cudaFreeAsync(s.staging, s.stream), "nccl: cudaFreeAsync");
      s.staging = nullptr;
      s.staging_bytes = 0;
      void* ptr = nullptr;
      const int64_t size = staging_size(n);
      BATON_RETURN_IF_CUDA_ERROR(cudaMallocAsync(&ptr, static_cast<size_t>(size), s.stream),
                                 "nccl: cudaMallocAsync of " + std::to_string(size) + " bytes of staging");
      s.staging = static_cast<char*>(ptr);
      s.staging_bytes = size;
    }
    const ncclResult_t r = ncclRecv(s.staging, static_cast<size_t>(n), ncclUint8, /*peer=*/0, s.comm, s.stream);
    if (r == ncclInProgress) {
      BATON_RETURN_IF_ERROR(wait_comm(s.comm, deadline_, cancelled_, where + ": ncclRecv"));
    } else {
      BATON_RETURN_IF_ERROR(nccl_status(r, s.comm, where + ": ncclRecv"));
    }
    BATON_RETURN_IF_CUDA_ERROR(cudaEventRecord(s.received, s.stream), "nccl: cudaEventRecord");
    // Never a blocking wait on the receive: a sender that died leaves it pending until teardown.
    BATON_RETURN_IF_ERROR(wait_event(s.received, s.comm, deadline_, cancelled_, where + ": ncclRecv"));
    chunk->k.resize(static_cast<size_t>(desc.k_bytes()));
    chunk->v.resize(static_cast<size_t>(desc.v_bytes()));
    BATON_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(chunk->k.data(), s.staging, chunk->k.size(), cudaMemcpyDeviceToHost, s.stream),
        "nccl: copying K to the host");
    BATON_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(chunk->v.data(), s.staging + desc.k_bytes(), chunk->v.size(), cudaMemcpyDeviceToHost, s.stream),
        "nccl: copying V to the host");
    BATON_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(s.stream), "nccl: copy to the host");
    return {};
  }

  void finish(bool intact) override { receiver_.release(session_, intact); }

 private:
  NcclReceiver& receiver_;
  std::shared_ptr<NcclReceiver::Session> session_;
  const SysClock::time_point deadline_;
  const std::function<bool()> cancelled_;
};

}  // namespace

NcclReceiver::NcclReceiver(const NcclReceiverConfig& config) : config_(config) {}

NcclReceiver::~NcclReceiver() {
  std::unordered_map<std::string, std::shared_ptr<Session>> sessions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    sessions.swap(sessions_);
  }
  if (sessions.empty()) return;
  (void)cudaSetDevice(config_.device);
  for (auto& [name, s] : sessions) s->teardown();
}

Status NcclReceiver::bootstrap(const baton::v1::NcclBootstrapRequest& request) {
  if (request.unique_id().size() != sizeof(ncclUniqueId)) {
    return invalid_argument("the NCCL unique id has " + std::to_string(request.unique_id().size()) + " bytes, not " +
                            std::to_string(sizeof(ncclUniqueId)));
  }
  if (request.session().empty()) return invalid_argument("the NCCL bootstrap names no session");
  ncclUniqueId id;
  std::memcpy(&id, request.unique_id().data(), sizeof(id));
  auto session = std::make_shared<Session>();
  session->name = request.session();
  std::shared_ptr<Session> evicted;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (sessions_.count(request.session())) {
      return invalid_argument("the NCCL session " + request.session() + " exists already");
    }
    if (static_cast<int>(sessions_.size()) >= config_.max_sessions) {
      // Make room: the least recently used session no transfer holds.
      auto lru = sessions_.end();
      for (auto it = sessions_.begin(); it != sessions_.end(); ++it) {
        if (!it->second->busy && (lru == sessions_.end() || it->second->last_used < lru->second->last_used)) lru = it;
      }
      if (lru == sessions_.end()) {
        return resource_exhausted("all " + std::to_string(config_.max_sessions) +
                                  " NCCL sessions of this decode worker are in use");
      }
      evicted = lru->second;
      sessions_.erase(lru);
    }
    sessions_.emplace(session->name, session);
    // Started under the lock, so a teardown (which joins it) can only follow.
    session->init_thread = std::thread([s = session.get(), device = config_.device, id,
                                        timeout = config_.init_timeout] { s->init(device, id, timeout); });
  }
  if (evicted) {
    spdlog::info("nccl: tearing down the least recently used session {} to make room", evicted->name);
    (void)cudaSetDevice(config_.device);
    evicted->teardown();
  }
  return {};
}

Result<std::unique_ptr<KvDeviceInbound>> NcclReceiver::open(const baton::v1::KvDeviceOpen& open,
                                                            SysClock::time_point deadline,
                                                            std::function<bool()> cancelled) {
  std::shared_ptr<Session> session;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(open.nccl_session());
    if (it == sessions_.end()) {
      return not_found("this decode worker holds no NCCL session '" + open.nccl_session() +
                       "' (it restarted or tore the session down): bootstrap again");
    }
    if (it->second->busy) {
      return not_found("the NCCL session '" + open.nccl_session() + "' is held by another transfer");
    }
    session = it->second;
    session->busy = true;
    session->last_used = std::chrono::steady_clock::now();
  }
  Status init_status;
  {
    std::unique_lock<std::mutex> lock(session->mu);
    while (session->state == Session::State::kInitializing) {
      if (SysClock::now() >= deadline || (cancelled && cancelled())) break;
      session->cv.wait_for(lock, std::chrono::milliseconds(10));
    }
    if (session->state == Session::State::kInitializing) {
      init_status =
          deadline_exceeded("the NCCL session '" + session->name + "' was still initialising at the deadline");
    } else if (session->state == Session::State::kFailed) {
      init_status = unavailable("the NCCL session '" + session->name +
                                "' failed to initialise: " + session->init_status.message());
    }
  }
  if (!init_status.ok()) {
    release(session, /*intact=*/false);
    return init_status;
  }
  return std::unique_ptr<KvDeviceInbound>(new NcclInbound(*this, std::move(session), deadline, std::move(cancelled)));
}

void NcclReceiver::release(const std::shared_ptr<Session>& session, bool intact) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (intact) {
      session->busy = false;
      session->last_used = std::chrono::steady_clock::now();
      return;
    }
    auto it = sessions_.find(session->name);
    if (it != sessions_.end() && it->second == session) sessions_.erase(it);
  }
  spdlog::info("nccl: tearing down session {} after a failed transfer", session->name);
  (void)cudaSetDevice(config_.device);
  session->teardown();
}

}  // namespace baton
