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

// Packed order, per group of 64 elements (two blocks b, b+1): [b 0..15, b+1 0..15, b 16..31,
// b+1 16..31]. It is the order a W4 group's 32 bytes unpack into (low nibbles of both blocks,
// then high nibbles), so a W4 group needs no shuffle; W8 weights and the activations are stored
// in it too. A vpdpbusd over a group gives lanes 0-3 and 8-11 for block b, 4-7 and 12-15 for b+1.
inline int64_t packed_index(int64_t j) {  // j in 0..63 (natural order within the group)
  const int64_t block = j / 32, e = j % 32;
  return (e / 16) * 32 + block * 16 + e % 16;
}

float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return fp16_to_fp32(h);
}

// Scratch of one quant_gemm call: x quantised in packed order, per row.
struct QuantizedX {
  std::vector<int8_t> q;    // [rows, k] packed order (W8: + 128, i.e. u8)
  std::vector<float> dx;    // [rows, k/32]
  std::vector<float> t;     // [rows, k/32]: W4 dx·Σqx, W8 dx (what m multiplies)
};

void quantize_for(const Tensor& x, QuantKind kind, QuantizedX* out) {
  const int64_t rows = x.rows, k = x.cols, nb = k / 32;
  out->q.resize(static_cast<size_t>(rows * k));
  out->dx.resize(static_cast<size_t>(rows * nb));
  out->t.resize(static_cast<size_t>(rows * nb));
  const int8_t shift = kind != QuantKind::kW4 ? static_cast<int8_t>(-128) : 0;  // xor 0x80 = + 128 as u8
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x.f32() + r * x.ld;
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = xr + b * 32;
      float amax = 0;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float id = amax > 0 ? 127.0f / amax : 0.0f;
      const float dx = amax / 127.0f;
      int sum = 0;
      const int64_t group = (b / 2) * 64;
      for (int j = 0; j < 32; ++j) {
        const int q = static_cast<int>(std::nearbyint(xb[j] * id));
        sum += q;
        out->q[r * k + group + packed_index((b % 2) * 32 + j)] = static_cast<int8_t>(q ^ shift);
      }
      out->dx[r * nb + b] = dx;
      out->t[r * nb + b] = kind == QuantKind::kW4 ? dx * static_cast<float>(sum) : dx;
    }
  }
}

// Σ_b m[b]·t[b] over nb blocks.
inline float min_term(const float* m, const float* t, int64_t nb) {
  float s = 0;
  for (int64_t b = 0; b < nb; ++b) s += m[b] * t[b];
  return s;
}

// The portable kernel: the same sums, one element at a time.
void gemm_rows_portable(const QuantizedX& xq, const QuantWeights& w, int64_t n, int64_t rows, float* out) {
  const int64_t k = w.k, nb = k / 32;
  const uint8_t* wq = w.qs.data() + n * w.row_bytes();
  const float* d = w.d.data() + n * w.scales_per_row();
  const float* m = w.m.data() + n * nb;
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* q = xq.q.data() + r * k;
    float acc = 0;
    for (int64_t g = 0; g < k / 64; ++g) {
      // Per 16 weights: [block b 0..15, b 16..31, b+1 0..15, b+1 16..31].
      int32_t isum[4] = {0, 0, 0, 0};
      for (int64_t p = 0; p < 64; ++p) {  // p: packed position
        const int block = static_cast<int>((p % 32) / 16), half = static_cast<int>(p / 32);
        int32_t wv, xv;
        if (w.kind == QuantKind::kW4) {
          const uint8_t byte = wq[g * 32 + p % 32];
          wv = p < 32 ? (byte & 0x0F) : (byte >> 4);
          xv = q[g * 64 + p];
        } else {
          wv = static_cast<int8_t>(wq[g * 64 + p]);
          xv = static_cast<uint8_t>(q[g * 64 + p]);
        }
        isum[2 * block + half] += wv * xv;
      }
      for (int h = 0; h < 2; ++h) {
        const int64_t b = 2 * g + h;
        const float dx = xq.dx[r * nb + b];
        if (w.kind == QuantKind::kW8S16) {
          acc += dx * (d[2 * b] * static_cast<float>(isum[2 * h]) + d[2 * b + 1] * static_cast<float>(isum[2 * h + 1]));
        } else {
          acc += d[b] * dx * static_cast<float>(isum[2 * h] + isum[2 * h + 1]);
        }
      }
    }
    out[r] = acc + min_term(m, xq.t.data() + r * nb, nb);
  }
}

#if defined(__x86_64__)
// GCC 12 reports the intrinsics' own _mm512_undefined_*() placeholders as uninitialised once
// they are inlined into target("avx512...") functions; they are not reads of our data.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define BATON_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

