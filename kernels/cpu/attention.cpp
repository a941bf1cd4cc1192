// CPU causal attention over the paged KV cache (prefill chunks and decode alike), and the KV write.
//
// Work is split into items (sequence, kv head, query tile). An item holds the queries of every q
// head that shares the kv head (GQA) for kQueryRows / group positions, so each gathered K/V tile is
// reused by all of them. Keys are visited in tiles of kKeyTile with an online softmax (running
// max and sum per row): no T×T score matrix exists, memory per item is O(rows × kKeyTile).
// K is gathered transposed ([head_dim][key]) so the score loop vectorises over keys without
// horizontal reductions; P·V vectorises over head_dim. Decode-sized items (at most kDirectMaxRows
// rows) skip the gather and read the cache rows in place (attend_direct_avx512 on AVX-512 CPUs).
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common/check.h"
#include "kernels/cpu/attention_common.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/sum16.h"

namespace baton::cpu {
namespace {

constexpr int kKeyTile = 64;     // keys per tile: 4 AVX-512 vectors of scores per row
constexpr int kQueryRows = 128;  // query rows (positions × heads in the group) per item
constexpr int kMaxHeadDim = 256;
// Sequences with at least this many new tokens use the tile-matmul path: below it the per-tile
// matmul overhead outweighs the matrix units (decode steps and short chunks stay direct).
constexpr int kTiledMinTokens = 16;
// Items with at most this many query rows (decode steps: one position × the GQA group) read an
// f32 or bf16 cache in place, one key row at a time, instead of gathering K transposed: the
// gather's per-element copies cost more than the few rows' dot products they would vectorise.
constexpr int kDirectMaxRows = 8;

struct WorkItem {
  int seq;
  int g;    // first kv head
  int n_g;  // kv heads [g, g + n_g): more than one only for decode-sized items (attend_direct*)
  int q0;   // first new token of the tile (relative to the sequence)
  int n_q;  // positions in the tile
  int64_t cost;
};

struct Scratch {
  std::vector<float> q, o, s, kt, v, m, l;
  std::vector<uint16_t> qb;  // attend_direct_bf16_dot's Q in bf16
};

// A cache element as f32: f32 itself, or bf16 (the high half of an f32).
inline float as_f32(float v) {
  return v;
}
inline float as_f32(uint16_t v) {
  return std::bit_cast<float>(static_cast<uint32_t>(v) << 16);
}

// attend_item for few query rows (decode): each key's K and V rows are read where they lie in the
// cache (f32 or bf16), one dot product per row and key, instead of gathering K transposed. The
// item's kv heads are visited per key tile, so the tile's cache rows are read in order. `rows`:
// query rows per kv head (row r of head gi is scratch row gi·rows + r).
template <typename T>
void attend_direct(const T* kpool, const T* vpool, const KvLayerView& kv, const SeqView& sv, const WorkItem& it,
                   int group, int rows, Scratch& sc) {
  const int hd = kv.head_dim;
  float* S = sc.s.data();
  const int32_t first_pos = sv.kv_offset + it.q0;
  const int32_t n_keys = first_pos + it.n_q;
  const T* krow[kKeyTile];
  const T* vrow[kKeyTile];
  for (int32_t k0 = 0; k0 < n_keys; k0 += kKeyTile) {
    const int kn = std::min<int32_t>(kKeyTile, n_keys - k0);
    const bool crosses_diagonal = k0 + kKeyTile - 1 > first_pos;
    for (int gi = 0; gi < it.n_g; ++gi) {
      for (int j = 0; j < kn; ++j) {
        const size_t off = kv_offset_of(kv, sv, k0 + j, it.g + gi);
        krow[j] = kpool + off;
        vrow[j] = vpool + off;
      }
      float* Q = sc.q.data() + static_cast<size_t>(gi) * rows * hd;
      float* O = sc.o.data() + static_cast<size_t>(gi) * rows * hd;
      float* M = sc.m.data() + static_cast<size_t>(gi) * rows;
      float* L = sc.l.data() + static_cast<size_t>(gi) * rows;
      for (int r = 0; r < rows; ++r) {
        float* sr = S + static_cast<size_t>(r) * kKeyTile;
        const float* qr = Q + static_cast<size_t>(r) * hd;
        for (int j = 0; j < kn; ++j) {
          const T* kj = krow[j];
          float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
          for (int d = 0; d < hd; ++d) acc += qr[d] * as_f32(kj[d]);
          sr[j] = acc;
        }
        const int32_t limit = crosses_diagonal ? std::clamp<int32_t>(first_pos + r / group - k0 + 1, 0, kn) : kn;
        const SoftmaxStep st = softmax_row_update(sr, kKeyTile, limit, &M[r]);
        L[r] = L[r] * st.alpha + st.sum;
        float* orow = O + static_cast<size_t>(r) * hd;
        const float alpha = st.alpha;
#pragma omp simd
        for (int d = 0; d < hd; ++d) orow[d] *= alpha;
        for (int j = 0; j < limit; ++j) {
          const float p = sr[j];
          const T* vj = vrow[j];
#pragma omp simd
          for (int d = 0; d < hd; ++d) orow[d] += p * as_f32(vj[d]);
        }
      }
    }
  }
}

#if defined(__x86_64__)
// The decode path with AVX-512, for head_dim = 16·NV. Keys go in tiles of 16, one score vector
// per row and tile: each key's K row is read once per row from L1 (the tile's rows are the cache's
// own for f32, converted once into a scratch tile for bf16), its NV partial products summed into
// one lane by sum16; a row's output stays in registers across the tile's P·V. The next tile's
// rows are prefetched while this one is computed: the cache rows of one kv head are head_dim
// elements every n_kv_heads·head_dim, and a decode step is bound by reading them.
#define BATON_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
// GCC 12 warns that the intrinsics' own undefined-value placeholders may be used uninitialized
// when they are inlined into target("avx512...") functions; they are not reads of our data.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

bool direct_avx512_supported() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return ok;
}

template <typename T>
BATON_AVX512 inline __m512 load16(const T* p) {
  if constexpr (sizeof(T) == 4) {
    return _mm512_loadu_ps(p);
  } else {  // bf16: the high half of an f32
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// Element offsets of keys [k0, k0 + kn) of kv head g: one block lookup per tile where the tile
// lies in one block (block sizes that are multiples of 16), one per key otherwise.
inline void tile_offsets(const KvLayerView& kv, const SeqView& sv, int32_t k0, int kn, int g, size_t* off) {
  if (kv.block_size % 16 == 0) {
    const size_t base = kv_offset_of(kv, sv, k0, g);
    const size_t stride = static_cast<size_t>(kv.n_kv_heads) * kv.head_dim;
    for (int j = 0; j < kn; ++j) off[j] = base + j * stride;
  } else {
    for (int j = 0; j < kn; ++j) off[j] = kv_offset_of(kv, sv, k0 + j, g);
  }
}

// Keys a decode kernel prefetches ahead of the tile it computes, into L2: the cache rows come in
// blocks spread over the pool, which the hardware prefetchers only find some way into each block.
// Measured at batch 8 and 1,024 positions on one core, attention time against no software
// prefetch in the same run: into L2 64 keys ahead 0.62-0.67× (f32 KV), 0.68-0.94× (bf16); into L1
// one tile ahead (the previous scheme) 0.97× and 1.11×.
constexpr int kPrefetchKeys = 64;

// Prefetches keys [k0, k0 + 16) (those below n_keys) of kv head g into L2, `lines` cache lines a row.
template <typename T>
inline void prefetch_keys(const T* kpool, const T* vpool, const KvLayerView& kv, const SeqView& sv, int32_t k0,
                          int32_t n_keys, int g, int lines) {
  if (k0 >= n_keys) return;
  size_t off[16];
  const int n = std::min<int32_t>(16, n_keys - k0);
  tile_offsets(kv, sv, k0, n, g, off);
  for (int j = 0; j < n; ++j) {
    for (int l = 0; l < lines; ++l) {
      _mm_prefetch(reinterpret_cast<const char*>(kpool + off[j]) + 64 * l, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(vpool + off[j]) + 64 * l, _MM_HINT_T1);
    }
  }
}

// The key tiles of a decode item, 16 keys each: at(k0) gives the cache offsets of tile k0's rows
// (kv head g; the item's other heads follow it in each row) and prefetches the rows kPrefetchKeys
// ahead; the first tiles' rows are prefetched when it is made.
template <typename T>
struct KeyTiles {
  KeyTiles(const T* kpool, const T* vpool, const KvLayerView& kv, const SeqView& sv, int g, int row_lines,
           int32_t n_keys)
      : kpool(kpool), vpool(vpool), kv(kv), sv(sv), g(g), row_lines(row_lines), n_keys(n_keys) {
    for (int32_t k = 16; k < kPrefetchKeys; k += 16) prefetch_keys(kpool, vpool, kv, sv, k, n_keys, g, row_lines);
  }
  int at(int32_t k0, size_t* off) const {  // the tile's key count
    const int kn = std::min<int32_t>(16, n_keys - k0);
    tile_offsets(kv, sv, k0, kn, g, off);
    prefetch_keys(kpool, vpool, kv, sv, k0 + kPrefetchKeys, n_keys, g, row_lines);
    return kn;
  }
  const T* kpool;
  const T* vpool;
  const KvLayerView& kv;
  const SeqView& sv;
  int g, row_lines;
  int32_t n_keys;
};

template <typename T, int NV>
BATON_AVX512 void attend_direct_avx512(const T* kpool, const T* vpool, const KvLayerView& kv, const SeqView& sv,
                                       const WorkItem& it, int group, int rows, Scratch& sc) {
  constexpr int hd = 16 * NV;
  constexpr int kTile = 16;
  constexpr bool f32 = sizeof(T) == 4;
  constexpr int lines = hd * static_cast<int>(sizeof(T)) / 64;  // cache lines per row (≥ 1 for hd ≥ 32)
  alignas(64) float S[kTile];
  alignas(64) float kbuf[f32 ? 1 : kTile * hd];
  alignas(64) float vbuf[f32 ? 1 : kTile * hd];
  const float* krow[kTile];
  const float* vrow[kTile];
  const int32_t first_pos = sv.kv_offset + it.q0;
  const int32_t n_keys = first_pos + it.n_q;
  const KeyTiles<T> tiles(kpool, vpool, kv, sv, it.g, lines * it.n_g, n_keys);  // heads adjacent in a row
  size_t off[kTile];
  for (int32_t k0 = 0; k0 < n_keys; k0 += kTile) {
    const int kn = tiles.at(k0, off);
    const bool crosses_diagonal = k0 + kTile - 1 > first_pos;
    for (int gi = 0; gi < it.n_g; ++gi) {
      const size_t head = static_cast<size_t>(gi) * hd;
      for (int j = 0; j < kn; ++j) {
        if constexpr (f32) {
          krow[j] = reinterpret_cast<const float*>(kpool + off[j] + head);
          vrow[j] = reinterpret_cast<const float*>(vpool + off[j] + head);
        } else {
          for (int v = 0; v < NV; ++v) {
            _mm512_store_ps(kbuf + j * hd + 16 * v, load16(kpool + off[j] + head + 16 * v));
            _mm512_store_ps(vbuf + j * hd + 16 * v, load16(vpool + off[j] + head + 16 * v));
          }
          krow[j] = kbuf + j * hd;
          vrow[j] = vbuf + j * hd;
        }
      }
      const float* Q = sc.q.data() + static_cast<size_t>(gi) * rows * hd;
      float* O = sc.o.data() + static_cast<size_t>(gi) * rows * hd;
      float* M = sc.m.data() + static_cast<size_t>(gi) * rows;
      float* L = sc.l.data() + static_cast<size_t>(gi) * rows;
      for (int r = 0; r < rows; ++r) {
        __m512 qv[NV];
        for (int v = 0; v < NV; ++v) qv[v] = _mm512_loadu_ps(Q + static_cast<size_t>(r) * hd + 16 * v);
        __m512 p[kTile];
        for (int j = 0; j < kTile; ++j) {
          if (j < kn) {
            __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(krow[j]));
            for (int v = 1; v < NV; ++v) acc = _mm512_fmadd_ps(qv[v], _mm512_loadu_ps(krow[j] + 16 * v), acc);
            p[j] = acc;
          } else {
            p[j] = _mm512_setzero_ps();
          }
        }
        _mm512_store_ps(S, sum16(p));
        const int32_t limit = crosses_diagonal ? std::clamp<int32_t>(first_pos + r / group - k0 + 1, 0, kn) : kn;
        const SoftmaxStep st = softmax_row_update(S, kTile, limit, &M[r]);
        L[r] = L[r] * st.alpha + st.sum;
        float* orow = O + static_cast<size_t>(r) * hd;
        __m512 ov[NV];
        const __m512 alpha = _mm512_set1_ps(st.alpha);
        for (int v = 0; v < NV; ++v) ov[v] = _mm512_mul_ps(_mm512_loadu_ps(orow + 16 * v), alpha);
        for (int j = 0; j < limit; ++j) {
          const __m512 pj = _mm512_set1_ps(S[j]);
          for (int v = 0; v < NV; ++v) ov[v] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vrow[j] + 16 * v), ov[v]);
        }
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(orow + 16 * v, ov[v]);
      }
    }
  }
}

