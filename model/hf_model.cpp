#include "model/hf_model.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numbers>
#include <set>

#include "model/safetensors.h"

namespace baton {
namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

Result<Json> read_json(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return not_found("cannot open " + path.string());
  Json j = Json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return invalid_argument(path.string() + " is not a JSON object");
  return j;
}

// A positive integer key (or `fallback` when it is absent and fallback > 0).
Result<int> positive(const Json& c, const char* key, int fallback = 0) {
  if (!c.contains(key) || c.at(key).is_null()) {
    if (fallback > 0) return fallback;
    return invalid_argument(std::string("config.json has no ") + key);
  }
  const Json& v = c.at(key);
  if (!v.is_number_integer() || v.get<int64_t>() <= 0 || v.get<int64_t>() > (1 << 24)) {
    return invalid_argument(std::string("config.json ") + key + " = " + v.dump() + " is not a positive integer");
  }
  return static_cast<int>(v.get<int64_t>());
}

double number(const Json& c, const char* key, double fallback) {
  return c.contains(key) && c.at(key).is_number() ? c.at(key).get<double>() : fallback;
}

// Keys that change what a model computes, which baton does not implement: refused when set to
// anything but their neutral value (null, false, or the value given).
struct MathKey {
  const char* key;
  Json neutral;
  const char* what;
};
const MathKey kMathKeys[] = {
    {"attention_bias", false, "biases on q, k, v and o (baton has q/k/v biases only: Qwen2)"},
    {"mlp_bias", false, "biases on the MLP projections"},
    {"partial_rotary_factor", 1.0, "RoPE on part of each head"},
    {"quantization_config", nullptr, "quantised weights"},
    {"final_logit_softcapping", nullptr, "logit soft-capping"},
    {"attn_logit_softcapping", nullptr, "attention logit soft-capping"},
    {"embedding_multiplier", nullptr, "a scaled embedding"},
    {"residual_multiplier", nullptr, "a scaled residual"},
    {"logits_scaling", nullptr, "scaled logits"},
    {"attention_multiplier", nullptr, "a scaled attention"},
    {"use_qk_norm", false, "q/k normalisation"},
    {"qk_layernorm", false, "q/k normalisation"},
};

Status check_math_keys(const Json& c) {
  for (const MathKey& m : kMathKeys) {
    if (!c.contains(m.key) || c.at(m.key).is_null() || c.at(m.key) == m.neutral) continue;
    return unimplemented(std::string("config.json ") + m.key + " = " + c.at(m.key).dump().substr(0, 80) + " asks for " +
                         m.what + ", which baton does not implement");
  }
  if (c.contains("hidden_act") && c.at("hidden_act") != "silu") {
    return unimplemented("config.json hidden_act = " + c.at("hidden_act").dump() + ": baton's MLP is SwiGLU (silu)");
  }
  return Status::ok_status();
}

// RoPE: theta, and scaling (rope_scaling, or transformers 5's rope_parameters). "llama3" becomes
// per-pair frequency divisors as Hugging Face's _compute_llama3_parameters computes them.
Status read_rope(const Json& c, ModelConfig& config) {
  RopeConfig& rope = config.rope;
  rope.neox = true;  // Hugging Face's rotate_half on unpermuted q/k weights
  rope.n_rot = config.head_dim;
  Json scaling = c.value("rope_parameters", Json());
  if (scaling.is_null()) scaling = c.value("rope_scaling", Json());
  rope.theta =
      static_cast<float>(number(c, "rope_theta", scaling.is_object() ? number(scaling, "rope_theta", 10000) : 10000));
  if (!scaling.is_object()) {
    if (!scaling.is_null()) return invalid_argument("config.json rope_scaling is not an object");
    return Status::ok_status();
  }
  const std::string type = scaling.value("rope_type", scaling.value("type", "default"));
  if (type == "default") return Status::ok_status();
  const double factor = number(scaling, "factor", 0);
  if (!(factor > 0)) return invalid_argument("config.json rope scaling \"" + type + "\" needs a positive factor");
  if (type == "linear") {
    rope.freq_scale = static_cast<float>(1 / factor);
    return Status::ok_status();
  }
  if (type != "llama3") {
    return unimplemented("config.json rope scaling \"" + type + "\" is not supported (linear and llama3 are)");
  }
  const double low = number(scaling, "low_freq_factor", 0), high = number(scaling, "high_freq_factor", 0);
  const double old_ctx = number(scaling, "original_max_position_embeddings", 0);
  if (!(low > 0) || !(high > low) || !(old_ctx > 0)) {
    return invalid_argument(
        "config.json llama3 rope scaling needs low_freq_factor < high_freq_factor and "
        "original_max_position_embeddings");
  }
  const double low_wavelen = old_ctx / low, high_wavelen = old_ctx / high;
  rope.freq_factors.resize(rope.n_rot / 2);
  for (int i = 0; i < rope.n_rot / 2; ++i) {
    const double inv_freq = std::pow(static_cast<double>(rope.theta), -2.0 * i / rope.n_rot);
    const double wavelen = 2 * std::numbers::pi / inv_freq;
    double scaled = wavelen > low_wavelen ? inv_freq / factor : inv_freq;
    if (wavelen >= high_wavelen && wavelen <= low_wavelen) {
      const double smooth = (old_ctx / wavelen - low) / (high - low);
      scaled = (1 - smooth) * scaled / factor + smooth * scaled;
    }
    rope.freq_factors[i] = static_cast<float>(inv_freq / scaled);
  }
  return Status::ok_status();
}

Result<ModelConfig> config_from_json(const Json& c) {
  ModelConfig config;
  const Json arch = c.value("architectures", Json::array());
  const std::string name = arch.is_array() && arch.size() == 1 && arch[0].is_string() ? arch[0].get<std::string>() : "";
  static const std::map<std::string, std::string> kArchs = {
      {"LlamaForCausalLM", "llama"},
      {"MistralForCausalLM", "mistral"},
      {"Qwen2ForCausalLM", "qwen2"},
      {"Qwen3ForCausalLM", "qwen3"}};
  const auto it = kArchs.find(name);
  if (it == kArchs.end()) {
    return unimplemented("config.json architectures " + arch.dump().substr(0, 100) +
                         " is not supported (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
                         "Qwen3ForCausalLM are)");
  }
  config.arch = it->second;
  config.name = c.value("_name_or_path", name);
  BATON_RETURN_IF_ERROR(check_math_keys(c));
  BATON_ASSIGN_OR_RETURN(config.dim, positive(c, "hidden_size"));
  BATON_ASSIGN_OR_RETURN(config.ffn_dim, positive(c, "intermediate_size"));
  BATON_ASSIGN_OR_RETURN(config.n_layers, positive(c, "num_hidden_layers"));
  BATON_ASSIGN_OR_RETURN(config.n_heads, positive(c, "num_attention_heads"));
  BATON_ASSIGN_OR_RETURN(config.n_kv_heads, positive(c, "num_key_value_heads", config.n_heads));
  BATON_ASSIGN_OR_RETURN(config.head_dim, positive(c, "head_dim", config.dim / config.n_heads));
  BATON_ASSIGN_OR_RETURN(config.n_vocab, positive(c, "vocab_size"));
  BATON_ASSIGN_OR_RETURN(config.n_ctx, positive(c, "max_position_embeddings"));
  if (config.n_heads % config.n_kv_heads != 0) {
    return invalid_argument("config.json num_attention_heads " + std::to_string(config.n_heads) +
                            " is not a multiple of num_key_value_heads " + std::to_string(config.n_kv_heads));
  }
  if (config.head_dim % 2 != 0 || config.head_dim > 256) {
    return unimplemented("head_dim " + std::to_string(config.head_dim) + " is not supported (even, at most 256)");
  }
  if (config.head_dim * config.n_heads != config.dim && config.arch != "qwen3") {
    return unimplemented("head_dim " + std::to_string(config.head_dim) + " x " + std::to_string(config.n_heads) +
                         " heads differs from hidden_size " + std::to_string(config.dim));
  }
  config.rms_eps = static_cast<float>(number(c, "rms_norm_eps", 1e-6));
  BATON_RETURN_IF_ERROR(read_rope(c, config));
  // A sliding window (Mistral's sliding_window; Qwen2's when use_sliding_window) is honoured by
  // serving no context longer than it: within it, attention over everything is what it computes.
  const bool windowed = config.arch.starts_with("qwen") ? c.value("use_sliding_window", false) : true;
  if (windowed && c.contains("sliding_window") && !c.at("sliding_window").is_null()) {
    BATON_ASSIGN_OR_RETURN(const int window, positive(c, "sliding_window"));
    if (window < config.n_ctx) {
      config.context_note = "context " + std::to_string(window) +
                            " tokens: the sliding_window (attention within it "
                            "is full), not max_position_embeddings " +
                            std::to_string(config.n_ctx);
      config.n_ctx = window;
    }
  }
  // Qwen3 has no q/k/v biases (attention_bias, which would add o's too, is refused above); it
  // normalises q and k per head before RoPE.
  config.qkv_bias = config.arch == "qwen2";
  config.qk_norm = config.arch == "qwen3";
  config.tied_output = c.value("tie_word_embeddings", false);
  return config;
}

// Hugging Face's tensor name -> baton's (GGUF's), or "" for one baton does not know. Sets *ignore
// for one that carries nothing baton needs (a precomputed RoPE table).
std::string baton_name(const std::string& hf, int n_layers, bool* ignore) {
  static const std::map<std::string, std::string> kTop = {
      {"model.embed_tokens.weight", "token_embd.weight"},
      {"model.norm.weight", "output_norm.weight"},
      {"lm_head.weight", "output.weight"},
  };
  static const std::map<std::string, std::string> kLayer = {
      {"input_layernorm.weight", "attn_norm.weight"}, {"post_attention_layernorm.weight", "ffn_norm.weight"},
      {"self_attn.q_proj.weight", "attn_q.weight"},   {"self_attn.k_proj.weight", "attn_k.weight"},
      {"self_attn.v_proj.weight", "attn_v.weight"},   {"self_attn.o_proj.weight", "attn_output.weight"},
      {"self_attn.q_proj.bias", "attn_q.bias"},       {"self_attn.k_proj.bias", "attn_k.bias"},
      {"self_attn.v_proj.bias", "attn_v.bias"},       {"mlp.gate_proj.weight", "ffn_gate.weight"},
      {"self_attn.q_norm.weight", "attn_q_norm.weight"}, {"self_attn.k_norm.weight", "attn_k_norm.weight"},
      {"mlp.up_proj.weight", "ffn_up.weight"},        {"mlp.down_proj.weight", "ffn_down.weight"},
  };
  *ignore = false;
  if (const auto it = kTop.find(hf); it != kTop.end()) return it->second;
  constexpr std::string_view kPrefix = "model.layers.";
  if (!hf.starts_with(kPrefix)) return "";
  const size_t dot = hf.find('.', kPrefix.size());
  if (dot == std::string::npos) return "";
  const std::string index = hf.substr(kPrefix.size(), dot - kPrefix.size());
  if (index.empty() || index.size() > 6 || index.find_first_not_of("0123456789") != std::string::npos ||
      std::stoi(index) >= n_layers) {
    return "";
  }
  const std::string rest = hf.substr(dot + 1);
  if (rest == "self_attn.rotary_emb.inv_freq") {
    *ignore = true;
    return "";
  }
  const auto it = kLayer.find(rest);
  return it == kLayer.end() ? "" : "blk." + index + "." + it->second;
}

class HfModelSource final : public ModelSource {
 public:
  const ModelConfig& config() const override { return config_; }
  const std::string& fingerprint() const override { return fingerprint_; }
  std::optional<SourceTensor> tensor(std::string_view name) const override {
    const auto it = tensors_.find(std::string(name));
    if (it == tensors_.end()) return std::nullopt;
    return it->second;
  }
  void release(std::string_view name) const override {  // every file is mapped (SafetensorsFile::open)
    if (const auto it = tensors_.find(std::string(name)); it != tensors_.end()) release_mapped_pages(it->second.data);
  }

