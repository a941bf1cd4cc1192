// GEMMs on quantised weights, kept quantised in memory ("native" weights): a decode step is bound
// by reading the weights, so they are kept at the bytes the file holds for them.
//
// Weights are repacked at load, exactly (the file's fp16 scales stay fp16 bits and its K-quant
// sub-block scales stay integers; nothing is requantised), into one of these forms, u the quants
// (4, 5 or 6 bits: a low nibble plus 0, 1 or 2 high bits; or 8):
//   kind  from   value per weight               scales per 32 weights of a row       bits/weight
//   W4    Q4_0   d·(u − 8)                      d fp16                               4.5   (file 4.5)
//   W4M   Q4_1   d·u + m                        d, m fp16                            5.0   (file 5.0)
//   W4K   Q4_K   (D·sc)·u − Dmin·mn             sc, mn u8; D, Dmin fp16 per 256      4.625 (file 4.5)
//   W5    Q5_0   d·(u − 16)                     d fp16                               5.5   (file 5.5)
//   W5M   Q5_1   d·u + m                        d, m fp16                            6.0   (file 6.0)
//   W5K   Q5_K   (D·sc)·u − Dmin·mn             sc, mn u8; D, Dmin fp16 per 256      5.625 (file 5.5)
//   W6K   Q6_K   (D·sc)·(u − 32), sc per 16     sc int8 ×2; D fp16 per 256           6.5625 (file 6.5625)
//   W8    Q8_0   d·(u − 128), u = q + 128       d fp16                               8.5   (file 8.5)
//   BF16  BF16   the value                      –                                    16    (file 16)
// (K-quants' 6-bit sub-block scales take a byte each: 2.8 % and 2.3 % over the file.)
// Activations are quantised per call, per row and block of 32, to int8 (x ≈ dx · qx with
// dx = max|x| / 127, round to nearest even), and each block's dot product is an integer one
// (AVX-512 VNNI vpdpbusd: the weights' u8 against the activations' s8) scaled once:
//   offset kinds (W4, W5, W6K, W8): Σ_j d(u_j − o)·dx·qx_j = d·dx·(Σ u_j·qx_j − o·Σ qx_j): the
//       offset folds into the activation block's integer sum (W6K: per 16, with its scales);
//   minimum kinds (W4M, W4K, W5M, W5K): Σ_j (d·u_j + m)(dx·qx_j) = d·dx·Σ u_j·qx_j + m·dx·Σ qx_j.
// So the result equals, up to f32 rounding, the product of the dequantised weights with the
// quantised activations (tests/unit/kernels/quant_gemm_test.cpp checks it against that
// reference, and the bytes against the file's); the activation rounding is the only
// approximation, as in llama.cpp's kernels.
//
// Weights are stored in tiles of 16 rows, each tile's blocks one record after another, so that a
// thread streams one contiguous range. A record is one block of 32 inputs × 16 rows: its quants,
// then its scales for the 16 rows. The quants: the low nibbles in 4 chunks of 64 bytes (chunk j,
// lane i = row i of the tile: byte c holds inputs 4j + c (low nibble) and 16 + 4j + c (high));
// then the high bits: one bit (5-bit kinds) in 64 bytes, byte c of lane i holding input 4j + c's
// at bit j and 16 + 4j + c's at bit 4 + j; two bits (W6K) in 2 × 64 bytes, chunk h, byte c of lane
// i holding input 16h + 4j + c's at bits 2j..2j+1. W8: 8 chunks, chunk j, lane i: inputs 4j..4j+3
// of row i. Each 32-bit lane of a vpdpbusd holds four consecutive weights of one row, so one
// instruction is 4 inputs × 16 outputs against a broadcast of four activations, and the float
// work (convert, scale, minimum) is paid once per block and 16 outputs instead of once per 64
// weights and one output, which is what bounds a decode step of several sequences
// (bench/RESULTS.md).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/huge_bytes.h"

