// Helpers shared by the GPU tests: fresh random inputs, bf16 rounding as the device does it,
// poisoned device outputs (so an element a kernel never wrote fails the comparison) and the
// relative error ‖out − ref‖ / ‖ref‖ the tolerances are written in.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/half.h"

namespace baton::gpu_test {

// The run's seed: BATON_TEST_SEED when set (to replay a failure), else fresh from random_device.
// tests/gpu/main.cpp prints it first thing.
inline uint64_t test_seed() {
  static const uint64_t seed = [] {
    const char* env = std::getenv("BATON_TEST_SEED");
    return env != nullptr ? std::strtoull(env, nullptr, 10) : (uint64_t{std::random_device{}()} << 32) ^ std::random_device{}();
  }();
  return seed;
}

// Every random input of the GPU tests comes from this generator: fresh inputs every run.
inline std::mt19937_64& rng() {
  static std::mt19937_64 g(test_seed());
  return g;
}

inline std::vector<float> random_vector(size_t n, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng());
  return v;
}

// x rounded to bf16 and back (round to nearest even), as the device stores it.
inline float round_bf16(float x) { return bf16_to_fp32(fp32_to_bf16(x)); }
inline std::vector<float> round_bf16(std::vector<float> v) {
  for (float& x : v) x = round_bf16(x);
  return v;
}

// ‖a − b‖₂ / ‖b‖₂; NaN anywhere in `a` gives infinity so it never passes.
inline double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  return std::sqrt(num / (den > 0 ? den : 1.0));
}

// Fills `bytes` of device memory with 0xFF bytes (NaN in f32, bf16 and f16), finished before it
// returns: the backend's ops run on their own non-blocking stream, which a pending memset on the
// legacy stream would race.
inline void poison(void* device, size_t bytes) {
  CUDA_CHECK(cudaMemset(device, 0xFF, bytes));
  CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace baton::gpu_test