// The decode path for a bf16 cache under bf16 compute, with avx512_bf16: vdpbf16ps multiplies
// bf16 pairs into f32 lanes, so Q·K reads the cache's K rows as they are (Q rounded to bf16 once
// per item) and P·V takes P rounded to bf16 against two keys' V rows interleaved, once per tile
// for all the group's rows: half the multiply instructions of the f32 path and none of its
// conversions of K and V (the rounding of Q and P is the tile-matmul path's, the bound the tests
// hold bf16 compute to). Output rows accumulate in unpack order ([d0-3, d8-11, ...] and
// [d4-7, d12-15, ...] per 32 dims) and are put back in order after the last tile.
#define BATON_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

bool direct_bf16_dot_supported() {
  static const bool ok = direct_avx512_supported() && __builtin_cpu_supports("avx512bf16");
  return ok;
}

template <int NB>  // head_dim = 32·NB
BATON_AVX512_BF16 void attend_direct_bf16_dot(const uint16_t* kpool, const uint16_t* vpool, const KvLayerView& kv,
                                              const SeqView& sv, const WorkItem& it, int group, int rows, Scratch& sc) {
  constexpr int hd = 32 * NB;
  constexpr int kTile = 16;
  const int n_rows = rows * it.n_g;
  sc.qb.resize(static_cast<size_t>(n_rows) * hd);  // Q rows in bf16
  for (int r = 0; r < n_rows; ++r) {
    for (int c = 0; c < NB; ++c) {
      const float* q = sc.q.data() + static_cast<size_t>(r) * hd + 32 * c;
      _mm512_storeu_si512(sc.qb.data() + static_cast<size_t>(r) * hd + 32 * c,
                          reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 16), _mm512_loadu_ps(q))));
    }
  }
  alignas(64) float S[kTile];
  alignas(64) uint32_t P[kTile / 2];
  alignas(64) __m512i vpair[kTile / 2][2 * NB];  // keys 2t and 2t+1 interleaved, per 32 dims: unpacklo, unpackhi
  const int32_t first_pos = sv.kv_offset + it.q0;
  const int32_t n_keys = first_pos + it.n_q;
  const KeyTiles<uint16_t> tiles(kpool, vpool, kv, sv, it.g, NB * it.n_g, n_keys);  // heads adjacent in a row
  size_t off[kTile];
  for (int32_t k0 = 0; k0 < n_keys; k0 += kTile) {
    const int kn = tiles.at(k0, off);
    const bool crosses_diagonal = k0 + kTile - 1 > first_pos;
    for (int gi = 0; gi < it.n_g; ++gi) {
      const size_t head = static_cast<size_t>(gi) * hd;
      for (int t = 0; t < kTile / 2; ++t) {
        for (int c = 0; c < NB; ++c) {
          const int j = 2 * t;
          const __m512i a = j < kn ? _mm512_loadu_si512(vpool + off[j] + head + 32 * c) : _mm512_setzero_si512();
          const __m512i b =
              j + 1 < kn ? _mm512_loadu_si512(vpool + off[j + 1] + head + 32 * c) : _mm512_setzero_si512();
          vpair[t][2 * c] = _mm512_unpacklo_epi16(a, b);
          vpair[t][2 * c + 1] = _mm512_unpackhi_epi16(a, b);
        }
      }
      float* O = sc.o.data() + static_cast<size_t>(gi) * rows * hd;
      float* M = sc.m.data() + static_cast<size_t>(gi) * rows;
      float* L = sc.l.data() + static_cast<size_t>(gi) * rows;
      for (int r = 0; r < rows; ++r) {
        const uint16_t* qr = sc.qb.data() + static_cast<size_t>(gi * rows + r) * hd;
        __m512 p[kTile];
        for (int j = 0; j < kTile; ++j) {
          __m512 acc = _mm512_setzero_ps();
          if (j < kn) {
            for (int c = 0; c < NB; ++c) {
              acc = _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(_mm512_loadu_si512(qr + 32 * c)),
                                     reinterpret_cast<__m512bh>(_mm512_loadu_si512(kpool + off[j] + head + 32 * c)));
            }
          }
          p[j] = acc;
        }
        _mm512_store_ps(S, sum16(p));
        const int32_t limit = crosses_diagonal ? std::clamp<int32_t>(first_pos + r / group - k0 + 1, 0, kn) : kn;
        const SoftmaxStep st = softmax_row_update(S, kTile, limit, &M[r]);
        L[r] = L[r] * st.alpha + st.sum;
        _mm256_store_si256(reinterpret_cast<__m256i*>(P),
                           reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_load_ps(S))));
        float* orow = O + static_cast<size_t>(r) * hd;
        __m512 ov[2 * NB];
        const __m512 alpha = _mm512_set1_ps(st.alpha);
        for (int v = 0; v < 2 * NB; ++v) ov[v] = _mm512_mul_ps(_mm512_loadu_ps(orow + 16 * v), alpha);
        for (int t = 0; t < (limit + 1) / 2; ++t) {  // P is 0 past limit
          const __m512bh pt = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(P[t])));
          for (int v = 0; v < 2 * NB; ++v) ov[v] = _mm512_dpbf16_ps(ov[v], pt, reinterpret_cast<__m512bh>(vpair[t][v]));
        }
        for (int v = 0; v < 2 * NB; ++v) _mm512_storeu_ps(orow + 16 * v, ov[v]);
      }
    }
  }
  // Unpack order back to dims: lane 4L+i of the unpacklo vector is dim 8L+i, of unpackhi 8L+4+i.
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int r = 0; r < n_rows; ++r) {
    float* orow = sc.o.data() + static_cast<size_t>(r) * hd;
    for (int c = 0; c < NB; ++c) {
      const __m512 lo = _mm512_loadu_ps(orow + 32 * c), hi = _mm512_loadu_ps(orow + 32 * c + 16);
      _mm512_storeu_ps(orow + 32 * c, _mm512_permutex2var_ps(lo, first, hi));
      _mm512_storeu_ps(orow + 32 * c + 16, _mm512_permutex2var_ps(lo, second, hi));
    }
  }
}

