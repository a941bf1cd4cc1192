// The GPU tests' check before any test runs: without a usable CUDA device the whole binary is
// skipped (exit code 77, which ctest reports as "Skipped") and says why, so CI without a GPU
// stays honest. The main itself is tests/common/test_main.cpp.
#include <cuda_runtime.h>

#include <cstdio>

#include "tests/gpu/gpu_test_util.h"

int gpu_precheck() {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess || n == 0) {
    std::printf("GPU tests SKIPPED: no CUDA device (%s)\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "cudaGetDeviceCount found 0 devices");
    return 77;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
    std::printf("GPU tests on %s (sm_%d%d, %d SMs; %d device(s))\n", prop.name, prop.major, prop.minor,
                prop.multiProcessorCount, n);
  }
  std::printf("random inputs from seed %llu (BATON_TEST_SEED=%llu replays them)\n",
              static_cast<unsigned long long>(baton::gpu_test::test_seed()),
              static_cast<unsigned long long>(baton::gpu_test::test_seed()));
  return -1;
}
