// attention_decode: one query row per sequence against its paged KV cache (flash-decoding).
//
// Memory-bound, so K and V are read once per KV head: one warp-sized CTA per (key split, KV head,
// sequence) computes the G = n_head / n_kv_heads query heads that share the KV head together, as
// the rows of an m16n8k16 tensor-core tile (rows past G are zero and never stored; G > 16 takes
// several head groups). No shared memory: every operand goes global → registers with 16-byte
// loads, which works because a dot product does not care in which order its terms are summed:
//   - S = Q·Kᵀ: lane (g, t) loads chunk 4j + t (8 dims) of key g; the chunk's dims are assigned
//     to the k-slots that lane holds in k-steps 2j and 2j + 1, and Q is loaded the same way;
//   - O = P·V: output column c of n-tile nt stands for dim π(nt, c) = (nt / 8)·64 + 8c + nt % 8,
//     so lane g needs dims [h·64 + 8g, +8) of each of its keys: one 16-byte load per key and
//     half h, regrouped into B fragments with byte permutes; π is undone when storing.
// Splits of the key range run in parallel; a second kernel merges their partial (O, log-sum-exp)
// pairs. The split count depends only on host values (see decode_plan), so a CUDA graph captured
// with one max_kv_len bound replays correctly for any true lengths within it.
#include <cuda_bf16.h>

#include <atomic>
#include <cstdint>

#include "common/check.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/mma_ptx.cuh"

namespace baton::cuda {
namespace {

constexpr int kTileKeys = 16;       // keys per loop iteration (one P·V k-step)
constexpr int kHeadsPerGroup = 16;  // mma rows
// Enough one-warp CTAs for ~8 per SM (the kernel's ~214 registers allow 9), each keeping up to
// 8 KB of K/V loads in flight: HBM latency × bandwidth per SM is ~40-60 KB on H100/H200. Splits
// stay >= 64 keys (4 tiles) so a split's setup and its share of the combine pass stay small.
constexpr int kWarpsPerSm = 8;
constexpr int kMinSplitKeys = 64;

int ceil_div(int64_t a, int64_t b) {
  return static_cast<int>((a + b - 1) / b);
}

// Multiprocessor count of the current device, queried once per device.
int sm_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};  // racing callers store the same value
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < kMaxDevices && cache[dev] > 0) return cache[dev];
  int n = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  if (dev < kMaxDevices) cache[dev] = n;
  return n;
}

// How a decode launch divides keys: n_splits ranges of split_keys keys (a multiple of
// kTileKeys); the last ones may be empty for sequences shorter than the bound.
struct DecodePlan {
  int n_splits;
  int split_keys;
};

// A function of host values only. n_groups = n_kv_heads × head groups per KV head; the workspace
// bound uses n_groups = 1, the most splits any call with these n_seqs / max_kv_len can choose.
// The split count is rounded to nearest, not up: 1024 CTAs against a target of 1056 stay one
// wave at one split instead of becoming 1.7 waves at two.
DecodePlan decode_plan(int n_seqs, int n_groups, int max_kv_len, int n_sm) {
  const int64_t ctas = static_cast<int64_t>(n_seqs) * n_groups;
  const int want = static_cast<int>((static_cast<int64_t>(kWarpsPerSm) * n_sm + ctas / 2) / ctas);
  const int cap = ceil_div(max_kv_len, kMinSplitKeys);
  int n_splits = want < cap ? want : cap;
  if (n_splits < 1) n_splits = 1;
  const int split_keys = ceil_div(ceil_div(max_kv_len, n_splits), kTileKeys) * kTileKeys;
  return {ceil_div(max_kv_len, split_keys), split_keys};
}

size_t decode_workspace_bytes(int n_splits, int n_seqs, int n_head, int head_dim) {
  if (n_splits <= 1) return 0;
  // [n_splits][n_seqs][n_head][head_dim] partial outputs, then [n_splits][n_seqs][n_head] lse
  return static_cast<size_t>(n_splits) * n_seqs * n_head * (head_dim + 1) * sizeof(float);
}

// ---- device helpers ----------------------------------------------------------------------------

