// Sampling on the device (the definition is sample_logits in kernels/sampling.h): greedy rows by
// a block-wide argmax; otherwise each row is sorted by logit (stable radix sort, descending, so
// ties keep the lower index first as on the CPU), then one block per row applies temperature,
// top-k and top-p in double precision and picks the token by the row's u.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/sampling.h"

namespace baton::cuda {

// Device scratch for sample_rows over up to `rows` rows of `vocab` logits.
size_t sample_workspace_bytes(int rows, int vocab);

// out_d[i] = a token for logits row i (f32, row stride ld) under specs_d[i] (device copies of the
// specs; `any_random` is false when every spec is greedy, which skips the sort).
void sample_rows(const float* logits, int64_t ld, int rows, int vocab, const SampleSpec* specs_d, bool any_random,
                 int32_t* out_d, void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace baton::cuda
