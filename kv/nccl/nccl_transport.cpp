// The sender's end of the nccl KV transport (NcclKvTransport); the receiver's is in
// nccl_receiver.cpp.
#include "kv/nccl/nccl_transport.h"

#include <cuda_runtime.h>
#include <spdlog/spdlog.h>

#include <vector>

#include "common/grpc_status.h"
#include "kv/kv_cuda_status.h"
#include "kv/nccl/nccl_comm.h"
#include "kv/tcp/tcp_transport.h"

namespace baton {
namespace {

using SysClock = std::chrono::system_clock;
using SteadyClock = std::chrono::steady_clock;

// Makes `later` wait for everything `earlier` has been given so far, without blocking the host;
// where that cannot be arranged, waits for `earlier` on the host instead.
void stream_wait_stream(cudaStream_t later, cudaStream_t earlier) {
  cudaEvent_t done = nullptr;
  const bool ordered = cudaEventCreateWithFlags(&done, cudaEventDisableTiming) == cudaSuccess &&
                       cudaEventRecord(done, earlier) == cudaSuccess &&
                       cudaStreamWaitEvent(later, done, 0) == cudaSuccess;
  if (done) (void)cudaEventDestroy(done);  // the wait was captured when it was enqueued
  if (!ordered) (void)cudaStreamSynchronize(earlier);
}

}  // namespace

struct NcclKvTransport::Peer {
  explicit Peer(std::string a) : address(std::move(a)) {}

  const std::string address;
  // Held for a whole transfer, bootstrap included: NCCL matches a communicator's sends to its
  // receives in issue order. The fields from `session` to `refused_until` are guarded by it.
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
  // The decode worker's last UNIMPLEMENTED or FAILED_PRECONDITION answer to the bootstrap, given
  // again instead of asking until `refused_until`.
  Status refusal;
  SteadyClock::time_point refused_until{};
  // Guarded by NcclKvTransport::mu_.
  int n_users = 0;  // sends holding or waiting for `busy`
  SteadyClock::time_point last_used = SteadyClock::now();

  bool holds_device_state() const { return comm || copy_stream || send_stream || !slots.empty(); }

