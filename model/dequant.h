// Dequantisation of ggml tensor blocks to float32 (done once, at load).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "kernels/half.h"
#include "model/gguf.h"

namespace baton {

// True for the types baton can dequantise: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
// Q5_K, Q6_K.
bool ggml_type_supported(GgmlType type);

// Converts `n` elements (a multiple of the type's block size) from `src` to `dst`.
// `src` must hold exactly the bytes of those n elements. UNIMPLEMENTED for unsupported types.
Status dequantize(GgmlType type, std::span<const uint8_t> src, float* dst, int64_t n);

// The whole tensor as float32, row-major with dims[0] fastest (a [rows, dims[0]] matrix).
Result<std::vector<float>> dequantize_tensor(const GgufFile& file, const GgufTensorInfo& info);

}  // namespace baton
