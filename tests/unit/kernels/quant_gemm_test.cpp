// Native weights: the CPU kernel on random GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
// Q6_K) and random BF16 rows against a reference that dequantises the same blocks
// (model/dequant.cpp) and quantises the activations the way the kernel documents (int8 blocks;
// bf16 for BF16 weights), summed in double; the fast (AVX-512 VNNI) and portable kernels
// both; shapes with row counts that are not multiples of the 16-row weight tile or of the 8
// activation rows a pass takes; bias and accumulate; and
// the error against unquantised activations stays at what int8 activations cost.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <tuple>
#include <random>
#include <vector>

#include "kernels/cpu/quant_gemm.h"
#include "kernels/half.h"
#include "model/dequant.h"

using namespace baton;

namespace {

constexpr uint32_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
                   kBF16 = 30;
constexpr uint32_t kAllTypes[] = {kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K, kBF16};

size_t block_bytes(uint32_t type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ8_0: return 34;
    case kBF16: return 64;  // per 32 values
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    default: return 210;
  }
}
int64_t block_elems(uint32_t type) { return type == kQ4_K || type == kQ5_K || type == kQ6_K ? 256 : 32; }

void put_fp16(uint8_t* p, float v) {
  const uint16_t h = fp32_to_fp16(v);
  std::memcpy(p, &h, 2);
}

// Random, valid blocks: scales in a realistic range, random quants.
std::vector<uint8_t> random_blocks(uint32_t type, int64_t n, int64_t k, std::mt19937& rng) {
  std::uniform_real_distribution<float> scale(0.001f, 0.05f), minimum(-0.4f, 0.1f);
  std::uniform_int_distribution<int> byte(0, 255);
  const size_t bb = block_bytes(type);
  std::vector<uint8_t> out(static_cast<size_t>(n * k / block_elems(type)) * bb);
  if (type == kBF16) {
    std::normal_distribution<float> value(0.0f, 0.05f);
    for (size_t i = 0; i < out.size(); i += 2) {
      const uint16_t h = fp32_to_bf16(value(rng));
      std::memcpy(out.data() + i, &h, 2);
    }
    return out;
  }
  for (size_t b = 0; b < out.size() / bb; ++b) {
    uint8_t* p = out.data() + b * bb;
    if (type == kQ4_K || type == kQ5_K || type == kQ6_K) {
      // Every byte random (any scales, minimums and quants are a valid block), then the fp16
      // super-block scales set to realistic values (a random fp16 could be infinite).
      for (size_t i = 0; i < bb; ++i) p[i] = static_cast<uint8_t>(byte(rng));
      if (type != kQ6_K) {
        put_fp16(p, scale(rng) / 8);     // d: times a 6-bit sub-block scale
        put_fp16(p + 2, scale(rng) / 8);  // dmin
      } else {
        put_fp16(p + 208, (byte(rng) & 1 ? 1 : -1) * scale(rng) / 16);  // d: times an int8 scale
      }
      continue;
    }
    put_fp16(p, (byte(rng) & 1 ? 1 : -1) * scale(rng));
    size_t q0 = 2;
    if (type == kQ4_1 || type == kQ5_1) {
      put_fp16(p + 2, minimum(rng));
      q0 = 4;
    }
    for (size_t i = q0; i < bb; ++i) p[i] = static_cast<uint8_t>(byte(rng));
    if (type == kQ8_0) {
      for (size_t i = q0; i < bb; ++i) {
        if (p[i] == 0x80) p[i] = 0x81;  // -128 is not a value Q8_0 writes (|q| <= 127)
      }
    }
  }
  return out;
}

GgmlType ggml(uint32_t type) { return static_cast<GgmlType>(type); }

struct Case {
  uint32_t type;
  int64_t m, n, k;
};