// The AVX-512 decode path where this CPU and head_dim allow it; false: use attend_direct.
// `bf16_dot`: a bf16 cache under bf16 compute may take attend_direct_bf16_dot.
template <typename T>
bool attend_direct_fast(const T* kpool, const T* vpool, const KvLayerView& kv, const SeqView& sv, const WorkItem& it,
                        int group, int rows, bool bf16_dot, Scratch& sc) {
  if (!direct_avx512_supported()) return false;
  if constexpr (sizeof(T) == 2) {
    if (bf16_dot && direct_bf16_dot_supported()) {
      switch (kv.head_dim) {
        case 32: attend_direct_bf16_dot<1>(kpool, vpool, kv, sv, it, group, rows, sc); return true;
        case 64: attend_direct_bf16_dot<2>(kpool, vpool, kv, sv, it, group, rows, sc); return true;
        case 128: attend_direct_bf16_dot<4>(kpool, vpool, kv, sv, it, group, rows, sc); return true;
        default: break;
      }
    }
  }
  switch (kv.head_dim) {
    case 32: attend_direct_avx512<T, 2>(kpool, vpool, kv, sv, it, group, rows, sc); return true;
    case 64: attend_direct_avx512<T, 4>(kpool, vpool, kv, sv, it, group, rows, sc); return true;
    case 128: attend_direct_avx512<T, 8>(kpool, vpool, kv, sv, it, group, rows, sc); return true;
    default: return false;
  }
}
#pragma GCC diagnostic pop
#else
template <typename T>
bool attend_direct_fast(const T*, const T*, const KvLayerView&, const SeqView&, const WorkItem&, int, int, bool,
                        Scratch&) {
  return false;
}
#endif