// 16 bytes of the KV cache: read once per step, so no L1 allocation.
__device__ __forceinline__ uint4 load_kv16(const __nv_bfloat16* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// ---- kernels -----------------------------------------------------------------------------------

struct DecodeArgs {
  AttnParams p;
  FastDiv bs_div;
  float scale_log2;  // scale · log2(e)
  int n_splits;
  int split_keys;
  int n_head_groups;  // ceil(G / 16)
  float* ws_o;        // [n_splits][n_seqs][n_head][D] (n_splits > 1)
  float* ws_lse;      // [n_splits][n_seqs][n_head], base 2
};

// Grid: (n_splits, n_kv_heads × n_head_groups, n_seqs); 32 threads.
template <int D>
__global__ void __launch_bounds__(32) attention_decode_kernel(DecodeArgs a) {
  const AttnParams& p = a.p;
  const int split = blockIdx.x;
  const int kvh = blockIdx.y / a.n_head_groups;
  const int head_group = blockIdx.y % a.n_head_groups;
  const int seq_i = blockIdx.z;
  const AttnSeq seq = p.seqs[seq_i];
  if (seq.n_new <= 0) return;
  const int G = p.n_head / p.n_kv_heads;
  const int kv_len = seq.kv_offset + 1;
  const int key_begin = split * a.split_keys;
  const int key_end = min(key_begin + a.split_keys, kv_len);

  const int lane = threadIdx.x;
  const int g = lane / 4;
  const int t = lane % 4;
  const int head0 = kvh * G + head_group * kHeadsPerGroup;  // query head of mma row 0
  const int n_rows = min(kHeadsPerGroup, G - head_group * kHeadsPerGroup);
  const int64_t ws_row0 = (static_cast<int64_t>(split) * p.n_seqs + seq_i) * p.n_head + head0;

  if (key_begin >= key_end) {  // past this sequence's keys: an empty partial
    if (lane < n_rows) a.ws_lse[ws_row0 + lane] = -INFINITY;
    return;
  }

  // Q rows g and g + 8 (zero past n_rows), dims of chunk 4j + t.
  uint4 qf[D / 32][2];
#pragma unroll
  for (int j = 0; j < D / 32; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = g + half * 8;
      qf[j][half] = r < n_rows ? *reinterpret_cast<const uint4*>(p.q + static_cast<int64_t>(seq.row0) * p.ld_q +
                                                                 static_cast<int64_t>(head0 + r) * D + 8 * (4 * j + t))
                               : make_uint4(0, 0, 0, 0);
    }
  }

  // Cache rows of a tile's keys this lane loads: K keys key0 + 8n + g, V keys key0 + 2t + {0, 1, 8, 9};
  // -1 past key_end (loaded as zeros, so masked keys stay finite through P·V).
  const int32_t* table = p.block_tables + seq.table0;
  auto cache_row = [&](int key) -> int {
    if (key >= key_end) return -1;
    int blk_i, slot;
    a.bs_div.divmod(key, blk_i, slot);
    return __ldg(table + blk_i) * p.block_size + slot;
  };
  struct Rows {
    int k[2];
    int v[4];
  };
  auto resolve = [&](int key0) {
    Rows r;
    r.k[0] = cache_row(key0 + g);
    r.k[1] = cache_row(key0 + 8 + g);
#pragma unroll
    for (int i = 0; i < 4; ++i) r.v[i] = cache_row(key0 + 2 * t + (i & 1) + (i >> 1) * 8);
    return r;
  };
  const int64_t row_stride = static_cast<int64_t>(p.n_kv_heads) * D;
  const __nv_bfloat16* k_head = p.k_cache + static_cast<int64_t>(kvh) * D + 8 * t;  // + chunk 4j
  const __nv_bfloat16* v_head = p.v_cache + static_cast<int64_t>(kvh) * D + 8 * g;  // + half · 64
  uint4 kf[2][D / 32];
  uint4 vf[4][D / 64];
  auto load_k = [&](const Rows& r) {
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int j = 0; j < D / 32; ++j) {
        kf[n][j] = r.k[n] >= 0 ? load_kv16(k_head + r.k[n] * row_stride + 32 * j) : make_uint4(0, 0, 0, 0);
      }
    }
  };
  auto load_v = [&](const Rows& r) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int h = 0; h < D / 64; ++h) {
        vf[i][h] = r.v[i] >= 0 ? load_kv16(v_head + r.v[i] * row_stride + 64 * h) : make_uint4(0, 0, 0, 0);
      }
    }
  };

  float acc[D / 8][4];
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.0f;
  }
  float row_max[2] = {-INFINITY, -INFINITY};  // raw scores, rows g and g + 8
  float row_sum[2] = {0.0f, 0.0f};            // this lane's part

  // Software pipeline: tile i + 1's K loads are issued once S(i) has consumed the K registers,
  // its V loads once P·V(i) has consumed V, and tile i + 2's table lookups right after.
  const int n_tiles = (key_end - key_begin + kTileKeys - 1) / kTileKeys;
  Rows rows = resolve(key_begin);
  load_k(rows);
  load_v(rows);
  if (n_tiles > 1) rows = resolve(key_begin + kTileKeys);
  for (int i = 0; i < n_tiles; ++i) {
    const int key0 = key_begin + i * kTileKeys;
    float s[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
#pragma unroll
      for (int j = 0; j < D / 32; ++j) {
        mma_bf16(s[n], qf[j][0].x, qf[j][1].x, qf[j][0].y, qf[j][1].y, kf[n][j].x, kf[n][j].y);
        mma_bf16(s[n], qf[j][0].z, qf[j][1].z, qf[j][0].w, qf[j][1].w, kf[n][j].z, kf[n][j].w);
      }
    }
    if (i + 1 < n_tiles) load_k(rows);

#pragma unroll
    for (int n = 0; n < 2; ++n) {
      // Keys past key_end (the last tile only) are masked; every split has at least one valid
      // key, so no row is ever all -inf.
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (key0 + 8 * n + 2 * t + (e & 1) >= key_end) s[n][e] = -INFINITY;
      }
    }
    float alpha[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float mx = fmaxf(row_max[half],
                       fmaxf(fmaxf(s[0][2 * half], s[0][2 * half + 1]), fmaxf(s[1][2 * half], s[1][2 * half + 1])));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float shift = mx * a.scale_log2;
      alpha[half] = fast_exp2(row_max[half] * a.scale_log2 - shift);
      row_max[half] = mx;
      float sum = 0.0f;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pe = fast_exp2(fmaf(s[n][2 * half + e], a.scale_log2, -shift));
          s[n][2 * half + e] = pe;
          sum += pe;
        }
      }
      row_sum[half] = row_sum[half] * alpha[half] + sum;
    }
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      acc[nt][0] *= alpha[0];
      acc[nt][1] *= alpha[0];
      acc[nt][2] *= alpha[1];
      acc[nt][3] *= alpha[1];
    }

    // O += P · V. P's A fragment is S's accumulator; V's B fragment for n-tile h·8 + e takes
    // element e of the lane's four keys (k-slots 2t, 2t + 1, 2t + 8, 2t + 9).
    const uint32_t pa0 = pack_bf16(s[0][0], s[0][1]);
    const uint32_t pa1 = pack_bf16(s[0][2], s[0][3]);
    const uint32_t pa2 = pack_bf16(s[1][0], s[1][1]);
    const uint32_t pa3 = pack_bf16(s[1][2], s[1][3]);