// Up to four rows against weight row n. Per group: the weights are unpacked once; per row one
// vpdpbusd, one multiply by dx and one fused multiply-add by d.
template <int R, QuantKind K>
BATON_VNNI void gemm_rows_vnni(const QuantizedX& xq, const QuantWeights& w, int64_t n, int64_t r0, float* out) {
  const int64_t k = w.k, nb = k / 32, ng = k / 64;
  const uint8_t* wq = w.qs.data() + n * w.row_bytes();
  const float* d = w.d.data() + n * w.scales_per_row();
  const __m512i pair_idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
  // W8S16: lanes 0-3 hold block b's weights 0..15, 4-7 b+1's 0..15, 8-11 b's 16..31, 12-15
  // b+1's 16..31; the group's four scales are [b 0..15, b 16..31, b+1 0..15, b+1 16..31].
  const __m512i quad_idx = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 3, 3, 3, 3);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* xrow[R];
  const float* dxrow[R];
  for (int r = 0; r < R; ++r) {
    xrow[r] = xq.q.data() + (r0 + r) * k;
    dxrow[r] = xq.dx.data() + (r0 + r) * nb;
  }
  for (int64_t g = 0; g < ng; ++g) {
    __m512i wv;
    if constexpr (K == QuantKind::kW4) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + g * 32));
      const __m256i lo = _mm256_and_si256(packed, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
      wv = _mm512_inserti64x4(_mm512_zextsi256_si512(lo), hi, 1);
    } else {
      wv = _mm512_loadu_si512(wq + g * 64);
    }
    __m512 dpat;
    if constexpr (K == QuantKind::kW8S16) {
      dpat = _mm512_permutexvar_ps(quad_idx, _mm512_zextps128_ps512(_mm_loadu_ps(d + 4 * g)));
    } else {
      dpat = _mm512_permutexvar_ps(
          pair_idx, _mm512_zextps128_ps512(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(d + 2 * g)))));
    }
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_loadu_si512(xrow[r] + g * 64);
      const __m512i prod = K == QuantKind::kW4 ? _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv)
                                               : _mm512_dpbusd_epi32(_mm512_setzero_si512(), xv, wv);
      const __m512 dxpat = _mm512_permutexvar_ps(
          pair_idx, _mm512_zextps128_ps512(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(dxrow[r] + 2 * g)))));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(prod), dxpat), dpat, acc[r]);
    }
  }
  const float* m = w.m.data() + n * nb;
  for (int r = 0; r < R; ++r) {
    const float* t = xq.t.data() + (r0 + r) * nb;
    __m512 s = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 16 <= nb; b += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(m + b), _mm512_loadu_ps(t + b), s);
    if (b < nb) {
      const __mmask16 mask = static_cast<__mmask16>((1u << (nb - b)) - 1);
      s = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, m + b), _mm512_maskz_loadu_ps(mask, t + b), s);
    }
    out[r] = _mm512_reduce_add_ps(acc[r]) + _mm512_reduce_add_ps(s);
  }
}

template <QuantKind K>
void gemm_row_vnni(const QuantizedX& xq, const QuantWeights& w, int64_t n, int64_t rows, float* out) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) gemm_rows_vnni<4, K>(xq, w, n, r, out + r);
  switch (rows - r) {
    case 3: gemm_rows_vnni<3, K>(xq, w, n, r, out + r); break;
    case 2: gemm_rows_vnni<2, K>(xq, w, n, r, out + r); break;
    case 1: gemm_rows_vnni<1, K>(xq, w, n, r, out + r); break;
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

// One 32-block of W4 from its 32 values u (0..15), scale and minimum: the layout Q4_0's qs have
// (byte j: u_j low, u_{j+16} high), at its place in the packed group.
void put_w4_block(QuantWeights& w, int64_t row, int64_t b, const uint8_t* u, float d, float m) {
  uint8_t* out = w.qs.data() + row * w.row_bytes() + (b / 2) * 32 + (b % 2) * 16;
  for (int j = 0; j < 16; ++j) out[j] = static_cast<uint8_t>(u[j] | (u[j + 16] << 4));
  const size_t i = static_cast<size_t>(row * (w.k / 32) + b);
  w.d[i] = d;
  w.m[i] = m;
}

}  // namespace

