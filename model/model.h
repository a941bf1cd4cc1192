// The Llama-family decoder (RMSNorm, RoPE, GQA attention, SwiGLU, tied or untied LM head),
// written once against Backend. Weights (from a GGUF file or a Hugging Face directory: a
// ModelSource) are dequantised at load and handed to the
// backend in its compute dtype, or, with native weights, kept in the file's quantised blocks
// where the backend has kernels for them (Backend::make_quantized_matrix); q/k/v and gate/up are
// fused so each step runs one GEMM per projection group over all its tokens.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "common/status.h"
#include "kernels/backend.h"
#include "model/batch.h"
#include "model/config.h"
#include "model/gguf.h"
#include "model/model_source.h"

namespace baton {

struct LayerWeights {
  std::unique_ptr<Matrix> attn_norm;  // (dim)
  std::unique_ptr<Matrix> wqkv;       // (n_heads*hd + 2*n_kv*hd, dim): q rows, then k, then v
  std::unique_ptr<Matrix> bqkv;       // (n_heads*hd + 2*n_kv*hd) or null
  std::unique_ptr<Matrix> q_norm;     // (hd) or null: per-head RMSNorm of q before RoPE (qwen3)
  std::unique_ptr<Matrix> k_norm;     // (hd) or null
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
  // Which representation GEMM weights get (weights of types without native kernels are dense).
  // Every tensor is dequantised and checked finite whichever it is.
  enum class Weights {
    kDense,            // dequantised, in the backend's compute dtype
    kNative,           // the file's quantised blocks: decode-sized steps read 4-8 bits a weight
    kNativeAndDense,   // both: native for steps of up to Backend::kNativeMaxRows tokens, dense
                       // above (a process that prefills and decodes, e.g. baton generate)
  };
  using LoadProgress = std::function<void(int done, int total)>;
  static Result<std::unique_ptr<Model>> load(const ModelSource& source, Backend& backend,
                                             const LoadProgress& progress = {}, Weights weights = Weights::kDense);
  // The same from a GGUF file (gguf_model_source).
  static Result<std::unique_ptr<Model>> load(const GgufFile& file, Backend& backend, const LoadProgress& progress = {},
                                             Weights weights = Weights::kDense);

  const ModelConfig& config() const { return config_; }
  const std::string& fingerprint() const { return fingerprint_; }
  // GEMM weights kept quantised / dense (native_weights loads count the first).
  int n_native_matrices() const { return n_native_; }
  int n_dense_matrices() const { return n_dense_; }
  // Seconds load() spent checking that every dequantised weight is finite (part of the load).
  double finite_check_seconds() const { return finite_check_seconds_; }
  Backend& backend() const { return backend_; }

  // A paged KV cache for this model: n_blocks blocks of block_size tokens, in `dtype`.
  std::unique_ptr<KvCache> make_kv_cache(int n_blocks, int block_size, DType dtype) const;

  // Runs one step over every token of `batch`: writes their K/V into `cache` and fills `logits`
  // with [batch.logit_rows().size(), n_vocab] floats, in the batch's order.
  void forward(const StepBatch& batch, KvCache& cache, std::vector<float>* logits);
  // The same step, but samples a token from each logits row where the logits are (one spec per
  // row of batch.logit_rows(), see Sampler::spec_at) and returns only the ids.
  // `layer_done`, when set, is called on this thread once layer l's K and V of every token of the
  // step are in the cache, for l = 0, 1, ... (a layer-wise KV hand-off may copy them out from
  // another thread meanwhile). Only on backends whose ops complete when they return
  // (Backend::synchronous()); on others it is not called and a step's KV is complete when
  // forward_sample returns.
  using LayerDone = std::function<void(int layer)>;
  // `adjust` and *logprobs as Backend::sample takes and fills them (logprobs is resized to the
  // rows when a spec asks for log-probabilities, and may be null when none does).
  void forward_sample(const StepBatch& batch, KvCache& cache, std::span<const SampleSpec> specs,
                      std::span<const LogitAdjust> adjust, std::vector<int32_t>* tokens,
                      std::vector<TokenLogprobs>* logprobs, const LayerDone& layer_done = {});

 private:
  Model(const ModelConfig& config, Backend& backend) : config_(config), backend_(backend) {}
  Status load_weights(const ModelSource& source, const LoadProgress& progress);
  // A GEMM weight: the tensors `parts` ({name, rows}) stacked by rows, each `cols` wide.
  Result<std::unique_ptr<Matrix>> load_gemm(const ModelSource& source,
                                            const std::vector<std::pair<std::string, int64_t>>& parts, int64_t cols);
  void reserve(int64_t n_tokens);
  void reserve_logits(int64_t n_rows);
  // The step's ops up to the logits (in logits_), between the backend's begin/end_step.
  void run(const StepBatch& batch, KvCache& cache, const LayerDone& layer_done = {});

  ModelConfig config_;
  std::string fingerprint_;
  Backend& backend_;
  std::unique_ptr<Matrix> tok_embd_;   // (n_vocab, dim) table; null when it is the tied lm_head_
  std::unique_ptr<Matrix> out_norm_;   // (dim)
  std::unique_ptr<Matrix> lm_head_;    // (n_vocab, dim) gemm weight
  std::vector<LayerWeights> layers_;
  Weights weights_ = Weights::kDense;
  int n_native_ = 0;
  int n_dense_ = 0;
  double finite_check_seconds_ = 0;

  // Activations, sized for `capacity_` tokens and grown on demand. x_ is the f32 residual stream;
  // the others are in the backend's activation dtype.
  int64_t capacity_ = 0;
  Buffer x_buf_, h_buf_, qkv_buf_, att_buf_, ffn_buf_, act_buf_;
  Tensor x_, h_, qkv_, att_, ffn_, act_;  // (n, dim) (n, dim) (n, qkv_dim) (n, q_dim) (n, 2 ffn) (n, ffn)
  // The LM head's rows, sized for `logits_capacity_` rows: selected x rows (f32), normed, logits (f32).
  int64_t logits_capacity_ = 0;
  Buffer sel_buf_, normed_buf_, logits_buf_;
  Tensor sel_, normed_, logits_;  // (n_out, dim) (n_out, dim) (n_out, n_vocab)
  uint64_t buffers_generation_ = 0;  // process-unique, renewed whenever a buffer above is reallocated
};

// BATON_PROFILE=1 sums every forward's per-op wall time and prints it at exit; this forgets what
// was summed so far (a benchmark that sets up with forwards of its own measures only what follows).
void reset_op_profile();

}  // namespace baton
