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
// (AVX-512 VNNI vpdpbusd: 64 multiply-adds per instruction) scaled once:
//   W4: Σ_j (d·u_j + m)(dx·qx_j) = d·dx·Σ u_j·qx_j + m·dx·Σ qx_j
//   W8: Σ_j d·q_j·dx·qx_j       = d·dx·Σ q_j·(qx_j + 128) − 128·d·dx·Σ q_j   (vpdpbusd wants u8)
//   W8S16: the same per 16 weights (each with its own d), one dx per 32
// So the result equals, up to f32 rounding, the product of the dequantised weights with the
// quantised activations (tests/unit/kernels/quant_gemm_test.cpp checks it against that
// reference); the activation rounding is the only approximation, as in llama.cpp's kernels.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/backend.h"

namespace baton::cpu {

enum class QuantKind { kW4, kW8, kW8S16 };

// An [n, k] weight (n outputs, k inputs, k a multiple of 64; 256 from K-quants) in one of the
// forms above.
struct QuantWeights {
  QuantKind kind = QuantKind::kW4;
  int64_t n = 0;
  int64_t k = 0;
  // Per row: W4 k/2 bytes (two 4-bit values a byte), W8 k bytes; in the order quantize_rows
  // writes activations in (see quant_gemm.cpp).
  std::vector<uint8_t> qs;
  std::vector<float> d;  // [n, k/32] scales (W8S16: [n, k/16])
  std::vector<float> m;  // [n, k/32] W4: minimums m; W8, W8S16: −128·Σ d·q (the u8 shift's correction)
  size_t row_bytes() const { return static_cast<size_t>(kind == QuantKind::kW4 ? k / 2 : k); }
  int64_t scales_per_row() const { return kind == QuantKind::kW8S16 ? k / 16 : k / 32; }
  size_t bytes() const { return qs.size() + (d.size() + m.size()) * sizeof(float); }
};

// GGUF block types that repack (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K).
bool quant_type_supported(uint32_t ggml_type);
// Repacks `blocks` (n rows of k/32 GGUF blocks of `ggml_type`, row-major). INVALID_ARGUMENT for
// another type, a k that is not a multiple of 64, or a byte count that does not match.
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
