// Causal GQA attention over the paged KV cache on CUDA: the launchers the CUDA backend calls.
// Both read the step's sequences from device memory (AttnSeq, block tables), so a decode step's
// launches can be captured in a CUDA graph and replayed with new lengths.
//
// Layouts (bf16 everywhere, fp32 accumulation and softmax):
// - q, out: [n_tokens, n_head * head_dim], row strides ld_q / ld_out elements; head h of token t
//   is q[t * ld_q + h * head_dim ...]. Query head h reads KV head h / (n_head / n_kv_heads).
// - k_cache, v_cache: one layer, [n_blocks, block_size, n_kv_heads, head_dim]; position p of a
//   sequence lives in block block_tables[seq.table0 + p / block_size], slot p % block_size.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace baton::cuda {

// One sequence of the step, in device memory. Its new tokens are rows [row0, row0 + n_new) of
// q/out at positions [kv_offset, kv_offset + n_new); they attend to positions [0, own position].
struct AttnSeq {
  int32_t row0;
  int32_t n_new;
  int32_t kv_offset;
  int32_t table0;  // index of its first block id in block_tables
};

struct AttnParams {
  const __nv_bfloat16* q;
  int64_t ld_q;
  __nv_bfloat16* out;
  int64_t ld_out;
  const __nv_bfloat16* k_cache;
  const __nv_bfloat16* v_cache;
  const AttnSeq* seqs;          // device [n_seqs]
  const int32_t* block_tables;  // device
  int n_seqs;
  int n_head;
  int n_kv_heads;
  int head_dim;                 // 64 or 128
  int block_size;               // tokens per KV block (any value >= 1)
  float scale;                  // softmax scale, usually 1/sqrt(head_dim)
  // Host-side bounds the grid is sized from (the kernels read the true values from `seqs`):
  int max_n_new;                // >= every seq's n_new
  int max_kv_len;               // >= every seq's kv_offset + n_new
};

// Any mix of sequence lengths (prefill chunks, decode rows): FlashAttention-2-style tiles of
// queries × keys on the tensor cores, online softmax, causal mask, never a T×T matrix.
void attention_prefill(const AttnParams& p, cudaStream_t stream);

// Decode steps (every seq has n_new == 1): one query row per (seq, head) group sharing a KV head,
// keys split into chunks (flash-decoding) when max_kv_len is long, partial results combined by
// their log-sum-exp. `workspace` holds the partials; size it with attention_decode_workspace_bytes.
size_t attention_decode_workspace_bytes(int n_seqs, int n_head, int head_dim, int max_kv_len);
void attention_decode(const AttnParams& p, void* workspace, size_t workspace_bytes, cudaStream_t stream);

// True when the kernels support this head dim (the backend checks at KV-cache creation).
bool attention_supports_head_dim(int head_dim);

}  // namespace baton::cuda
