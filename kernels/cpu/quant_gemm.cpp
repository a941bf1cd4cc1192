#include "kernels/cpu/quant_gemm.h"

#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "common/check.h"
#include "kernels/half.h"
#include "kernels/cpu/parallel.h"

namespace baton::cpu {
namespace {

// GGUF type ids (model/gguf.h's GgmlType; kernels/ does not see model/).
constexpr uint32_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
                   kBF16 = 30;

// Activation rows per pass over a weight tile: 8 int32 and 8 f32 accumulators plus the block's 8
// weight vectors fit AVX-512's 32 registers; more rows take another pass over the tile (in L1).
constexpr int kRowsPerPass = 8;


// Row `row`'s byte for input e (0..31) of a block: its low nibble (e / 16 says which half; W8:
// the whole quant), and its high bits' byte and shift.
size_t quant_byte(const QuantWeights& w, int64_t row, int e) {
  const size_t lane = static_cast<size_t>(row % kQuantTileRows) * 4;
  if (w.traits().high_bits < 0) return static_cast<size_t>((e / 4) * 64 + e % 4) + lane;
  return static_cast<size_t>(((e % 16) / 4) * 64 + e % 4) + lane;
}
size_t high_bits_byte(const QuantWeights& w, int64_t row, int e) {
  const size_t chunk = w.traits().high_bits == 2 ? static_cast<size_t>(e / 16) : 0;
  return 256 + chunk * 64 + static_cast<size_t>(e % 4) + static_cast<size_t>(row % kQuantTileRows) * 4;
}
int high_bits_shift(const QuantWeights& w, int e) {
  const int j = (e % 16) / 4;
  return w.traits().high_bits == 2 ? 2 * j : 4 * (e / 16) + j;
}
uint8_t* record_of(QuantWeights& w, int64_t row, int64_t b) {
  return const_cast<uint8_t*>(w.record(row / kQuantTileRows, b));
}
void put_fp16_bits(uint8_t* p, uint16_t h) { std::memcpy(p, &h, 2); }
uint16_t fp16_bits(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

// Row `row`'s quant u of input e in the block at `rec`.
int32_t quant_of(const QuantWeights& w, const uint8_t* rec, int64_t row, int e) {
  const int hb = w.traits().high_bits;
  const uint8_t byte = rec[quant_byte(w, row, e)];
  if (hb < 0) return byte;
  const int32_t lo = e < 16 ? (byte & 0x0F) : (byte >> 4);
  if (hb == 0) return lo;
  const int32_t hi = (rec[high_bits_byte(w, row, e)] >> high_bits_shift(w, e)) & ((1 << hb) - 1);
  return lo | (hi << 4);
}

// BF16: row `row`'s value of input e in the block at `rec` (chunk e / 2, lane, half e % 2).
size_t bf16_byte(int64_t row, int e) {
  return static_cast<size_t>((e / 2) * 64 + (e % 2) * 2) + static_cast<size_t>(row % kQuantTileRows) * 4;
}
float bf16_of(const uint8_t* rec, int64_t row, int e) { return bf16_to_fp32(fp16_bits(rec + bf16_byte(row, e))); }

// What one block of one row is, for the portable kernel: value_e = d[e / 16]·(u_e − offset) + m.
struct BlockParams {
  float d[2];
  float m;
  int32_t offset;  // folded into the activations' integer sums
};
BlockParams block_params(const QuantWeights& w, int64_t row, int64_t b) {
  const int64_t tile = row / kQuantTileRows, i = row % kQuantTileRows;
  const uint8_t* sc = w.record(tile, b) + w.quant_bytes();
  const QuantTraits t = w.traits();
  BlockParams p{{0, 0}, 0, t.offset};
  switch (t.scales) {
    case QuantScales::kD: p.d[0] = p.d[1] = fp16_to_fp32(fp16_bits(sc + 2 * i)); break;
    case QuantScales::kDM:
      p.d[0] = p.d[1] = fp16_to_fp32(fp16_bits(sc + 2 * i));
      p.m = fp16_to_fp32(fp16_bits(sc + 32 + 2 * i));
      break;
    case QuantScales::kKMin: {
      const uint8_t* h = w.super_header(tile, b);
      p.d[0] = p.d[1] = fp16_to_fp32(fp16_bits(h + 2 * i)) * static_cast<float>(sc[i]);
      p.m = -(fp16_to_fp32(fp16_bits(h + 32 + 2 * i)) * static_cast<float>(sc[16 + i]));
      break;
    }
    case QuantScales::kKSigned16: {
      const float d = fp16_to_fp32(fp16_bits(w.super_header(tile, b) + 2 * i));
      p.d[0] = d * static_cast<float>(static_cast<int8_t>(sc[i]));
      p.d[1] = d * static_cast<float>(static_cast<int8_t>(sc[16 + i]));
      break;
    }
    case QuantScales::kNone: break;  // BF16 has no scales (bf16_of)
  }
  return p;
}

// Scratch of one quant_gemm call: x quantised, per row, in natural order.
struct QuantizedX {
  std::vector<int8_t> q;    // [rows, k]
  std::vector<float> dx;    // [rows, k/32]
  std::vector<float> t;     // [rows, k/32]: dx·Σqx, what a block's m multiplies
  std::vector<int32_t> sx;  // [rows, k/32, 2]: Σqx of inputs 0..15 and 16..31, what an offset multiplies
  std::vector<uint16_t> bf;  // BF16 weights: [rows, k], x rounded to bf16
};

// x rounded to bf16 per row (BF16 weights' activations).
void round_for(const Tensor& x, QuantizedX* out) {
  const int64_t rows = x.rows, k = x.cols;
  out->bf.resize(static_cast<size_t>(rows * k));
#pragma omp parallel for schedule(static) if (rows > 1 && worth_parallel(rows * k))
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x.f32() + r * x.ld;
    uint16_t* o = out->bf.data() + r * k;
    for (int64_t j = 0; j < k; ++j) o[j] = fp32_to_bf16(xr[j]);
  }
}

void quantize_for(const Tensor& x, QuantizedX* out) {
  const int64_t rows = x.rows, k = x.cols, nb = k / 32;
  out->q.resize(static_cast<size_t>(rows * k));
  out->dx.resize(static_cast<size_t>(rows * nb));
  out->t.resize(static_cast<size_t>(rows * nb));
  out->sx.resize(static_cast<size_t>(rows * nb * 2));
  // A prefill's rows split across the team (one decode row stays on the calling thread).
#pragma omp parallel for schedule(static) if (rows > 1 && worth_parallel(rows * k))
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x.f32() + r * x.ld;
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = xr + b * 32;
      float amax = 0;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float id = amax > 0 ? 127.0f / amax : 0.0f;
      const float dx = amax / 127.0f;
      int sum[2] = {0, 0};
      int8_t* q = out->q.data() + r * k + b * 32;
      for (int j = 0; j < 32; ++j) {
        const int v = static_cast<int>(std::nearbyint(xb[j] * id));
        sum[j / 16] += v;
        q[j] = static_cast<int8_t>(v);
      }
      out->dx[r * nb + b] = dx;
      out->sx[(r * nb + b) * 2] = sum[0];
      out->sx[(r * nb + b) * 2 + 1] = sum[1];
      out->t[r * nb + b] = dx * static_cast<float>(sum[0] + sum[1]);
    }
  }
}