void check_case(const Case& c, std::mt19937& rng, cpu::QuantKernel kernel) {
  CAPTURE(c.type, c.m, c.n, c.k, static_cast<int>(kernel));
  const auto blocks = random_blocks(c.type, c.n, c.k, rng);
  auto w = cpu::repack_quant(c.type, blocks, c.n, c.k);
  REQUIRE(w.ok());
  std::vector<float> wf(static_cast<size_t>(c.n * c.k));
  REQUIRE(dequantize(ggml(c.type), blocks, wf.data(), c.n * c.k).ok());

  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t ld = c.k + 3;  // a strided x, as the model's views are
  std::vector<float> x(static_cast<size_t>(c.m * ld));
  for (float& v : x) v = normal(rng);
  if (c.m > 1) {
    for (int64_t j = 0; j < 32; ++j) x[ld + j] = 0.0f;  // an all-zero block: dx = 0
  }
  std::vector<float> bias(static_cast<size_t>(c.n));
  for (float& v : bias) v = normal(rng);
  std::vector<float> y(static_cast<size_t>(c.m * c.n));
  for (float& v : y) v = normal(rng);
  const std::vector<float> y0 = y;

  Tensor xt{x.data(), DType::kF32, c.m, c.k, ld};
  Tensor yt{y.data(), DType::kF32, c.m, c.n, c.n};
  const bool accumulate = (c.m + c.n) % 2 == 0;
  cpu::quant_gemm(xt, *w, bias.data(), yt, accumulate, kernel);

  std::vector<int8_t> qx(static_cast<size_t>(c.m * c.k));
  std::vector<float> dx(static_cast<size_t>(c.m * c.k / 32));
  cpu::quantize_activations(x.data(), c.m, c.k, ld, qx.data(), dx.data());
  double worst = 0, worst_unquantised = 0;
  for (int64_t r = 0; r < c.m; ++r) {
    for (int64_t n = 0; n < c.n; ++n) {
      double ref = 0, mag = 0, exact = 0, exact_mag = 0;
      for (int64_t j = 0; j < c.k; ++j) {
        const double wj = wf[n * c.k + j];
        const double term = c.type == kBF16 ? wj * bf16_to_fp32(fp32_to_bf16(x[r * ld + j]))
                                            : wj * qx[r * c.k + j] * dx[r * (c.k / 32) + j / 32];
        ref += term;
        mag += std::fabs(term);
        exact += wj * x[r * ld + j];
        exact_mag += std::fabs(wj * x[r * ld + j]);
      }
      const double base = (accumulate ? y0[r * c.n + n] : 0.0) + bias[n];
      const double got = y[r * c.n + n] - base;
      const double err = std::fabs(got - ref) / (mag + 1e-30);
      worst = std::max(worst, err);
      worst_unquantised = std::max(worst_unquantised, std::fabs(got - exact) / (exact_mag + 1e-30));
      // Integer block sums are exact, so only the blocks' f32 accumulation rounds; BF16 sums
      // every product in f32.
      if (err > (c.type == kBF16 ? 2e-5 : 2e-6)) {
        FAIL_CHECK("row " << r << " col " << n << ": got " << got << ", reference " << ref << " (|terms| " << mag << ")");
        return;
      }
    }
  }
  INFO("worst relative error " << worst << ", against unquantised activations " << worst_unquantised);
  // int8 activations: each term off by at most half a step of 1/127 of its block's max.
  CHECK(worst_unquantised < 0.02);
}

}  // namespace

TEST_CASE("native weights: repacked blocks times int8 activations equal the dequantised reference", "[kernels][quant]") {
  std::random_device rd;
  const unsigned seed = rd();
  INFO("seed " << seed);
  std::mt19937 rng(seed);
  for (uint32_t type : kAllTypes) {
    for (const auto& [m, n, k] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
             {1, 96, 576}, {2, 13, 64}, {3, 40, 1536}, {4, 7, 128}, {5, 33, 576}, {8, 96, 192}, {12, 17, 96},
             {17, 20, 576}, {33, 9, 256}}) {
      if (k % block_elems(type) != 0) continue;
      check_case({type, m, n, k}, rng, cpu::QuantKernel::kBest);
      check_case({type, m, n, k}, rng, cpu::QuantKernel::kPortable);
      if (type == kBF16) check_case({type, m, n, k}, rng, cpu::QuantKernel::kNoBf16Dot);
    }
  }
  for (uint32_t type : {kQ4_K, kQ5_K, kQ6_K}) {
    check_case({type, 1, 64, 2048}, rng, cpu::QuantKernel::kBest);
    check_case({type, 6, 50, 768}, rng, cpu::QuantKernel::kBest);
    check_case({type, 6, 50, 768}, rng, cpu::QuantKernel::kPortable);
  }
  // Big enough that the OpenMP team splits the rows.
  check_case({kQ4_1, 2, 3000, 576}, rng, cpu::QuantKernel::kBest);
  check_case({kBF16, 1, 2000, 2048}, rng, cpu::QuantKernel::kBest);
}

