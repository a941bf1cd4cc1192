// attention_prefill: FlashAttention-2-style causal GQA attention over the paged KV cache, for any
// mix of prefill chunks (and decode rows) in one launch.
//
// One CTA computes one tile of kBlockM query rows of one (sequence, query head):
//   - its Q tile and, kStages-deep, K/V tiles of kBlockN keys are copied into shared memory with
//     16-byte cp.async (K/V rows gathered token by token through the block table);
//   - S = Q·Kᵀ and O += P·V run on the tensor cores (mma.sync m16n8k16 bf16 → f32, operands from
//     ldmatrix, .trans for V), P never leaves registers (S's accumulator layout is P's A operand);
//   - softmax is online in fp32 with exp2 (scale·log2 e folded into one FMA);
//   - key tiles are visited from the diagonal down: the first (diagonal) tiles are masked, the
//     ones wholly below the diagonal are not;
//   - the finished O tile is staged through the (now free) Q buffer so rows go out as 16-byte
//     coalesced stores, and rows past the sequence's n_new are never written.
// Shared memory rows are XOR-swizzled in 16-byte chunks (chunk ^ (row & 7)), which makes every
// ldmatrix phase and the staging stores bank-conflict free without padding.
#include <cuda_bf16.h>

#include <atomic>
#include <cstdint>

#include "common/check.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/mma_ptx.cuh"

namespace baton::cuda {
namespace {

// Tile shapes. Each warp owns kBlockM / kNWarps query rows (kMTiles m16 tiles) and walks every key
// of the tile, so one warp reads a K/V tile from shared memory per 32 rows of work rather than 16:
// that halves shared-memory traffic per FLOP against 16 rows per warp, which is what keeps
// mma.sync fed on H100/H200 (FlashAttention-2 uses the same 128 × 64, 4-warp tiles for hd 128 on
// sm80/sm90). Q is re-read from shared memory for every key tile (holding it in registers would
// not fit next to the 32-row accumulators).
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kStages_>
struct PrefillTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // query rows per CTA
  static constexpr int kBlockN = kBlockN_;  // keys per K/V tile
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kStages = kStages_;  // K/V tiles in flight (2 = double buffering)
  static constexpr int kThreads = kNWarps * 32;
  static constexpr int kWarpRows = kBlockM / kNWarps;
  static constexpr int kMTiles = kWarpRows / 16;  // m16 tiles per warp
  static constexpr int kChunks = kHeadDim / 8;    // 16-byte chunks per row
  static constexpr int kRowBytes = kHeadDim * 2;
  static constexpr int kQBytes = kBlockM * kRowBytes;
  static constexpr int kKvTileBytes = kBlockN * kRowBytes;
  static constexpr int kSmemBytes = kQBytes + 2 * kStages * kKvTileBytes + 256;  // + alignment slack

