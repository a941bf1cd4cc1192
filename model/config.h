// Llama-family model hyper-parameters, read from GGUF metadata (or a Hugging Face config.json:
// hf_model.cpp) and validated in one place.
#pragma once

#include <string>

#include "common/status.h"
#include "kernels/backend.h"
#include "model/gguf.h"

namespace baton {

struct ModelConfig {
  std::string arch;          // general.architecture (or config.json's): llama | qwen2 | qwen3 | mistral
  std::string name;          // general.name (for logs)
  int n_layers = 0;          // {arch}.block_count
  int dim = 0;               // {arch}.embedding_length
  int ffn_dim = 0;           // {arch}.feed_forward_length
  int n_heads = 0;           // {arch}.attention.head_count
  int n_kv_heads = 0;        // {arch}.attention.head_count_kv (GQA when < n_heads)
  int head_dim = 0;          // dim / n_heads, or {arch}.attention.key_length (n_heads·head_dim may differ from dim)
  int n_vocab = 0;           // rows of token_embd
  int n_ctx = 0;             // {arch}.context_length: the longest sequence served
  float rms_eps = 1e-5f;     // {arch}.attention.layer_norm_rms_epsilon
  RopeConfig rope;           // theta, dims, neox (qwen2) vs adjacent pairs (llama), scaling
  bool qkv_bias = false;     // q/k/v projections carry a bias (qwen2)
  bool qk_norm = false;      // q and k are RMS-normalised per head before RoPE (qwen3: attn_q_norm, attn_k_norm)
  bool tied_output = false;  // no output.weight: the LM head reuses token_embd
  std::string context_note;  // why n_ctx is below the model's trained context ("" when it is not)
};

// Reads and checks the config. UNIMPLEMENTED for architectures outside the Llama family.
Result<ModelConfig> model_config_from_gguf(const GgufFile& file);

// A short stable digest of the config and tensor layout, used to refuse KV from another model.
std::string model_fingerprint(const ModelConfig& config, const GgufFile& file);

}  // namespace baton
