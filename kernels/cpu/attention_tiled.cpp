// Prefill attention through oneDNN tile matmuls (AMX / avx512 brgemm), for sequences with many
// new tokens. Same algorithm as the direct kernel (online softmax over key blocks, causal,
// GQA-grouped query rows, no T×T buffer), but the two products of a tile — S = Q·Kᵀ and
// O += P·V — are small matmuls, so on CPUs with AMX they run on the matrix units.
//
// Per layer call, each (sequence, kv head) first gathers its keys and values from the paged cache
// into contiguous [n_keys, head_dim] arrays in the compute dtype (zero-padded to a multiple of
// kKeyPad), so the tiles read them in place. Key blocks are padded to kKeyPad and query tiles
// have a fixed size, so only a handful of matmul shapes exist and their primitives are cached
// per thread (a primitive is then never executed by two threads at once).
//
// Measured (bench/RESULTS.md): on 2 Sapphire Rapids cores this path is what takes SmolLM2
// prefill at 2048 tokens from 12 % to the ratio reported there.
#include <map>
#include <oneapi/dnnl/dnnl.hpp>
#include <tuple>
#include <vector>

#include "common/check.h"
#include "kernels/cpu/attention_common.h"

namespace baton::cpu {
namespace {

using dt = dnnl::memory::data_type;

constexpr int kKeyBlock = 256;   // keys per block: S tile of kQueryRows × 256 f32 stays in L2
constexpr int kKeyPad = 32;      // key blocks are padded to this (bounds the set of shapes)
constexpr int kQueryRows = 128;  // query rows (positions × heads of the group) per item

// Thread-local cache of matmul primitives keyed by shape and strides.
class TileMatmul {
 public:
  TileMatmul() : engine_(dnnl::engine::kind::cpu, 0), stream_(engine_) {}

  // C[m, n] (f32, ld ldc) = A[m, k] · B, where B is [k, n] stored row-major (ld ldb), or with
  // b_trans stored as [n, k] (ld ldb). With accumulate, C += instead.
  void run(dt type, const void* a, int64_t lda, const void* b, int64_t ldb, bool b_trans, float* c, int64_t ldc,
           int64_t m, int64_t n, int64_t k, bool accumulate) {
    auto key = std::make_tuple(static_cast<int>(type), m, n, k, lda, ldb, ldc, b_trans, accumulate);
    auto it = cache_.find(key);
    dnnl::memory::desc a_md({m, k}, type, {lda, 1});
    dnnl::memory::desc b_md({k, n}, type, b_trans ? dnnl::memory::dims{1, ldb} : dnnl::memory::dims{ldb, 1});
    dnnl::memory::desc c_md({m, n}, dt::f32, {ldc, 1});
    if (it == cache_.end()) {
      dnnl::primitive_attr attr;
      if (accumulate) {
        dnnl::post_ops po;
        po.append_sum(1.0f);
        attr.set_post_ops(po);
      }
      auto pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, c_md), attr, engine_);
      it = cache_.emplace(key, dnnl::matmul(pd)).first;
    }
    it->second.execute(stream_, {{DNNL_ARG_SRC, dnnl::memory(a_md, engine_, const_cast<void*>(a))},
                                 {DNNL_ARG_WEIGHTS, dnnl::memory(b_md, engine_, const_cast<void*>(b))},
                                 {DNNL_ARG_DST, dnnl::memory(c_md, engine_, c)}});
  }

 private:
  dnnl::engine engine_;
  dnnl::stream stream_;
  std::map<std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool>, dnnl::matmul> cache_;
};

TileMatmul& tile_matmul() {
  thread_local TileMatmul tm;
  return tm;
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Elements of the compute type: f32 or bf16 (stored as uint16_t).
template <typename T>
inline T to_compute(float x);
template <>
inline float to_compute<float>(float x) { return x; }
template <>
inline uint16_t to_compute<uint16_t>(float x) { return fp32_to_bf16(x); }

// Probabilities (finite, in [0, 1]) to the compute type; round to nearest even, vectorised.
inline void convert_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void convert_row(const float* src, uint16_t* dst, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t v = std::bit_cast<uint32_t>(src[j]);
    dst[j] = static_cast<uint16_t>((v + 0x7FFFu + ((v >> 16) & 1u)) >> 16);
  }
}

