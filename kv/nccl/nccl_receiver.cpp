// The receiver's end of the nccl KV transport (NcclReceiver, kv/nccl/nccl_transport.h); the
// sender's is in nccl_transport.cpp.
#include <cuda_runtime.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>

#include "kv/kv_cuda_status.h"
#include "kv/nccl/nccl_comm.h"
#include "kv/nccl/nccl_transport.h"
#include "kv/tcp/tcp_transport.h"

namespace baton {
namespace {

using SysClock = std::chrono::system_clock;
using SteadyClock = std::chrono::steady_clock;

std::string random_session_name() {
  std::random_device rd;
  char buf[33];
  std::snprintf(buf, sizeof(buf), "%08x%08x%08x%08x", rd(), rd(), rd(), rd());
  return buf;
}

}  // namespace

struct NcclReceiver::Session {
  std::string name;
  std::mutex mu;
  std::condition_variable cv;
  enum class State { kInitializing, kReady, kFailed };
  State state = State::kInitializing;  // guarded by mu; from the bootstrap on
  Status init_status;                  // guarded by mu
  std::atomic<bool> abandon{false};    // the init thread gives up at its next poll
  // Guarded by NcclReceiver::mu_.
  bool reserved = true;            // reserved, not bootstrapped: no init thread, nothing to tear down
  SysClock::time_point expires{};  // while reserved: forgotten from then on
  bool busy = false;
  SteadyClock::time_point last_used = SteadyClock::now();
  // Written by the init thread before kReady; then used by the one transfer holding the session.
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t received = nullptr;
  char* staging = nullptr;  // stream-ordered allocation (stream)
  int64_t staging_bytes = 0;
  std::thread init_thread;

  // May be torn down to make room (under NcclReceiver::mu_): no transfer holds it, and it is
  // neither reserved nor initialising, which its sender is about to use.
  bool can_evict() {
    if (busy || reserved) return false;
    std::lock_guard<std::mutex> lock(mu);
    return state != State::kInitializing;
  }

