#include "kernels/cpu/quant_gemm.h"

#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "common/check.h"
#include "kernels/half.h"
#include "kernels/cpu/parallel.h"

namespace baton::cpu {
namespace {

// GGUF type ids (model/gguf.h's GgmlType; kernels/ does not see model/).
constexpr uint32_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14;

// Activation rows per pass over a weight tile: 8 int32 and 8 f32 accumulators plus the block's 8
// weight vectors fit AVX-512's 32 registers; more rows take another pass over the tile (in L1).
constexpr int kRowsPerPass = 8;

float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return fp16_to_fp32(h);
}

// Where row `row`'s input e (0..31) of block b lives (quant_gemm.h's layout).
size_t tile_block(const QuantWeights& w, int64_t row, int64_t b) {
  return static_cast<size_t>((row / kQuantTileRows) * w.n_blocks() + b);
}
size_t w4_byte(const QuantWeights& w, int64_t row, int64_t b, int e) {  // nibble: e / 16
  return tile_block(w, row, b) * 256 + static_cast<size_t>(((e % 16) / 4) * 64 + (row % kQuantTileRows) * 4 + e % 4);
}
size_t w8_byte(const QuantWeights& w, int64_t row, int64_t b, int e) {
  return tile_block(w, row, b) * 512 + static_cast<size_t>((e / 4) * 64 + (row % kQuantTileRows) * 4 + e % 4);
}
size_t scale_index(const QuantWeights& w, int64_t row, int64_t b, int half) {
  return (tile_block(w, row, b) * static_cast<size_t>(w.scales_per_block()) + static_cast<size_t>(half)) * 16 +
         static_cast<size_t>(row % kQuantTileRows);
}
size_t min_index(const QuantWeights& w, int64_t row, int64_t b) {
  return tile_block(w, row, b) * 16 + static_cast<size_t>(row % kQuantTileRows);
}

// Scratch of one quant_gemm call: x quantised, per row, in natural order.
struct QuantizedX {
  std::vector<int8_t> q;  // [rows, k] (W8: + 128, i.e. u8)
  std::vector<float> dx;  // [rows, k/32]
  std::vector<float> t;   // [rows, k/32]: W4 dx·Σqx, W8 dx (what m multiplies)
};

void quantize_for(const Tensor& x, QuantKind kind, QuantizedX* out) {
  const int64_t rows = x.rows, k = x.cols, nb = k / 32;
  out->q.resize(static_cast<size_t>(rows * k));
  out->dx.resize(static_cast<size_t>(rows * nb));
  out->t.resize(static_cast<size_t>(rows * nb));
  const int shift = kind != QuantKind::kW4 ? 0x80 : 0;  // xor 0x80 = + 128 as u8
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x.f32() + r * x.ld;
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = xr + b * 32;
      float amax = 0;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float id = amax > 0 ? 127.0f / amax : 0.0f;
      const float dx = amax / 127.0f;
      int sum = 0;
      int8_t* q = out->q.data() + r * k + b * 32;
      for (int j = 0; j < 32; ++j) {
        const int v = static_cast<int>(std::nearbyint(xb[j] * id));
        sum += v;
        q[j] = static_cast<int8_t>(v ^ shift);
      }
      out->dx[r * nb + b] = dx;
      out->t[r * nb + b] = kind == QuantKind::kW4 ? dx * static_cast<float>(sum) : dx;
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
    for (int64_t r = 0; r < rows; ++r) {
      const int8_t* q = xq.q.data() + r * k;
      float acc = 0;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t isum[2] = {0, 0};  // inputs 0..15, 16..31
        for (int e = 0; e < 32; ++e) {
          int32_t wv, xv;
          if (w.kind == QuantKind::kW4) {
            const uint8_t byte = w.qs[w4_byte(w, n, b, e)];
            wv = e < 16 ? (byte & 0x0F) : (byte >> 4);
            xv = q[b * 32 + e];
          } else {
            wv = static_cast<int8_t>(w.qs[w8_byte(w, n, b, e)]);
            xv = static_cast<uint8_t>(q[b * 32 + e]);
          }
          isum[e / 16] += wv * xv;
        }
        const float dx = xq.dx[r * nb + b];
        if (w.kind == QuantKind::kW8S16) {
          acc += dx * (w.d[scale_index(w, n, b, 0)] * static_cast<float>(isum[0]) +
                       w.d[scale_index(w, n, b, 1)] * static_cast<float>(isum[1]));
        } else {
          acc += w.d[scale_index(w, n, b, 0)] * dx * static_cast<float>(isum[0] + isum[1]);
        }
        acc += w.m[min_index(w, n, b)] * xq.t[r * nb + b];
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

// Rows r0..r0+R-1 of x against one 16-row tile. Per block: the tile's weights are loaded (and
// W4's nibbles split) once, then per row 8 vpdpbusd against broadcast activations, one convert
// and two fused multiply-adds (scale, minimum) for all 16 outputs.
template <int R, QuantKind K>
BATON_VNNI void gemm_tile_vnni(const QuantizedX& xq, const QuantWeights& w, int64_t tile, int64_t r0,
                               const float* bias, const Tensor& y, bool accumulate) {
  const int64_t k = w.k, nb = w.n_blocks();
  const uint8_t* wq = w.qs.data() + static_cast<size_t>(tile * nb) * w.tile_block_bytes();
  const float* d = w.d.data() + tile * nb * 16 * w.scales_per_block();
  const float* m = w.m.data() + tile * nb * 16;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    // wv[j]: inputs 4j..4j+3 of the block for the 16 rows.
    __m512i wv[8];
    if constexpr (K == QuantKind::kW4) {
      for (int j = 0; j < 4; ++j) {
        const __m512i packed = _mm512_loadu_si512(wq + b * 256 + j * 64);
        wv[j] = _mm512_and_si512(packed, low4);
        wv[4 + j] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
      }
    } else {
      for (int j = 0; j < 8; ++j) wv[j] = _mm512_loadu_si512(wq + b * 512 + j * 64);
    }
    const __m512 d0 = _mm512_loadu_ps(d + b * 16 * w.scales_per_block());
    const __m512 mv = _mm512_loadu_ps(m + b * 16);
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xq.q.data() + (r0 + r) * k + b * 32;
      const __m512 dx = _mm512_set1_ps(xq.dx[(r0 + r) * nb + b]);
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        if constexpr (K == QuantKind::kW4) {  // vpdpbusd: u8 first (the weights), s8 second
          s0 = _mm512_dpbusd_epi32(s0, wv[j], broadcast4(xb + 4 * j));
          s1 = _mm512_dpbusd_epi32(s1, wv[4 + j], broadcast4(xb + 16 + 4 * j));
        } else {  // the activations as u8 (+ 128), the weights int8
          s0 = _mm512_dpbusd_epi32(s0, broadcast4(xb + 4 * j), wv[j]);
          s1 = _mm512_dpbusd_epi32(s1, broadcast4(xb + 16 + 4 * j), wv[4 + j]);
        }
      }
      if constexpr (K == QuantKind::kW8S16) {
        const __m512 d1 = _mm512_loadu_ps(d + b * 32 + 16);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(d0, dx), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(d1, dx), acc[r]);
      } else {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_mul_ps(d0, dx), acc[r]);
      }
      acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xq.t[(r0 + r) * nb + b]), acc[r]);
    }
  }
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