#pragma unroll
    for (int h = 0; h < D / 64; ++h) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const uint32_t sel = (e & 1) ? 0x7632u : 0x5410u;  // high or low halves of two words
        const uint32_t b0 = __byte_perm(word(vf[0][h], e / 2), word(vf[1][h], e / 2), sel);
        const uint32_t b1 = __byte_perm(word(vf[2][h], e / 2), word(vf[3][h], e / 2), sel);
        mma_bf16(acc[h * 8 + e], pa0, pa1, pa2, pa3, b0, b1);
      }
    }
    if (i + 1 < n_tiles) load_v(rows);
    if (i + 2 < n_tiles) rows = resolve(key0 + 2 * kTileKeys);
  }

  // Lane (g, t) holds rows g, g + 8 at dims h·64 + 16t + [0, 8) (accumulator element 0/2 of
  // n-tiles h·8 + e) and h·64 + 16t + 8 + [0, 8) (element 1/3).
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float l = row_sum[half];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = __fdividef(1.0f, l);
    const int r = g + half * 8;
    if (r >= n_rows) continue;
    if (a.n_splits == 1) {
      __nv_bfloat16* dst = p.out + static_cast<int64_t>(seq.row0) * p.ld_out + static_cast<int64_t>(head0 + r) * D;
#pragma unroll
      for (int h = 0; h < D / 64; ++h) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          uint4 v;
          v.x = pack_bf16(acc[h * 8 + 0][2 * half + c] * inv, acc[h * 8 + 1][2 * half + c] * inv);
          v.y = pack_bf16(acc[h * 8 + 2][2 * half + c] * inv, acc[h * 8 + 3][2 * half + c] * inv);
          v.z = pack_bf16(acc[h * 8 + 4][2 * half + c] * inv, acc[h * 8 + 5][2 * half + c] * inv);
          v.w = pack_bf16(acc[h * 8 + 6][2 * half + c] * inv, acc[h * 8 + 7][2 * half + c] * inv);
          *reinterpret_cast<uint4*>(dst + h * 64 + 16 * t + 8 * c) = v;
        }
      }
    } else {
      float* dst = a.ws_o + (ws_row0 + r) * D;
#pragma unroll
      for (int h = 0; h < D / 64; ++h) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
#pragma unroll
          for (int q = 0; q < 2; ++q) {
            const float4 v =
                make_float4(acc[h * 8 + 4 * q + 0][2 * half + c] * inv, acc[h * 8 + 4 * q + 1][2 * half + c] * inv,
                            acc[h * 8 + 4 * q + 2][2 * half + c] * inv, acc[h * 8 + 4 * q + 3][2 * half + c] * inv);
            *reinterpret_cast<float4*>(dst + h * 64 + 16 * t + 8 * c + 4 * q) = v;
          }
        }
      }
      if (t == 0) a.ws_lse[ws_row0 + r] = row_max[half] * a.scale_log2 + __log2f(l);
    }
  }
}

