#include "model/config.h"

#include <cstdio>

namespace baton {
namespace {

Status read_positive(const GgufFile& f, const std::string& key, int* out) {
  BATON_ASSIGN_OR_RETURN(int64_t v, f.get_int(key));
  if (v <= 0 || v > (1 << 24)) return invalid_argument("GGUF " + key + " = " + std::to_string(v) + " is out of range");
  *out = static_cast<int>(v);
  return {};
}

}  // namespace

Result<ModelConfig> model_config_from_gguf(const GgufFile& f) {
  ModelConfig c;
  BATON_ASSIGN_OR_RETURN(c.arch, f.get_string("general.architecture"));
  if (c.arch != "llama" && c.arch != "qwen2" && c.arch != "qwen3" && c.arch != "mistral") {
    return unimplemented("model architecture '" + c.arch +
                         "' is not supported (baton runs llama, qwen2, qwen3, mistral)");
  }
  if (auto name = f.get_string("general.name"); name.ok()) c.name = *name;
  const std::string a = c.arch + ".";
  BATON_RETURN_IF_ERROR(read_positive(f, a + "block_count", &c.n_layers));
  BATON_RETURN_IF_ERROR(read_positive(f, a + "embedding_length", &c.dim));
  BATON_RETURN_IF_ERROR(read_positive(f, a + "feed_forward_length", &c.ffn_dim));
  BATON_RETURN_IF_ERROR(read_positive(f, a + "attention.head_count", &c.n_heads));
  c.n_kv_heads = c.n_heads;
  if (f.find(a + "attention.head_count_kv") != nullptr) {
    BATON_RETURN_IF_ERROR(read_positive(f, a + "attention.head_count_kv", &c.n_kv_heads));
  }
  BATON_RETURN_IF_ERROR(read_positive(f, a + "context_length", &c.n_ctx));
  if (c.n_heads % c.n_kv_heads != 0) {
    return invalid_argument("attention.head_count " + std::to_string(c.n_heads) +
                            " is not a multiple of head_count_kv " + std::to_string(c.n_kv_heads));
  }
  c.head_dim = c.dim / c.n_heads;
  if (f.find(a + "attention.key_length") != nullptr) {
    BATON_RETURN_IF_ERROR(read_positive(f, a + "attention.key_length", &c.head_dim));
  }
  if (c.head_dim * c.n_heads != c.dim && c.arch != "qwen3") {
    return unimplemented("head_dim " + std::to_string(c.head_dim) + " × " + std::to_string(c.n_heads) +
                         " heads differs from embedding_length " + std::to_string(c.dim));
  }
  if (f.find(a + "attention.value_length") != nullptr) {
    int value_length = 0;
    BATON_RETURN_IF_ERROR(read_positive(f, a + "attention.value_length", &value_length));
    if (value_length != c.head_dim) {
      return unimplemented("attention.value_length " + std::to_string(value_length) + " differs from key_length " +
                           std::to_string(c.head_dim));
    }
  }
  if (c.head_dim % 2 != 0 || c.head_dim > 256) {
    return unimplemented("head_dim " + std::to_string(c.head_dim) + " is not supported (even, at most 256)");
  }
  if (auto eps = f.get_float(a + "attention.layer_norm_rms_epsilon"); eps.ok()) c.rms_eps = static_cast<float>(*eps);
  c.rope.theta = 10000.0f;
  if (auto theta = f.get_float(a + "rope.freq_base"); theta.ok()) c.rope.theta = static_cast<float>(*theta);
  c.rope.n_rot = c.head_dim;
  if (f.find(a + "rope.dimension_count") != nullptr) {
    BATON_RETURN_IF_ERROR(read_positive(f, a + "rope.dimension_count", &c.rope.n_rot));
    if (c.rope.n_rot > c.head_dim || c.rope.n_rot % 2 != 0) {
      return invalid_argument("rope.dimension_count " + std::to_string(c.rope.n_rot) + " does not fit head_dim");
    }
  }
  // llama.cpp's converter permutes llama Q/K weights for adjacent-pair rotation; qwen2 and qwen3
  // keep the half-split (NeoX) layout.
  c.rope.neox = c.arch == "qwen2" || c.arch == "qwen3";
  if (auto type = f.get_string(a + "rope.scaling.type"); type.ok() && *type != "none") {
    if (*type != "linear") return unimplemented("rope scaling '" + *type + "' is not supported (linear only)");
    BATON_ASSIGN_OR_RETURN(double factor, f.get_float(a + "rope.scaling.factor"));
    if (factor <= 0) return invalid_argument("rope.scaling.factor must be positive");
    c.rope.freq_scale = static_cast<float>(1.0 / factor);
  }
  c.qkv_bias = f.tensor("blk.0.attn_q.bias") != nullptr;
  const bool q_norm = f.tensor("blk.0.attn_q_norm.weight") != nullptr, k_norm = f.tensor("blk.0.attn_k_norm.weight") != nullptr;
  if (c.arch == "qwen3" && !(q_norm && k_norm)) {
    return not_found("qwen3 needs per-head q/k norms: tensor 'blk.0.attn_" + std::string(q_norm ? "k" : "q") +
                     "_norm.weight' is missing");
  }
  if (c.arch != "qwen3" && (q_norm || k_norm)) {
    return unimplemented(c.arch + " with per-head q/k norms (attn_q_norm, attn_k_norm) is not supported");
  }
  c.qk_norm = c.arch == "qwen3";
  c.tied_output = f.tensor("output.weight") == nullptr;
  const GgufTensorInfo* embd = f.tensor("token_embd.weight");
  if (embd == nullptr) return not_found("tensor 'token_embd.weight' is missing");
  if (embd->dims.size() != 2 || embd->dims[0] != static_cast<uint64_t>(c.dim)) {
    return invalid_argument("tensor 'token_embd.weight' does not have rows of embedding_length " + std::to_string(c.dim));
  }
  c.n_vocab = static_cast<int>(embd->dims[1]);
  return c;
}

std::string model_fingerprint(const ModelConfig& c, const GgufFile& f) {
  // FNV-1a over the shape-defining config and every tensor's name, type, dims and first bytes.
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  };
  mix(c.arch.data(), c.arch.size());
  const int shape[] = {c.n_layers, c.dim, c.ffn_dim, c.n_heads, c.n_kv_heads, c.head_dim, c.n_vocab};
  mix(shape, sizeof(shape));
  for (const GgufTensorInfo& t : f.tensors()) {
    mix(t.name.data(), t.name.size());
    mix(&t.type, sizeof(t.type));
    for (uint64_t d : t.dims) mix(&d, sizeof(d));
    auto data = f.tensor_data(t);
    mix(data.data(), std::min<size_t>(data.size(), 64));
  }
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

}  // namespace baton