  // Aborts the communicator (which ends its pending sends) and releases everything, without
  // waiting on the host.
  void teardown() {
    if (comm) {
      const ncclResult_t r = nccl().ncclCommAbort(comm);
      if (r != ncclSuccess && r != ncclInProgress) {
        spdlog::warn("nccl: ncclCommAbort: {}", nccl().ncclGetErrorString(r));
      }
      comm = nullptr;
    }
    // The frees go on copy_stream. A slot's `sent` event covers only an ncclSend that was posted
    // and recorded; one that failed, or was still in progress when the transfer gave up, left
    // its kernel on send_stream with nothing recorded: order the frees after all of send_stream.
    if (copy_stream && send_stream) stream_wait_stream(copy_stream, send_stream);
    for (Slot& s : slots) {
      if (s.ptr && copy_stream) (void)cudaFreeAsync(s.ptr, copy_stream);
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

// One DecodeKvDevice.BootstrapNccl call; the session the decode worker names in its answer.
Result<std::string> call_bootstrap(baton::v1::DecodeKvDevice::Stub& stub,
                                   const baton::v1::NcclBootstrapRequest& request, SysClock::time_point deadline) {
  grpc::ClientContext context;
  context.set_deadline(deadline);
  baton::v1::NcclBootstrapResponse response;
  const grpc::Status status = stub.BootstrapNccl(&context, request, &response);
  if (!status.ok()) {
    const Status s = from_grpc(status);
    if (status.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
      return Status(s.code(),
                    "NCCL bootstrap: it does not serve device KV transfers (built without CUDA); " + s.message());
    }
    return Status(s.code(), "NCCL bootstrap: " + s.message());
  }
  if (response.session().empty()) return internal_error("NCCL bootstrap: the decode worker named no session");
  return response.session();
}

// Joins a new communicator with the decode worker behind `channel` as rank 0. On failure the
// peer may hold partial state: the caller tears it down.
Status bootstrap_peer(NcclKvTransport::Peer& p, const std::shared_ptr<grpc::Channel>& channel, int device, int window,
                      SysClock::time_point deadline) {
  auto stub = baton::v1::DecodeKvDevice::NewStub(channel);
  // The reservation first: ncclGetUniqueId starts a root thread that waits for both ranks and
  // cannot be cancelled, so it is only started once the decode worker has agreed to join.
  BATON_ASSIGN_OR_RETURN(const std::string session, call_bootstrap(*stub, baton::v1::NcclBootstrapRequest(), deadline));
  // What can fail on this side, before the root thread exists too.
  BATON_RETURN_IF_CUDA_ERROR(cudaSetDevice(device), "nccl: cudaSetDevice(" + std::to_string(device) + ")");
  BATON_RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&p.copy_stream, cudaStreamNonBlocking),
                             "nccl: cudaStreamCreate");
  BATON_RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&p.send_stream, cudaStreamNonBlocking),
                             "nccl: cudaStreamCreate");
  p.slots.resize(static_cast<size_t>(window));
  for (NcclKvTransport::Peer::Slot& s : p.slots) {
    BATON_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&s.copied, cudaEventDisableTiming), "nccl: cudaEventCreate");
    BATON_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&s.sent, cudaEventDisableTiming), "nccl: cudaEventCreate");
  }
  ncclUniqueId id;
  BATON_RETURN_IF_ERROR(nccl_status(nccl().ncclGetUniqueId(&id), nullptr, "ncclGetUniqueId"));
  baton::v1::NcclBootstrapRequest request;
  request.set_unique_id(std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
  request.set_session(session);
  BATON_RETURN_IF_ERROR(call_bootstrap(*stub, request, deadline).status());
  ncclConfig_t config = nccl_nonblocking_config();
  const ncclResult_t r = nccl().ncclCommInitRankConfig(&p.comm, 2, id, 0, &config);
  if (r != ncclSuccess && r != ncclInProgress) return nccl_status(r, p.comm, "ncclCommInitRankConfig (rank 0)");
  BATON_RETURN_IF_ERROR(nccl_wait_comm(p.comm, deadline, nullptr,
                                       "ncclCommInitRankConfig (rank 0, device " + std::to_string(device) + ")"));
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
  BATON_RETURN_IF_ERROR(nccl_staging_fit(&s.ptr, &s.bytes, n, p.copy_stream));
  BATON_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(s.ptr, c.k.data(), c.k.size(), cudaMemcpyHostToDevice, p.copy_stream),
                             "nccl: staging K");
  BATON_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(s.ptr + k_bytes, c.v.data(), c.v.size(), cudaMemcpyHostToDevice, p.copy_stream),
      "nccl: staging V");
  BATON_RETURN_IF_CUDA_ERROR(cudaEventRecord(s.copied, p.copy_stream), "nccl: cudaEventRecord");
  BATON_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(p.send_stream, s.copied, 0), "nccl: cudaStreamWaitEvent");
  const ncclResult_t r = nccl().ncclSend(s.ptr, static_cast<size_t>(n), ncclUint8, /*peer=*/1, p.comm, p.send_stream);
  if (r == ncclInProgress) {
    BATON_RETURN_IF_ERROR(nccl_wait_comm(p.comm, deadline, nullptr, "ncclSend"));
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

// Bootstrap refusals no retry mends (a decode worker built without CUDA, without a usable GPU or
// without NCCL): remembered for refusal_ttl.
bool refusal_lasts(const Status& s) {
  return s.code() == StatusCode::kUnimplemented || s.code() == StatusCode::kFailedPrecondition;
}

}  // namespace

NcclKvTransport::NcclKvTransport(const NcclKvConfig& config) : config_(config), channels_(config.credentials) {
  BATON_CHECK(config_.window >= 1, "nccl window must be at least 1, got %d", config_.window);
  BATON_CHECK(config_.max_peers >= 1, "nccl max_peers must be at least 1, got %d", config_.max_peers);
}

NcclKvTransport::~NcclKvTransport() {
  std::vector<std::shared_ptr<Peer>> peers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [address, p] : peers_) peers.push_back(std::move(p));
    peers_.clear();
  }
  drop(std::move(peers), nullptr);
}

int NcclKvTransport::n_peers() {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(peers_.size());
}

void NcclKvTransport::drop(std::vector<std::shared_ptr<Peer>> peers, const char* why) {
  bool device_set = false;
  for (const std::shared_ptr<Peer>& p : peers) {
    // Out of peers_ and used by no send (n_users == 0): nobody else can reach its lock.
    std::lock_guard<std::timed_mutex> lock(p->busy);
    if (why) spdlog::info("nccl: dropping decode worker {} ({})", p->address, why);
    if (p->holds_device_state()) {
      if (!device_set) (void)cudaSetDevice(config_.device);
      device_set = true;
      p->teardown();
    }
    channels_.forget(p->address);
  }
}