// y[r, n] = acc (+ bias[n]) (+ y[r, n] with `accumulate`) for one computed value.
inline void store_one(const Tensor& y, int64_t r, int64_t n, float acc, const float* bias, bool accumulate) {
  float* dst = y.f32() + r * y.ld + n;
  *dst = (accumulate ? *dst : 0.0f) + acc + (bias ? bias[n] : 0.0f);
}

// The portable kernel: the same sums, one element at a time, for the rows of one tile.
void gemm_tile_portable(const QuantizedX& xq, const QuantWeights& w, int64_t tile, int64_t rows, const float* bias,
                        const Tensor& y, bool accumulate) {
  const int64_t k = w.k, nb = w.n_blocks();
  const int64_t n_end = std::min(w.n, (tile + 1) * kQuantTileRows);
  for (int64_t n = tile * kQuantTileRows; n < n_end; ++n) {
    for (int64_t r = 0; r < rows && w.kind == QuantKind::kBF16; ++r) {
      float acc = 0;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* rec = w.record(tile, b);
        for (int e = 0; e < 32; ++e) acc += bf16_of(rec, n, e) * bf16_to_fp32(xq.bf[r * k + b * 32 + e]);
      }
      store_one(y, r, n, acc, bias, accumulate);
    }
    for (int64_t r = 0; r < rows && w.kind != QuantKind::kBF16; ++r) {
      const int8_t* q = xq.q.data() + r * k;
      float acc = 0;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* rec = w.record(tile, b);
        const BlockParams p = block_params(w, n, b);
        int32_t isum[2] = {0, 0};  // inputs 0..15, 16..31
        for (int e = 0; e < 32; ++e) isum[e / 16] += quant_of(w, rec, n, e) * q[b * 32 + e];
        const float dx = xq.dx[r * nb + b];
        const int32_t* sx = xq.sx.data() + (r * nb + b) * 2;
        if (p.offset != 0) {
          isum[0] -= p.offset * sx[0];
          isum[1] -= p.offset * sx[1];
        }
        acc += dx * (p.d[0] * static_cast<float>(isum[0]) + p.d[1] * static_cast<float>(isum[1]));
        acc += p.m * xq.t[r * nb + b];
      }
      store_one(y, r, n, acc, bias, accumulate);
    }
  }
}

