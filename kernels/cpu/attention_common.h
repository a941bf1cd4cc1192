// Helpers shared by the CPU attention kernels (kernels/cpu/attention.cpp, attention_tiled.cpp).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/fast_math.h"
#include "kernels/half.h"

namespace baton::cpu {

// Online-softmax update of one score row s[0, n) whose first `limit` entries are valid: masks
// the rest, updates the running max *m and returns (alpha, sum) where alpha rescales earlier
// partial results and sum is the row's new probability mass; s becomes exp2(s - max).
struct SoftmaxStep {
  float alpha;
  float sum;
};
inline SoftmaxStep softmax_row_update(float* s, int64_t n, int64_t limit, float* m) {
  for (int64_t j = limit; j < n; ++j) s[j] = -std::numeric_limits<float>::infinity();
  float mx = *m;
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < n; ++j) mx = s[j] > mx ? s[j] : mx;  // (std::max does not vectorise)
  const float alpha = exp2_neg(*m - mx);  // *m = -inf on the first block: alpha = 0
  *m = mx;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    s[j] = exp2_neg(s[j] - mx);
    sum += s[j];
  }
  return {alpha, sum};
}

inline float load_elem(const void* base, size_t i, DType dtype) {
  switch (dtype) {
    case DType::kF32: return static_cast<const float*>(base)[i];
    case DType::kBF16: return bf16_to_fp32(static_cast<const uint16_t*>(base)[i]);
    case DType::kF16: return fp16_to_fp32(static_cast<const uint16_t*>(base)[i]);
  }
  return 0.0f;
}

inline void store_row(void* base, size_t i0, const float* src, int n, DType dtype) {
  switch (dtype) {
    case DType::kF32: std::memcpy(static_cast<float*>(base) + i0, src, n * sizeof(float)); return;
    case DType::kBF16:
      for (int j = 0; j < n; ++j) static_cast<uint16_t*>(base)[i0 + j] = fp32_to_bf16(src[j]);
      return;
    case DType::kF16:
      for (int j = 0; j < n; ++j) static_cast<uint16_t*>(base)[i0 + j] = fp32_to_fp16(src[j]);
      return;
  }
}

// Element offset of (position, kv head) in a layer's K or V pool.
inline size_t kv_offset_of(const KvLayerView& kv, const SeqView& s, int32_t pos, int g) {
  const int32_t blk = s.block_table[pos / kv.block_size];
  const int32_t slot = pos % kv.block_size;
  return ((static_cast<size_t>(blk) * kv.block_size + slot) * kv.n_kv_heads + g) * kv.head_dim;
}

}  // namespace baton::cpu
