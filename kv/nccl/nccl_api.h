// NCCL, loaded when the nccl KV transport is first used instead of linked into the binary.
//
// Why: a CUDA build of baton is one binary for every role. Linked, libnccl.so.2 would be NEEDED
// at start-up, and every role (a frontend, a --device=cpu worker) would fail to start on a host
// without NCCL. Loaded with dlopen, only the nccl transport needs it: the sender and the receiver
// refuse with FAILED_PRECONDITION when it cannot be loaded, and `baton serve
// --kv-transport=nccl` says so at start-up. nccl.h is still included for the types.
#pragma once

#include <nccl.h>

#include <string>

namespace baton {

// Every NCCL function baton calls.
#define BATON_NCCL_FUNCTIONS(X) \
  X(ncclCommAbort)              \
  X(ncclCommGetAsyncError)      \
  X(ncclCommInitRankConfig)     \
  X(ncclGetErrorString)         \
  X(ncclGetLastError)           \
  X(ncclGetUniqueId)            \
  X(ncclRecv)                   \
  X(ncclSend)

struct NcclApi {
#define BATON_NCCL_FIELD(name) decltype(&::name) name = nullptr;
  BATON_NCCL_FUNCTIONS(BATON_NCCL_FIELD)
#undef BATON_NCCL_FIELD
};

// Loads libnccl (once; thread-safe). nullptr with a message naming the library in `*error` when
// it cannot.
const NcclApi* nccl_load(std::string* error);
// The loaded API; a bug to call before nccl_load succeeded.
const NcclApi& nccl();

}  // namespace baton
