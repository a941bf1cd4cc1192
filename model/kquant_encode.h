// Encoders for ggml's K-quant blocks (super-blocks of 256 values): f32 rows to Q4_K, Q5_K and
// Q6_K bytes, for test models and kernel tests. The encoding is the plain one (each sub-block's
// range from its minimum and maximum, scales quantised against the largest), not llama.cpp's
// error-minimising search: the blocks are valid and decode (model/dequant.h) to values close to
// the input, which is all a test model needs.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "model/gguf.h"

namespace baton {

// The blocks of `x` (a multiple of 256 values) in `type` (Q4_K, Q5_K or Q6_K).
// INVALID_ARGUMENT for another type or a length that is not a multiple of 256.
Result<std::vector<uint8_t>> encode_kquant(GgmlType type, std::span<const float> x);

}  // namespace baton
