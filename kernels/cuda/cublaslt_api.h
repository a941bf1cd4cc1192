// cuBLASLt, loaded when the first CUDA backend starts instead of linked into the binary.
//
// Why: a library linked at start-up puts its thread-local storage in every thread's static TLS
// block, carved out of the thread's stack. libcublasLt's is ~94 KiB, more than the small stacks
// some libraries give their threads (civetweb's, under the prometheus-cpp /metrics server baton
// once used, failed pthread_create with EINVAL), so a CPU-only `baton serve` would break just
// for having CUDA built in. Loaded with dlopen, its TLS is allocated per thread on first use instead.
#pragma once

#include <cublasLt.h>

#include <string>

namespace baton::cuda {

// Every cuBLASLt function baton calls.
#define BATON_CUBLASLT_FUNCTIONS(X)       \
  X(cublasLtCreate)                       \
  X(cublasLtDestroy)                      \
  X(cublasLtGetStatusString)              \
  X(cublasLtMatmul)                       \
  X(cublasLtMatmulAlgoGetHeuristic)       \
  X(cublasLtMatmulDescCreate)             \
  X(cublasLtMatmulDescDestroy)            \
  X(cublasLtMatmulDescSetAttribute)       \
  X(cublasLtMatmulPreferenceCreate)       \
  X(cublasLtMatmulPreferenceDestroy)      \
  X(cublasLtMatmulPreferenceSetAttribute) \
  X(cublasLtMatrixLayoutCreate)           \
  X(cublasLtMatrixLayoutDestroy)

struct CublasLtApi {
#define BATON_CUBLASLT_FIELD(name) decltype(&::name) name = nullptr;
  BATON_CUBLASLT_FUNCTIONS(BATON_CUBLASLT_FIELD)
#undef BATON_CUBLASLT_FIELD
};

// Loads libcublasLt (once; thread-safe). nullptr with a message in `*error` when it cannot.
const CublasLtApi* cublaslt_load(std::string* error);
// The loaded API; a bug to call before cublaslt_load succeeded.
const CublasLtApi& cublaslt();

}  // namespace baton::cuda