  static_assert(kHeadDim % 16 == 0 && kBlockN % 16 == 0 && kWarpRows % 16 == 0);
  static_assert(kChunks >= 8, "the XOR swizzle needs rows of at least 8 chunks");
  static_assert((kBlockM * kChunks) % kThreads == 0 && (kBlockN * kChunks) % kThreads == 0);
  static_assert(kThreads % kChunks == 0 && (kThreads / kChunks) % 8 == 0,
                "a thread's copy rows must share (row & 7), so its swizzle is one constant");
  static_assert((kWarpRows * kChunks) % 32 == 0);
  static_assert(kStages >= 2);
  static_assert(kQBytes % 256 == 0 && kKvTileBytes % 256 == 0, "buffers keep the 256-byte alignment");
};

// hd 128: 32 KB Q + 2 × (16 + 16) KB K/V = 96 KB, two CTAs (8 warps) per H100/H200 SM.
using PrefillTraitsHd128 = PrefillTraits<128, 128, 64, 4, 2>;
// hd 64: same 32-rows-per-warp shape, 48 KB; the accumulators are half as large.
using PrefillTraitsHd64 = PrefillTraits<64, 128, 64, 4, 2>;

// x, as a value the compiler cannot see through: keeps per-iteration address arithmetic inside the
// loop instead of hoisting one register per unrolled offset out of it (which spills).
template <class I>
__device__ __forceinline__ I opaque(I x) {
  static_assert(sizeof(I) == 4);
  asm volatile("" : "+r"(x));
  return x;
}


// ---- the kernel --------------------------------------------------------------------------------

// Grid: (n_head, n_seqs, m tiles of the longest sequence); blockIdx.z counts down from the last
// (heaviest: most keys) query tile so those start first and the light ones fill the tail.
template <class T>
__global__ void __launch_bounds__(T::kThreads)
    attention_prefill_kernel(AttnParams p, FastDiv bs_div, float scale_log2) {
  constexpr int D = T::kHeadDim;
  constexpr int kRB = T::kRowBytes;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  // Buffers start on a 256-byte boundary so a row's swizzle bits (4..7) are zero in its address
  // and swizzling is one XOR of the address (kSmemBytes includes the slack).
  const uint32_t q_s = (smem_u32(smem_raw) + 255u) & ~255u;
  uint8_t* smem = smem_raw + (q_s - smem_u32(smem_raw));
  const uint32_t k_s = q_s + T::kQBytes;
  const uint32_t v_s = k_s + T::kStages * T::kKvTileBytes;

  const AttnSeq seq = p.seqs[blockIdx.y];
  const int m0 = (gridDim.z - 1 - blockIdx.z) * T::kBlockM;
  if (m0 >= seq.n_new) return;  // whole CTA: before any barrier
  const int h = blockIdx.x;
  const int kvh = h / (p.n_head / p.n_kv_heads);
  const int n_rows = min(T::kBlockM, seq.n_new - m0);
  const int q_first = seq.kv_offset + m0;   // position of the tile's first row
  const int q_last = q_first + n_rows - 1;  // ... and of its last valid row
  const int n_tiles = q_last / T::kBlockN + 1;
  const int n_unmasked = (q_first + 1) / T::kBlockN;  // tiles whose keys are all <= q_first

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;

  // Copy assignment: thread tid moves chunk (tid % kChunks) of rows tid / kChunks + i · kRowStep.
  constexpr int kRowStep = T::kThreads / T::kChunks;
  const int copy_row = tid / T::kChunks;
  const int copy_chunk = tid % T::kChunks;
  const uint32_t copy_swz = static_cast<uint32_t>((copy_chunk ^ (copy_row & 7)) * 16);

  {  // Q tile: rows past n_rows are zero (their results are computed but never stored)
    const __nv_bfloat16* q_tile = p.q + (static_cast<int64_t>(seq.row0) + m0) * p.ld_q + h * D + copy_chunk * 8;
#pragma unroll
    for (int i = 0; i < T::kBlockM / kRowStep; ++i) {
      const int r = copy_row + i * kRowStep;
      const bool valid = r < n_rows;
      cp_async_16(q_s + r * kRB + copy_swz, valid ? q_tile + r * p.ld_q : p.q, valid);
    }
  }
  const int64_t kv_row_stride = static_cast<int64_t>(p.n_kv_heads) * D;
  const int64_t kv_head_off = static_cast<int64_t>(kvh) * D + copy_chunk * 8;
  const int32_t* table = p.block_tables + seq.table0;
  // K and V of key tile `tile` into stage `stage`; keys past q_last are zero-filled, never read
  // (their table lookup is clamped to q_last's), so a partial last tile stays finite through P·V.
  auto load_kv = [&](int tile, int stage) {
    const int key0 = tile * T::kBlockN;
#pragma unroll
    for (int i = 0; i < T::kBlockN / kRowStep; ++i) {
      const int r = copy_row + i * kRowStep;
      const int key = key0 + r;
      const bool valid = key <= q_last;
      int blk_i, slot;
      bs_div.divmod(min(key, q_last), blk_i, slot);
      const int64_t off =
          (static_cast<int64_t>(__ldg(table + blk_i)) * p.block_size + slot) * kv_row_stride + kv_head_off;
      const uint32_t dst = stage * T::kKvTileBytes + r * kRB + copy_swz;
      cp_async_16(k_s + dst, p.k_cache + off, valid);
      cp_async_16(v_s + dst, p.v_cache + off, valid);
    }
  };

  // Iteration `it` processes key tile n_tiles - 1 - it from stage it % kStages. Group g of
  // cp.async holds tile g (group 0 also Q); empty groups keep the count uniform.
#pragma unroll
  for (int s = 0; s < T::kStages - 1; ++s) {
    if (s < n_tiles) load_kv(n_tiles - 1 - s, s);
    cp_async_commit();
  }

  // Per-lane ldmatrix addressing. All three operand patterns touch rows whose (row & 7) equals
  // (lane & 7) and read chunk (even compile-time c) + (one lane bit), so the swizzled address is
  // (lane's address of chunk its_bit ^ (lane & 7)) ^ (c · 16): one XOR with an immediate.
  const int g = lane / 4;  // mma fragment row (C/A) or column (B)
  const int t = lane % 4;
  const int warp_row0 = warp * T::kWarpRows;
  const uint32_t q_lane = q_s + (warp_row0 + (lane & 15)) * kRB + (((lane >> 4) ^ (lane & 7)) << 4);
  const uint32_t k_lane = ((lane & 7) + ((lane >> 4) << 3)) * kRB + ((((lane >> 3) & 1) ^ (lane & 7)) << 4);
  const uint32_t v_lane = (lane & 15) * kRB + (((lane >> 4) ^ (lane & 7)) << 4);

  float acc_o[T::kMTiles][D / 8][4];
  float row_max[T::kMTiles][2];  // running max of raw scores for rows g and g + 8
  float row_sum[T::kMTiles][2];  // this thread's part of the running sum (quad-reduced at the end)
#pragma unroll
  for (int mt = 0; mt < T::kMTiles; ++mt) {
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mt][nt][e] = 0.0f;
    }
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.0f;
  }

  for (int it = 0; it < n_tiles; ++it) {
    const int tile = n_tiles - 1 - it;
    cp_async_wait<T::kStages - 2>();  // this thread's copies of tile `it` have landed
    __syncthreads();                  // everyone's have, and everyone is done with iteration it - 1
    {
      const int next = it + T::kStages - 1;  // refill the stage iteration it - 1 read
      if (next < n_tiles) load_kv(n_tiles - 1 - next, next % T::kStages);
      cp_async_commit();
    }
    const int stage = it % T::kStages;
    const uint32_t q_warp = opaque(q_lane);
    const uint32_t k_tile = k_s + stage * T::kKvTileBytes + k_lane;
    const uint32_t v_tile = v_s + stage * T::kKvTileBytes + v_lane;

    // S = Q · Kᵀ: warp rows × kBlockN keys.
    float s[T::kMTiles][T::kBlockN / 8][4];
#pragma unroll
    for (int mt = 0; mt < T::kMTiles; ++mt) {
#pragma unroll
      for (int nt = 0; nt < T::kBlockN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.0f;
      }
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t qa[T::kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < T::kMTiles; ++mt) ldmatrix_x4(qa[mt], (q_warp ^ (kk * 32)) + mt * 16 * kRB);
#pragma unroll
      for (int np = 0; np < T::kBlockN / 16; ++np) {
        uint32_t kb[4];
        ldmatrix_x4(kb, (k_tile ^ (kk * 32)) + np * 16 * kRB);
#pragma unroll
        for (int mt = 0; mt < T::kMTiles; ++mt) {
          mma_bf16(s[mt][2 * np], qa[mt], kb[0], kb[1]);
          mma_bf16(s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
        }
      }
    }

    // Causal mask on the diagonal tiles: row at position P sees keys <= P, and no row sees keys
    // past q_last (never loaded; only rows past n_new would reach them).
    if (tile >= n_unmasked) {
      const int key_base = tile * T::kBlockN + 2 * t;
      const int row_pos = opaque(q_first + warp_row0 + g);  // computed here, not kept live in registers
#pragma unroll
      for (int mt = 0; mt < T::kMTiles; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int limit = min(row_pos + mt * 16 + half * 8, q_last);
#pragma unroll
          for (int nt = 0; nt < T::kBlockN / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              if (key_base + nt * 8 + e > limit) s[mt][nt][half * 2 + e] = -INFINITY;
            }
          }
        }
      }
    }

    // Online softmax (fp32, base 2). A row can be fully masked in its first tiles: its max stays
    // -inf and it is shifted by 0 instead, so every exp2 sees -inf (→ 0), never NaN.