  void init(int device, ncclUniqueId id, std::chrono::milliseconds timeout) {
    const auto deadline = SysClock::now() + timeout;
    Status s = kv_cuda_status(cudaSetDevice(device), "nccl: cudaSetDevice(" + std::to_string(device) + ")");
    if (s.ok()) s = kv_cuda_status(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "nccl: cudaStreamCreate");
    if (s.ok())
      s = kv_cuda_status(cudaEventCreateWithFlags(&received, cudaEventDisableTiming), "nccl: cudaEventCreate");
    if (s.ok()) {
      ncclConfig_t config = nccl_nonblocking_config();
      const ncclResult_t r = nccl().ncclCommInitRankConfig(&comm, 2, id, 1, &config);
      if (r != ncclSuccess && r != ncclInProgress) s = nccl_status(r, comm, "ncclCommInitRankConfig (rank 1)");
    }
    if (s.ok()) {
      s = nccl_wait_comm(
          comm, deadline, [this] { return abandon.load(); },
          "ncclCommInitRankConfig (rank 1, device " + std::to_string(device) + ")");
    }
    if (!s.ok() && comm) {
      // A half-joined communicator holds sockets and memory until someone aborts it: now.
      (void)nccl().ncclCommAbort(comm);
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
      const ncclResult_t r = nccl().ncclCommAbort(comm);
      if (r != ncclSuccess && r != ncclInProgress) {
        spdlog::warn("nccl: ncclCommAbort: {}", nccl().ncclGetErrorString(r));
      }
      comm = nullptr;
    }
    // Every ncclRecv into `staging` ran on `stream` itself (one stream per session, nothing
    // else touches the buffer), so this free is stream-ordered after them, pending or aborted.
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
    // On s.stream, after the receives into it.
    BATON_RETURN_IF_ERROR(nccl_staging_fit(&s.staging, &s.staging_bytes, n, s.stream));
    const ncclResult_t r = nccl().ncclRecv(s.staging, static_cast<size_t>(n), ncclUint8, /*peer=*/0, s.comm, s.stream);
    if (r == ncclInProgress) {
      BATON_RETURN_IF_ERROR(nccl_wait_comm(s.comm, deadline_, cancelled_, where + ": ncclRecv"));
    } else {
      BATON_RETURN_IF_ERROR(nccl_status(r, s.comm, where + ": ncclRecv"));
    }
    BATON_RETURN_IF_CUDA_ERROR(cudaEventRecord(s.received, s.stream), "nccl: cudaEventRecord");
    // Never a blocking wait on the receive: a sender that died leaves it pending until teardown.
    BATON_RETURN_IF_ERROR(nccl_wait_event(s.received, s.comm, deadline_, cancelled_, where + ": ncclRecv"));
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

Status NcclReceiver::make_room_locked(std::shared_ptr<Session>* evicted) {
  const auto now = SysClock::now();
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    if (it->second->reserved && it->second->expires <= now) {
      it = sessions_.erase(it);  // a reservation holds nothing to tear down
    } else {
      ++it;
    }
  }
  if (static_cast<int>(sessions_.size()) < config_.max_sessions) return {};
  auto lru = sessions_.end();
  for (auto it = sessions_.begin(); it != sessions_.end(); ++it) {
    if (it->second->can_evict() && (lru == sessions_.end() || it->second->last_used < lru->second->last_used)) lru = it;
  }
  if (lru == sessions_.end()) {
    return resource_exhausted("all " + std::to_string(config_.max_sessions) +
                              " NCCL sessions of this decode worker are in use or reserved");
  }
  *evicted = lru->second;
  sessions_.erase(lru);
  return {};
}

Result<std::string> NcclReceiver::bootstrap(const baton::v1::NcclBootstrapRequest& request,
                                            SysClock::time_point call_deadline) {
  BATON_RETURN_IF_ERROR(nccl_available());
  const bool reservation = request.unique_id().empty();
  if (reservation && !request.session().empty()) {
    return invalid_argument("an NCCL reservation (no unique id) names no session: the decode worker picks it");
  }
  if (!reservation && request.unique_id().size() != sizeof(ncclUniqueId)) {
    return invalid_argument("the NCCL unique id has " + std::to_string(request.unique_id().size()) + " bytes, not " +
                            std::to_string(sizeof(ncclUniqueId)));
  }
  if (!reservation && request.session().empty()) return invalid_argument("the NCCL bootstrap names no session");
  std::string name;
  std::shared_ptr<Session> evicted;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (reservation) {
      BATON_RETURN_IF_ERROR(make_room_locked(&evicted));
      auto session = std::make_shared<Session>();
      do {
        session->name = random_session_name();
      } while (sessions_.count(session->name));
      session->expires = std::min(call_deadline, SysClock::now() + config_.init_timeout);
      sessions_.emplace(session->name, session);
      name = session->name;
    } else {
      auto it = sessions_.find(request.session());
      if (it == sessions_.end() || (it->second->reserved && it->second->expires <= SysClock::now())) {
        return not_found("this decode worker holds no NCCL reservation '" + request.session() +
                         "' (it expired, or the worker restarted): reserve again");
      }
      Session& s = *it->second;
      if (!s.reserved) return invalid_argument("the NCCL session " + request.session() + " was bootstrapped already");
      s.reserved = false;
      s.last_used = SteadyClock::now();
      ncclUniqueId id;
      std::memcpy(&id, request.unique_id().data(), sizeof(id));
      // Started under the lock, so a teardown (which joins it) can only follow.
      s.init_thread = std::thread([session = &s, device = config_.device, id, timeout = config_.init_timeout] {
        session->init(device, id, timeout);
      });
      name = s.name;
    }
  }
  if (evicted) {
    spdlog::info("nccl: tearing down the least recently used session {} to make room", evicted->name);
    (void)cudaSetDevice(config_.device);
    evicted->teardown();
  }
  return name;
}

Result<std::unique_ptr<KvDeviceInbound>> NcclReceiver::open(const baton::v1::KvDeviceOpen& open,
                                                            SysClock::time_point deadline,
                                                            std::function<bool()> cancelled) {
  std::shared_ptr<Session> session;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(open.nccl_session());
    if (it == sessions_.end() || it->second->reserved) {
      return not_found("this decode worker holds no NCCL session '" + open.nccl_session() +
                       "' (it restarted or tore the session down, or it was never bootstrapped): bootstrap again");
    }
    if (it->second->busy) {
      return not_found("the NCCL session '" + open.nccl_session() + "' is held by another transfer");
    }
    session = it->second;
    session->busy = true;
    session->last_used = SteadyClock::now();
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
      session->last_used = SteadyClock::now();
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