template <QuantKind K>
void gemm_tile_vnni_rows(const QuantizedX& xq, const QuantWeights& w, int64_t tile, int64_t rows, const float* bias,
                         const Tensor& y, bool accumulate) {
  int64_t r = 0;
  for (; r + kRowsPerPass <= rows; r += kRowsPerPass) {
    gemm_tile_vnni<kRowsPerPass, K>(xq, w, tile, r, bias, y, accumulate);
  }
  switch (rows - r) {
    case 7: gemm_tile_vnni<7, K>(xq, w, tile, r, bias, y, accumulate); break;
    case 6: gemm_tile_vnni<6, K>(xq, w, tile, r, bias, y, accumulate); break;
    case 5: gemm_tile_vnni<5, K>(xq, w, tile, r, bias, y, accumulate); break;
    case 4: gemm_tile_vnni<4, K>(xq, w, tile, r, bias, y, accumulate); break;
    case 3: gemm_tile_vnni<3, K>(xq, w, tile, r, bias, y, accumulate); break;
    case 2: gemm_tile_vnni<2, K>(xq, w, tile, r, bias, y, accumulate); break;
    case 1: gemm_tile_vnni<1, K>(xq, w, tile, r, bias, y, accumulate); break;
    default: break;
  }
}
#pragma GCC diagnostic pop
#endif

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
  return ggml_type == kQ4_0 || ggml_type == kQ4_1 || ggml_type == kQ8_0 || ggml_type == kQ4_K || ggml_type == kQ6_K;
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

