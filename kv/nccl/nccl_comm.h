// What both ends of the nccl KV transport (kv/nccl/nccl_transport.h) do with NCCL: check that it
// can be loaded, turn its errors into Statuses, and wait on non-blocking communicators without
// ever blocking on one (a peer that died leaves an operation pending until it is aborted).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "common/status.h"
#include "kv/nccl/nccl_api.h"

namespace baton {

// Makes the stream-ordered staging buffer `*ptr` (of `*bytes`; nullptr and 0 at first) hold at
// least `n` bytes: when it is smaller, frees it and allocates a power of two from 1 MiB, both on
// `stream`, so after everything the stream was given.
Status nccl_staging_fit(char** ptr, int64_t* bytes, int64_t n, cudaStream_t stream);

// OK once libnccl is loaded (loading it the first time); FAILED_PRECONDITION naming the library
// when it cannot be. Every other function here needs it to have succeeded.
Status nccl_available();

// OK for ncclSuccess; UNAVAILABLE otherwise ("`what`: the NCCL error (its last error message)").
Status nccl_status(ncclResult_t r, ncclComm_t comm, const std::string& what);

// Waits until a non-blocking communicator's pending call (init, or an ncclSend/ncclRecv that
// returned ncclInProgress) has completed. DEADLINE_EXCEEDED past `deadline`, CANCELLED once
// `cancelled` (may be empty) says so, UNAVAILABLE when the communicator fails.
Status nccl_wait_comm(ncclComm_t comm, std::chrono::system_clock::time_point deadline,
                      const std::function<bool()>& cancelled, const std::string& what);

// Waits for `event` (recorded after an NCCL operation) while watching the communicator for
// errors; the same errors as nccl_wait_comm, and a CUDA error as kv_cuda_status has it.
Status nccl_wait_event(cudaEvent_t event, ncclComm_t comm, std::chrono::system_clock::time_point deadline,
                       const std::function<bool()>& cancelled, const std::string& what);

// The config of every communicator here: non-blocking, so inits and operations can be polled
// against a deadline and aborted.
ncclConfig_t nccl_nonblocking_config();

}  // namespace baton