  static Result<std::unique_ptr<ModelSource>> open(const fs::path& dir) {
    auto src = std::unique_ptr<HfModelSource>(new HfModelSource());
    BATON_ASSIGN_OR_RETURN(const Json c, read_json(dir / "config.json"));
    BATON_ASSIGN_OR_RETURN(src->config_, config_from_json(c));
    BATON_RETURN_IF_ERROR(src->open_weights(dir));
    BATON_RETURN_IF_ERROR(src->check_tensors());
    src->fingerprint_ = src->digest();
    return std::unique_ptr<ModelSource>(std::move(src));
  }

 private:
  HfModelSource() = default;

  Status open_weights(const fs::path& dir) {
    std::vector<std::string> files;
    if (fs::exists(dir / "model.safetensors.index.json")) {
      BATON_ASSIGN_OR_RETURN(const Json index, read_json(dir / "model.safetensors.index.json"));
      if (!index.contains("weight_map") || !index.at("weight_map").is_object()) {
        return invalid_argument("model.safetensors.index.json has no weight_map");
      }
      std::set<std::string> shards;
      for (const auto& [tensor, file] : index.at("weight_map").items()) {
        if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos) {
          return invalid_argument("model.safetensors.index.json names tensor '" + tensor + "' in " + file.dump());
        }
        shards.insert(file.get<std::string>());
      }
      files.assign(shards.begin(), shards.end());
    } else if (fs::exists(dir / "model.safetensors")) {
      files.push_back("model.safetensors");
    } else {
      const bool torch = fs::exists(dir / "pytorch_model.bin") || fs::exists(dir / "pytorch_model.bin.index.json");
      return not_found(dir.string() + " has no model.safetensors or model.safetensors.index.json" +
                       (torch ? std::string(" (pytorch_model.bin is not read: save the model as safetensors)") : ""));
    }
    for (const std::string& name : files) {
      BATON_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open((dir / name).string()));
      for (const auto& [hf, info] : file->tensors()) {
        bool ignore = false;
        const std::string ours = baton_name(hf, config_.n_layers, &ignore);
        if (ignore) continue;
        if (ours.empty()) {
          return unimplemented("tensor '" + hf + "' in " + name + " is not one baton knows for " + config_.arch +
                               ": refusing a model baton would run without it");
        }
        SourceTensor t{info.type, {info.shape.rbegin(), info.shape.rend()}, info.data};
        if (!tensors_.emplace(ours, std::move(t)).second) {
          return invalid_argument("tensor '" + hf + "' is in more than one safetensors file");
        }
      }
      files_.push_back(std::move(file));
    }
    return Status::ok_status();
  }

  // The config against the tensors: the vocabulary, the LM head, the biases.
  Status check_tensors() {
    const auto embd = tensors_.find("token_embd.weight");
    if (embd == tensors_.end()) return not_found("tensor 'model.embed_tokens.weight' is missing");
    if (embd->second.dims.size() != 2 || embd->second.dims[1] != static_cast<uint64_t>(config_.n_vocab)) {
      return invalid_argument("model.embed_tokens.weight does not have vocab_size " + std::to_string(config_.n_vocab) +
                              " rows");
    }
    if (!config_.tied_output && !tensors_.contains("output.weight")) {
      return not_found("tensor 'lm_head.weight' is missing and tie_word_embeddings is false");
    }
    if (config_.tied_output) tensors_.erase("output.weight");  // the embeddings are the head
    for (const char* norm : {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"}) {
      if (tensors_.contains(norm) != config_.qk_norm) {
        const std::string hf = std::string("model.layers.0.self_attn.") + (norm[11] == 'q' ? "q" : "k") + "_norm.weight";
        return config_.qk_norm ? not_found("tensor '" + hf + "' is missing (" + config_.arch + " normalises q and k)")
                               : unimplemented(config_.arch + " with " + hf + " (per-head q/k norms) is not supported");
      }
    }
    const bool biased = tensors_.contains("blk.0.attn_q.bias");
    if (biased != config_.qkv_bias) {
      return invalid_argument(config_.arch + (biased ? " has q/k/v biases, which its config does not ask for"
                                                     : " needs q/k/v biases (self_attn.q_proj.bias is missing)"));
    }
    return Status::ok_status();
  }

  // FNV-1a over the architecture, the shape and every tensor's name, type, dims and first bytes.
  std::string digest() const {
    uint64_t h = 1469598103934665603ull;
    const auto mix = [&h](const void* p, size_t n) {
      const auto* b = static_cast<const uint8_t*>(p);
      for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
    };
    const ModelConfig& c = config_;
    mix(c.arch.data(), c.arch.size());
    const int shape[] = {c.n_layers, c.dim, c.ffn_dim, c.n_heads, c.n_kv_heads, c.head_dim, c.n_vocab};
    mix(shape, sizeof(shape));
    for (const auto& [name, t] : tensors_) {
      mix(name.data(), name.size());
      mix(&t.type, sizeof(t.type));
      for (uint64_t d : t.dims) mix(&d, sizeof(d));
      mix(t.data.data(), std::min<size_t>(t.data.size(), 64));
    }
    char buf[17];
    std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h));
    return buf;
  }

  ModelConfig config_;
  std::string fingerprint_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, SourceTensor> tensors_;  // by baton's name
};

}  // namespace

bool is_hf_model_dir(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::exists(fs::path(path) / "config.json", ec);
}

Result<std::unique_ptr<ModelSource>> hf_model_source(const std::string& dir) {
  Result<std::unique_ptr<ModelSource>> src = [&]() -> Result<std::unique_ptr<ModelSource>> {
    try {
      return HfModelSource::open(dir);
    } catch (const Json::exception& e) {  // a value of the wrong type
      return invalid_argument(std::string("config.json: ") + e.what());
    }
  }();
  if (!src.ok()) return Status(src.status().code(), dir + ": " + src.status().message());
  return src;
}

}  // namespace baton
