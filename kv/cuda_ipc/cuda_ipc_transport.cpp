#include "kv/cuda_ipc/cuda_ipc_transport.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <fstream>

#include "kv/kv_cuda_status.h"
#include "kv/tcp/tcp_transport.h"

namespace baton {
namespace {

// Staging sizes are powers of two from 2 MiB. Why not smaller: cudaMalloc serves small requests
// by sub-allocating from a larger block it reserved earlier, and a CUDA IPC handle names the
// whole block, not the sub-allocation: cudaIpcOpenMemHandle in the receiver returns the block's
// base, while the sender says the chunk sits at offset 0 of its buffer (the receiver would read
// the wrong bytes), and two buffers of one block get the same handle bytes (the receiver's
// mapping cache would take them for one buffer). Allocations of a multiple of 2 MiB get a VA
// range of their own, so the handle's base is the buffer's. Powers of two also let a buffer fit
// later chunks of similar size.
constexpr int64_t kMinStagingBytes = int64_t{2} << 20;

std::string handle_bytes(const cudaIpcMemHandle_t& h) {
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

// A CUDA stream for one transfer's copies, destroyed with it (cudaStreamDestroy does not wait;
// every copy on it is synchronised before the owner returns anyway).
class TransferStream {
 public:
  TransferStream() = default;
  TransferStream(const TransferStream&) = delete;
  TransferStream& operator=(const TransferStream&) = delete;
  ~TransferStream() {
    if (stream_) (void)cudaStreamDestroy(stream_);
  }
  Status create() {
    return kv_cuda_status(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

}  // namespace

std::string kv_node_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

// ---- sender ------------------------------------------------------------------------------------

CudaIpcKvTransport::CudaIpcKvTransport(const CudaIpcKvConfig& config)
    : config_(config), node_id_(kv_node_id()), channels_(config.credentials) {
  BATON_CHECK(config_.window >= 1, "cuda_ipc window must be at least 1, got %d", config_.window);
}

CudaIpcKvTransport::~CudaIpcKvTransport() {
  if (all_.empty()) return;
  (void)cudaSetDevice(config_.device);
  for (const Staging& s : all_) (void)cudaFree(s.ptr);
  (void)cudaGetLastError();
}

Result<CudaIpcKvTransport::Staging> CudaIpcKvTransport::lease(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto best = free_.end();
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->bytes >= bytes && (best == free_.end() || it->bytes < best->bytes)) best = it;
  }
  if (best != free_.end()) {
    const Staging s = *best;
    free_.erase(best);
    return s;
  }
  Staging s;
  s.bytes = kv_staging_bytes(bytes, kMinStagingBytes);
  void* p = nullptr;
  BATON_RETURN_IF_CUDA_ERROR(cudaMalloc(&p, static_cast<size_t>(s.bytes)),
                             "cuda_ipc: cudaMalloc of " + std::to_string(s.bytes) + " bytes of staging");
  s.ptr = static_cast<char*>(p);
  Status exported = kv_cuda_status(cudaIpcGetMemHandle(&s.handle, p), "cuda_ipc: cudaIpcGetMemHandle");
  if (exported.ok()) {
    // The 2 MiB floor (kMinStagingBytes) is what keeps every buffer's handle its own; a handle
    // seen before means the receiver would mix two buffers up.
    for (const Staging& other : all_) {
      if (std::memcmp(&other.handle, &s.handle, sizeof(s.handle)) == 0) {
        exported = internal_error("cuda_ipc: a staging buffer of " + std::to_string(s.bytes) +
                                  " bytes shares its IPC handle with another one");
        break;
      }
    }
  }
  if (!exported.ok()) {
    (void)cudaFree(p);  // never exported: no receiver can be using it
    return exported;
  }
  all_.push_back(s);  // from here on the destructor frees it
  return s;
}

void CudaIpcKvTransport::give_back(const Staging& staging) {
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(staging);
}

Status CudaIpcKvTransport::send(const std::string& address, const KvTransferHeader& header, KvSource& source,
                                int64_t* bytes_sent) {
  if (bytes_sent) *bytes_sent = 0;
  const auto deadline = std::chrono::system_clock::now() + config_.deadline;
  KvDeviceCall call(channels_.get(address), deadline);
  baton::v1::KvDeviceOpen open;
  kv_header_to_proto(header, open.mutable_header());
  open.set_transport("cuda_ipc");
  open.set_node_id(node_id_);
  if (!call.open(open)) return call.finish(header.request_id, address);

  // The slots this transfer leased; they go back to the pool however it ends (see the header).
  std::vector<Staging> slots(static_cast<size_t>(config_.window));
  struct GiveBack {
    CudaIpcKvTransport* self;
    std::vector<Staging>* slots;
    ~GiveBack() {
      for (const Staging& s : *slots) {
        if (s.ptr) self->give_back(s);
      }
    }
  } give_back_slots{this, &slots};

  Status local;  // a failure on this side (CUDA), which cancels the call
  TransferStream stream;
  local =
      kv_cuda_status(cudaSetDevice(config_.device), "cuda_ipc: cudaSetDevice(" + std::to_string(config_.device) + ")");
  if (local.ok()) local = stream.create();
  int64_t bytes = 0;
  KvChunk chunk;
  bool drained = false;
  while (local.ok()) {
    if (!source.next(&chunk)) {
      drained = true;
      break;
    }
    // Slot i % window last held chunk i - window: wait for its ack before overwriting it.
    if (!call.wait_window(config_.window - 1)) break;
    Staging& slot = slots[static_cast<size_t>(call.n_written() % config_.window)];
    const int64_t k_bytes = static_cast<int64_t>(chunk.k.size());
    const int64_t v_bytes = static_cast<int64_t>(chunk.v.size());
    if (slot.ptr && slot.bytes < k_bytes + v_bytes) {
      give_back(slot);
      slot = Staging{};
    }
    if (!slot.ptr) {
      auto leased = lease(k_bytes + v_bytes);
      if (!leased.ok()) {
        local = leased.status();
        break;
      }
      slot = *leased;
    }
    // Pageable source: the copies are complete on the device once the stream is synchronised,
    // before the receiver can learn of them.
    local = kv_cuda_status(
        cudaMemcpyAsync(slot.ptr, chunk.k.data(), static_cast<size_t>(k_bytes), cudaMemcpyHostToDevice, stream.get()),
        "cuda_ipc: staging K");
    if (local.ok()) {
      local = kv_cuda_status(cudaMemcpyAsync(slot.ptr + k_bytes, chunk.v.data(), static_cast<size_t>(v_bytes),
                                             cudaMemcpyHostToDevice, stream.get()),
                             "cuda_ipc: staging V");
    }
    if (local.ok()) local = kv_cuda_status(cudaStreamSynchronize(stream.get()), "cuda_ipc: staging copy");
    if (!local.ok()) break;

    baton::v1::KvDeviceChunk desc;
    desc.set_layer(chunk.layer);
    desc.set_token_start(chunk.token_start);
    desc.set_token_count(chunk.token_count);
    desc.set_k_bytes(k_bytes);
    desc.set_v_bytes(v_bytes);
    desc.set_checksum(chunk.checksum);
    desc.set_ipc_handle(handle_bytes(slot.handle));
    desc.set_offset(0);
    desc.set_buffer_bytes(slot.bytes);
    if (!call.write_chunk(desc)) break;
    bytes += k_bytes + v_bytes;
  }
  if (!local.ok()) return call.fail(local, header.request_id, address);
  if (drained) {
    const std::optional<int32_t> first = source.first_token();
    if (!first) return call.fail(cancelled("abandoned by its sender"), header.request_id, address);
    call.write_end(*first);
  }
  BATON_RETURN_IF_ERROR(call.finish(header.request_id, address));
  if (bytes_sent) *bytes_sent = bytes;
  return {};
}

// ---- receiver ----------------------------------------------------------------------------------

namespace {

// One transfer's payload side: copies each chunk out of the sender's staging buffer to the host.
class CudaIpcInbound final : public KvDeviceInbound {
 public:
  CudaIpcInbound(CudaIpcReceiver& receiver, std::unique_ptr<TransferStream> stream)
      : receiver_(receiver), stream_(std::move(stream)) {}

  Status fetch(const baton::v1::KvDeviceChunk& desc, KvChunk* chunk) override {
    const std::string where = kv_chunk_name(kv_chunk_desc(desc));
    if (desc.ipc_handle().size() != sizeof(cudaIpcMemHandle_t)) {
      return invalid_argument(where + ": the cuda_ipc handle has " + std::to_string(desc.ipc_handle().size()) +
                              " bytes, not " + std::to_string(sizeof(cudaIpcMemHandle_t)));
    }
    // k_bytes and v_bytes are checked (non-negative, bounded) before fetch is called.
    if (desc.offset() < 0 || desc.buffer_bytes() < 0 || desc.offset() > desc.buffer_bytes() ||
        desc.k_bytes() + desc.v_bytes() > desc.buffer_bytes() - desc.offset()) {
      return invalid_argument(where + ": K and V at offset " + std::to_string(desc.offset()) +
                              " do not fit the staging buffer of " + std::to_string(desc.buffer_bytes()) + " bytes");
    }
    BATON_ASSIGN_OR_RETURN(char* base, receiver_.map(desc.ipc_handle()));
    const char* src = base + desc.offset();
    chunk->k.resize(static_cast<size_t>(desc.k_bytes()));
    chunk->v.resize(static_cast<size_t>(desc.v_bytes()));
    Status s =
        kv_cuda_status(cudaMemcpyAsync(chunk->k.data(), src, chunk->k.size(), cudaMemcpyDeviceToHost, stream_->get()),
                       "cuda_ipc: copying K out of the sender's staging");
    if (s.ok()) {
      s = kv_cuda_status(cudaMemcpyAsync(chunk->v.data(), src + desc.k_bytes(), chunk->v.size(), cudaMemcpyDeviceToHost,
                                         stream_->get()),
                         "cuda_ipc: copying V out of the sender's staging");
    }
    // Synchronised before the ack is sent: the sender may overwrite the slot right after it.
    if (s.ok()) s = kv_cuda_status(cudaStreamSynchronize(stream_->get()), "cuda_ipc: copy out of staging");
    receiver_.unmap(desc.ipc_handle());
    return s;
  }

  // Nothing is shared with the sender beyond the acknowledged chunks: a cuda_ipc transfer leaves
  // no device state to tear down either way.
  void finish(bool) override {}

 private:
  CudaIpcReceiver& receiver_;
  std::unique_ptr<TransferStream> stream_;
};

}  // namespace

CudaIpcReceiver::CudaIpcReceiver(const CudaIpcReceiverConfig& config) : config_(config), node_id_(kv_node_id()) {}

CudaIpcReceiver::~CudaIpcReceiver() {
  if (mappings_.empty()) return;
  (void)cudaSetDevice(config_.device);
  for (auto& [handle, m] : mappings_) (void)cudaIpcCloseMemHandle(m.ptr);
  (void)cudaGetLastError();
}

Result<std::unique_ptr<KvDeviceInbound>> CudaIpcReceiver::open(const baton::v1::KvDeviceOpen& open) {
  if (open.node_id().empty() || open.node_id() != node_id_) {
    return failed_precondition(
        "cuda_ipc needs the prefill and decode workers on the same node (the sender's boot id '" + open.node_id() +
        "' is not this node's '" + node_id_ + "'): use --kv-transport=nccl or tcp between nodes");
  }
  auto stream = std::make_unique<TransferStream>();
  BATON_RETURN_IF_ERROR(stream->create());
  return std::unique_ptr<KvDeviceInbound>(new CudaIpcInbound(*this, std::move(stream)));
}

Result<char*> CudaIpcReceiver::map(const std::string& handle) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = mappings_.find(handle);
  if (it == mappings_.end()) {
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    void* p = nullptr;
    // Opening under the lock: a handle is opened once per process, however many transfers use it.
    const cudaError_t err = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      const Status s =
          kv_cuda_status(err, "cuda_ipc: cudaIpcOpenMemHandle on device " + std::to_string(config_.device));
      return failed_precondition(s.message() +
                                 " (the sender's GPU must be this one or a peer of it, visible here, in a process "
                                 "this one may share CUDA IPC with: in containers, a shared PID namespace; else use "
                                 "--kv-transport=nccl or tcp)");
    }
    Mapping m;
    m.ptr = static_cast<char*>(p);
    it = mappings_.emplace(handle, m).first;
  } else if (it->second.users == 0) {
    idle_.erase(it->second.idle);
  }
  ++it->second.users;
  return it->second.ptr;
}

void CudaIpcReceiver::unmap(const std::string& handle) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = mappings_.find(handle);
  BATON_CHECK(it != mappings_.end() && it->second.users > 0, "cuda_ipc: unmap of a mapping not in use");
  if (--it->second.users == 0) {
    idle_.push_front(handle);
    it->second.idle = idle_.begin();
    close_idle_locked(static_cast<size_t>(std::max(config_.n_cached_mappings, 0)));
  }
}

void CudaIpcReceiver::close_idle_locked(size_t keep) {
  while (idle_.size() > keep) {
    auto it = mappings_.find(idle_.back());
    idle_.pop_back();
    const cudaError_t err = cudaIpcCloseMemHandle(it->second.ptr);
    if (err != cudaSuccess) spdlog::warn("cuda_ipc: cudaIpcCloseMemHandle: {}", kv_cuda_status(err, "close").message());
    mappings_.erase(it);
  }
}

}  // namespace baton
