#include "kernels/cuda/gemm.h"

#include "kernels/cuda/cublaslt_api.h"
#include "kernels/cuda/cuda_check.h"

namespace baton::cuda {
namespace {

// A serving process sees a bounded set of step sizes; past this many shapes the cache starts over.
constexpr size_t kMaxPlans = 512;

int alignment_of(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  int a = 256;
  while (a > 2 && v % a != 0) a /= 2;
  return a;
}

}  // namespace

LtGemm::LtGemm(cudaStream_t stream, size_t workspace_bytes) : stream_(stream), workspace_bytes_(workspace_bytes) {
  CUBLAS_CHECK(cublaslt().cublasLtCreate(&handle_));
  CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
}

LtGemm::~LtGemm() {
  for (auto& [key, p] : plans_) destroy(p);
  cudaFree(workspace_);
  cublaslt().cublasLtDestroy(handle_);
}

void LtGemm::destroy(Plan& p) {
  if (p.a) cublaslt().cublasLtMatrixLayoutDestroy(p.a);
  if (p.b) cublaslt().cublasLtMatrixLayoutDestroy(p.b);
  if (p.c) cublaslt().cublasLtMatrixLayoutDestroy(p.c);
  if (p.op) cublaslt().cublasLtMatmulDescDestroy(p.op);
}

// Row-major y = x · wᵀ is column-major yᵀ [N, M] = op_T(w as [K, N]) · (x as [K, M]): A is the
// weight read transposed, B the activations, C/D the output, with the row strides as the
// column-major leading dimensions.
const LtGemm::Plan& LtGemm::plan(const Key& key, int64_t m, int64_t n, int64_t k, int64_t ld_x, int64_t ld_w,
                                 int64_t ld_y, DType y_dtype, bool accumulate, int align_x, int align_w, int align_y) {
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  if (plans_.size() >= kMaxPlans) {
    for (auto& [old_key, p] : plans_) destroy(p);
    plans_.clear();
  }
  Plan p;
  const cudaDataType_t y_type = y_dtype == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
  CUBLAS_CHECK(cublaslt().cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t trans = CUBLAS_OP_T, no_trans = CUBLAS_OP_N;
  CUBLAS_CHECK(cublaslt().cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof(trans)));
  CUBLAS_CHECK(cublaslt().cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &no_trans, sizeof(no_trans)));
  CUBLAS_CHECK(cublaslt().cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, static_cast<uint64_t>(k), static_cast<uint64_t>(n), ld_w));
  CUBLAS_CHECK(cublaslt().cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, static_cast<uint64_t>(k), static_cast<uint64_t>(m), ld_x));
  CUBLAS_CHECK(cublaslt().cublasLtMatrixLayoutCreate(&p.c, y_type, static_cast<uint64_t>(n), static_cast<uint64_t>(m), ld_y));

  cublasLtMatmulPreference_t pref;
  CUBLAS_CHECK(cublaslt().cublasLtMatmulPreferenceCreate(&pref));
  CUBLAS_CHECK(cublaslt().cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes_,
                                                    sizeof(workspace_bytes_)));
  const uint32_t ax = static_cast<uint32_t>(align_x), aw = static_cast<uint32_t>(align_w), ay = static_cast<uint32_t>(align_y);
  CUBLAS_CHECK(cublaslt().cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aw, sizeof(aw)));
  CUBLAS_CHECK(cublaslt().cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ax, sizeof(ax)));
  CUBLAS_CHECK(cublaslt().cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ay, sizeof(ay)));
  CUBLAS_CHECK(cublaslt().cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ay, sizeof(ay)));
  cublasLtMatmulHeuristicResult_t result{};
  int n_results = 0;
  CUBLAS_CHECK(cublaslt().cublasLtMatmulAlgoGetHeuristic(handle_, p.op, p.a, p.b, p.c, p.c, pref, 1, &result, &n_results));
  cublaslt().cublasLtMatmulPreferenceDestroy(pref);
  BATON_CHECK(n_results > 0, "cuBLASLt has no algorithm for y[%ld, %ld] = x[%ld, %ld] wT (y %s, accumulate %d)",
              static_cast<long>(m), static_cast<long>(n), static_cast<long>(m), static_cast<long>(k), dtype_name(y_dtype),
              accumulate ? 1 : 0);
  p.algo = result.algo;
  return plans_.emplace(key, p).first->second;
}

void LtGemm::run(const void* x, int64_t ld_x, const void* w, int64_t ld_w, void* y, int64_t ld_y, DType y_dtype,
                 int64_t m, int64_t n, int64_t k, bool accumulate) {
  BATON_CHECK(y_dtype == DType::kF32 || y_dtype == DType::kBF16, "gemm output must be f32 or bf16, not %s",
              dtype_name(y_dtype));
  if (m == 0) return;
  const int ax = alignment_of(x), aw = alignment_of(w), ay = alignment_of(y);
  const Key key{m, n, k, ld_x, ld_w, ld_y, static_cast<int>(y_dtype), accumulate, ax | aw << 9 | ay << 18};
  std::lock_guard<std::mutex> lock(mu_);
  const Plan& p = plan(key, m, n, k, ld_x, ld_w, ld_y, y_dtype, accumulate, ax, aw, ay);
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  CUBLAS_CHECK(cublaslt().cublasLtMatmul(handle_, p.op, &alpha, w, p.a, x, p.b, &beta, y, p.c, y, p.c, &p.algo, workspace_,
                              workspace_bytes_, stream_));
}

}  // namespace baton::cuda
