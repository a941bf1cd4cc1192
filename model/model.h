// The Llama-family decoder (RMSNorm, RoPE, GQA attention, SwiGLU, tied or untied LM head),
// written once against Backend. Weights are dequantised from GGUF at load and handed to the
// backend in its compute dtype; q/k/v and gate/up are fused so each step runs one GEMM per
// projection group over all its tokens.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "common/status.h"
#include "kernels/backend.h"
#include "model/batch.h"
#include "model/config.h"
#include "model/gguf.h"

namespace baton {

struct LayerWeights {
  std::unique_ptr<Matrix> attn_norm;  // (dim)
  std::unique_ptr<Matrix> wqkv;       // (n_heads*hd + 2*n_kv*hd, dim): q rows, then k, then v
  std::unique_ptr<Matrix> bqkv;       // (n_heads*hd + 2*n_kv*hd) or null
  std::unique_ptr<Matrix> wo;         // (dim, n_heads*hd)
  std::unique_ptr<Matrix> ffn_norm;   // (dim)
  std::unique_ptr<Matrix> w_gate_up;  // (2*ffn_dim, dim): gate rows, then up
  std::unique_ptr<Matrix> w_down;     // (dim, ffn_dim)
};

class Model {
 public:
  // Loads every tensor of `file` onto `backend` (which must outlive the model). Shapes are
  // checked against the config; a missing or misshapen tensor is an error naming it.
  // `progress`, when set, is called with (layers loaded, total layers) as loading proceeds.
  using LoadProgress = std::function<void(int done, int total)>;
  static Result<std::unique_ptr<Model>> load(const GgufFile& file, Backend& backend, const LoadProgress& progress = {});

  const ModelConfig& config() const { return config_; }
  const std::string& fingerprint() const { return fingerprint_; }
  Backend& backend() const { return backend_; }

  // A paged KV cache for this model: n_blocks blocks of block_size tokens, in `dtype`.
  std::unique_ptr<KvCache> make_kv_cache(int n_blocks, int block_size, DType dtype) const;

  // Runs one step over every token of `batch`: writes their K/V into `cache` and fills `logits`
  // with [batch.logit_rows().size(), n_vocab] floats, in the batch's order.
  void forward(const StepBatch& batch, KvCache& cache, std::vector<float>* logits);

 private:
  Model(const ModelConfig& config, Backend& backend) : config_(config), backend_(backend) {}
  Status load_weights(const GgufFile& file, const LoadProgress& progress);
  void reserve(int64_t n_tokens);

  ModelConfig config_;
  std::string fingerprint_;
  Backend& backend_;
  std::unique_ptr<Matrix> tok_embd_;   // (n_vocab, dim) table
  std::unique_ptr<Matrix> out_norm_;   // (dim)
  std::unique_ptr<Matrix> lm_head_;    // (n_vocab, dim) gemm weight
  std::vector<LayerWeights> layers_;

  // Activations, sized for `capacity_` tokens and grown on demand.
  int64_t capacity_ = 0;
  Buffer x_buf_, h_buf_, qkv_buf_, att_buf_, ffn_buf_, act_buf_;
  Tensor x_, h_, qkv_, att_, ffn_, act_;
};

}  // namespace baton
