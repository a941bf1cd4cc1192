// CUDA runtime errors of the device KV transports as recoverable Statuses: a transfer that fails
// on the device fails that transfer (the prefill worker reports it, the frontend retries
// elsewhere); it does not take the worker down the way CUDA_CHECK (kernels/) does.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "common/status.h"

namespace baton {

// OK for cudaSuccess; RESOURCE_EXHAUSTED when out of memory; UNAVAILABLE otherwise ("`what`:
// the CUDA error"). Clears the thread's last-error state, so a later CUDA_CHECK_LAUNCH on the
// same thread (the backend's kv_export runs on the prefill worker's sender threads) does not
// mistake this recoverable error for a failed kernel launch.
inline Status kv_cuda_status(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return {};
  (void)cudaGetLastError();
  const std::string message = what + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
  if (err == cudaErrorMemoryAllocation) return resource_exhausted(message);
  return unavailable(message);
}

#define BATON_RETURN_IF_CUDA_ERROR(call, what) BATON_RETURN_IF_ERROR(::baton::kv_cuda_status((call), (what)))

}  // namespace baton