// Merges the splits' partials: out = Σ 2^(lse_s − max) · o_s / Σ 2^(lse_s − max). Grid
// (n_head, n_seqs), D / 4 threads, 4 dims each.
template <int D>
__global__ void __launch_bounds__(D / 4)
    attention_decode_combine_kernel(AttnParams p, int n_splits, const float* ws_o, const float* ws_lse) {
  const int h = blockIdx.x;
  const int seq_i = blockIdx.y;
  const AttnSeq seq = p.seqs[seq_i];
  if (seq.n_new <= 0) return;
  const int64_t split_stride = static_cast<int64_t>(p.n_seqs) * p.n_head;
  const int64_t row = static_cast<int64_t>(seq_i) * p.n_head + h;
  float mx = -INFINITY;
  for (int s = 0; s < n_splits; ++s) mx = fmaxf(mx, ws_lse[s * split_stride + row]);
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float sum = 0.0f;
  for (int s = 0; s < n_splits; ++s) {
    const float lse = ws_lse[s * split_stride + row];
    if (lse == -INFINITY) continue;  // empty split: its o was never written
    const float w = exp2f(lse - mx);
    const float4 o = reinterpret_cast<const float4*>(ws_o + (s * split_stride + row) * D)[threadIdx.x];
    acc.x += w * o.x;
    acc.y += w * o.y;
    acc.z += w * o.z;
    acc.w += w * o.w;
    sum += w;
  }
  const float inv = 1.0f / sum;
  uint2 v;
  v.x = pack_bf16(acc.x * inv, acc.y * inv);
  v.y = pack_bf16(acc.z * inv, acc.w * inv);
  *reinterpret_cast<uint2*>(p.out + static_cast<int64_t>(seq.row0) * p.ld_out + static_cast<int64_t>(h) * D +
                            4 * threadIdx.x) = v;
}

