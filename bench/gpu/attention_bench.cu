// bench/gpu/attention_bench: the CUDA attention launchers alone (kernels/cuda/attention.h).
//   - attention_prefill, causal, one sequence of n tokens, Llama-3-8B heads (32 query, 8 KV),
//     head dim 128 at n = 512 / 2048 / 8192 and head dim 64 at 8192. Counted FLOPs are the
//     useful causal ones: 2 (mul+add) · 2 (Q·Kᵀ and P·V) · n_head · head_dim · n(n+1)/2.
//   - attention_decode, batch {1, 8, 32, 128} × context {1024, 8192}, head dim 128: time and the
//     bandwidth of the K/V it must read (batch · context · n_kv_heads · head_dim · 2 bytes · 2).
//     L2 is flushed before each decode rep so small batches are not served from cache.
// Each figure is the median of kReps CUDA-event timings after kWarmup launches. Output: a table,
// and one `BENCH_JSON {...}` line per measurement for scripts. Exit 77 without a GPU.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_check.h"

using baton::cuda::AttnParams;
using baton::cuda::AttnSeq;

namespace {

constexpr int kWarmup = 3;
constexpr int kReps = 25;
constexpr int kNHead = 32;
constexpr int kNKvHeads = 8;
constexpr int kBlockSize = 16;

// Deterministic pseudo-random bf16 in [-1, 1) (values do not affect speed, NaNs might).
__global__ void fill_random(__nv_bfloat16* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    x[i] = __float2bfloat16(static_cast<float>(h >> 8) * (2.0f / 16777216.0f) - 1.0f);
  }
}

struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) { CUDA_CHECK(cudaMalloc(&ptr, bytes > 0 ? bytes : 1)); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr(o.ptr) { o.ptr = nullptr; }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
};

DeviceBuffer random_bf16(size_t n, uint32_t seed) {
  DeviceBuffer b(n * sizeof(__nv_bfloat16));
  fill_random<<<1024, 256>>>(b.as<__nv_bfloat16>(), n, seed);
  CUDA_CHECK_LAUNCH();
  return b;
}