#if defined(__x86_64__)
// GCC 12 reports the intrinsics' own _mm512_undefined_*() placeholders as uninitialised once
// they are inlined into target("avx512...") functions; they are not reads of our data.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define BATON_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

// Four consecutive activation bytes in every lane (a vpbroadcastd from memory).
BATON_VNNI inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// 16 fp16 scales (one per row of the tile) as f32.
BATON_VNNI inline __m512 load_fp16x16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// 16 u8 (one per row of the tile) as f32.
BATON_VNNI inline __m512 load_u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// 16 int8 (one per row of the tile) as f32.
BATON_VNNI inline __m512 load_s8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// A tile's results for rows r0..r0+R-1: y = acc (+ bias) (+ y with `accumulate`), the tile's
// padding rows masked off.
template <int R>
BATON_VNNI inline void store_tile(const __m512 (&acc)[R], const QuantWeights& w, int64_t tile, int64_t r0,
                                  const float* bias, const Tensor& y, bool accumulate) {
  const int64_t n0 = tile * kQuantTileRows;
  const int64_t n_valid = std::min<int64_t>(kQuantTileRows, w.n - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << n_valid) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    float* dst = y.f32() + (r0 + r) * y.ld + n0;
    __m512 v = _mm512_add_ps(acc[r], bv);
    if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, dst));
    _mm512_mask_storeu_ps(dst, mask, v);
  }
}

