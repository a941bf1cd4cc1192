// The CPU backend: oneDNN matmul for gemm (bf16 with fp32 accumulation where the CPU has
// avx512_bf16/AMX, else f32), OpenMP kernels for everything else, f32 activations.
#pragma once

#include <memory>
#include <string>

#include "kernels/backend.h"

namespace baton {

std::unique_ptr<Backend> make_cpu_backend(const BackendOptions& options, std::string* error);

// True when this CPU runs bf16 matmuls natively (avx512_bf16 or AMX).
bool cpu_has_bf16();

}  // namespace baton
