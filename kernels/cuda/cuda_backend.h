// The CUDA backend: bf16 weights and activations with fp32 accumulation, cuBLASLt GEMMs,
// FlashAttention-2-style prefill and split-K paged decode attention, device sampling, and CUDA
// graphs for decode steps. One backend owns one device and one compute stream.
#pragma once

#include <memory>
#include <string>

#include "kernels/backend.h"

namespace baton {

// options.device is "cuda" or "cuda:N". nullptr and a message when there is no such device or
// options ask for something it cannot do (f16 compute).
std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& options, std::string* error);

}  // namespace baton
