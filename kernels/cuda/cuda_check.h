// CUDA_CHECK / CUBLAS_CHECK / CUDA_CHECK_LAUNCH: every CUDA runtime and cuBLAS call is checked,
// and every kernel launch is followed by a check of the launch error. A failure is a bug or a
// broken device, not bad input: it prints file:line, the call and the error, then aborts.
#pragma once

#include <cuda_runtime.h>

#include "common/check.h"
#include "kernels/cuda/cublaslt_api.h"

#define CUDA_CHECK(call)                                                                      \
  do {                                                                                        \
    cudaError_t baton_err_ = (call);                                                          \
    BATON_CHECK(baton_err_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(baton_err_)); \
  } while (0)

// After every <<<...>>>: catches bad launch configurations at once (execution errors surface at
// the next synchronising call, which is checked too).
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

#define CUBLAS_CHECK(call)                                                                    \
  do {                                                                                        \
    cublasStatus_t baton_st_ = (call);                                                        \
    BATON_CHECK(baton_st_ == CUBLAS_STATUS_SUCCESS, "%s: cuBLAS status %d (%s)", #call,       \
                static_cast<int>(baton_st_), ::baton::cuda::cublaslt().cublasLtGetStatusString(baton_st_));               \
  } while (0)
