#include "kernels/cuda/sampling.h"

#include <cfloat>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

#include "common/check.h"
#include "kernels/cuda/cuda_check.h"

namespace baton::cuda {
namespace {

constexpr int kThreads = 1024;
// The pick kernel keeps doubles and two CUB collectives in flight: at 1024 threads it would have
// 64 registers and spill; 512 gives it room.
constexpr int kPickThreads = 512;
// row_logprobs_kernel spills (20 bytes, ptxas -v) under 1024 threads' 64 registers; 512 does not.
constexpr int kLogprobThreads = 512;
// Rows sorted per radix-sort call: bounds the scratch (keys and ids of this many rows).
constexpr int kSortRows = 32;

struct ArgMax {
  float v;
  int32_t i;
};
struct ArgMaxOp {
  __device__ ArgMax operator()(const ArgMax& a, const ArgMax& b) const {
    return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
  }
};

__global__ void __launch_bounds__(kThreads) argmax_kernel(const float* logits, int64_t ld, int vocab, int32_t* out) {
  using Reduce = cub::BlockReduce<ArgMax, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const float* row = logits + blockIdx.x * ld;
  ArgMax best{-INFINITY, INT32_MAX};
  for (int i = threadIdx.x; i < vocab; i += kThreads) best = ArgMaxOp()(best, ArgMax{row[i], i});
  best = Reduce(tmp).Reduce(best, ArgMaxOp());
  if (threadIdx.x == 0) out[blockIdx.x] = best.i < vocab ? best.i : 0;
}

// keys[r * vocab + i] = logits[r][i], ids[...] = i: the sort's input for `rows` rows from row0.
__global__ void sort_input_kernel(const float* logits, int64_t ld, int vocab, float* keys, int32_t* ids) {
  const float* row = logits + blockIdx.x * ld;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    keys[static_cast<int64_t>(blockIdx.x) * vocab + i] = row[i];
    ids[static_cast<int64_t>(blockIdx.x) * vocab + i] = i;
  }
}

__global__ void segment_offsets_kernel(int rows, int vocab, int* offsets) {
  for (int r = threadIdx.x; r <= rows; r += blockDim.x) offsets[r] = r * vocab;
}

// One block per row of sorted (descending) logits: the CPU's sample_logits over the sorted order.
__global__ void __launch_bounds__(kPickThreads)
    pick_kernel(const float* sorted, const int32_t* ids, int vocab, const SampleSpec* specs, int32_t* out) {
  using Reduce = cub::BlockReduce<double, kPickThreads>;
  using Scan = cub::BlockScan<double, kPickThreads>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename Scan::TempStorage scan;
  } tmp;
  __shared__ double s_total;
  __shared__ int s_found;
  const SampleSpec spec = specs[blockIdx.x];
  const float* row = sorted + static_cast<int64_t>(blockIdx.x) * vocab;
  const int32_t* row_ids = ids + static_cast<int64_t>(blockIdx.x) * vocab;
  if (spec.temperature == 0.0f) {
    if (threadIdx.x == 0) out[blockIdx.x] = row_ids[0];
    return;
  }
  const float mx = row[0];
  const double t = spec.temperature;
  auto prob = [&](int i) { return exp(static_cast<double>(row[i] - mx) / t); };
  int keep = spec.top_k > 0 && spec.top_k < vocab ? spec.top_k : vocab;

  double part = 0.0;
  for (int i = threadIdx.x; i < keep; i += kPickThreads) part += prob(i);
  double total = Reduce(tmp.reduce).Sum(part);
  if (threadIdx.x == 0) s_total = total;
  __syncthreads();
  total = s_total;

  // Finds the first index i in [0, keep) whose inclusive prefix sum of probabilities satisfies
  // `hit(prefix)`; keep when none does.
  auto first_hit = [&](auto hit) {
    if (threadIdx.x == 0) s_found = keep;
    __syncthreads();
    double running = 0.0;
    for (int base = 0; base < keep; base += kPickThreads) {
      const int i = base + threadIdx.x;
      const double p = i < keep ? prob(i) : 0.0;
      double prefix, chunk;
      Scan(tmp.scan).InclusiveSum(p, prefix, chunk);
      prefix += running;
      if (i < keep && hit(prefix)) atomicMin(&s_found, i);
      __syncthreads();
      const bool done = s_found < keep;
      __syncthreads();  // every thread has read s_found before the next round may lower it
      if (done) break;
      running += chunk;
    }
    const int found = s_found;
    __syncthreads();
    return found;
  };

