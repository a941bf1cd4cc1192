// The `nccl` KV transport: prefill and decode workers on any GPUs NCCL connects (NVLink, PCIe,
// InfiniBand/RoCE, sockets). The control plane is DecodeKvDevice.TransferKvDevice
// (kv/kv_device_call.h); the K and V bytes of each chunk move by ncclSend/ncclRecv over a 2-rank
// communicator per (prefill worker, decode worker) pair. Both ends live here: the sender
// (NcclKvTransport) and the payload side of the receiver (NcclReceiver, which KvDeviceService
// drives).
//
// Bootstrap (lazily, on the first send to a decode worker, and again after any teardown), in two
// calls of DecodeKvDevice.BootstrapNccl:
//   1. reservation (no unique id): the receiver checks that it can take part (a usable GPU,
//      NCCL loadable) and holds a session slot for this sender until the call's deadline, and
//      answers with the session's name. Every refusal (UNIMPLEMENTED: built without CUDA;
//      FAILED_PRECONDITION: no usable GPU or no NCCL; RESOURCE_EXHAUSTED: every session busy;
//      UNAVAILABLE: unreachable or shutting down) comes here, before anything exists to leak.
//   2. only then ncclGetUniqueId, and the bootstrap proper (the id and the reserved session): the
//      receiver starts ncclCommInitRankConfig as rank 1 on a thread of its own and answers at
//      once; the sender then joins as rank 0. Both inits are non-blocking communicators polled
//      against a deadline, so a peer that never joins costs a timeout, not a hung thread.
// A decode worker that refused with UNIMPLEMENTED or FAILED_PRECONDITION (a misconfigured pair,
// which no retry mends) is not asked again for `refusal_ttl`: sends to it fail at once with the
// same status.
//
// A transfer: the sender holds its peer's lock for the whole transfer (a communicator matches
// sends to receives in issue order, so transfers to one decode worker go one at a time), opens
// the call naming its session and waits for the open's ack before posting anything. Per chunk it
// copies K|V into staging slot i % window (copy stream, after that slot's previous ncclSend),
// posts one ncclSend of k_bytes + v_bytes (send stream, after the copy), then writes the
// descriptor. The receiver checks the descriptor (KvIncoming::check_chunk) BEFORE it posts the matching
// ncclRecv (never a receive the sender will not match), waits for it against the call's
// deadline and cancellation, copies the bytes to the host, checks the checksum, hands the chunk
// to the KvReceiver and acks. The sender reuses a slot after the ack of its previous chunk.
//
// Teardown (ncclCommAbort, both sides) after any failure once the open was acknowledged (either
// side may then have posted an operation the other never will) and after any failure of the
// communicator itself; the next send bootstraps a new session. A refusal of the open itself
// (model mismatch, not admitted, bad header) leaves the communicator in place: nothing was
// posted. The receiver answers NOT_FOUND for a session it does not hold (it restarted, or it tore
// the session down); the sender then bootstraps again and retries that transfer once.
//
// Lifetimes:
// - Sender: per decode worker address, a communicator, two streams (copy, send) and `window`
//   staging slots (cudaMallocAsync, grown stream-ordered, power-of-two sizes) with two events
//   each; all released by teardown (the frees stream-ordered after everything the send stream
//   was given, aborted sends included) or the destructor. A decode worker not sent to for
//   `peer_idle_ttl`, the least recently used beyond `max_peers`, and one that answered
//   UNAVAILABLE are dropped with everything they hold, at the start of a later send and never
//   while a send holds or awaits them.
// - Receiver: per session, a communicator, one stream, one event, one staging buffer (grown
//   stream-ordered) and its init thread (joined at teardown). At most max_sessions sessions,
//   reservations included; to make room for a reservation the least recently used session that
//   no transfer holds and that is not initialising is torn down. A reservation not followed by
//   its bootstrap expires at the reservation call's deadline (init_timeout at most). A session is
//   used by one transfer at a time.
// - NCCL's root thread: ncclGetUniqueId starts a thread in the sender that waits for both ranks
//   (NCCL offers no way to cancel it). It is started only once the receiver reserved a session,
//   so what can still leave it waiting is a receiver that dies or restarts between the
//   reservation and the bootstrap, or a bootstrap call lost on the network.
// - libnccl is loaded at run time (kv/nccl/nccl_api.h); where it cannot be, both ends refuse
//   with FAILED_PRECONDITION.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "kv/kv_device_call.h"
#include "kv/kv_transfer.h"

