// CPU implementations of the non-GEMM backend ops (kernels/cpu/attention.cpp,
// kernels/cpu/elementwise.cpp). All tensors are f32 host memory; the KV cache memory is given
// as raw per-layer pointers.
#pragma once

#include <vector>

#include "kernels/backend.h"

namespace baton::cpu {

// Per-layer view of the paged cache: K and V as [n_blocks, block_size, n_kv_heads, head_dim].
struct KvLayerView {
  void* k = nullptr;
  void* v = nullptr;
  DType dtype = DType::kF32;
  int block_size = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
};

// Buffers the attention kernels reuse across calls (grow-only), owned by the backend so that two
// backends in one process never share them.
struct AttentionScratch {
  std::vector<float> k_f32, v_f32;
  std::vector<uint16_t> k_bf16, v_bf16;
};

void rms_norm(const Tensor& x, const float* w, float eps, const Tensor& out);
// Backend::head_rms_norm: each head_dim segment of each row of x normalised in place.
void head_rms_norm(const Tensor& x, int head_dim, const float* w, float eps);
void embed(const float* table, int64_t dim, const int32_t* ids, int64_t n, const Tensor& out);
void rope(const Tensor& q, const Tensor& k, const int32_t* positions, int head_dim, const RopeConfig& rope);
void silu_mul(const Tensor& gate_up, const Tensor& out);
void gather_rows(const Tensor& x, const int32_t* rows, int64_t n, const Tensor& out);
void kv_write(const KvLayerView& kv, const Tensor& k, const Tensor& v, const BatchView& batch);
// Causal paged attention for every sequence of the batch. Sequences with many new tokens go
// through attention_tiled (tile matmuls in `compute`), the rest through a direct f32 kernel.
void attention(const Tensor& q, const KvLayerView& kv, const BatchView& batch, int n_head, float scale, DType compute,
               AttentionScratch& scratch, const Tensor& out);
// The tile-matmul path for the sequences batch.seqs[seq_ids[i]] (kernels/cpu/attention_tiled.cpp).
void attention_tiled(const Tensor& q, const KvLayerView& kv, const BatchView& batch, const std::vector<int>& seq_ids,
                     int n_head, float scale, DType compute, AttentionScratch& scratch, const Tensor& out);

}  // namespace baton::cpu