  if (spec.top_p < 1.0f) {
    const double top_p = spec.top_p;
    const int cut = first_hit([&](double prefix) { return prefix / total >= top_p; });
    if (cut < keep) keep = cut + 1;
    part = 0.0;
    for (int i = threadIdx.x; i < keep; i += kPickThreads) part += prob(i);
    const double kept = Reduce(tmp.reduce).Sum(part);
    if (threadIdx.x == 0) s_total = kept;
    __syncthreads();
    total = s_total;
  }
  const double r = spec.u * total;
  const int pick = first_hit([&](double prefix) { return prefix > r; });
  if (threadIdx.x == 0) out[blockIdx.x] = row_ids[pick < keep ? pick : keep - 1];
}

struct SortScratch {
  float* keys_in;
  float* keys_out;
  int32_t* ids_in;
  int32_t* ids_out;
  int* offsets;
  void* cub_tmp;
  size_t cub_bytes;
};

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

size_t cub_sort_bytes(int rows, int vocab) {
  size_t bytes = 0;
  CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(
      nullptr, bytes, static_cast<const float*>(nullptr), static_cast<float*>(nullptr), static_cast<const int32_t*>(nullptr),
      static_cast<int32_t*>(nullptr), static_cast<int64_t>(rows) * vocab, rows, static_cast<const int*>(nullptr),
      static_cast<const int*>(nullptr)));
  return bytes;
}

SortScratch carve(void* workspace, int rows, int vocab) {
  const size_t n = static_cast<size_t>(rows) * vocab;
  char* p = static_cast<char*>(workspace);
  SortScratch s{};
  s.keys_in = reinterpret_cast<float*>(p);
  p += align256(n * sizeof(float));
  s.keys_out = reinterpret_cast<float*>(p);
  p += align256(n * sizeof(float));
  s.ids_in = reinterpret_cast<int32_t*>(p);
  p += align256(n * sizeof(int32_t));
  s.ids_out = reinterpret_cast<int32_t*>(p);
  p += align256(n * sizeof(int32_t));
  s.offsets = reinterpret_cast<int*>(p);
  p += align256((rows + 1) * sizeof(int));
  s.cub_tmp = p;
  s.cub_bytes = cub_sort_bytes(rows, vocab);
  return s;
}

// out[row] = kNonFiniteLogits where the row holds a NaN or an infinity (after the token kernels,
// on the same stream: it overrides their pick), as sample_logits does on the CPU.
__global__ void mark_non_finite_kernel(const float* logits, int64_t ld, int vocab, int32_t* out) {
  const float* row = logits + blockIdx.x * ld;
  int bad = 0;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) bad |= !isfinite(row[i]);
  if (__syncthreads_or(bad) && threadIdx.x == 0) out[blockIdx.x] = kNonFiniteLogits;
}