void attend_item(const Tensor& q, const KvLayerView& kv, const SeqView& sv, const WorkItem& it, int group,
                 float scale_log2, DType compute, const Tensor& out, Scratch& sc) {
  const int hd = kv.head_dim;
  const int rows = it.n_q * group;  // per kv head
  const int n_rows = rows * it.n_g;
  sc.q.resize(static_cast<size_t>(n_rows) * hd);
  sc.o.assign(static_cast<size_t>(n_rows) * hd, 0.0f);
  sc.s.resize(static_cast<size_t>(n_rows) * kKeyTile);
  sc.kt.resize(static_cast<size_t>(hd) * kKeyTile);
  sc.v.resize(static_cast<size_t>(kKeyTile) * hd);
  sc.m.assign(n_rows, -std::numeric_limits<float>::infinity());
  sc.l.assign(n_rows, 0.0f);
  float* Q = sc.q.data();
  float* O = sc.o.data();
  float* S = sc.s.data();
  float* Kt = sc.kt.data();
  float* V = sc.v.data();

  // Row gi·rows + i·group + h: position i of the tile, q head (g + gi)·group + h. Scores are kept
  // in log2 units (scale · log2 e folded into Q) so the softmax uses exp2.
  for (int gi = 0; gi < it.n_g; ++gi) {
    for (int i = 0; i < it.n_q; ++i) {
      const float* qrow = q.f32() + static_cast<int64_t>(sv.row0 + it.q0 + i) * q.ld;
      for (int h = 0; h < group; ++h) {
        const float* src = qrow + static_cast<int64_t>((it.g + gi) * group + h) * hd;
        float* dst = Q + static_cast<size_t>(gi * rows + i * group + h) * hd;
        for (int d = 0; d < hd; ++d) dst[d] = src[d] * scale_log2;
      }
    }
  }

  const int32_t first_pos = sv.kv_offset + it.q0;  // position of the tile's first query
  const int32_t n_keys = first_pos + it.n_q;       // keys [0, last query position]
  const bool direct = rows <= kDirectMaxRows && (kv.dtype == DType::kF32 || kv.dtype == DType::kBF16);
  BATON_CHECK(direct || it.n_g == 1, "attention: an item of %d kv heads off the direct path", it.n_g);
  if (direct && kv.dtype == DType::kF32) {
    const auto* kp = static_cast<const float*>(kv.k);
    const auto* vp = static_cast<const float*>(kv.v);
    if (!attend_direct_fast(kp, vp, kv, sv, it, group, rows, false, sc)) {
      attend_direct(kp, vp, kv, sv, it, group, rows, sc);
    }
  } else if (direct) {
    const auto* kp = static_cast<const uint16_t*>(kv.k);
    const auto* vp = static_cast<const uint16_t*>(kv.v);
    if (!attend_direct_fast(kp, vp, kv, sv, it, group, rows, compute == DType::kBF16, sc)) {
      attend_direct(kp, vp, kv, sv, it, group, rows, sc);
    }
  }
  for (int32_t k0 = 0; k0 < n_keys && !direct; k0 += kKeyTile) {
    const int kn = std::min<int32_t>(kKeyTile, n_keys - k0);
    for (int j = 0; j < kn; ++j) {
      const size_t off = kv_offset_of(kv, sv, k0 + j, it.g);
      for (int d = 0; d < hd; ++d) {
        Kt[d * kKeyTile + j] = load_elem(kv.k, off + d, kv.dtype);
        V[j * hd + d] = load_elem(kv.v, off + d, kv.dtype);
      }
    }
    for (int j = kn; j < kKeyTile; ++j) {
      for (int d = 0; d < hd; ++d) Kt[d * kKeyTile + j] = 0.0f;
    }
    const bool crosses_diagonal = k0 + kKeyTile - 1 > first_pos;
    for (int r = 0; r < rows; ++r) {
      float* sr = S + static_cast<size_t>(r) * kKeyTile;
      const float* qr = Q + static_cast<size_t>(r) * hd;
      for (int j = 0; j < kKeyTile; ++j) sr[j] = 0.0f;
      for (int d = 0; d < hd; ++d) {
        const float qd = qr[d];
        const float* kd = Kt + d * kKeyTile;
#pragma omp simd
        for (int j = 0; j < kKeyTile; ++j) sr[j] += qd * kd[j];
      }
      // Keys past this row's position (and padding past kn) are masked out.
      const int32_t limit = crosses_diagonal ? std::clamp<int32_t>(first_pos + r / group - k0 + 1, 0, kn) : kn;
      const SoftmaxStep st = softmax_row_update(sr, kKeyTile, limit, &sc.m[r]);
      sc.l[r] = sc.l[r] * st.alpha + st.sum;
      const float alpha = st.alpha;
      float* orow = O + static_cast<size_t>(r) * hd;
#pragma omp simd
      for (int d = 0; d < hd; ++d) orow[d] *= alpha;
      for (int j = 0; j < limit; ++j) {
        const float p = sr[j];
        const float* vj = V + static_cast<size_t>(j) * hd;
#pragma omp simd
        for (int d = 0; d < hd; ++d) orow[d] += p * vj[d];
      }
    }
  }

  for (int gi = 0; gi < it.n_g; ++gi) {
    for (int i = 0; i < it.n_q; ++i) {
      float* orow = out.f32() + static_cast<int64_t>(sv.row0 + it.q0 + i) * out.ld;
      for (int h = 0; h < group; ++h) {
        const int r = gi * rows + i * group + h;
        const float inv = 1.0f / sc.l[r];
        const float* src = O + static_cast<size_t>(r) * hd;
        float* dst = orow + static_cast<int64_t>((it.g + gi) * group + h) * hd;
        for (int d = 0; d < hd; ++d) dst[d] = src[d] * inv;
      }
    }
  }
}

}  // namespace