// One 32-block of row `row` from its 32 values: W4 u (0..15) with scale and minimum; W8 q (int8)
// with a scale per 32 (W8) or per 16 (W8S16, d[0] for inputs 0..15, d[1] for 16..31), m the
// u8 shift's correction −128·Σ d·q.
void put_w4_block(QuantWeights& w, int64_t row, int64_t b, const uint8_t* u, float d, float m) {
  for (int e = 0; e < 16; ++e) w.qs[w4_byte(w, row, b, e)] = static_cast<uint8_t>(u[e] | (u[e + 16] << 4));
  w.d[scale_index(w, row, b, 0)] = d;
  w.m[min_index(w, row, b)] = m;
}
void put_w8_block(QuantWeights& w, int64_t row, int64_t b, const int8_t* q, const float* d) {
  float corr = 0;
  for (int h = 0; h < w.scales_per_block(); ++h) {
    const int per = 32 / static_cast<int>(w.scales_per_block());
    int sum = 0;
    for (int e = h * per; e < (h + 1) * per; ++e) {
      w.qs[w8_byte(w, row, b, e)] = static_cast<uint8_t>(q[e]);
      sum += q[e];
    }
    w.d[scale_index(w, row, b, h)] = d[h];
    corr += d[h] * static_cast<float>(sum);
  }
  w.m[min_index(w, row, b)] = -128.0f * corr;
}

}  // namespace

