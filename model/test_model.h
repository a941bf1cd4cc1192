// A small random Llama-family model written as GGUF (F32, or K-quant GEMM weights), with a
// byte-level BPE vocabulary of its own: fast, self-contained input for unit and integration tests.
#pragma once

#include <cstdint>
#include <string>

#include "model/gguf_writer.h"

namespace baton {

struct TestModelSpec {
  // llama (adjacent-pair RoPE), qwen2 (NeoX RoPE, q/k/v bias) or qwen3 (NeoX RoPE, per-head q/k
  // RMSNorm, head_dim of its own)
  std::string arch = "llama";
  uint64_t seed = 1;
  int n_layers = 2;
  int dim = 64;
  int n_heads = 4;
  int n_kv_heads = 2;
  int head_dim = 0;  // 0: dim / n_heads; qwen3 may give another (n_heads · head_dim ≠ dim)
  int ffn_dim = 128;
  int n_ctx = 1024;
  // Untied by default: with a tied head the random model's logits are dominated by the input
  // token's own embedding (it echoes its input whatever the context), which would hide KV bugs.
  bool tied_output = false;
  float rope_theta = 10000.0f;
  // The layers' GEMM weights: "f32", or K-quant blocks (model/kquant_encode.h) of the random
  // values: "q4_k", "q5_k", "q6_k", or "mixed" (Q6_K for attn_v and ffn_down, Q4_K for the rest,
  // as llama.cpp's Q4_K_M mixes them). K-quants need dim and ffn to be multiples of 256.
  std::string gemm_type = "f32";
};

// INVALID_ARGUMENT when the spec is inconsistent (dims not divisible, non-positive sizes).
Status validate_test_model_spec(const TestModelSpec& spec);
GgufWriter make_test_model(const TestModelSpec& spec);

}  // namespace baton
