// bench/gpu: the CUDA backend's end-to-end numbers, each against a ceiling measured on the same
// card in the same run:
//   1. cuBLAS bf16 peak: cuBLASLt (baton's LtGemm) on 8192³ and the Llama-3-8B layer shapes at
//      M = 8192, random data, CUDA events, median of 20 after 3 warm-ups.
//   2. Prefill MFU at Llama-3-8B shapes (dim 4096, 32 heads, 8 KV heads, head dim 128, FFN
//      14336) with random weights, `--layers` layers (default 2; MFU does not depend on depth):
//      one forward of T = 512, 2048, 8192 prompt tokens through Model (GEMMs, flash attention,
//      elementwise, the LM head for the last row), FLOPs = 2·T·(matmul params) + causal attention
//      4·head_dim·n_heads·T(T+1)/2 per layer; MFU = achieved / measured cuBLAS peak.
//   3. Decode tokens/s vs batch on the same model: every sequence at a 1024-token context, one
//      new token each per step (CUDA graphs as in serving), tokens/s = batch / step time.
// Prints a table and one `BENCH_JSON {...}` line per number (tests/gpu/run.sh collects them).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/cublaslt_api.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gemm.h"
#include "model/model.h"
#include "model/test_model.h"

using namespace baton;

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

template <typename F>
double median_seconds(int warmup, int reps, F&& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const double t0 = now();
    fn();
    t.push_back(now() - t0);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Random bf16 device data (not zeros: zeros run faster than real data).
void* random_bf16(size_t n, uint64_t seed) {
  std::vector<uint16_t> h(n);
  std::mt19937_64 g(seed);
  for (size_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(static_cast<int64_t>(g() >> 40) - (1 << 23)) / static_cast<float>(1 << 25);
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    h[i] = static_cast<uint16_t>(bits >> 16);
  }
  void* d = nullptr;
  CUDA_CHECK(cudaMalloc(&d, n * 2));
  CUDA_CHECK(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
  return d;
}

// TFLOP/s of y[m, n] = x[m, k] wᵀ through LtGemm, timed with events.
double gemm_tflops(int64_t m, int64_t n, int64_t k) {
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreate(&s));
  cuda::LtGemm gemm(s, size_t{64} << 20);
  void* x = random_bf16(static_cast<size_t>(m * k), 1);
  void* w = random_bf16(static_cast<size_t>(n * k), 2);
  void* y = nullptr;
  CUDA_CHECK(cudaMalloc(&y, static_cast<size_t>(m * n) * 2));
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) gemm.run(x, k, w, k, y, n, DType::kBF16, m, n, k, false);
  std::vector<float> ms;
  for (int i = 0; i < 20; ++i) {
    CUDA_CHECK(cudaEventRecord(e0, s));
    gemm.run(x, k, w, k, y, n, DType::kBF16, m, n, k, false);
    CUDA_CHECK(cudaEventRecord(e1, s));
    CUDA_CHECK(cudaEventSynchronize(e1));
    float t = 0;
    CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  cudaFree(x);
  cudaFree(w);
  cudaFree(y);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(s);
  return 2.0 * m * n * k / (ms[ms.size() / 2] * 1e-3) / 1e12;
}

void json(const std::string& fields) { std::printf("BENCH_JSON {%s}\n", fields.c_str()); }

}  // namespace