// Rows r0..r0+R-1 of x against one 16-row tile. Per block: the tile's weights are loaded (the
// nibbles split, the high bits merged) and its scales converted once, then per row 8 vpdpbusd
// against broadcast activations, the offset folded into the integer sum, one convert and one or
// two fused multiply-adds for all 16 outputs.
template <int R, QuantKind K>
BATON_VNNI void gemm_tile_vnni(const QuantizedX& xq, const QuantWeights& w, int64_t tile, int64_t r0,
                               const float* bias, const Tensor& y, bool accumulate) {
  constexpr QuantTraits kT = quant_traits(K);
  constexpr bool kSuper = kT.scales == QuantScales::kKMin || kT.scales == QuantScales::kKSigned16;
  constexpr bool kMin = kT.scales == QuantScales::kDM || kT.scales == QuantScales::kKMin;
  const int64_t k = w.k, nb = w.n_blocks();
  const size_t quant_bytes = w.quant_bytes(), record_bytes = w.record_bytes(), header_bytes = w.super_header_bytes();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i bit4 = _mm512_set1_epi8(0x10);
  const __m512i bits45 = _mm512_set1_epi8(0x30);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  __m512 super_d = _mm512_setzero_ps(), super_dmin = _mm512_setzero_ps();
  const uint8_t* rec = w.record(tile, 0);
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (kSuper) {
      if (b % 8 == 0) {
        const uint8_t* h = rec - header_bytes;
        super_d = load_fp16x16(h);
        if constexpr (kT.scales == QuantScales::kKMin) super_dmin = load_fp16x16(h + 32);
      }
    }
    // wv[j]: inputs 4j..4j+3 of the block for the 16 rows (u8).
    __m512i wv[8];
    if constexpr (kT.high_bits < 0) {
      for (int j = 0; j < 8; ++j) wv[j] = _mm512_loadu_si512(rec + j * 64);
    } else {
      for (int j = 0; j < 4; ++j) {
        const __m512i packed = _mm512_loadu_si512(rec + j * 64);
        wv[j] = _mm512_and_si512(packed, low4);
        wv[4 + j] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
      }
      // wv | (shifted & mask) in one vpternlogd (A | (B & C) is truth table 0xF8).
      const auto merge = [](__m512i a, __m512i shifted, __m512i mask) {
        return _mm512_ternarylogic_epi32(a, shifted, mask, 0xF8);
      };
      if constexpr (kT.high_bits == 1) {  // input 4j + c's bit at j, 16 + 4j + c's at 4 + j: to bit 4
        const __m512i hi = _mm512_loadu_si512(rec + 256);
        wv[0] = merge(wv[0], _mm512_slli_epi16(hi, 4), bit4);
        wv[1] = merge(wv[1], _mm512_slli_epi16(hi, 3), bit4);
        wv[2] = merge(wv[2], _mm512_slli_epi16(hi, 2), bit4);
        wv[3] = merge(wv[3], _mm512_slli_epi16(hi, 1), bit4);
        wv[4] = merge(wv[4], hi, bit4);
        wv[5] = merge(wv[5], _mm512_srli_epi16(hi, 1), bit4);
        wv[6] = merge(wv[6], _mm512_srli_epi16(hi, 2), bit4);
        wv[7] = merge(wv[7], _mm512_srli_epi16(hi, 3), bit4);
      } else if constexpr (kT.high_bits == 2) {  // chunk h: input 16h + 4j + c's bits at 2j: to bits 4..5
        for (int h = 0; h < 2; ++h) {
          const __m512i hi = _mm512_loadu_si512(rec + 256 + h * 64);
          wv[4 * h + 0] = merge(wv[4 * h + 0], _mm512_slli_epi16(hi, 4), bits45);
          wv[4 * h + 1] = merge(wv[4 * h + 1], _mm512_slli_epi16(hi, 2), bits45);
          wv[4 * h + 2] = merge(wv[4 * h + 2], hi, bits45);
          wv[4 * h + 3] = merge(wv[4 * h + 3], _mm512_srli_epi16(hi, 2), bits45);
        }
      }
    }
    const uint8_t* sc = rec + quant_bytes;
    __m512 d0, d1 = _mm512_setzero_ps(), mv = _mm512_setzero_ps();
    if constexpr (kT.scales == QuantScales::kD) {
      d0 = load_fp16x16(sc);
    } else if constexpr (kT.scales == QuantScales::kDM) {
      d0 = load_fp16x16(sc);
      mv = load_fp16x16(sc + 32);
    } else if constexpr (kT.scales == QuantScales::kKMin) {
      d0 = _mm512_mul_ps(super_d, load_u8x16(sc));
      mv = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(super_dmin, load_u8x16(sc + 16)));
    } else {
      d0 = _mm512_mul_ps(super_d, load_s8x16(sc));
      d1 = _mm512_mul_ps(super_d, load_s8x16(sc + 16));
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xq.q.data() + (r0 + r) * k + b * 32;
      const int32_t* sx = xq.sx.data() + ((r0 + r) * nb + b) * 2;
      const __m512 dx = _mm512_set1_ps(xq.dx[(r0 + r) * nb + b]);
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {  // vpdpbusd: u8 first (the weights), s8 second
        s0 = _mm512_dpbusd_epi32(s0, wv[j], broadcast4(xb + 4 * j));
        s1 = _mm512_dpbusd_epi32(s1, wv[4 + j], broadcast4(xb + 16 + 4 * j));
      }
      if constexpr (kT.scales == QuantScales::kKSigned16) {  // a scale per 16
        s0 = _mm512_sub_epi32(s0, _mm512_set1_epi32(kT.offset * sx[0]));
        s1 = _mm512_sub_epi32(s1, _mm512_set1_epi32(kT.offset * sx[1]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(d0, dx), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(d1, dx), acc[r]);
      } else {
        __m512i s = _mm512_add_epi32(s0, s1);
        if constexpr (kT.offset != 0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(kT.offset * (sx[0] + sx[1])));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d0, dx), acc[r]);
        if constexpr (kMin) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xq.t[(r0 + r) * nb + b]), acc[r]);
      }
    }
    (void)d1;
    (void)mv;
    rec += record_bytes;
    if constexpr (kSuper) {
      if (b % 8 == 7) rec += header_bytes;
    }
  }
  store_tile<R>(acc, w, tile, r0, bias, y, accumulate);
}