struct SeqKv {
  int seq = 0;
  int64_t n_keys = 0;    // kv_offset + n_new
  int64_t n_padded = 0;  // rounded up to kKeyPad
  size_t offset = 0;     // element offset of this sequence's arrays in the gathered buffers
};

struct Item {
  int seq_kv;  // index into the SeqKv list
  int g;
  int q0;
  int n_q;
  int64_t cost;
};

template <typename T>
void run_items(const Tensor& q, const KvLayerView& kv, const BatchView& batch, const std::vector<SeqKv>& seqs,
               const std::vector<Item>& items, int group, float scale_log2, const T* kbuf, const T* vbuf,
               const Tensor& out) {
  const int hd = kv.head_dim;
  const dt type = sizeof(T) == 4 ? dt::f32 : dt::bf16;
#pragma omp parallel
  {
    // Per-thread tiles, kept across calls: reallocating them every layer costs page faults.
    thread_local std::vector<T> qt, p;
    thread_local std::vector<float> o, s, mrow, lrow;
#pragma omp for schedule(dynamic, 1)
    for (size_t ii = 0; ii < items.size(); ++ii) {
      const Item& it = items[ii];
      const SeqKv& sk = seqs[it.seq_kv];
      const SeqView& sv = batch.seqs[sk.seq];
      const int rows = it.n_q * group;
      qt.resize(static_cast<size_t>(rows) * hd);
      o.assign(static_cast<size_t>(rows) * hd, 0.0f);
      s.resize(static_cast<size_t>(rows) * kKeyBlock);
      p.resize(static_cast<size_t>(rows) * kKeyBlock);
      mrow.assign(rows, -std::numeric_limits<float>::infinity());
      lrow.assign(rows, 0.0f);
      for (int i = 0; i < it.n_q; ++i) {
        const float* qrow = q.f32() + static_cast<int64_t>(sv.row0 + it.q0 + i) * q.ld;
        for (int h = 0; h < group; ++h) {
          const float* src = qrow + static_cast<int64_t>(it.g * group + h) * hd;
          T* dst = qt.data() + static_cast<size_t>(i * group + h) * hd;
          for (int d = 0; d < hd; ++d) dst[d] = to_compute<T>(src[d] * scale_log2);
        }
      }
      // Keys and values of (sequence, kv head g): [n_padded, hd] at this offset.
      const size_t base = sk.offset + static_cast<size_t>(it.g) * sk.n_padded * hd;
      const T* kg = kbuf + base;
      const T* vg = vbuf + base;
      const int32_t first_pos = sv.kv_offset + it.q0;
      const int64_t n_keys = first_pos + it.n_q;
      for (int64_t k0 = 0; k0 < n_keys; k0 += kKeyBlock) {
        const int64_t kn = std::min<int64_t>(kKeyBlock, n_keys - k0);
        const int64_t kp = round_up(kn, kKeyPad);
        tile_matmul().run(type, qt.data(), hd, kg + k0 * hd, hd, /*b_trans=*/true, s.data(), kKeyBlock, rows, kp, hd,
                          false);
        const bool crosses_diagonal = k0 + kp - 1 > first_pos;
        for (int r = 0; r < rows; ++r) {
          float* sr = s.data() + static_cast<size_t>(r) * kKeyBlock;
          T* pr = p.data() + static_cast<size_t>(r) * kKeyBlock;
          const int64_t limit = crosses_diagonal ? std::clamp<int64_t>(first_pos + r / group - k0 + 1, 0, kn) : kn;
          const SoftmaxStep st = softmax_row_update(sr, kp, limit, &mrow[r]);
          convert_row(sr, pr, kp);
          lrow[r] = lrow[r] * st.alpha + st.sum;
          const float alpha = st.alpha;
          float* orow = o.data() + static_cast<size_t>(r) * hd;
#pragma omp simd
          for (int d = 0; d < hd; ++d) orow[d] *= alpha;
        }
        tile_matmul().run(type, p.data(), kKeyBlock, vg + k0 * hd, hd, /*b_trans=*/false, o.data(), hd, rows, hd, kp,
                          /*accumulate=*/true);
      }
      for (int i = 0; i < it.n_q; ++i) {
        float* orow = out.f32() + static_cast<int64_t>(sv.row0 + it.q0 + i) * out.ld;
        for (int h = 0; h < group; ++h) {
          const int r = i * group + h;
          const float inv = 1.0f / lrow[r];
          const float* src = o.data() + static_cast<size_t>(r) * hd;
          float* dst = orow + static_cast<int64_t>(it.g * group + h) * hd;
          for (int d = 0; d < hd; ++d) dst[d] = src[d] * inv;
        }
      }
    }
  }
}

