// GEMMs through cuBLASLt: y[M, N] (= or +=) x[M, K] · w[N, K]ᵀ with bf16 x and w, fp32
// accumulation, and y in f32 or bf16, all row-major with row strides. One call covers every
// token of a step. The plan for a shape (descriptors and the heuristic's algorithm) is made once
// and cached; the workspace is allocated once, so calls can be captured in a CUDA graph.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include "kernels/backend.h"

namespace baton::cuda {

class LtGemm {
 public:
  LtGemm(cudaStream_t stream, size_t workspace_bytes);
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  void run(const void* x, int64_t ld_x, const void* w, int64_t ld_w, void* y, int64_t ld_y, DType y_dtype, int64_t m,
           int64_t n, int64_t k, bool accumulate);

 private:
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  // (m, n, k, ld_x, ld_w, ld_y, y dtype, accumulate, alignment of x|w|y)
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, bool, int>;
  const Plan& plan(const Key& key, int64_t m, int64_t n, int64_t k, int64_t ld_x, int64_t ld_w, int64_t ld_y,
                   DType y_dtype, bool accumulate, int align_x, int align_w, int align_y);
  static void destroy(Plan& p);

  cudaStream_t stream_;
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::mutex mu_;
  std::map<Key, Plan> plans_;  // guarded by mu_
};

}  // namespace baton::cuda
