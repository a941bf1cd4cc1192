// GEMMs on quantised weights, kept quantised in memory ("native" weights): the decode path reads
// 4.5 bits per weight (Q4_0, Q4_1, Q4_K) or 8.5 (Q8_0, Q6_K) instead of 16 (bf16), and a decode
// step is bound by reading the weights.
//
// Weights are repacked at load into one of three forms, exactly (scales go from fp16 to f32, a
// K-quant's super-block scale times its 6- or 8-bit sub-block scale is exact in f32; nothing is
// requantised):
//   W4     value = d · u + m,   u in 0..15 (4 bits), d and m per 32    from Q4_0 (m = -8d), Q4_1,
//                                                                      Q4_K (d·sc, -dmin·m)
//   W8     value = d · q,       q in -127..127, d per 32                from Q8_0
//   W8S16  value = d · q,       q in -32..31, d per 16                  from Q6_K (d·sc)
// Activations are quantised per call, per row and block of 32, to int8 (x ≈ dx · qx with
// dx = max|x| / 127, round to nearest even), and each block's dot product is an integer one
// (AVX-512 VNNI vpdpbusd) scaled once:
//   W4: Σ_j (d·u_j + m)(dx·qx_j) = d·dx·Σ u_j·qx_j + m·dx·Σ qx_j
//   W8: Σ_j d·q_j·dx·qx_j       = d·dx·Σ q_j·(qx_j + 128) − 128·d·dx·Σ q_j   (vpdpbusd wants u8)
//   W8S16: the same per 16 weights (each with its own d), one dx per 32
// So the result equals, up to f32 rounding, the product of the dequantised weights with the
// quantised activations (tests/unit/kernels/quant_gemm_test.cpp checks it against that
// reference); the activation rounding is the only approximation, as in llama.cpp's kernels.
//
// Weights are stored in tiles of 16 rows: each 32-bit lane of a vpdpbusd holds four consecutive
// weights of one row, so one instruction is 4 inputs × 16 outputs against a broadcast of four
// activations, and the block's scales are one vector of 16 rows. The float work (convert, scale,
// minimum) is then paid once per block and 16 outputs instead of once per 64 weights and one
// output, which is what bounds a decode step of several sequences (bench/RESULTS.md).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/backend.h"

namespace baton::cpu {

enum class QuantKind { kW4, kW8, kW8S16 };

// Rows per weight tile: the 16 lanes of an AVX-512 vector of int32.
constexpr int64_t kQuantTileRows = 16;

// An [n, k] weight (n outputs, k inputs, k a multiple of 32; 256 from K-quants) in one of the
// forms above, in tiles of kQuantTileRows rows (n rounded up; the padding rows are zero).
struct QuantWeights {
  QuantKind kind = QuantKind::kW4;
  int64_t n = 0;
  int64_t k = 0;
  // [tiles, k/32, tile_block_bytes()]: per tile and block of 32 inputs, W4 4 chunks of 64 bytes
  // (chunk j, lane i = row i of the tile: byte c holds inputs 4j + c (low nibble) and 16 + 4j + c
  // (high)), W8 and W8S16 8 chunks (chunk j, lane i: inputs 4j..4j+3 of row i, int8).
  std::vector<uint8_t> qs;
  std::vector<float> d;  // [tiles, k/32, 16] scales (W8S16: [tiles, k/32, 2, 16], inputs 0..15 then 16..31)
  std::vector<float> m;  // [tiles, k/32, 16] W4: minimums m; W8, W8S16: −128·Σ d·q (the u8 shift's correction)
  int64_t n_tiles() const { return (n + kQuantTileRows - 1) / kQuantTileRows; }
  int64_t n_blocks() const { return k / 32; }
  size_t tile_block_bytes() const { return kind == QuantKind::kW4 ? 256 : 512; }
  int64_t scales_per_block() const { return kind == QuantKind::kW8S16 ? 2 : 1; }
  size_t bytes() const { return qs.size() + (d.size() + m.size()) * sizeof(float); }
};

// GGUF block types that repack (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K).
bool quant_type_supported(uint32_t ggml_type);
// Repacks `blocks` (n rows of GGUF blocks of `ggml_type`, row-major). INVALID_ARGUMENT for
// another type, a k that is not whole blocks, or a byte count that does not match.
Result<QuantWeights> repack_quant(uint32_t ggml_type, std::span<const uint8_t> blocks, int64_t n, int64_t k);

// True when this CPU has the instructions the fast kernel needs (AVX-512 BW/VL and VNNI); the
// portable kernel computes the same values, slowly, everywhere else.
bool quant_gemm_fast();

// y[T, N] = x[T, K] · Wᵀ (+ bias), or y += with `accumulate`; x and y f32. Uses OpenMP.
// `portable` forces the portable kernel (tests compare the two).
void quant_gemm(const Tensor& x, const QuantWeights& w, const float* bias, const Tensor& y, bool accumulate,
                bool portable = false);

// The activation quantisation quant_gemm applies, in natural element order, for references:
// qx[r·k + j], dx[r·k/32 + b].
void quantize_activations(const float* x, int64_t rows, int64_t k, int64_t ld, int8_t* qx, float* dx);

}  // namespace baton::cpu
