#include "kv/nccl/nccl_comm.h"

#include <cuda_runtime.h>

#include <thread>

#include "kv/kv_cuda_status.h"
#include "kv/kv_device_call.h"

namespace baton {
namespace {

using SysClock = std::chrono::system_clock;

// nccl staging is stream-ordered pool memory that never leaves its process: any power of two
// from 1 MiB (unlike cuda_ipc's exported buffers, kv/cuda_ipc/cuda_ipc_transport.cpp).
constexpr int64_t kMinStagingBytes = int64_t{1} << 20;

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

}  // namespace

Status nccl_available() {
  std::string error;
  if (nccl_load(&error) != nullptr) return {};
  return failed_precondition("the nccl KV transport cannot run here: " + error);
}

Status nccl_status(ncclResult_t r, ncclComm_t comm, const std::string& what) {
  if (r == ncclSuccess) return {};
  std::string message = what + ": " + nccl().ncclGetErrorString(r);
  const char* last = nccl().ncclGetLastError(comm);
  if (last && *last) message += " (" + std::string(last) + ")";
  return unavailable(message);
}

Status nccl_wait_comm(ncclComm_t comm, SysClock::time_point deadline, const std::function<bool()>& cancelled,
                      const std::string& what) {
  Backoff backoff;
  for (;;) {
    ncclResult_t state = ncclSuccess;
    BATON_RETURN_IF_ERROR(nccl_status(nccl().ncclCommGetAsyncError(comm, &state), comm, what));
    if (state == ncclSuccess) return {};
    if (state != ncclInProgress) return nccl_status(state, comm, what);
    if (SysClock::now() >= deadline) return deadline_exceeded(what + ": not done before the deadline");
    if (cancelled && cancelled()) return cancelled_status(what);
    backoff.pause();
  }
}

Status nccl_wait_event(cudaEvent_t event, ncclComm_t comm, SysClock::time_point deadline,
                       const std::function<bool()>& cancelled, const std::string& what) {
  Backoff backoff;
  for (;;) {
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return {};
    if (e != cudaErrorNotReady) return kv_cuda_status(e, what);
    ncclResult_t state = ncclSuccess;
    BATON_RETURN_IF_ERROR(nccl_status(nccl().ncclCommGetAsyncError(comm, &state), comm, what));
    if (state != ncclSuccess && state != ncclInProgress) return nccl_status(state, comm, what);
    if (SysClock::now() >= deadline) return deadline_exceeded(what + ": not done before the deadline");
    if (cancelled && cancelled()) return cancelled_status(what);
    backoff.pause();
  }
}

Status nccl_staging_fit(char** ptr, int64_t* bytes, int64_t n, cudaStream_t stream) {
  if (*bytes >= n) return {};
  if (*ptr) BATON_RETURN_IF_CUDA_ERROR(cudaFreeAsync(*ptr, stream), "nccl: cudaFreeAsync");
  *ptr = nullptr;
  *bytes = 0;
  void* p = nullptr;
  const int64_t size = kv_staging_bytes(n, kMinStagingBytes);
  BATON_RETURN_IF_CUDA_ERROR(cudaMallocAsync(&p, static_cast<size_t>(size), stream),
                             "nccl: cudaMallocAsync of " + std::to_string(size) + " bytes of staging");
  *ptr = static_cast<char*>(p);
  *bytes = size;
  return {};
}

ncclConfig_t nccl_nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

}  // namespace baton