Result<QuantWeights> repack_quant(uint32_t type, std::span<const uint8_t> blocks, int64_t n, int64_t k) {
  if (!quant_type_supported(type)) return invalid_argument("no native kernel for ggml type " + std::to_string(type));
  const bool kquant = type == kQ4_K || type == kQ6_K;
  const int64_t block_elems = kquant ? 256 : 32;
  if (n <= 0 || k <= 0 || k % 64 != 0 || k % block_elems != 0) {
    return invalid_argument("native weights need a row width that is a multiple of 64 (256 for K-quants), got " +
                            std::to_string(k));
  }
  const size_t block_bytes = type == kQ4_0 ? 18 : type == kQ4_1 ? 20 : type == kQ8_0 ? 34 : type == kQ4_K ? 144 : 210;
  const int64_t nb = k / 32, n_src = k / block_elems;
  if (blocks.size() != static_cast<size_t>(n * n_src) * block_bytes) {
    return invalid_argument("quantised weight of " + std::to_string(blocks.size()) + " bytes is not " +
                            std::to_string(n) + " rows of " + std::to_string(n_src) + " blocks");
  }
  QuantWeights w;
  w.kind = type == kQ8_0 ? QuantKind::kW8 : type == kQ6_K ? QuantKind::kW8S16 : QuantKind::kW4;
  w.n = n;
  w.k = k;
  w.qs.assign(static_cast<size_t>(n) * w.row_bytes(), 0);
  w.d.resize(static_cast<size_t>(n * w.scales_per_row()));
  w.m.resize(static_cast<size_t>(n * nb));
  for (int64_t row = 0; row < n; ++row) {
    uint8_t* out = w.qs.data() + row * w.row_bytes();
    for (int64_t sb = 0; sb < n_src; ++sb) {
      const uint8_t* blk = blocks.data() + (row * n_src + sb) * block_bytes;
      if (type == kQ8_0 || type == kQ4_0 || type == kQ4_1) {
        const int64_t b = sb;
        const size_t i = static_cast<size_t>(row * nb + b);
        const int64_t group = b / 2, half = b % 2;
        if (type == kQ8_0) {
          w.d[i] = fp16(blk);
          const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
          int sum = 0;
          for (int j = 0; j < 32; ++j) {
            out[group * 64 + packed_index(half * 32 + j)] = static_cast<uint8_t>(q[j]);
            sum += q[j];
          }
          w.m[i] = -128.0f * w.d[i] * static_cast<float>(sum);
        } else {
          w.d[i] = fp16(blk);
          w.m[i] = type == kQ4_0 ? -8.0f * w.d[i] : fp16(blk + 2);
          // A group's byte p (0..31) holds packed elements p (low nibble) and p + 32 (high): block
          // b's qs[j] holds its elements j and j + 16, i.e. packed p = half·16 + j in both.
          std::memcpy(out + group * 32 + half * 16, blk + (type == kQ4_0 ? 2 : 4), 16);
        }
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
        for (int s16 = 0; s16 < 16; ++s16) w.d[static_cast<size_t>(row * (k / 16) + sb * 16 + s16)] = d * sc[s16];
        for (int j = 0; j < 8; ++j) {  // 32-blocks
          const int64_t b = sb * 8 + j, group = b / 2, half = b % 2;
          float corr = 0;
          for (int h = 0; h < 2; ++h) {
            int sum = 0;
            for (int l = 0; l < 16; ++l) {
              const int e = 32 * j + 16 * h + l;
              out[group * 64 + packed_index(half * 32 + 16 * h + l)] = static_cast<uint8_t>(q[e]);
              sum += q[e];
            }
            corr += w.d[static_cast<size_t>(row * (k / 16) + 2 * b + h)] * static_cast<float>(sum);
          }
          w.m[static_cast<size_t>(row * nb + b)] = -128.0f * corr;
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
  // One weight row at a time, all activation rows against it (the row stays in L1).
#pragma omp parallel if (worth_parallel(w.n * w.k))
  {
    std::vector<float> out(static_cast<size_t>(rows));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < w.n; ++n) {
#if defined(__x86_64__)
      if (fast) {
        if (w.kind == QuantKind::kW4) {
          gemm_row_vnni<QuantKind::kW4>(xq, w, n, rows, out.data());
        } else if (w.kind == QuantKind::kW8) {
          gemm_row_vnni<QuantKind::kW8>(xq, w, n, rows, out.data());
        } else {
          gemm_row_vnni<QuantKind::kW8S16>(xq, w, n, rows, out.data());
        }
      } else {
        gemm_rows_portable(xq, w, n, rows, out.data());
      }
#else
      gemm_rows_portable(xq, w, n, rows, out.data());
#endif
      const float b = bias ? bias[n] : 0.0f;
      for (int64_t r = 0; r < rows; ++r) {
        float* dst = y.f32() + r * y.ld + n;
        *dst = (accumulate ? *dst : 0.0f) + out[static_cast<size_t>(r)] + b;
      }
    }
  }
}

}  // namespace baton::cpu