template <typename T>
void attention_tiled_t(const Tensor& q, const KvLayerView& kv, const BatchView& batch, const std::vector<int>& seq_ids,
                       int n_head, float scale, std::vector<T>& kbuf, std::vector<T>& vbuf, const Tensor& out) {
  const int hd = kv.head_dim;
  const int n_kv = kv.n_kv_heads;
  const int group = n_head / n_kv;
  const int tile = std::max(1, kQueryRows / group);
  std::vector<SeqKv> seqs;
  size_t total = 0;
  for (int si : seq_ids) {
    const SeqView& s = batch.seqs[si];
    SeqKv sk;
    sk.seq = si;
    sk.n_keys = s.kv_offset + s.n_new;
    sk.n_padded = round_up(sk.n_keys, kKeyPad);
    sk.offset = total;
    total += static_cast<size_t>(sk.n_padded) * n_kv * hd;
    seqs.push_back(sk);
  }
  // Gather K and V per (sequence, kv head) into contiguous arrays; padding rows are zeroed.
  // The buffers persist (grow-only) so a layer call does not page-fault fresh memory.
  if (kbuf.size() < total) {
    kbuf.resize(total);
    vbuf.resize(total);
  }
  std::vector<std::pair<int, int64_t>> rows;  // (seq_kv, position)
  for (int i = 0; i < static_cast<int>(seqs.size()); ++i) {
    for (int64_t pos = 0; pos < seqs[i].n_keys; ++pos) rows.emplace_back(i, pos);
    for (int g = 0; g < n_kv; ++g) {
      const size_t pad0 = seqs[i].offset + (static_cast<size_t>(g) * seqs[i].n_padded + seqs[i].n_keys) * hd;
      std::fill(kbuf.begin() + pad0, kbuf.begin() + pad0 + (seqs[i].n_padded - seqs[i].n_keys) * hd, T{});
      std::fill(vbuf.begin() + pad0, vbuf.begin() + pad0 + (seqs[i].n_padded - seqs[i].n_keys) * hd, T{});
    }
  }
#pragma omp parallel for schedule(static)
  for (size_t r = 0; r < rows.size(); ++r) {
    const SeqKv& sk = seqs[rows[r].first];
    const SeqView& sv = batch.seqs[sk.seq];
    const int32_t pos = static_cast<int32_t>(rows[r].second);
    for (int g = 0; g < n_kv; ++g) {
      const size_t src = kv_offset_of(kv, sv, pos, g);
      const size_t dst = sk.offset + (static_cast<size_t>(g) * sk.n_padded + pos) * hd;
      for (int d = 0; d < hd; ++d) {
        kbuf[dst + d] = to_compute<T>(load_elem(kv.k, src + d, kv.dtype));
        vbuf[dst + d] = to_compute<T>(load_elem(kv.v, src + d, kv.dtype));
      }
    }
  }
  std::vector<Item> items;
  for (int i = 0; i < static_cast<int>(seqs.size()); ++i) {
    const SeqView& s = batch.seqs[seqs[i].seq];
    for (int q0 = 0; q0 < s.n_new; q0 += tile) {
      const int n_q = std::min(tile, s.n_new - q0);
      for (int g = 0; g < n_kv; ++g) items.push_back({i, g, q0, n_q, static_cast<int64_t>(n_q) * (s.kv_offset + q0 + n_q)});
    }
  }
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  run_items<T>(q, kv, batch, seqs, items, group, scale * static_cast<float>(M_LOG2E), kbuf.data(), vbuf.data(), out);
}

}  // namespace

void attention_tiled(const Tensor& q, const KvLayerView& kv, const BatchView& batch, const std::vector<int>& seq_ids,
                     int n_head, float scale, DType compute, AttentionScratch& scratch, const Tensor& out) {
  if (seq_ids.empty()) return;
  if (compute == DType::kBF16) {
    attention_tiled_t<uint16_t>(q, kv, batch, seq_ids, n_head, scale, scratch.k_bf16, scratch.v_bf16, out);
  } else {
    attention_tiled_t<float>(q, kv, batch, seq_ids, n_head, scale, scratch.k_f32, scratch.v_f32, out);
  }
}

}  // namespace baton::cpu