// One block per row whose spec asks for log-probabilities (the others return at once), on the raw
// logits: log_sum_exp and top_logprobs of kernels/sampling.cpp, in the same double arithmetic.
// The top tokens are rounds of a block-wide argmax, each over the tokens ordered after the
// previous pick (logit descending, index ascending), so no set of taken tokens is kept.
__global__ void __launch_bounds__(kLogprobThreads)
    row_logprobs_kernel(const float* logits, int64_t ld, int vocab, const SampleSpec* specs, TokenLogprobs* out,
                        double* lse_out) {
  const int asked = specs[blockIdx.x].top_logprobs;
  if (asked < 0) return;
  using ArgReduce = cub::BlockReduce<ArgMax, kLogprobThreads>;
  using SumReduce = cub::BlockReduce<double, kLogprobThreads>;
  __shared__ union {
    typename ArgReduce::TempStorage arg;
    typename SumReduce::TempStorage sum;
  } tmp;
  __shared__ ArgMax s_best;
  __shared__ double s_lse;
  const float* row = logits + blockIdx.x * ld;
  TokenLogprobs& lp = out[blockIdx.x];

  auto best_after = [&](ArgMax prev) {
    ArgMax best{-INFINITY, INT32_MAX};
    for (int i = threadIdx.x; i < vocab; i += kLogprobThreads) {
      const float v = row[i];
      if (v < prev.v || (v == prev.v && i > prev.i)) best = ArgMaxOp()(best, ArgMax{v, i});
    }
    best = ArgReduce(tmp.arg).Reduce(best, ArgMaxOp());
    if (threadIdx.x == 0) s_best = best;
    __syncthreads();
    best = s_best;
    __syncthreads();  // every thread has read s_best before the next round may write it
    return best;
  };

  // The first pick is the row's maximum, which the log-sum-exp needs (even when n_top is 0).
  ArgMax pick = best_after(ArgMax{INFINITY, -1});
  const float mx = pick.v;
  double part = 0.0;
  for (int i = threadIdx.x; i < vocab; i += kLogprobThreads) part += exp(static_cast<double>(row[i]) - mx);
  const double total = SumReduce(tmp.sum).Sum(part);
  if (threadIdx.x == 0) s_lse = mx + log(total);
  __syncthreads();
  const double lse = s_lse;

  const int n_top = min(asked, min(kMaxTopLogprobs, vocab));
  for (int j = 0; j < n_top; ++j) {
    if (j > 0) pick = best_after(pick);
    if (threadIdx.x == 0) {
      lp.top_ids[j] = pick.i;
      lp.top_logprobs[j] = static_cast<float>(pick.v - lse);
    }
  }
  for (int j = n_top + threadIdx.x; j < kMaxTopLogprobs; j += kLogprobThreads) {
    lp.top_ids[j] = 0;
    lp.top_logprobs[j] = 0.0f;
  }
  if (threadIdx.x == 0) {
    lp.n_top = n_top;
    lse_out[blockIdx.x] = lse;
  }
}

// One thread per entry; the (row, token) pairs are distinct, so no two threads touch one logit.
// __fmul_rn rounds the product on its own as the CPU's expression does: nvcc would otherwise fuse
// it with the subtraction into one FMA.
__global__ void adjust_kernel(float* logits, int64_t ld, const LogitAdjust* adjust, int n, float* raw) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= n) return;
  const LogitAdjust a = adjust[e];
  float& l = logits[a.row * ld + a.token];
  raw[e] = l;
  l = (l > 0.0f ? l / a.repetition : __fmul_rn(l, a.repetition)) - a.subtract;
}

// One thread per row; a row's entries are its penalised tokens (at most its context), a scan that
// costs little next to the row's sampling.
__global__ void sampled_logprob_kernel(const float* logits, int64_t ld, int rows, const SampleSpec* specs,
                                       const int32_t* tokens, const LogitAdjust* adjust, const int32_t* adjust_first,
                                       const float* raw, const double* lse, TokenLogprobs* out) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows || specs[r].top_logprobs < 0 || tokens[r] == kNonFiniteLogits) return;
  const int32_t token = tokens[r];
  float value = logits[r * ld + token];
  for (int e = adjust_first[r]; e < adjust_first[r + 1]; ++e) {
    if (adjust[e].token == token) value = raw[e];
  }
  out[r].logprob = static_cast<float>(value - lse[r]);
}

}  // namespace

__global__ void mask_logits_kernel(float* logits, int64_t ld, int vocab, const int32_t* slot, const uint32_t* masks,
                                   int n_words) {
  const int32_t at = slot[blockIdx.x];
  if (at < 0) return;
  float* row = logits + blockIdx.x * ld;
  const uint32_t* mask = masks + static_cast<int64_t>(at) * n_words;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    if (!((mask[i / 32] >> (i % 32)) & 1u) && isfinite(row[i])) row[i] = -FLT_MAX;
  }
}

