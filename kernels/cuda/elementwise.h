// The CUDA backend's memory-bound kernels: launchers over Tensor views of device memory. Every
// launcher accepts f32 and bf16 tensors (the dtype travels in the Tensor) and checks its launch.
// Index arrays (`*_d`) are device pointers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/backend.h"
#include "kernels/cuda/attention.h"

namespace baton::cuda {

// out[t] = x[t] / sqrt(mean(x[t]²) + eps) * w, w f32 [cols].
void rms_norm(const Tensor& x, const float* w, float eps, const Tensor& out, cudaStream_t stream);
// Backend::head_rms_norm: each head_dim segment of each row of x normalised in place.
void head_rms_norm(const Tensor& x, int head_dim, const float* w, float eps, cudaStream_t stream);
// out[t] = table[ids[t]], table bf16 [n_vocab, dim].
void embed(const uint16_t* table, int64_t dim, const int32_t* ids_d, const Tensor& out, cudaStream_t stream);
// Rotates q and k in place; inv_freq_d: n_rot/2 doubles (theta^(-2i/n_rot) / factor_i).
void rope(const Tensor& q, const Tensor& k, const int32_t* positions_d, int head_dim, int n_rot, bool neox,
          float freq_scale, const double* inv_freq_d, cudaStream_t stream);
// out[t, i] = silu(gate_up[t, i]) * gate_up[t, F + i].
void silu_mul(const Tensor& gate_up, const Tensor& out, cudaStream_t stream);
// out[i] = x[rows[i]].
void gather_rows(const Tensor& x, const int32_t* rows_d, const Tensor& out, cudaStream_t stream);
// y[t] += bias (f32 [cols]).
void add_bias(const Tensor& y, const float* bias, cudaStream_t stream);
// dst = src, converting between f32 and bf16 (same shape, any strides).
void convert(const Tensor& src, const Tensor& dst, cudaStream_t stream);

// Writes token t's k and v rows ([n_kv * head_dim] each) to its slot: position positions[t] of
// sequence token_seq[t], through that sequence's block table. Cache elements are `cache_dtype`.
void kv_write(const Tensor& k, const Tensor& v, const int32_t* positions_d, const int32_t* token_seq_d,
              const AttnSeq* seqs_d, const int32_t* tables_d, void* k_cache, void* v_cache, DType cache_dtype,
              int block_size, cudaStream_t stream);
// Copies positions [start, start + n) of one sequence (table_d) between the paged cache and a
// packed device buffer [n, row_bytes] (to_packed: cache → packed; else packed → cache).
void kv_copy_packed(void* k_cache, void* v_cache, int64_t row_bytes, const int32_t* table_d, int32_t start, int32_t n,
                    int block_size, void* k_packed, void* v_packed, bool to_packed, cudaStream_t stream);

}  // namespace baton::cuda