#pragma unroll
    for (int mt = 0; mt < T::kMTiles; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float mx = row_max[mt][half];
#pragma unroll
        for (int nt = 0; nt < T::kBlockN / 8; ++nt) {
          mx = fmaxf(mx, fmaxf(s[mt][nt][half * 2], s[mt][nt][half * 2 + 1]));
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float shift = mx == -INFINITY ? 0.0f : mx * scale_log2;
        const float alpha = fast_exp2(row_max[mt][half] * scale_log2 - shift);
        row_max[mt][half] = mx;
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < T::kBlockN / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pe = fast_exp2(fmaf(s[mt][nt][half * 2 + e], scale_log2, -shift));
            s[mt][nt][half * 2 + e] = pe;
            sum += pe;
          }
        }
        row_sum[mt][half] = row_sum[mt][half] * alpha + sum;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
          acc_o[mt][nt][half * 2] *= alpha;
          acc_o[mt][nt][half * 2 + 1] *= alpha;
        }
      }
    }

    // O += P · V: S's accumulators, rounded to bf16, are exactly P's A fragments (keys 16·kk ..).
#pragma unroll
    for (int kk = 0; kk < T::kBlockN / 16; ++kk) {
      uint32_t pa[T::kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < T::kMTiles; ++mt) {
        pa[mt][0] = pack_bf16(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pa[mt][1] = pack_bf16(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pa[mt][2] = pack_bf16(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pa[mt][3] = pack_bf16(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int np = 0; np < D / 16; ++np) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, (v_tile ^ (np * 32)) + kk * 16 * kRB);
#pragma unroll
        for (int mt = 0; mt < T::kMTiles; ++mt) {
          mma_bf16(acc_o[mt][2 * np], pa[mt], vb[0], vb[1]);
          mma_bf16(acc_o[mt][2 * np + 1], pa[mt], vb[2], vb[3]);
        }
      }
    }
  }

  // Normalise and stage the warp's rows in its own rows of the Q buffer (no other warp reads
  // them), then write whole 16-byte chunks of the valid rows.
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < T::kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float l = row_sum[mt][half];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = l > 0.0f ? __fdividef(1.0f, l) : 0.0f;
      const int r = warp_row0 + mt * 16 + half * 8 + g;
      uint8_t* row = smem + r * kRB + t * 4;
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt) {
        *reinterpret_cast<uint32_t*>(row + ((nt ^ (r & 7)) << 4)) =
            pack_bf16(acc_o[mt][nt][half * 2] * inv, acc_o[mt][nt][half * 2 + 1] * inv);
      }
    }
  }
  __syncwarp();
  __nv_bfloat16* out_tile = p.out + (static_cast<int64_t>(seq.row0) + m0) * p.ld_out + h * D;