std::shared_ptr<NcclKvTransport::Peer> NcclKvTransport::acquire(const std::string& address) {
  std::shared_ptr<Peer> peer;
  std::vector<std::shared_ptr<Peer>> idle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = SteadyClock::now();
    std::shared_ptr<Peer>& slot = peers_[address];
    if (!slot) slot = std::make_shared<Peer>(address);
    peer = slot;
    ++peer->n_users;
    peer->last_used = now;
    // Idle past the TTL, then the least recently used beyond the cap; never a peer a send holds
    // or awaits, so no transfer ever loses its communicator here.
    for (auto it = peers_.begin(); it != peers_.end();) {
      if (it->second->n_users == 0 && now - it->second->last_used >= config_.peer_idle_ttl) {
        idle.push_back(std::move(it->second));
        it = peers_.erase(it);
      } else {
        ++it;
      }
    }
    while (static_cast<int>(peers_.size()) > config_.max_peers) {
      auto lru = peers_.end();
      for (auto it = peers_.begin(); it != peers_.end(); ++it) {
        if (it->second->n_users == 0 && (lru == peers_.end() || it->second->last_used < lru->second->last_used)) {
          lru = it;
        }
      }
      if (lru == peers_.end()) break;  // all in use: over the cap until some are not
      idle.push_back(std::move(lru->second));
      peers_.erase(lru);
    }
  }
  // On this send's thread, before its transfer: aborting a communicator takes milliseconds.
  if (!idle.empty()) drop(std::move(idle), "not sent to lately, or beyond max_peers");
  return peer;
}

void NcclKvTransport::release(const std::shared_ptr<Peer>& peer, bool forget) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    --peer->n_users;
    peer->last_used = SteadyClock::now();
    if (!forget || peer->n_users > 0) return;
    auto it = peers_.find(peer->address);
    if (it == peers_.end() || it->second != peer) return;
    peers_.erase(it);
  }
  drop({peer}, "unavailable");
}

Status NcclKvTransport::send(const std::string& address, const KvTransferHeader& header, KvSource& source,
                             int64_t* bytes_sent) {
  if (bytes_sent) *bytes_sent = 0;
  const auto deadline = SysClock::now() + config_.deadline;
  const std::string what = "KV transfer of request " + header.request_id + " to decode worker " + address + ": ";
  if (Status s = nccl_available(); !s.ok()) return {s.code(), what + s.message()};
  const std::shared_ptr<Peer> peer = acquire(address);
  bool forget = false;
  Status s;
  {
    std::unique_lock<std::timed_mutex> lock(peer->busy, std::defer_lock);
    if (lock.try_lock_until(SteadyClock::now() + config_.deadline)) {
      s = transfer(*peer, address, header, source, bytes_sent, deadline, &forget);
    } else {
      s = deadline_exceeded(what + "an earlier transfer to the same decode worker still holds its communicator");
    }
  }
  release(peer, forget);
  return s;
}

Status NcclKvTransport::transfer(Peer& p, const std::string& address, const KvTransferHeader& header,
                                 KvSource& source, int64_t* bytes_sent,
                                 SysClock::time_point deadline, bool* forget) {
  const std::string what = "KV transfer of request " + header.request_id + " to decode worker " + address + ": ";
  if (SteadyClock::now() < p.refused_until) {
    return {p.refusal.code(),
            what + p.refusal.message() + " (its answer within the last " +
                std::to_string(std::chrono::duration_cast<std::chrono::seconds>(config_.refusal_ttl).count()) +
                " s, not asked again before then)"};
  }
  std::shared_ptr<grpc::Channel> channel = channels_.get(address);
  for (int attempt = 0;; ++attempt) {
    if (p.session.empty()) {
      const Status s = bootstrap_peer(p, channel, config_.device, config_.window, deadline);
      if (!s.ok()) {
        if (refusal_lasts(s)) {
          p.refusal = s;
          p.refused_until = SteadyClock::now() + config_.refusal_ttl;
        }
        *forget = s.code() == StatusCode::kUnavailable;
        p.teardown();
        return {s.code(), what + s.message()};
      }
    } else {
      BATON_RETURN_IF_ERROR(kv_cuda_status(cudaSetDevice(config_.device),
                                           what + "cudaSetDevice(" + std::to_string(config_.device) + ")"));
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
      *forget = s.code() == StatusCode::kUnavailable;  // the decode worker is gone, perhaps for good
      return s;
    }
    int64_t bytes = 0;
    Status local;
    KvChunk chunk;
    bool drained = false;
    for (;;) {
      if (!source.next(&chunk)) {
        drained = true;
        break;
      }
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
    std::optional<int32_t> first;
    if (local.ok() && drained) {
      first = source.first_token();
      if (!first) local = cancelled("abandoned by its sender");
    }
    if (first) call.write_end(*first);
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

}  // namespace baton