void kv_write(const KvLayerView& kv, const Tensor& k, const Tensor& v, const BatchView& batch) {
  const int width = kv.n_kv_heads * kv.head_dim;
  BATON_CHECK(k.cols == width && v.cols == width, "kv_write: rows of %ld, cache rows of %d", static_cast<long>(k.cols),
              width);
  for (const SeqView& s : batch.seqs) {
    check_block_table(s, kv.block_size);
#pragma omp parallel for schedule(static) if (worth_parallel(static_cast <int64_t>(s.n_new) * width))
    for (int i = 0; i < s.n_new; ++i) {
      const int32_t pos = s.kv_offset + i;
      const size_t off = kv_offset_of(kv, s, pos, 0);
      store_row(kv.k, off, k.f32() + static_cast<int64_t>(s.row0 + i) * k.ld, width, kv.dtype);
      store_row(kv.v, off, v.f32() + static_cast<int64_t>(s.row0 + i) * v.ld, width, kv.dtype);
    }
  }
}

void attention(const Tensor& q, const KvLayerView& kv, const BatchView& batch, int n_head, float scale, DType compute,
               AttentionScratch& scratch, const Tensor& out) {
  const int hd = kv.head_dim;
  BATON_CHECK(hd <= kMaxHeadDim && n_head % kv.n_kv_heads == 0, "head_dim %d, %d heads over %d kv heads", hd, n_head,
              kv.n_kv_heads);
  BATON_CHECK(q.cols == static_cast<int64_t>(n_head) * hd && out.cols == q.cols, "attention shape mismatch");
  const int group = n_head / kv.n_kv_heads;
  const int tile = std::max(1, kQueryRows / group);

  // A decode-sized item (direct path) takes every kv head of its sequence when there are
  // sequences enough to keep the team busy: it then reads whole cache rows, in order, where an
  // item per head reads head_dim elements of every n_kv_heads·head_dim and the hardware
  // prefetchers fetch the rest (bench/RESULTS.md).
  const bool direct_kv = kv.dtype == DType::kF32 || kv.dtype == DType::kBF16;
  auto is_direct = [&](const SeqView& s) { return direct_kv && std::min(tile, s.n_new) * group <= kDirectMaxRows; };
  int n_direct = 0;
  for (const SeqView& s : batch.seqs) n_direct += s.n_new < kTiledMinTokens && is_direct(s);
  const bool whole_rows = n_direct >= omp_get_max_threads();
  std::vector<WorkItem> items;
  std::vector<int> tiled;
  for (int si = 0; si < static_cast<int>(batch.seqs.size()); ++si) {
    const SeqView& s = batch.seqs[si];
    check_block_table(s, kv.block_size);
    if (s.n_new >= kTiledMinTokens) {
      tiled.push_back(si);
      continue;
    }
    const int n_g = whole_rows && is_direct(s) ? kv.n_kv_heads : 1;
    for (int q0 = 0; q0 < s.n_new; q0 += tile) {
      const int n_q = std::min(tile, s.n_new - q0);
      for (int g = 0; g < kv.n_kv_heads; g += n_g) {
        items.push_back({si, g, n_g, q0, n_q, static_cast<int64_t>(n_g) * n_q * (s.kv_offset + q0 + n_q)});
      }
    }
  }
  // Largest first, so dynamic scheduling ends with small items and the threads finish together.
  std::sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });

  attention_tiled(q, kv, batch, tiled, n_head, scale, compute, scratch, out);
  if (items.empty()) return;
  const float scale_log2 = scale * static_cast<float>(M_LOG2E);
  int64_t work = 0;  // query-key pairs × head_dim × heads per kv head
  for (const WorkItem& it : items) work += it.cost * hd * group;
#pragma omp parallel if (worth_parallel(work))
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < items.size(); ++i) {
      const WorkItem& it = items[i];
      attend_item(q, kv, batch.seqs[it.seq], it, group, scale_log2, compute, out, scratch);
    }
  }
}

}  // namespace baton::cpu
