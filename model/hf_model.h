// A Hugging Face model directory as a ModelSource: config.json, and the weights in
// model.safetensors or the shards model.safetensors.index.json lists (mapped, not read).
//
//   architectures   LlamaForCausalLM (rope_scaling "linear" or "llama3", as Llama 3.1/3.2 ship
//                   it), MistralForCausalLM and Qwen2ForCausalLM (q/k/v biases)
//   weights         F32, F16 or BF16; tied embeddings (no lm_head.weight, or tie_word_embeddings)
//   RoPE            Hugging Face's layout: q/k weights as trained, rotate_half on the two halves
//                   of each head (RopeConfig::neox), so no permutation is undone or needed
//   sliding window  honoured by serving contexts only up to it (n_ctx = the window): within the
//                   window, full attention is what the model computes
//
// Refused at load, naming the key or tensor: other architectures; a config key that would change
// the maths and baton does not implement (attention_bias or mlp_bias on Llama, rope scaling other
// than linear/llama3, partial rotary embeddings, a hidden_act other than silu, quantization_config,
// logit soft-capping, ...); a tensor baton does not know. A silently different model is the
// failure to avoid.
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "model/model_source.h"

namespace baton {

// True when `path` is a directory holding a config.json.
bool is_hf_model_dir(const std::string& path);

Result<std::unique_ptr<ModelSource>> hf_model_source(const std::string& dir);

}  // namespace baton
