// The `cuda_ipc` KV transport: prefill and decode workers on the same node (same GPU or peer
// GPUs). The control plane is DecodeKvDevice.TransferKvDevice (kv/kv_device_call.h); the K and V
// bytes of each chunk are staged by the sender in device memory it owns and copied out by the
// receiver through a CUDA IPC mapping of that memory. Both ends live here: the sender
// (CudaIpcKvTransport) and the payload side of the receiver (CudaIpcReceiver, which
// KvDeviceService drives).
//
// Lifetimes:
// - Sender staging buffers: cudaMalloc'd on config.device, exported once (cudaIpcGetMemHandle),
//   kept in the transport's pool and reused by later transfers; a transfer leases `window` of them
//   and reuses slot i % window only after the receiver acknowledged chunk i - window. The pool
//   grows to the peak in-flight staging (n concurrent sends × window × chunk size, power-of-two
//   sizes from 2 MiB, so each buffer is an allocation of its own with a handle of its own: see
//   kMinStagingBytes in the .cpp) and is freed only by the destructor: a receiver still copying out
//   of a buffer after its transfer failed on the sender's side (deadline) then reads a later
//   transfer's bytes (its checksum fails, and its broken call aborts that transfer anyway), never
//   freed memory.
// - Receiver mappings: cudaIpcOpenMemHandle on config.device (peer access enabled lazily), once per
//   staging buffer, cached by handle (CUDA gives every allocation of its own a distinct handle,
//   even at a reused address) and shared by concurrent transfers; at most n_cached_mappings unused
//   mappings stay open, the least recently used are closed (cudaIpcCloseMemHandle) beyond that, and
//   the destructor closes the rest. A mapping in use is never closed.
// - A CUDA IPC handle cannot be opened in the process that made it: prefill and decode must be
//   separate processes (not `baton local`), on the same node (the open carries the kernel's boot
//   id; another node is refused at once with FAILED_PRECONDITION). In containers both must also
//   see the sender's GPU and share a PID namespace (deploy/README.md): pods with one GPU each
//   cannot use cuda_ipc.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "kv/kv_device_call.h"
#include "kv/kv_transfer.h"

namespace baton {

struct CudaIpcKvConfig {
  int device = 0;  // CUDA device the staging buffers live on (the backend's --device=cuda:N)
  std::chrono::milliseconds deadline = std::chrono::seconds(60);  // one whole transfer
  int window = 4;  // chunks staged and not yet acknowledged per transfer (staging slots leased)
  std::shared_ptr<grpc::ChannelCredentials> credentials;  // the internal plane's; null = plaintext
};

// Thread-safe: concurrent sends share the staging pool and the channels.
class CudaIpcKvTransport final : public KvTransport {
 public:
  explicit CudaIpcKvTransport(const CudaIpcKvConfig& config);
  // Frees the staging pool; no send() may be running.
  ~CudaIpcKvTransport() override;

  std::string name() const override { return "cuda_ipc"; }
  // Errors: the decode worker's refusal (FAILED_PRECONDITION, INVALID_ARGUMENT, DATA_LOSS, ...),
  // UNAVAILABLE when it cannot be reached or a CUDA call fails, RESOURCE_EXHAUSTED when staging
  // memory cannot be allocated, DEADLINE_EXCEEDED past the deadline; the message names
  // `address`. `*bytes_sent` counts the K and V bytes the receiver acknowledged.
  Status send(const std::string& address, const KvTransferHeader& header, KvSource& source,
              int64_t* bytes_sent) override;

 private:
  struct Staging {
    char* ptr = nullptr;
    int64_t bytes = 0;
    cudaIpcMemHandle_t handle{};
  };
  Result<Staging> lease(int64_t bytes);
  void give_back(const Staging& staging);

  const CudaIpcKvConfig config_;
  const std::string node_id_;
  KvChannelCache channels_;
  std::mutex mu_;
  std::vector<Staging> free_;  // staging buffers no transfer holds (guarded by mu_)
  std::vector<Staging> all_;   // every staging allocation, freed by the destructor (guarded by mu_)
};

struct CudaIpcReceiverConfig {
  int device = 0;               // CUDA device the receiver maps senders' buffers on
  int n_cached_mappings = 128;  // unused IPC mappings kept open for later transfers
};

// The payload side of cuda_ipc at the receiver. Thread-safe: one inbound per transfer, many at
// once.
class CudaIpcReceiver {
 public:
  explicit CudaIpcReceiver(const CudaIpcReceiverConfig& config);
  // Closes every mapping; no transfer may be running.
  ~CudaIpcReceiver();

  // For a transfer whose open names cuda_ipc: FAILED_PRECONDITION when the sender is on another
  // node. Called on the transfer's thread, with config.device current.
  Result<std::unique_ptr<KvDeviceInbound>> open(const baton::v1::KvDeviceOpen& open);

  // The mapped base of the staging buffer `handle` names (opened now or cached), counted as in
  // use until unmap(handle).
  Result<char*> map(const std::string& handle);
  void unmap(const std::string& handle);

 private:
  struct Mapping {
    char* ptr = nullptr;
    int users = 0;
    std::list<std::string>::iterator idle;  // position in idle_ while users == 0
  };
  void close_idle_locked(size_t keep);

  const CudaIpcReceiverConfig config_;
  const std::string node_id_;
  std::mutex mu_;
  std::unordered_map<std::string, Mapping> mappings_;  // by handle bytes (guarded by mu_)
  std::list<std::string> idle_;                        // unused mappings, most recently used first (guarded)
};

// This node's identity for cuda_ipc: the kernel's boot id (shared by every container on the node).
std::string kv_node_id();

}  // namespace baton