// Median milliseconds of `launch` over kReps CUDA-event timings; `before` runs outside the timed
// region of each rep (e.g. an L2 flush).
template <class Launch, class Before>
double median_ms(Launch&& launch, Before&& before) {
  for (int i = 0; i < kWarmup; ++i) launch();
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> ms;
  for (int i = 0; i < kReps; ++i) {
    before();
    CUDA_CHECK(cudaEventRecord(start));
    launch();
    CUDA_CHECK(cudaEventRecord(stop));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float t = 0;
    CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// A paged cache holding n_seqs sequences of kv_len tokens each, blocks in shuffled order.
struct Cache {
  int n_blocks;
  DeviceBuffer k, v, tables;
  std::vector<int32_t> host_tables;

  Cache(int n_seqs, int kv_len, int head_dim)
      : n_blocks(n_seqs * ((kv_len + kBlockSize - 1) / kBlockSize)),
        k(bytes(n_blocks, head_dim)),
        v(bytes(n_blocks, head_dim)),
        tables(sizeof(int32_t) * n_blocks),
        host_tables(n_blocks) {
    const size_t n = bytes(n_blocks, head_dim) / sizeof(__nv_bfloat16);
    fill_random<<<1024, 256>>>(k.as<__nv_bfloat16>(), n, 1);
    CUDA_CHECK_LAUNCH();
    fill_random<<<1024, 256>>>(v.as<__nv_bfloat16>(), n, 2);
    CUDA_CHECK_LAUNCH();
    std::iota(host_tables.begin(), host_tables.end(), 0);
    std::shuffle(host_tables.begin(), host_tables.end(), std::mt19937(7));
    CUDA_CHECK(cudaMemcpy(tables.ptr, host_tables.data(), sizeof(int32_t) * n_blocks, cudaMemcpyHostToDevice));
  }
  static size_t bytes(int n_blocks, int head_dim) {
    return static_cast<size_t>(n_blocks) * kBlockSize * kNKvHeads * head_dim * sizeof(__nv_bfloat16);
  }
};

AttnParams make_params(const DeviceBuffer& q, const DeviceBuffer& out, const Cache& c, const DeviceBuffer& seqs,
                       int n_seqs, int head_dim, int max_n_new, int max_kv_len) {
  AttnParams p{};
  p.q = q.as<__nv_bfloat16>();
  p.ld_q = static_cast<int64_t>(kNHead) * head_dim;
  p.out = out.as<__nv_bfloat16>();
  p.ld_out = p.ld_q;
  p.k_cache = c.k.as<__nv_bfloat16>();
  p.v_cache = c.v.as<__nv_bfloat16>();
  p.seqs = seqs.as<AttnSeq>();
  p.block_tables = c.tables.as<int32_t>();
  p.n_seqs = n_seqs;
  p.n_head = kNHead;
  p.n_kv_heads = kNKvHeads;
  p.head_dim = head_dim;
  p.block_size = kBlockSize;
  p.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  p.max_n_new = max_n_new;
  p.max_kv_len = max_kv_len;
  return p;
}

void bench_prefill(int head_dim, int n) {
  const Cache cache(1, n, head_dim);
  const DeviceBuffer q = random_bf16(static_cast<size_t>(n) * kNHead * head_dim, 3);
  const DeviceBuffer out(static_cast<size_t>(n) * kNHead * head_dim * sizeof(__nv_bfloat16));
  const AttnSeq seq{0, n, 0, 0};
  const DeviceBuffer seqs(sizeof(AttnSeq));
  CUDA_CHECK(cudaMemcpy(seqs.ptr, &seq, sizeof seq, cudaMemcpyHostToDevice));
  const AttnParams p = make_params(q, out, cache, seqs, 1, head_dim, n, n);
  const double ms = median_ms([&] { baton::cuda::attention_prefill(p, nullptr); }, [] {});
  const double flops = 4.0 * kNHead * head_dim * (static_cast<double>(n) * (n + 1) / 2);
  const double tflops = flops / (ms * 1e-3) / 1e12;
  std::printf("prefill  hd %3d  n %5d                 %9.3f ms  %7.1f TFLOP/s\n", head_dim, n, ms, tflops);
  std::printf(
      "BENCH_JSON {\"bench\":\"attention_prefill\",\"causal\":true,\"head_dim\":%d,\"n_tokens\":%d,\"n_head\":%d,"
      "\"n_kv_heads\":%d,\"ms\":%.5f,\"tflops\":%.2f}\n",
      head_dim, n, kNHead, kNKvHeads, ms, tflops);
}

void bench_decode(int batch, int context, const DeviceBuffer& l2_flush, size_t l2_flush_bytes) {
  constexpr int kHeadDim = 128;
  const Cache cache(batch, context, kHeadDim);
  const DeviceBuffer q = random_bf16(static_cast<size_t>(batch) * kNHead * kHeadDim, 4);
  const DeviceBuffer out(static_cast<size_t>(batch) * kNHead * kHeadDim * sizeof(__nv_bfloat16));
  const int blocks_per_seq = (context + kBlockSize - 1) / kBlockSize;
  std::vector<AttnSeq> host_seqs;
  for (int i = 0; i < batch; ++i) host_seqs.push_back({i, 1, context - 1, i * blocks_per_seq});
  const DeviceBuffer seqs(sizeof(AttnSeq) * batch);
  CUDA_CHECK(cudaMemcpy(seqs.ptr, host_seqs.data(), sizeof(AttnSeq) * batch, cudaMemcpyHostToDevice));
  const AttnParams p = make_params(q, out, cache, seqs, batch, kHeadDim, 1, context);
  const size_t ws_bytes = baton::cuda::attention_decode_workspace_bytes(batch, kNHead, kHeadDim, context);
  const DeviceBuffer ws(ws_bytes);
  const double ms = median_ms([&] { baton::cuda::attention_decode(p, ws.ptr, ws_bytes, nullptr); },
                              [&] { CUDA_CHECK(cudaMemsetAsync(l2_flush.ptr, 0, l2_flush_bytes)); });
  const double kv_bytes = static_cast<double>(batch) * context * kNKvHeads * kHeadDim * 2.0 * 2.0;
  const double gbps = kv_bytes / (ms * 1e-3) / 1e9;
  std::printf("decode   hd %3d  batch %3d  ctx %5d  %9.3f ms  %7.1f GB/s\n", kHeadDim, batch, context, ms, gbps);
  std::printf(
      "BENCH_JSON {\"bench\":\"attention_decode\",\"head_dim\":%d,\"batch\":%d,\"context\":%d,\"n_head\":%d,"
      "\"n_kv_heads\":%d,\"ms\":%.5f,\"kv_gbps\":%.1f}\n",
      kHeadDim, batch, context, kNHead, kNKvHeads, ms, gbps);
}

}  // namespace

int main() {
  int n_dev = 0;
  const cudaError_t err = cudaGetDeviceCount(&n_dev);
  if (err != cudaSuccess || n_dev == 0) {
    std::printf("attention bench SKIPPED: no CUDA device (%s)\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "cudaGetDeviceCount found 0 devices");
    return 77;
  }
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("attention bench on %s (sm_%d%d, %d SMs, L2 %d MB); median of %d reps\n", prop.name, prop.major,
              prop.minor, prop.multiProcessorCount, prop.l2CacheSize >> 20, kReps);

  for (int n : {512, 2048, 8192}) bench_prefill(128, n);
  bench_prefill(64, 8192);

  const size_t flush_bytes = std::max<size_t>(4 * static_cast<size_t>(prop.l2CacheSize), 64 << 20);
  const DeviceBuffer flush(flush_bytes);
  for (int context : {1024, 8192}) {
    for (int batch : {1, 8, 32, 128}) bench_decode(batch, context, flush, flush_bytes);
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  return 0;
}
