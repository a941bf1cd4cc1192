// CPU causal attention over the paged KV cache (prefill chunks and decode alike), and the KV write.
//
// Work is split into items (sequence, kv head, query tile). An item holds the queries of every q
// head that shares the kv head (GQA) for kQueryRows / group positions, so each gathered K/V tile is
// reused by all of them. Keys are visited in tiles of kKeyTile with an online softmax (running
// max and sum per row): no T×T score matrix exists, memory per item is O(rows × kKeyTile).
// K is gathered transposed ([head_dim][key]) so the score loop vectorises over keys without
// horizontal reductions; P·V vectorises over head_dim.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/check.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/attention_common.h"
#include "kernels/cpu/parallel.h"

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
  int g;      // kv head
  int q0;     // first new token of the tile (relative to the sequence)
  int n_q;    // positions in the tile
  int64_t cost;
};

struct Scratch {
  std::vector<float> q, o, s, kt, v, m, l;
};

// A cache element as f32: f32 itself, or bf16 (the high half of an f32).
inline float as_f32(float v) { return v; }
inline float as_f32(uint16_t v) { return std::bit_cast<float>(static_cast<uint32_t>(v) << 16); }

// attend_item for few query rows (decode): each key's K and V rows are read where they lie in the
// cache (f32 or bf16), one dot product per row and key, instead of gathering K transposed.
template <typename T>
void attend_direct(const T* kpool, const T* vpool, const KvLayerView& kv, const SeqView& sv, const WorkItem& it,
                   int group, int rows, Scratch& sc) {
  const int hd = kv.head_dim;
  float* Q = sc.q.data();
  float* O = sc.o.data();
  float* S = sc.s.data();
  const int32_t first_pos = sv.kv_offset + it.q0;
  const int32_t n_keys = first_pos + it.n_q;
  const T* krow[kKeyTile];
  const T* vrow[kKeyTile];
  for (int32_t k0 = 0; k0 < n_keys; k0 += kKeyTile) {
    const int kn = std::min<int32_t>(kKeyTile, n_keys - k0);
    for (int j = 0; j < kn; ++j) {
      const size_t off = kv_offset_of(kv, sv, k0 + j, it.g);
      krow[j] = kpool + off;
      vrow[j] = vpool + off;
    }
    const bool crosses_diagonal = k0 + kKeyTile - 1 > first_pos;
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
      const SoftmaxStep st = softmax_row_update(sr, kKeyTile, limit, &sc.m[r]);
      sc.l[r] = sc.l[r] * st.alpha + st.sum;
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

void attend_item(const Tensor& q, const KvLayerView& kv, const SeqView& sv, const WorkItem& it, int group,
                 float scale_log2, const Tensor& out, Scratch& sc) {
  const int hd = kv.head_dim;
  const int rows = it.n_q * group;
  sc.q.resize(static_cast<size_t>(rows) * hd);
  sc.o.assign(static_cast<size_t>(rows) * hd, 0.0f);
  sc.s.resize(static_cast<size_t>(rows) * kKeyTile);
  sc.kt.resize(static_cast<size_t>(hd) * kKeyTile);
  sc.v.resize(static_cast<size_t>(kKeyTile) * hd);
  sc.m.assign(rows, -std::numeric_limits<float>::infinity());
  sc.l.assign(rows, 0.0f);
  float* Q = sc.q.data();
  float* O = sc.o.data();
  float* S = sc.s.data();
  float* Kt = sc.kt.data();
  float* V = sc.v.data();

  // Row r = i * group + h: position i of the tile, q head g * group + h. Scores are kept in log2
  // units (scale · log2 e folded into Q) so the softmax uses exp2.
  for (int i = 0; i < it.n_q; ++i) {
    const float* qrow = q.f32() + static_cast<int64_t>(sv.row0 + it.q0 + i) * q.ld;
    for (int h = 0; h < group; ++h) {
      const float* src = qrow + static_cast<int64_t>(it.g * group + h) * hd;
      float* dst = Q + static_cast<size_t>(i * group + h) * hd;
      for (int d = 0; d < hd; ++d) dst[d] = src[d] * scale_log2;
    }
  }

  const int32_t first_pos = sv.kv_offset + it.q0;       // position of the tile's first query
  const int32_t n_keys = first_pos + it.n_q;            // keys [0, last query position]
  const bool direct = rows <= kDirectMaxRows && (kv.dtype == DType::kF32 || kv.dtype == DType::kBF16);
  if (direct && kv.dtype == DType::kF32) {
    attend_direct(static_cast<const float*>(kv.k), static_cast<const float*>(kv.v), kv, sv, it, group, rows, sc);
  } else if (direct) {
    attend_direct(static_cast<const uint16_t*>(kv.k), static_cast<const uint16_t*>(kv.v), kv, sv, it, group, rows, sc);
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
      const int32_t limit =
          crosses_diagonal ? std::clamp<int32_t>(first_pos + r / group - k0 + 1, 0, kn) : kn;
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

  for (int i = 0; i < it.n_q; ++i) {
    float* orow = out.f32() + static_cast<int64_t>(sv.row0 + it.q0 + i) * out.ld;
    for (int h = 0; h < group; ++h) {
      const int r = i * group + h;
      const float inv = 1.0f / sc.l[r];
      const float* src = O + static_cast<size_t>(r) * hd;
      float* dst = orow + static_cast<int64_t>(it.g * group + h) * hd;
      for (int d = 0; d < hd; ++d) dst[d] = src[d] * inv;
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
#pragma omp parallel for schedule(static) if (worth_parallel(static_cast<int64_t>(s.n_new) * width))
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

  std::vector<WorkItem> items;
  std::vector<int> tiled;
  for (int si = 0; si < static_cast<int>(batch.seqs.size()); ++si) {
    const SeqView& s = batch.seqs[si];
    check_block_table(s, kv.block_size);
    if (s.n_new >= kTiledMinTokens) {
      tiled.push_back(si);
      continue;
    }
    for (int q0 = 0; q0 < s.n_new; q0 += tile) {
      const int n_q = std::min(tile, s.n_new - q0);
      for (int g = 0; g < kv.n_kv_heads; ++g) {
        items.push_back({si, g, q0, n_q, static_cast<int64_t>(n_q) * (s.kv_offset + q0 + n_q)});
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
      attend_item(q, kv, batch.seqs[it.seq], it, group, scale_log2, out, scratch);
    }
  }
}

}  // namespace baton::cpu