// BF16 weights, rows r0..r0+R-1 of x against one 16-row tile: per pair of inputs one 64-byte
// chunk (2 inputs × 16 rows) times the broadcast pair of activations. With vdpbf16ps (kDp), one
// instruction per chunk and row; else the even inputs are the chunk shifted left 16 bits and the
// odd ones its high halves, as f32, in two FMAs. Few rows get several accumulators each, so a
// decode row's adds do not wait on each other.
template <int R, bool kDp>
BATON_VNNI __attribute__((target("avx512bf16"))) void gemm_tile_bf16(const QuantizedX& xq, const QuantWeights& w,
                                                                       int64_t tile, int64_t r0, const float* bias,
                                                                       const Tensor& y, bool accumulate) {
  constexpr int kAcc = R >= 4 ? 1 : 4 / R;
  const int64_t k = w.k;
  __m512 acc[R][kAcc];
  for (int r = 0; r < R; ++r) {
    for (int a = 0; a < kAcc; ++a) acc[r][a] = _mm512_setzero_ps();
  }
  const __m512i high16 = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const uint8_t* rec = w.record(tile, 0);
  for (int64_t p = 0; p < k / 2; ++p, rec += 64) {  // records are consecutive: no scales, no headers
    const __m512i wv = _mm512_loadu_si512(rec);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, xq.bf.data() + (r0 + r) * k + 2 * p, 4);
      __m512& a = acc[r][p % kAcc];
      if constexpr (kDp) {
        a = _mm512_dpbf16_ps(a, (__m512bh)wv, (__m512bh)_mm512_set1_epi32(pair));
      } else {
        const uint32_t bits = static_cast<uint32_t>(pair);
        float even, odd;
        const uint32_t even_bits = bits << 16, odd_bits = bits & 0xFFFF0000u;
        std::memcpy(&even, &even_bits, 4);
        std::memcpy(&odd, &odd_bits, 4);
        a = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(wv, 16)), _mm512_set1_ps(even), a);
        a = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(wv, high16)), _mm512_set1_ps(odd), a);
      }
    }
  }
  __m512 sum[R];
  for (int r = 0; r < R; ++r) {
    sum[r] = acc[r][0];
    for (int a = 1; a < kAcc; ++a) sum[r] = _mm512_add_ps(sum[r], acc[r][a]);
  }
  store_tile<R>(sum, w, tile, r0, bias, y, accumulate);
}