int main(int argc, char** argv) {
  int n_layers = 2;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--layers" && i + 1 < argc) {
      n_layers = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: baton_bench_gpu [--layers N]\n");
      return 2;
    }
  }
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
    std::printf("GPU benchmark SKIPPED: no CUDA device\n");
    return 77;
  }
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);

  std::string lt_error;
  BATON_CHECK(cuda::cublaslt_load(&lt_error) != nullptr, "%s", lt_error.c_str());

  // 1. cuBLAS peak.
  double peak = gemm_tflops(8192, 8192, 8192);
  std::printf("cuBLASLt bf16 8192^3: %.1f TFLOP/s\n", peak);
  json("\"bench\": \"cublas_peak\", \"m\": 8192, \"n\": 8192, \"k\": 8192, \"tflops\": " + std::to_string(peak));
  const int64_t shapes[4][2] = {{6144, 4096}, {4096, 4096}, {28672, 4096}, {4096, 14336}};
  for (const auto& sh : shapes) {
    const double t = gemm_tflops(8192, sh[0], sh[1]);
    peak = std::max(peak, t);
    std::printf("cuBLASLt bf16 M=8192 N=%ld K=%ld: %.1f TFLOP/s\n", static_cast<long>(sh[0]), static_cast<long>(sh[1]), t);
    json("\"bench\": \"cublas_shape\", \"m\": 8192, \"n\": " + std::to_string(sh[0]) + ", \"k\": " + std::to_string(sh[1]) +
         ", \"tflops\": " + std::to_string(t));
  }
  std::printf("measured peak (best of the above): %.1f TFLOP/s\n\n", peak);

  // 2. Prefill MFU at Llama-3-8B shapes.
  TestModelSpec spec;
  spec.n_layers = n_layers;
  spec.dim = 4096;
  spec.n_heads = 32;
  spec.n_kv_heads = 8;
  spec.ffn_dim = 14336;
  spec.n_ctx = 16384;
  spec.rope_theta = 500000.0f;
  const double t_build = now();
  auto file = GgufFile::parse(make_test_model(spec).to_bytes());
  BATON_CHECK(file.ok(), "test model: %s", file.status().message().c_str());
  std::string err;
  auto backend = make_backend({"cuda:0", DType::kBF16, 0, {}}, &err);
  BATON_CHECK(backend != nullptr, "%s", err.c_str());
  auto model = Model::load(**file, *backend);
  BATON_CHECK(model.ok(), "load: %s", model.status().message().c_str());
  std::printf("model: %d layers at Llama-3-8B shapes, built and loaded in %.1f s\n", n_layers, now() - t_build);
  const ModelConfig& c = (*model)->config();
  const double hd = c.head_dim;
  const double matmul_params =
      static_cast<double>(c.dim) * (c.n_heads * hd + 2 * c.n_kv_heads * hd) + c.n_heads * hd * c.dim + 3.0 * c.dim * c.ffn_dim;

  const int block = 16;
  const int max_tokens = 8192 + 64;
  const int n_blocks = 2 * max_tokens / block + 256 * (1024 / block + 2);
  auto cache = (*model)->make_kv_cache(n_blocks, block, DType::kBF16);
  std::vector<int32_t> table(n_blocks);
  for (int i = 0; i < n_blocks; ++i) table[i] = i;
  std::mt19937 rng(7);
  std::printf("%8s %12s %12s %10s %8s\n", "tokens", "ms", "tok/s", "TFLOP/s", "MFU");
  for (int t : {512, 2048, 8192}) {
    std::vector<int32_t> prompt(t);
    for (int32_t& id : prompt) id = static_cast<int32_t>(rng() % c.n_vocab);
    StepBatch batch;
    batch.add(prompt, 0, table, Logits::kLast);
    std::vector<float> logits;
    const double secs = median_seconds(2, 7, [&] { (*model)->forward(batch, *cache, &logits); });
    const double flops = c.n_layers * (2.0 * t * matmul_params + 4.0 * hd * c.n_heads * t * (t + 1) / 2.0) +
                         2.0 * c.dim * c.n_vocab;
    const double tflops = flops / secs / 1e12;
    std::printf("%8d %12.2f %12.0f %10.1f %7.1f%%\n", t, secs * 1e3, t / secs, tflops, 100 * tflops / peak);
    json("\"bench\": \"prefill\", \"layers\": " + std::to_string(c.n_layers) + ", \"tokens\": " + std::to_string(t) +
         ", \"ms\": " + std::to_string(secs * 1e3) + ", \"tflops\": " + std::to_string(tflops) +
         ", \"mfu\": " + std::to_string(tflops / peak));
  }

  // 3. Decode tokens/s vs batch at a 1024-token context.
  std::printf("\n%8s %12s %12s\n", "batch", "step ms", "tok/s");
  const int ctx = 1024;
  const int per_seq = (ctx + 64) / block + 1;
  for (int b : {1, 8, 32, 128, 256}) {
    if (b * per_seq > n_blocks) break;
    std::vector<std::vector<int32_t>> tables(b), toks(b, std::vector<int32_t>(1, 1));
    for (int i = 0; i < b; ++i) {
      for (int j = 0; j < per_seq; ++j) tables[i].push_back(i * per_seq + j);
    }
    std::vector<int32_t> step_tokens;
    int pos = ctx;
    auto step = [&] {
      StepBatch batch;
      for (int i = 0; i < b; ++i) batch.add(toks[i], pos, tables[i], Logits::kLast);
      std::vector<SampleSpec> specs(b);
      (*model)->forward_sample(batch, *cache, specs, {}, &step_tokens, nullptr);
      for (int i = 0; i < b; ++i) toks[i][0] = step_tokens[i];
      pos = pos + 1 < ctx + 60 ? pos + 1 : ctx;  // stay inside the reserved blocks
    };
    const double secs = median_seconds(5, 30, step);
    std::printf("%8d %12.3f %12.0f\n", b, secs * 1e3, b / secs);
    json("\"bench\": \"decode\", \"layers\": " + std::to_string(c.n_layers) + ", \"batch\": " + std::to_string(b) +
         ", \"context\": " + std::to_string(ctx) + ", \"step_ms\": " + std::to_string(secs * 1e3) +
         ", \"tokens_per_s\": " + std::to_string(b / secs));
  }
  return 0;
}