namespace baton::cpu {

enum class QuantKind { kW4, kW4M, kW4K, kW5, kW5M, kW5K, kW6K, kW8, kBF16 };

// How a kind's scales are kept.
enum class QuantScales {
  kD,         // d fp16[16]; the kind's offset applies
  kDM,        // d fp16[16], m fp16[16]
  kKMin,      // sc u8[16], mn u8[16]; header D fp16[16], Dmin fp16[16]
  kKSigned16,  // sc int8[2][16] (inputs 0..15, 16..31); header D fp16[16]; offset 32
  kNone        // BF16: the values themselves
};

struct QuantTraits {
  int high_bits;  // above the low nibble (0, 1, 2); W8: -1 (whole bytes)
  QuantScales scales;
  int32_t offset;  // subtracted from u (offset kinds), else 0
};
constexpr QuantTraits quant_traits(QuantKind kind) {
  switch (kind) {
    case QuantKind::kW4: return {0, QuantScales::kD, 8};
    case QuantKind::kW4M: return {0, QuantScales::kDM, 0};
    case QuantKind::kW4K: return {0, QuantScales::kKMin, 0};
    case QuantKind::kW5: return {1, QuantScales::kD, 16};
    case QuantKind::kW5M: return {1, QuantScales::kDM, 0};
    case QuantKind::kW5K: return {1, QuantScales::kKMin, 0};
    case QuantKind::kW6K: return {2, QuantScales::kKSigned16, 32};
    case QuantKind::kW8: return {-1, QuantScales::kD, 128};
    case QuantKind::kBF16: return {-1, QuantScales::kNone, 0};
  }
  return {0, QuantScales::kD, 0};
}

// Rows per weight tile: the 16 lanes of an AVX-512 vector of int32.
constexpr int64_t kQuantTileRows = 16;

// An [n, k] weight (n outputs, k inputs, k a multiple of 32; 256 from K-quants) in one of the
// forms above, in tiles of kQuantTileRows rows (n rounded up; the padding rows are zero).
struct QuantWeights {
  QuantKind kind = QuantKind::kW4;
  int64_t n = 0;
  int64_t k = 0;
  // [tiles, records]: per tile, its blocks' records in order (quant_gemm.h's layout). K-quants'
  // records come 8 to a super-block of 256 inputs, after its header.
  HugeBytes data;
  int64_t n_tiles() const { return (n + kQuantTileRows - 1) / kQuantTileRows; }
  int64_t n_blocks() const { return k / 32; }
  QuantTraits traits() const { return quant_traits(kind); }
  size_t quant_bytes() const {
    if (kind == QuantKind::kBF16) return 1024;
    const int hb = traits().high_bits;
    return hb < 0 ? 512 : 256 + 64 * static_cast<size_t>(hb);
  }
  size_t scale_bytes() const {
    const QuantScales s = traits().scales;
    return s == QuantScales::kNone ? 0 : s == QuantScales::kDM ? 64 : 32;
  }
  size_t record_bytes() const { return quant_bytes() + scale_bytes(); }
  // K-quants: the super-block's header before its 8 records (none for the others).
  size_t super_header_bytes() const {
    const QuantScales s = traits().scales;
    return s == QuantScales::kKMin ? 64 : s == QuantScales::kKSigned16 ? 32 : 0;
  }
  size_t tile_bytes() const {
    return static_cast<size_t>(n_blocks()) * record_bytes() + static_cast<size_t>(n_blocks() / 8) * super_header_bytes();
  }
  // The record of block b in tile `tile`.
  const uint8_t* record(int64_t tile, int64_t b) const {
    const uint8_t* t = data.data() + static_cast<size_t>(tile) * tile_bytes();
    const size_t headers = super_header_bytes() == 0 ? 0 : static_cast<size_t>(b / 8 + 1) * super_header_bytes();
    return t + headers + static_cast<size_t>(b) * record_bytes();
  }
  // K-quants: the header of the super-block that holds block b.
  const uint8_t* super_header(int64_t tile, int64_t b) const {
    return data.data() + static_cast<size_t>(tile) * tile_bytes() +
           static_cast<size_t>(b / 8) * (super_header_bytes() + 8 * record_bytes());
  }
  // What a step reads of it.
  size_t bytes() const { return data.size(); }
};

// BF16 weights are not quantised: their activations are rounded to bf16 (as the dense bf16 GEMM
// rounds them) and each product summed in f32, with AVX-512 BF16's vdpbf16ps where the CPU has it
// (AVX-512F shifts and FMAs where not). A record is 16 chunks of 64 bytes, chunk p lane i holding
// inputs 2p and 2p + 1 of row i, so one instruction is 2 inputs × 16 outputs: a decode step
// streams the file's bytes through a GEMV with no per-call set-up.
//
// GGUF block types that repack (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16).
bool quant_type_supported(uint32_t ggml_type);
// Repacks `blocks` (n rows of GGUF blocks of `ggml_type`, row-major). INVALID_ARGUMENT for
// another type, a k that is not whole blocks, or a byte count that does not match.
Result<QuantWeights> repack_quant(uint32_t ggml_type, std::span<const uint8_t> blocks, int64_t n, int64_t k);

// True when this CPU has the instructions the fast kernel needs (AVX-512 BW/VL and VNNI); the
// portable kernel computes the same values, slowly, everywhere else.
bool quant_gemm_fast();

// Which kernel quant_gemm runs: the fastest this CPU has, or (tests compare them) the portable one,
// or the AVX-512 one without vdpbf16ps for BF16 weights.
enum class QuantKernel { kBest, kPortable, kNoBf16Dot };

// y[T, N] = x[T, K] · Wᵀ (+ bias), or y += with `accumulate`; x and y f32. Uses OpenMP.
void quant_gemm(const Tensor& x, const QuantWeights& w, const float* bias, const Tensor& y, bool accumulate,
                QuantKernel kernel = QuantKernel::kBest);

// Row `row` of the weight, dequantised (n floats of k): a gather from a tied LM head that is
// also the embedding table.
void dequantize_row(const QuantWeights& w, int64_t row, float* out);

// The activation quantisation quant_gemm applies, in natural element order, for references:
// qx[r·k + j], dx[r·k/32 + b].
void quantize_activations(const float* x, int64_t rows, int64_t k, int64_t ld, int8_t* qx, float* dx);

}  // namespace baton::cpu
