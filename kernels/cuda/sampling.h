// Sampling on the device (the definition is sample_row in kernels/sampling.h): greedy rows by
// a block-wide argmax; otherwise each row is sorted by logit (stable radix sort, descending, so
// ties keep the lower index first as on the CPU), then one block per row applies temperature,
// top-k and top-p in double precision and picks the token by the row's u. Log-probabilities and
// penalties are separate steps around sample_rows, in this order: row_logprobs on the raw
// logits, adjust_logits, mask_logits, sample_rows, sampled_logprobs.
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

// For each row i whose spec asks (specs_d[i].top_logprobs >= 0; the others are left alone), from
// the raw logits: lse_d[i] = the row's log-sum-exp, and out_d[i]'s n_top and top_* (the rest of
// top_* zero). out_d[i].logprob is sampled_logprobs' to write.
void row_logprobs(const float* logits, int64_t ld, int rows, int vocab, const SampleSpec* specs_d, TokenLogprobs* out_d,
                  double* lse_d, cudaStream_t stream);

// Applies the n penalties adjust_d (device copies; distinct (row, token) pairs) to the logits in
// place, as adjusted_logit does; raw_d[e] = entry e's logit before.
void adjust_logits(float* logits, int64_t ld, const LogitAdjust* adjust_d, int n, float* raw_d, cudaStream_t stream);

// Structured output: for each row i with slot_d[i] >= 0, every finite logit whose bit is clear in
// masks_d[slot_d[i] * n_words ...] becomes the lowest float (kernels/sampling.h, mask_logits).
void mask_logits(float* logits, int64_t ld, int rows, int vocab, const int32_t* slot_d, const uint32_t* masks_d,
                 int n_words, cudaStream_t stream);

// out_d[i].logprob = raw logit of tokens_d[i] - lse_d[i] for each row that asked and got a token
// (not kNonFiniteLogits). The raw logit is raw_d[e] when the row has an entry e for the token
// (row i's entries are adjust_d[adjust_first_d[i] .. adjust_first_d[i + 1])), else the logit.
void sampled_logprobs(const float* logits, int64_t ld, int rows, const SampleSpec* specs_d, const int32_t* tokens_d,
                      const LogitAdjust* adjust_d, const int32_t* adjust_first_d, const float* raw_d,
                      const double* lse_d, TokenLogprobs* out_d, cudaStream_t stream);

}  // namespace baton::cuda