Result<QuantWeights> repack_quant(uint32_t type, std::span<const uint8_t> blocks, int64_t n, int64_t k) {
  if (!quant_type_supported(type)) return invalid_argument("no native kernel for ggml type " + std::to_string(type));
  const bool kquant = type == kQ4_K || type == kQ6_K;
  const int64_t block_elems = kquant ? 256 : 32;
  if (n <= 0 || k <= 0 || k % block_elems != 0) {
    return invalid_argument("native weights need a row width that is a multiple of " + std::to_string(block_elems) +
                            " for this type, got " + std::to_string(k));
  }
  const size_t block_bytes = type == kQ4_0 ? 18 : type == kQ4_1 ? 20 : type == kQ8_0 ? 34 : type == kQ4_K ? 144 : 210;
  const int64_t n_src = k / block_elems;
  if (blocks.size() != static_cast<size_t>(n * n_src) * block_bytes) {
    return invalid_argument("quantised weight of " + std::to_string(blocks.size()) + " bytes is not " +
                            std::to_string(n) + " rows of " + std::to_string(n_src) + " blocks");
  }
  QuantWeights w;
  w.kind = type == kQ8_0 ? QuantKind::kW8 : type == kQ6_K ? QuantKind::kW8S16 : QuantKind::kW4;
  w.n = n;
  w.k = k;
  const size_t tile_blocks = static_cast<size_t>(w.n_tiles() * w.n_blocks());
  w.qs.assign(tile_blocks * w.tile_block_bytes(), 0);  // padding rows: zero weights, scales, minimums
  w.d.assign(tile_blocks * 16 * static_cast<size_t>(w.scales_per_block()), 0.0f);
  w.m.assign(tile_blocks * 16, 0.0f);
  for (int64_t row = 0; row < n; ++row) {
    for (int64_t sb = 0; sb < n_src; ++sb) {
      const uint8_t* blk = blocks.data() + (row * n_src + sb) * block_bytes;
      if (type == kQ8_0) {
        const float d = fp16(blk);
        put_w8_block(w, row, sb, reinterpret_cast<const int8_t*>(blk + 2), &d);
      } else if (type == kQ4_0 || type == kQ4_1) {
        // qs[j] holds elements j (low nibble) and j + 16 (high).
        const uint8_t* qs = blk + (type == kQ4_0 ? 2 : 4);
        uint8_t u[32];
        for (int j = 0; j < 16; ++j) {
          u[j] = qs[j] & 0x0F;
          u[j + 16] = qs[j] >> 4;
        }
        const float d = fp16(blk);
        put_w4_block(w, row, sb, u, d, type == kQ4_0 ? -8.0f * d : fp16(blk + 2));
      } else if (type == kQ4_K) {
        // 8 blocks of 32: value = (d·sc)·u − (dmin·m), u the 4-bit values (model/dequant.cpp).
        const float d = fp16(blk), dmin = fp16(blk + 2);
        const uint8_t* scales = blk + 4;
        const uint8_t* qs = blk + 16;
        for (int j = 0; j < 8; ++j) {
          int sc, m;
          k4_scale_min(j, scales, &sc, &m);
          uint8_t u[32];
          for (int l = 0; l < 32; ++l) u[l] = j % 2 == 0 ? qs[32 * (j / 2) + l] & 0xF : qs[32 * (j / 2) + l] >> 4;
          put_w4_block(w, row, sb * 8 + j, u, d * static_cast<float>(sc), -(dmin * static_cast<float>(m)));
        }
      } else {  // Q6_K: 16 blocks of 16, value = (d·sc)·(q − 32)
        const uint8_t* ql = blk;
        const uint8_t* qh = blk + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        const float d = fp16(blk + 208);
        int8_t q[256];
        for (int h = 0; h < 2; ++h) {
          for (int l = 0; l < 32; ++l) {
            const uint8_t* lo = ql + 64 * h;
            const uint8_t hb = qh[32 * h + l];
            q[128 * h + l] = static_cast<int8_t>(((lo[l] & 0xF) | (((hb >> 0) & 3) << 4)) - 32);
            q[128 * h + l + 32] = static_cast<int8_t>(((lo[l + 32] & 0xF) | (((hb >> 2) & 3) << 4)) - 32);
            q[128 * h + l + 64] = static_cast<int8_t>(((lo[l] >> 4) | (((hb >> 4) & 3) << 4)) - 32);
            q[128 * h + l + 96] = static_cast<int8_t>(((lo[l + 32] >> 4) | (((hb >> 6) & 3) << 4)) - 32);
          }
        }
        for (int j = 0; j < 8; ++j) {  // 32-blocks, two scales each
          const float ds[2] = {d * sc[2 * j], d * sc[2 * j + 1]};
          put_w8_block(w, row, sb * 8 + j, q + 32 * j, ds);
        }
      }
    }
  }
  return w;
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
                bool portable) {
  BATON_CHECK(x.dtype == DType::kF32 && y.dtype == DType::kF32, "quant_gemm takes f32 activations");
  BATON_CHECK(x.cols == w.k && y.cols == w.n && y.rows == x.rows, "quant_gemm shapes");
  const int64_t rows = x.rows;
  if (rows == 0) return;
  thread_local QuantizedX scratch;  // the caller's; the team reads it through `xq`
  quantize_for(x, w.kind, &scratch);
  const QuantizedX& xq = scratch;
  const bool fast = quant_gemm_fast() && !portable;
  // One 16-row weight tile at a time, all activation rows against it (the tile stays in L1), the
  // team's threads each a contiguous range of tiles (the weights stream in order).
#pragma omp parallel for schedule(static) if (worth_parallel(w.n * w.k))
  for (int64_t tile = 0; tile < w.n_tiles(); ++tile) {
#if defined(__x86_64__)
    if (fast) {
      if (w.kind == QuantKind::kW4) {
        gemm_tile_vnni_rows<QuantKind::kW4>(xq, w, tile, rows, bias, y, accumulate);
      } else if (w.kind == QuantKind::kW8) {
        gemm_tile_vnni_rows<QuantKind::kW8>(xq, w, tile, rows, bias, y, accumulate);
      } else {
        gemm_tile_vnni_rows<QuantKind::kW8S16>(xq, w, tile, rows, bias, y, accumulate);
      }
      continue;
    }
#endif
    gemm_tile_portable(xq, w, tile, rows, bias, y, accumulate);
  }
}

}  // namespace baton::cpu