#pragma unroll
  for (int i = 0; i < T::kWarpRows * T::kChunks / 32; ++i) {
    const int idx = i * 32 + lane;
    const int r = warp_row0 + idx / T::kChunks;
    const int c = idx % T::kChunks;
    if (r < n_rows) {
      *reinterpret_cast<uint4*>(out_tile + r * p.ld_out + c * 8) =
          *reinterpret_cast<const uint4*>(smem + r * kRB + ((c ^ (r & 7)) << 4));
    }
  }
}

template <class T>
void launch_prefill(const AttnParams& p, cudaStream_t stream) {
  const int n_m_tiles = (p.max_n_new + T::kBlockM - 1) / T::kBlockM;
  BATON_CHECK(n_m_tiles <= 65535 && p.n_seqs <= 65535, "attention_prefill: grid too large (%d query tiles, %d seqs)",
              n_m_tiles, p.n_seqs);
  auto* kernel = attention_prefill_kernel<T>;
  if (T::kSmemBytes > 48 * 1024) {
    // The opt-in is per device; done once per device (so not again while a stream is captured).
    constexpr int kMaxDevices = 64;
    static std::atomic<bool> opted_in[kMaxDevices] = {};  // racing callers both set it: harmless
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    if (dev >= kMaxDevices || !opted_in[dev]) {
      CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes));
      if (dev < kMaxDevices) opted_in[dev] = true;
    }
  }
  constexpr float kLog2e = 1.4426950408889634f;
  const dim3 grid(p.n_head, p.n_seqs, n_m_tiles);
  kernel<<<grid, T::kThreads, T::kSmemBytes, stream>>>(p, FastDiv(p.block_size), p.scale * kLog2e);
  CUDA_CHECK_LAUNCH();
}

bool aligned16(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
}

}  // namespace

void attention_prefill(const AttnParams& p, cudaStream_t stream) {
  if (p.n_seqs == 0 || p.max_n_new == 0) return;
  BATON_CHECK(p.n_seqs > 0 && p.max_n_new > 0, "attention_prefill: n_seqs %d, max_n_new %d", p.n_seqs, p.max_n_new);
  BATON_CHECK(p.n_kv_heads > 0 && p.n_head % p.n_kv_heads == 0, "attention_prefill: n_head %d, n_kv_heads %d", p.n_head,
              p.n_kv_heads);
  BATON_CHECK(p.block_size >= 1, "attention_prefill: block_size %d", p.block_size);
  BATON_CHECK(p.scale > 0.0f, "attention_prefill: scale must be positive (the running max is kept unscaled)");
  // 16-byte cp.async reads and 16-byte output stores.
  BATON_CHECK(p.ld_q % 8 == 0 && p.ld_out % 8 == 0 && aligned16(p.q) && aligned16(p.out) && aligned16(p.k_cache) &&
                  aligned16(p.v_cache),
              "attention_prefill: q/out/k/v must be 16-byte aligned with row strides a multiple of 8");
  switch (p.head_dim) {
    case 64: launch_prefill<PrefillTraitsHd64>(p, stream); return;
    case 128: launch_prefill<PrefillTraitsHd128>(p, stream); return;
    default: BATON_CHECK(false, "attention_prefill: head_dim %d not supported", p.head_dim);
  }
}

}  // namespace baton::cuda