// pass(std::integral_constant<int, R>, r0) over x's rows: passes of kRowsPerPass rows, then one
// of the rest (each R its own instantiation: its accumulators in registers).
template <typename Pass>
void row_passes(int64_t rows, Pass&& pass) {
  int64_t r = 0;
  for (; r + kRowsPerPass <= rows; r += kRowsPerPass) pass(std::integral_constant<int, kRowsPerPass>{}, r);
  switch (rows - r) {
    case 7: pass(std::integral_constant<int, 7>{}, r); break;
    case 6: pass(std::integral_constant<int, 6>{}, r); break;
    case 5: pass(std::integral_constant<int, 5>{}, r); break;
    case 4: pass(std::integral_constant<int, 4>{}, r); break;
    case 3: pass(std::integral_constant<int, 3>{}, r); break;
    case 2: pass(std::integral_constant<int, 2>{}, r); break;
    case 1: pass(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

template <bool kDp>
void gemm_tile_bf16_rows(const QuantizedX& xq, const QuantWeights& w, int64_t tile, int64_t rows, const float* bias,
                         const Tensor& y, bool accumulate) {
  row_passes(rows, [&](auto R, int64_t r0) { gemm_tile_bf16<decltype(R)::value, kDp>(xq, w, tile, r0, bias, y, accumulate); });
}

template <QuantKind K>
void gemm_tile_vnni_rows(const QuantizedX& xq, const QuantWeights& w, int64_t tile, int64_t rows, const float* bias,
                         const Tensor& y, bool accumulate) {
  row_passes(rows, [&](auto R, int64_t r0) { gemm_tile_vnni<decltype(R)::value, K>(xq, w, tile, r0, bias, y, accumulate); });
}
#pragma GCC diagnostic pop
#endif

bool detect_bf16_dot() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

bool detect_fast() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

}  // namespace

bool quant_type_supported(uint32_t ggml_type) {
  switch (ggml_type) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: case kQ4_K: case kQ5_K: case kQ6_K: case kBF16:
      return true;
    default: return false;
  }
}

bool quant_gemm_fast() {
  static const bool fast = detect_fast() && std::getenv("BATON_QUANT_PORTABLE") == nullptr;
  return fast;
}

namespace {

// Q4_K sub-block j's (0..7) 6-bit scale and minimum (ggml's get_scale_min_k4).
void k4_scale_min(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One 32-block of row `row`: its quants u (4, 5, 6 or 8 bits).
void put_quants(QuantWeights& w, int64_t row, int64_t b, const uint8_t* u) {
  uint8_t* rec = record_of(w, row, b);
  const int hb = w.traits().high_bits;
  if (hb < 0) {
    for (int e = 0; e < 32; ++e) rec[quant_byte(w, row, e)] = u[e];
    return;
  }
  for (int e = 0; e < 16; ++e) {
    rec[quant_byte(w, row, e)] = static_cast<uint8_t>((u[e] & 0x0F) | ((u[e + 16] & 0x0F) << 4));
  }
  for (int e = 0; hb > 0 && e < 32; ++e) {
    rec[high_bits_byte(w, row, e)] |= static_cast<uint8_t>((u[e] >> 4) << high_bits_shift(w, e));
  }
}
// Its scales, after the quants (the file's fp16 bits, or a K-quant's sub-block values).
void put_scale16(QuantWeights& w, int64_t row, int64_t b, int slot, uint16_t h) {
  put_fp16_bits(record_of(w, row, b) + w.quant_bytes() + 32 * slot + 2 * (row % kQuantTileRows), h);
}
void put_scale8(QuantWeights& w, int64_t row, int64_t b, int slot, uint8_t v) {
  record_of(w, row, b)[w.quant_bytes() + 16 * slot + row % kQuantTileRows] = v;
}
// A K-quant super-block's fp16 header value `slot` (D, Dmin) of row `row`.
void put_super16(QuantWeights& w, int64_t row, int64_t sb, int slot, uint16_t h) {
  uint8_t* p = const_cast<uint8_t*>(w.super_header(row / kQuantTileRows, sb * 8));
  put_fp16_bits(p + 32 * slot + 2 * (row % kQuantTileRows), h);
}

// A legacy 4- or 5-bit block's 32 quants: qs[j] holds elements j (low nibble) and j + 16 (high);
// qh (5-bit) bit j is element j's fifth bit.
void legacy_quants(const uint8_t* qs, const uint8_t* qh, uint8_t* u) {
  uint32_t h = 0;
  if (qh != nullptr) std::memcpy(&h, qh, 4);
  for (int j = 0; j < 16; ++j) {
    u[j] = static_cast<uint8_t>((qs[j] & 0x0F) | (((h >> j) & 1) << 4));
    u[j + 16] = static_cast<uint8_t>((qs[j] >> 4) | (((h >> (j + 16)) & 1) << 4));
  }
}

// BF16 rows into 16-row tiles of pairs (quant_gemm.h).
Result<QuantWeights> repack_bf16(std::span<const uint8_t> values, int64_t n, int64_t k) {
  if (n <= 0 || k <= 0 || k % 32 != 0) {
    return invalid_argument("native bf16 weights need a row width that is a multiple of 32, got " + std::to_string(k));
  }
  if (values.size() != static_cast<size_t>(n * k) * 2) {
    return invalid_argument("bf16 weight of " + std::to_string(values.size()) + " bytes is not " + std::to_string(n) +
                            " rows of " + std::to_string(k));
  }
  QuantWeights w;
  w.kind = QuantKind::kBF16;
  w.n = n;
  w.k = k;
  w.data.assign_zero(static_cast<size_t>(w.n_tiles()) * w.tile_bytes());
  for (int64_t row = 0; row < n; ++row) {
    for (int64_t b = 0; b < k / 32; ++b) {
      uint8_t* rec = record_of(w, row, b);
      for (int e = 0; e < 32; ++e) std::memcpy(rec + bf16_byte(row, e), values.data() + (row * k + b * 32 + e) * 2, 2);
    }
  }
  return w;
}

}  // namespace

Result<QuantWeights> repack_quant(uint32_t type, std::span<const uint8_t> blocks, int64_t n, int64_t k) {
  if (!quant_type_supported(type)) return invalid_argument("no native kernel for ggml type " + std::to_string(type));
  if (type == kBF16) return repack_bf16(blocks, n, k);
  const bool kquant = type == kQ4_K || type == kQ5_K || type == kQ6_K;
  const int64_t block_elems = kquant ? 256 : 32;
  if (n <= 0 || k <= 0 || k % block_elems != 0) {
    return invalid_argument("native weights need a row width that is a multiple of " + std::to_string(block_elems) +
                            " for this type, got " + std::to_string(k));
  }
  size_t block_bytes = 0;
  QuantWeights w;
  switch (type) {
    case kQ4_0: block_bytes = 18, w.kind = QuantKind::kW4; break;
    case kQ4_1: block_bytes = 20, w.kind = QuantKind::kW4M; break;
    case kQ5_0: block_bytes = 22, w.kind = QuantKind::kW5; break;
    case kQ5_1: block_bytes = 24, w.kind = QuantKind::kW5M; break;
    case kQ8_0: block_bytes = 34, w.kind = QuantKind::kW8; break;
    case kQ4_K: block_bytes = 144, w.kind = QuantKind::kW4K; break;
    case kQ5_K: block_bytes = 176, w.kind = QuantKind::kW5K; break;
    default: block_bytes = 210, w.kind = QuantKind::kW6K; break;
  }
  const int64_t n_src = k / block_elems;
  if (blocks.size() != static_cast<size_t>(n * n_src) * block_bytes) {
    return invalid_argument("quantised weight of " + std::to_string(blocks.size()) + " bytes is not " +
                            std::to_string(n) + " rows of " + std::to_string(n_src) + " blocks");
  }
  w.n = n;
  w.k = k;
  w.data.assign_zero(static_cast<size_t>(w.n_tiles()) * w.tile_bytes());  // padding rows: zero weights and scales
  for (int64_t row = 0; row < n; ++row) {
    for (int64_t sb = 0; sb < n_src; ++sb) {
      const uint8_t* blk = blocks.data() + (row * n_src + sb) * block_bytes;
      uint8_t u[256];
      switch (type) {
        case kQ8_0:
          for (int e = 0; e < 32; ++e) u[e] = static_cast<uint8_t>(blk[2 + e] ^ 0x80);  // q + 128
          put_quants(w, row, sb, u);
          put_scale16(w, row, sb, 0, fp16_bits(blk));
          break;
        case kQ4_0:
        case kQ4_1:
        case kQ5_0:
        case kQ5_1: {  // d, (m), (qh), qs
          const bool has_min = type == kQ4_1 || type == kQ5_1, five = type == kQ5_0 || type == kQ5_1;
          const uint8_t* after_scales = blk + (has_min ? 4 : 2);
          legacy_quants(after_scales + (five ? 4 : 0), five ? after_scales : nullptr, u);
          put_quants(w, row, sb, u);
          put_scale16(w, row, sb, 0, fp16_bits(blk));
          if (has_min) put_scale16(w, row, sb, 1, fp16_bits(blk + 2));
          break;
        }
        case kQ4_K:
        case kQ5_K: {
          // 8 blocks of 32: value = (d·sc)·u − (dmin·m), u 4 bits (+ a fifth: Q5_K's qh, bit j of
          // byte l for element l of block j) (model/dequant.cpp).
          put_super16(w, row, sb, 0, fp16_bits(blk));
          put_super16(w, row, sb, 1, fp16_bits(blk + 2));
          const uint8_t* scales = blk + 4;
          const uint8_t* qh = type == kQ5_K ? blk + 16 : nullptr;
          const uint8_t* qs = blk + (type == kQ5_K ? 48 : 16);
          for (int j = 0; j < 8; ++j) {
            int sc, m;
            k4_scale_min(j, scales, &sc, &m);
            for (int l = 0; l < 32; ++l) {
              const uint8_t byte = qs[32 * (j / 2) + l];
              const int hi = qh != nullptr ? (qh[l] >> j) & 1 : 0;
              u[l] = static_cast<uint8_t>((j % 2 == 0 ? byte & 0xF : byte >> 4) | (hi << 4));
            }
            put_quants(w, row, sb * 8 + j, u);
            put_scale8(w, row, sb * 8 + j, 0, static_cast<uint8_t>(sc));
            put_scale8(w, row, sb * 8 + j, 1, static_cast<uint8_t>(m));
          }
          break;
        }
        default: {  // Q6_K: 16 blocks of 16, value = (d·sc)·(u − 32), u = 4 low bits | 2 high bits << 4
          const uint8_t* ql = blk;
          const uint8_t* qh = blk + 128;
          const uint8_t* sc = blk + 192;
          put_super16(w, row, sb, 0, fp16_bits(blk + 208));
          for (int h = 0; h < 2; ++h) {
            for (int l = 0; l < 32; ++l) {
              const uint8_t* lo = ql + 64 * h;
              const uint8_t hb = qh[32 * h + l];
              u[128 * h + l] = static_cast<uint8_t>((lo[l] & 0xF) | (((hb >> 0) & 3) << 4));
              u[128 * h + l + 32] = static_cast<uint8_t>((lo[l + 32] & 0xF) | (((hb >> 2) & 3) << 4));
              u[128 * h + l + 64] = static_cast<uint8_t>((lo[l] >> 4) | (((hb >> 4) & 3) << 4));
              u[128 * h + l + 96] = static_cast<uint8_t>((lo[l + 32] >> 4) | (((hb >> 6) & 3) << 4));
            }
          }
          for (int j = 0; j < 8; ++j) {  // 32-blocks, two int8 scales each
            put_quants(w, row, sb * 8 + j, u + 32 * j);
            put_scale8(w, row, sb * 8 + j, 0, sc[2 * j]);
            put_scale8(w, row, sb * 8 + j, 1, sc[2 * j + 1]);
          }
          break;
        }
      }
    }
  }
  return w;
}

void dequantize_row(const QuantWeights& w, int64_t row, float* out) {
  const int64_t tile = row / kQuantTileRows;
  for (int64_t b = 0; b < w.n_blocks(); ++b) {
    const uint8_t* rec = w.record(tile, b);
    if (w.kind == QuantKind::kBF16) {
      for (int e = 0; e < 32; ++e) out[b * 32 + e] = bf16_of(rec, row, e);
      continue;
    }
    const BlockParams p = block_params(w, row, b);
    for (int e = 0; e < 32; ++e) {
      out[b * 32 + e] = p.d[e / 16] * static_cast<float>(quant_of(w, rec, row, e) - p.offset) + p.m;
    }
  }
}

void quantize_activations(const float* x, int64_t rows, int64_t k, int64_t ld, int8_t* qx, float* dx) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < k / 32; ++b) {
      const float* xb = x + r * ld + b * 32;
      float amax = 0;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float id = amax > 0 ? 127.0f / amax : 0.0f;
      for (int j = 0; j < 32; ++j) qx[r * k + b * 32 + j] = static_cast<int8_t>(std::nearbyint(xb[j] * id));
      dx[r * (k / 32) + b] = amax / 127.0f;
    }
  }
}