namespace baton {

struct NcclKvConfig {
  int device = 0;  // the sender's CUDA device (the backend's --device=cuda:N)
  std::chrono::milliseconds deadline = std::chrono::seconds(60);  // one whole transfer, bootstrap included
  int window = 4;  // chunks sent and not yet acknowledged (staging slots per decode worker)
  // A decode worker not sent to for this long is dropped (communicator, streams, staging): it
  // probably left; a later send bootstraps again.
  std::chrono::milliseconds peer_idle_ttl = std::chrono::minutes(10);
  int max_peers = 32;  // decode workers held at once; the least recently used idle ones go beyond that
  // How long a decode worker's UNIMPLEMENTED or FAILED_PRECONDITION answer to the bootstrap is
  // reused instead of asking again.
  std::chrono::milliseconds refusal_ttl = std::chrono::seconds(30);
  std::shared_ptr<grpc::ChannelCredentials> credentials;  // the internal plane's; null = plaintext
};

// Thread-safe: sends to different decode workers run in parallel, to one worker in turn.
class NcclKvTransport final : public KvTransport {
 public:
  explicit NcclKvTransport(const NcclKvConfig& config);
  // Tears down every communicator; no send() may be running.
  ~NcclKvTransport() override;

  std::string name() const override { return "nccl"; }
  // Errors: the decode worker's refusal (FAILED_PRECONDITION, INVALID_ARGUMENT, DATA_LOSS, ...),
  // UNAVAILABLE when it cannot be reached or NCCL/CUDA fails, DEADLINE_EXCEEDED past the
  // deadline (waiting for an earlier transfer to the same worker included), FAILED_PRECONDITION
  // when libnccl cannot be loaded here; the message names `address`. `*bytes_sent` counts the K
  // and V bytes the receiver acknowledged.
  Status send(const std::string& address, const KvTransferHeader& header, KvSource& source,
              int64_t* bytes_sent) override;

  // Decode workers held now (for tests).
  int n_peers();

  struct Peer;  // one decode worker's communicator (nccl_transport.cpp)

 private:
  // The peer for `address`, counted as in use until release(); drops idle peers on the way.
  std::shared_ptr<Peer> acquire(const std::string& address);
  // `forget`: drop the peer now if no other send uses it (its decode worker did not answer).
  void release(const std::shared_ptr<Peer>& peer, bool forget);
  // One transfer on a peer whose lock the caller holds; `*forget` as release() takes it.
  Status transfer(Peer& p, const std::string& address, const KvTransferHeader& header,
                  KvSource& source, int64_t* bytes_sent,
                  std::chrono::system_clock::time_point deadline, bool* forget);
  // Tears down `peers` (out of peers_, used by no send) and forgets their channels; logs `why`
  // unless it is null.
  void drop(std::vector<std::shared_ptr<Peer>> peers, const char* why);

  const NcclKvConfig config_;
  KvChannelCache channels_;
  std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<Peer>> peers_;  // by address (guarded by mu_)
};

struct NcclReceiverConfig {
  int device = 0;         // CUDA device this decode worker receives on
  int max_sessions = 16;  // communicators held at once (about one per sending prefill worker)
  std::chrono::milliseconds init_timeout = std::chrono::seconds(60);  // rank 1 gives up when rank 0 does not join
};

// The payload side of nccl at the receiver. Thread-safe.
class NcclReceiver {
 public:
  explicit NcclReceiver(const NcclReceiverConfig& config);
  // Tears down every session (joins their init threads); no transfer may be running.
  ~NcclReceiver();

  // BootstrapNccl (the caller checked the device). Without a unique id, a reservation: holds a
  // session slot until `call_deadline` (init_timeout at most) and returns its name;
  // RESOURCE_EXHAUSTED when max_sessions are all busy. With one, for a reserved session: starts
  // joining the sender's communicator as rank 1 and returns at once (the session's name again);
  // NOT_FOUND when the session is not reserved (expired, or this worker restarted),
  // INVALID_ARGUMENT for a malformed request. FAILED_PRECONDITION when libnccl cannot be loaded.
  Result<std::string> bootstrap(const baton::v1::NcclBootstrapRequest& request,
                                std::chrono::system_clock::time_point call_deadline);
  // For a transfer whose open names an nccl session: waits (until `deadline`, or until
  // `cancelled` says so) for the session's init, and holds the session for this transfer.
  // NOT_FOUND when the session is unknown, only reserved, or held by another transfer;
  // UNAVAILABLE when its init failed.
  Result<std::unique_ptr<KvDeviceInbound>> open(const baton::v1::KvDeviceOpen& open,
                                                std::chrono::system_clock::time_point deadline,
                                                std::function<bool()> cancelled);

  struct Session;  // one communicator with one sender (nccl_receiver.cpp)
  // An inbound's end: keeps the session for the next transfer, or tears it down.
  void release(const std::shared_ptr<Session>& session, bool intact);

 private:
  // Drops reservations past their deadline; frees a slot for one more session if need be by
  // handing the least recently used evictable session to `*evicted` (the caller tears it down
  // outside mu_). RESOURCE_EXHAUSTED when every slot is held.
  Status make_room_locked(std::shared_ptr<Session>* evicted);

  const NcclReceiverConfig config_;
  std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<Session>> sessions_;  // by name (guarded by mu_)
};

}  // namespace baton
