// bench/quant: each native weight format's GEMV (one activation row, as a decode step multiplies)
// against a plain streaming read of the same bytes on the same OpenMP threads. For each GGUF type
// it repacks a random [n, k] weight (kernels/cpu/quant_gemm.h; by default 65536 × 4096, larger
// than a last-level cache), then reports the bytes the kernel
// reads per call against the file's, the GB/s it reaches, the streaming read's GB/s over the same
// buffer (AVX-512 loads summed, each thread a contiguous range, as the kernel splits it), and the
// ratio of the two. --rows M times M activation rows (a decode batch) instead of one.
// Output is a Markdown table (bench/RESULTS.md keeps the measured ones).
//
//   baton_bench_quant [--n N] [--k K] [--rows M] [--reps R]
#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/quant_gemm.h"
#include "kernels/half.h"

using namespace baton;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> t) {
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct Type {
  const char* name;
  uint32_t id;
  size_t block_bytes;
  int64_t block_elems;
};
constexpr Type kTypes[] = {{"Q4_0", 2, 18, 32},   {"Q4_1", 3, 20, 32},   {"Q5_0", 6, 22, 32},
                           {"Q5_1", 7, 24, 32},   {"Q8_0", 8, 34, 32},   {"Q4_K", 12, 144, 256},
                           {"Q5_K", 13, 176, 256}, {"Q6_K", 14, 210, 256}, {"BF16", 30, 64, 32}};

// Random blocks whose fp16 scales are small finite numbers (every other byte is any value).
std::vector<uint8_t> random_blocks(const Type& t, int64_t n, int64_t k, std::mt19937& rng) {
  std::vector<uint8_t> out(static_cast<size_t>(n * k / t.block_elems) * t.block_bytes);
  if (t.id == 30) {  // BF16: small finite values
    std::normal_distribution<float> nd(0.0f, 0.05f);
    for (size_t i = 0; i < out.size(); i += 2) {
      const uint16_t h = fp32_to_bf16(nd(rng));
      std::memcpy(out.data() + i, &h, 2);
    }
    return out;
  }
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  const uint16_t small = fp32_to_fp16(0.01f);
  for (size_t b = 0; b < out.size(); b += t.block_bytes) {
    const size_t at = t.id == 14 ? 208 : 0;  // Q6_K's d is last
    std::memcpy(out.data() + b + at, &small, 2);
    if (t.id == 3 || t.id == 7 || t.id == 12 || t.id == 13) std::memcpy(out.data() + b + 2, &small, 2);
  }
  return out;
}

// Sums the buffer with 64-byte loads, each thread a contiguous range; returns the sum so the
// loads are not dropped.
uint64_t stream_read(const uint8_t* p, size_t bytes) {
  uint64_t total = 0;
#pragma omp parallel reduction(+ : total)
  {
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    const size_t lines = bytes / 64, per = (lines + nt - 1) / nt;
    const size_t begin = std::min(lines, per * id), end = std::min(lines, begin + per);
#if defined(__AVX512F__)
    __m512i acc = _mm512_setzero_si512();
    for (size_t i = begin; i < end; ++i) {
      acc = _mm512_add_epi64(acc, _mm512_loadu_si512(p + i * 64));
    }
    uint64_t lanes[8];
    _mm512_storeu_si512(lanes, acc);
    for (uint64_t v : lanes) total += v;
#else
    for (size_t i = begin * 64; i < end * 64; i += 8) {
      uint64_t v;
      std::memcpy(&v, p + i, 8);
      total += v;
    }
#endif
  }
  return total;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t n = 65536, k = 4096, rows = 1;
  int reps = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const int64_t v = std::stoll(argv[i + 1]);
    if (a == "--n") n = v;
    else if (a == "--k") k = v;
    else if (a == "--rows") rows = v;
    else if (a == "--reps") reps = static_cast<int>(v);
    else {
      std::fprintf(stderr, "usage: %s [--n N] [--k K] [--rows M] [--reps R]\n", argv[0]);
      return 2;
    }
  }
  if (k % 256 != 0 || n <= 0 || rows <= 0 || reps <= 0) {
    std::fprintf(stderr, "baton: error: --k must be a multiple of 256, --n, --rows and --reps positive\n");
    return 2;
  }
  std::printf("weight [%ld, %ld], %ld activation row(s), %d threads, %s kernel\n\n", static_cast<long>(n),
              static_cast<long>(k), static_cast<long>(rows), omp_get_max_threads(),
              cpu::quant_gemm_fast() ? "AVX-512 VNNI" : "portable");
  std::printf("| type | file bytes | native bytes | native / file | kernel GB/s | streaming read GB/s | kernel / read |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  std::mt19937 rng(1);
  std::vector<float> x(static_cast<size_t>(rows * k)), y(static_cast<size_t>(rows * n));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (float& v : x) v = nd(rng);
  for (const Type& t : kTypes) {
    const auto blocks = random_blocks(t, n, k, rng);
    auto w = cpu::repack_quant(t.id, blocks, n, k);
    if (!w.ok()) {
      std::fprintf(stderr, "baton: error: %s\n", w.status().message().c_str());
      return 1;
    }
    const Tensor xt{x.data(), DType::kF32, rows, k, k};
    const Tensor yt{y.data(), DType::kF32, rows, n, n};
    // Alternated, so that both see the same machine (a VM's bandwidth drifts).
    volatile uint64_t sink = 0;
    std::vector<double> kernel_t, read_t;
    for (int i = 0; i <= reps; ++i) {
      const double t0 = now();
      cpu::quant_gemm(xt, *w, nullptr, yt, false);
      const double t1 = now();
      sink = sink + stream_read(w->data.data(), w->bytes());
      const double t2 = now();
      if (i == 0) continue;  // warm-up
      kernel_t.push_back(t1 - t0);
      read_t.push_back(t2 - t1);
    }
    const double kernel_s = median(kernel_t), read_s = median(read_t);
    const double gb = static_cast<double>(w->bytes()) / 1e9;
    std::printf("| %s | %zu | %zu | %.3f | %.1f | %.1f | %.0f %% |\n", t.name, blocks.size(), w->bytes(),
                static_cast<double>(w->bytes()) / static_cast<double>(blocks.size()), gb / kernel_s, gb / read_s,
                100.0 * read_s / kernel_s);
    std::fflush(stdout);
  }
  return 0;
}