void quant_gemm(const Tensor& x, const QuantWeights& w, const float* bias, const Tensor& y, bool accumulate,
                QuantKernel kernel) {
  BATON_CHECK(x.dtype == DType::kF32 && y.dtype == DType::kF32, "quant_gemm takes f32 activations");
  BATON_CHECK(x.cols == w.k && y.cols == w.n && y.rows == x.rows, "quant_gemm shapes");
  const int64_t rows = x.rows;
  if (rows == 0) return;
  thread_local QuantizedX scratch;  // the caller's; the team reads it through `xq`
  if (w.kind == QuantKind::kBF16) {
    round_for(x, &scratch);
  } else {
    quantize_for(x, &scratch);
  }
  const QuantizedX& xq = scratch;
  const bool fast = quant_gemm_fast() && kernel != QuantKernel::kPortable;
  static const bool has_bf16_dot = detect_bf16_dot();
  const bool bf16_dot = has_bf16_dot && kernel != QuantKernel::kNoBf16Dot;
  // One 16-row weight tile at a time, all activation rows against it (the tile stays in L1), the
  // team's threads each a contiguous range of tiles (the weights stream in order).
#pragma omp parallel for schedule(static) if (worth_parallel(w.n * w.k))
  for (int64_t tile = 0; tile < w.n_tiles(); ++tile) {
#if defined(__x86_64__)
    if (fast) {
      switch (w.kind) {
#define BATON_QUANT_CASE(K) \
  case QuantKind::K: gemm_tile_vnni_rows<QuantKind::K>(xq, w, tile, rows, bias, y, accumulate); break;
        BATON_QUANT_CASE(kW4)
        BATON_QUANT_CASE(kW4M)
        BATON_QUANT_CASE(kW4K)
        BATON_QUANT_CASE(kW5)
        BATON_QUANT_CASE(kW5M)
        BATON_QUANT_CASE(kW5K)
        BATON_QUANT_CASE(kW6K)
        BATON_QUANT_CASE(kW8)
#undef BATON_QUANT_CASE
        case QuantKind::kBF16:
          if (bf16_dot) {
            gemm_tile_bf16_rows<true>(xq, w, tile, rows, bias, y, accumulate);
          } else {
            gemm_tile_bf16_rows<false>(xq, w, tile, rows, bias, y, accumulate);
          }
          break;
      }
      continue;
    }
#endif
    gemm_tile_portable(xq, w, tile, rows, bias, y, accumulate);
  }
}

}  // namespace baton::cpu