size_t sample_workspace_bytes(int rows, int vocab) {
  const int r = rows < kSortRows ? rows : kSortRows;
  const size_t n = static_cast<size_t>(r) * vocab;
  return 2 * align256(n * sizeof(float)) + 2 * align256(n * sizeof(int32_t)) + align256((r + 1) * sizeof(int)) +
         align256(cub_sort_bytes(r, vocab));
}

void sample_rows(const float* logits, int64_t ld, int rows, int vocab, const SampleSpec* specs_d, bool any_random,
                 int32_t* out_d, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (rows == 0) return;
  if (!any_random) {
    argmax_kernel<<<rows, kThreads, 0, stream>>>(logits, ld, vocab, out_d);
    CUDA_CHECK_LAUNCH();
    mark_non_finite_kernel<<<rows, 256, 0, stream>>>(logits, ld, vocab, out_d);
    CUDA_CHECK_LAUNCH();
    return;
  }
  BATON_CHECK(vocab < (1 << 30) / kSortRows, "vocabulary of %d too large to sort", vocab);
  for (int r0 = 0; r0 < rows; r0 += kSortRows) {
    const int r = rows - r0 < kSortRows ? rows - r0 : kSortRows;
    BATON_CHECK(sample_workspace_bytes(r, vocab) <= workspace_bytes, "sampling workspace of %zu bytes is too small",
                workspace_bytes);
    SortScratch s = carve(workspace, r, vocab);
    sort_input_kernel<<<r, 256, 0, stream>>>(logits + r0 * ld, ld, vocab, s.keys_in, s.ids_in);
    CUDA_CHECK_LAUNCH();
    segment_offsets_kernel<<<1, 256, 0, stream>>>(r, vocab, s.offsets);
    CUDA_CHECK_LAUNCH();
    size_t cub_bytes = s.cub_bytes;
    CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(s.cub_tmp, cub_bytes, s.keys_in, s.keys_out, s.ids_in,
                                                                 s.ids_out, static_cast<int64_t>(r) * vocab, r, s.offsets,
                                                                 s.offsets + 1, 0, 32, stream));
    pick_kernel<<<r, kPickThreads, 0, stream>>>(s.keys_out, s.ids_out, vocab, specs_d + r0, out_d + r0);
    CUDA_CHECK_LAUNCH();
  }
  mark_non_finite_kernel<<<rows, 256, 0, stream>>>(logits, ld, vocab, out_d);
  CUDA_CHECK_LAUNCH();
}

void row_logprobs(const float* logits, int64_t ld, int rows, int vocab, const SampleSpec* specs_d, TokenLogprobs* out_d,
                  double* lse_d, cudaStream_t stream) {
  if (rows == 0) return;
  row_logprobs_kernel<<<rows, kLogprobThreads, 0, stream>>>(logits, ld, vocab, specs_d, out_d, lse_d);
  CUDA_CHECK_LAUNCH();
}

void adjust_logits(float* logits, int64_t ld, const LogitAdjust* adjust_d, int n, float* raw_d, cudaStream_t stream) {
  if (n == 0) return;
  adjust_kernel<<<(n + 255) / 256, 256, 0, stream>>>(logits, ld, adjust_d, n, raw_d);
  CUDA_CHECK_LAUNCH();
}

void mask_logits(float* logits, int64_t ld, int rows, int vocab, const int32_t* slot_d, const uint32_t* masks_d,
                 int n_words, cudaStream_t stream) {
  if (rows == 0) return;
  mask_logits_kernel<<<rows, 256, 0, stream>>>(logits, ld, vocab, slot_d, masks_d, n_words);
  CUDA_CHECK_LAUNCH();
}

void sampled_logprobs(const float* logits, int64_t ld, int rows, const SampleSpec* specs_d, const int32_t* tokens_d,
                      const LogitAdjust* adjust_d, const int32_t* adjust_first_d, const float* raw_d,
                      const double* lse_d, TokenLogprobs* out_d, cudaStream_t stream) {
  if (rows == 0) return;
  sampled_logprob_kernel<<<(rows + 255) / 256, 256, 0, stream>>>(logits, ld, rows, specs_d, tokens_d, adjust_d,
                                                                 adjust_first_d, raw_d, lse_d, out_d);
  CUDA_CHECK_LAUNCH();
}

}  // namespace baton::cuda