TEST_CASE("native weights: what does not repack is refused", "[kernels][quant]") {
  std::mt19937 rng(1);
  CHECK_FALSE(cpu::quant_type_supported(0));   // f32
  CHECK_FALSE(cpu::quant_type_supported(9));   // Q8_1: no kernel (files do not hold it)
  CHECK(cpu::repack_quant(9, {}, 1, 256).status().code() == StatusCode::kInvalidArgument);
  CHECK(cpu::repack_quant(kQ4_K, random_blocks(kQ4_K, 1, 256, rng), 1, 128).status().code() ==
        StatusCode::kInvalidArgument);  // a K-quant row is whole super-blocks of 256
  CHECK(cpu::repack_quant(kQ4_1, random_blocks(kQ4_1, 2, 96, rng), 2, 64).status().code() ==
        StatusCode::kInvalidArgument);  // 3 blocks a row are not 2
  CHECK(cpu::repack_quant(kBF16, std::vector<uint8_t>(2 * 48 * 2), 2, 48).status().code() ==
        StatusCode::kInvalidArgument);  // BF16 rows are whole pairs of 16 values
  const auto ok = random_blocks(kQ4_1, 2, 128, rng);
  CHECK(cpu::repack_quant(kQ4_1, std::span(ok).first(ok.size() - 1), 2, 128).status().code() ==
        StatusCode::kInvalidArgument);
  auto w = cpu::repack_quant(kQ4_1, random_blocks(kQ4_1, 32, 128, rng), 32, 128);
  REQUIRE(w.ok());
  CHECK(w->bytes() < 32 * 128 * 2);  // fewer bytes than bf16
}

TEST_CASE("native weights read the bytes the file holds, tensor by tensor", "[kernels][quant]") {
  // Llama-3.2-1B's and SmolLM2-135M's projection shapes ([n outputs, k inputs]) and a row count
  // that is not whole 16-row tiles (its padding is the only excess).
  std::mt19937 rng(7);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {2048, 2048}, {512, 2048}, {8192, 2048}, {2048, 8192}, {576, 576}, {192, 576}, {1536, 576}, {576, 1536}, {40, 512}};
  for (uint32_t type : kAllTypes) {
    for (const auto& [n, k] : shapes) {
      if (k % block_elems(type) != 0) continue;
      CAPTURE(type, n, k);
      const auto blocks = random_blocks(type, n, k, rng);
      auto w = cpu::repack_quant(type, blocks, n, k);
      REQUIRE(w.ok());
      const int64_t n_padded = (n + 15) / 16 * 16;
      const double file_bytes = static_cast<double>(blocks.size()) * static_cast<double>(n_padded) / static_cast<double>(n);
      const double ratio = static_cast<double>(w->bytes()) / file_bytes;
      INFO("native " << w->bytes() << " bytes, file (padded to whole tiles) " << file_bytes << ": " << ratio);
      if (type == kQ4_K || type == kQ5_K) {
        // The 6-bit sub-block scales and minimums take a byte each: 4.625 bits a weight for 4.5,
        // 5.625 for 5.5.
        CHECK(ratio == Approx(type == kQ4_K ? 4.625 / 4.5 : 5.625 / 5.5).epsilon(1e-9));
      } else {
        CHECK(ratio == Approx(1.0).epsilon(1e-9));
      }
    }
  }
}

TEST_CASE("native weights: a row gathered back is the file's dequantised row, exactly", "[kernels][quant]") {
  std::random_device rd;
  const unsigned seed = rd();
  INFO("seed " << seed);
  std::mt19937 rng(seed);
  for (uint32_t type : kAllTypes) {
    const int64_t n = 37, k = 512;  // a partial last tile
    const auto blocks = random_blocks(type, n, k, rng);
    auto w = cpu::repack_quant(type, blocks, n, k);
    REQUIRE(w.ok());
    std::vector<float> ref(static_cast<size_t>(n * k)), row(static_cast<size_t>(k));
    REQUIRE(dequantize(ggml(type), blocks, ref.data(), n * k).ok());
    for (int64_t r : {int64_t{0}, int64_t{15}, int64_t{16}, int64_t{36}}) {
      CAPTURE(type, r);
      cpu::dequantize_row(*w, r, row.data());
      int64_t mismatches = 0;
      for (int64_t j = 0; j < k; ++j) mismatches += row[j] != ref[r * k + j];
      CHECK(mismatches == 0);
    }
  }
}