template <int D>
void launch_decode(const AttnParams& p, const DecodePlan& plan, int n_head_groups, float* ws_o, float* ws_lse,
                   cudaStream_t stream) {
  constexpr float kLog2e = 1.4426950408889634f;
  const DecodeArgs args{
      p, FastDiv(p.block_size), p.scale * kLog2e, plan.n_splits, plan.split_keys, n_head_groups, ws_o, ws_lse};
  const dim3 grid(plan.n_splits, p.n_kv_heads * n_head_groups, p.n_seqs);
  attention_decode_kernel<D><<<grid, 32, 0, stream>>>(args);
  CUDA_CHECK_LAUNCH();
  if (plan.n_splits > 1) {
    attention_decode_combine_kernel<D><<<dim3(p.n_head, p.n_seqs), D / 4, 0, stream>>>(p, plan.n_splits, ws_o, ws_lse);
    CUDA_CHECK_LAUNCH();
  }
}

bool aligned16(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
}

}  // namespace

bool attention_supports_head_dim(int head_dim) {
  return head_dim == 64 || head_dim == 128;
}

size_t attention_decode_workspace_bytes(int n_seqs, int n_head, int head_dim, int max_kv_len) {
  if (n_seqs <= 0 || max_kv_len <= 0) return 0;
  const DecodePlan bound = decode_plan(n_seqs, 1, max_kv_len, sm_count());
  return decode_workspace_bytes(bound.n_splits, n_seqs, n_head, head_dim);
}

void attention_decode(const AttnParams& p, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (p.n_seqs == 0) return;
  BATON_CHECK(p.n_seqs > 0 && p.max_kv_len >= 1, "attention_decode: n_seqs %d, max_kv_len %d", p.n_seqs, p.max_kv_len);
  BATON_CHECK(p.n_kv_heads > 0 && p.n_head % p.n_kv_heads == 0, "attention_decode: n_head %d, n_kv_heads %d", p.n_head,
              p.n_kv_heads);
  BATON_CHECK(p.block_size >= 1, "attention_decode: block_size %d", p.block_size);
  BATON_CHECK(p.max_n_new == 1, "attention_decode computes one query row per sequence, not %d (use attention_prefill)",
              p.max_n_new);
  BATON_CHECK(p.scale > 0.0f, "attention_decode: scale must be positive (the running max is kept unscaled)");
  BATON_CHECK(p.ld_q % 8 == 0 && p.ld_out % 8 == 0 && aligned16(p.q) && aligned16(p.out) && aligned16(p.k_cache) &&
                  aligned16(p.v_cache),
              "attention_decode: q/out/k/v must be 16-byte aligned with row strides a multiple of 8");
  BATON_CHECK(attention_supports_head_dim(p.head_dim), "attention_decode: head_dim %d not supported", p.head_dim);
  const int n_head_groups = ceil_div(p.n_head / p.n_kv_heads, kHeadsPerGroup);
  BATON_CHECK(p.n_seqs <= 65535 && static_cast<int64_t>(p.n_kv_heads) * n_head_groups <= 65535,
              "attention_decode: grid too large (%d seqs, %d kv heads)", p.n_seqs, p.n_kv_heads);
  const DecodePlan plan = decode_plan(p.n_seqs, p.n_kv_heads * n_head_groups, p.max_kv_len, sm_count());
  const size_t need = decode_workspace_bytes(plan.n_splits, p.n_seqs, p.n_head, p.head_dim);
  BATON_CHECK(workspace_bytes >= need && (need == 0 || (workspace != nullptr && aligned16(workspace))),
              "attention_decode: workspace of %zu bytes at %p, %zu needed (attention_decode_workspace_bytes)",
              workspace_bytes, workspace, need);
  float* ws_o = static_cast<float*>(workspace);
  float* ws_lse = ws_o + static_cast<size_t>(plan.n_splits) * p.n_seqs * p.n_head * p.head_dim;
  if (p.head_dim == 64) {
    launch_decode<64>(p, plan, n_head_groups, ws_o, ws_lse, stream);
  } else {
    launch_decode<128>(p, plan, n_head_groups, ws_o, ws_lse, stream);
  }
}

}  // namespace baton::cuda
