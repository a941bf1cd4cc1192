#include "model/test_model.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "model/kquant_encode.h"

namespace baton {
namespace {

// GPT-2's byte → printable-character map, so byte tokens are spelled as the BPE vocab expects.
std::string byte_token(int b) {
  int cp = b;
  const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
  if (!printable) {
    int n = 0;
    for (int x = 0; x < b; ++x) {
      if (!((x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF))) ++n;
    }
    cp = 256 + n;
  }
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

}  // namespace

Status validate_test_model_spec(const TestModelSpec& s) {
  if (s.arch != "llama" && s.arch != "qwen2" && s.arch != "qwen3") {
    return invalid_argument("--arch must be llama, qwen2 or qwen3");
  }
  if (s.head_dim != 0 && (s.arch != "qwen3" || s.head_dim < 0 || s.head_dim % 2 != 0)) {
    return invalid_argument("--head-dim is qwen3's, and even");
  }
  if (s.n_layers <= 0 || s.dim <= 0 || s.n_heads <= 0 || s.n_kv_heads <= 0 || s.ffn_dim <= 0 || s.n_ctx <= 0) {
    return invalid_argument("layers, dim, heads, kv-heads, ffn and ctx must be positive");
  }
  if (s.head_dim == 0 && s.dim % s.n_heads != 0) return invalid_argument("--dim must be a multiple of --heads");
  if (s.n_heads % s.n_kv_heads != 0) return invalid_argument("--heads must be a multiple of --kv-heads");
  if (s.head_dim == 0 && (s.dim / s.n_heads) % 2 != 0) return invalid_argument("the head dim (dim / heads) must be even");
  const std::vector<std::string> types = {"f32", "q4_k", "q5_k", "q6_k", "mixed"};
  if (std::find(types.begin(), types.end(), s.gemm_type) == types.end()) {
    return invalid_argument("--gemm-type must be f32, q4_k, q5_k, q6_k or mixed");
  }
  if (s.gemm_type != "f32" && (s.dim % 256 != 0 || s.ffn_dim % 256 != 0)) {
    return invalid_argument("K-quant GEMM weights need --dim and --ffn to be multiples of 256");
  }
  return {};
}

GgufWriter make_test_model(const TestModelSpec& s) {
  BATON_CHECK(validate_test_model_spec(s).ok(), "invalid test model spec");
  // Vocabulary: three control tokens, the 256 byte tokens, then a few merges of common pairs.
  std::vector<std::string> tokens = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  std::vector<int32_t> types = {3, 3, 3};
  for (int b = 0; b < 256; ++b) {
    tokens.push_back(byte_token(b));
    types.push_back(1);
  }
  const std::string sp = byte_token(' ');
  const std::vector<std::pair<std::string, std::string>> merges = {
      {sp, "t"}, {"h", "e"}, {"i", "n"}, {"e", "r"}, {"a", "n"}, {sp + "t", "he"}, {"o", "n"}, {sp, "a"},
      {"r", "e"}, {"e", "n"}, {sp, "s"}, {"o", "r"}, {"in", "g"}, {sp, "w"}, {"a", "t"}, {sp, "c"}};
  std::vector<std::string> merge_strings;
  for (const auto& [a, b] : merges) {
    merge_strings.push_back(a + " " + b);
    tokens.push_back(a + b);
    types.push_back(1);
  }
  const int n_vocab = static_cast<int>(tokens.size());
  const int hd = s.head_dim > 0 ? s.head_dim : s.dim / s.n_heads;

  GgufWriter w;
  const std::string a = s.arch + ".";
  w.add_string("general.architecture", s.arch);
  w.add_string("general.name", "baton test model");
  w.add_u32(a + "block_count", s.n_layers);
  w.add_u32(a + "context_length", s.n_ctx);
  w.add_u32(a + "embedding_length", s.dim);
  w.add_u32(a + "feed_forward_length", s.ffn_dim);
  w.add_u32(a + "attention.head_count", s.n_heads);
  w.add_u32(a + "attention.head_count_kv", s.n_kv_heads);
  w.add_f32(a + "rope.freq_base", s.rope_theta);
  w.add_u32(a + "rope.dimension_count", hd);
  if (s.arch == "qwen3") {
    w.add_u32(a + "attention.key_length", hd);
    w.add_u32(a + "attention.value_length", hd);
  }
  w.add_f32(a + "attention.layer_norm_rms_epsilon", 1e-5f);
  w.add_string("tokenizer.ggml.model", "gpt2");
  w.add_string("tokenizer.ggml.pre", "gpt-2");
  w.add_string_array("tokenizer.ggml.tokens", tokens);
  w.add_i32_array("tokenizer.ggml.token_type", types);
  w.add_string_array("tokenizer.ggml.merges", merge_strings);
  w.add_u32("tokenizer.ggml.bos_token_id", 0);
  w.add_u32("tokenizer.ggml.eos_token_id", 2);
  w.add_bool("tokenizer.ggml.add_bos_token", false);
  w.add_string("tokenizer.chat_template",
               "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
               "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}");

  std::mt19937_64 rng(s.seed);
  // Weights ~ N(0, 1/fan_in) keep activations O(1) through the layers, so logits are well
  // spread and numeric comparisons are meaningful.
  auto normal = [&rng](size_t n, double stddev) {
    std::normal_distribution<float> dist(0.0f, static_cast<float>(stddev));
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng);
    return v;
  };
  auto around_one = [&rng](size_t n) {
    std::uniform_real_distribution<float> dist(0.8f, 1.2f);
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng);
    return v;
  };
  const auto d = static_cast<uint64_t>(s.dim), f = static_cast<uint64_t>(s.ffn_dim);
  const uint64_t kv = static_cast<uint64_t>(s.n_kv_heads) * hd;
  const uint64_t qd = static_cast<uint64_t>(s.n_heads) * hd;
  const uint64_t v = static_cast<uint64_t>(n_vocab);
  w.add_tensor_f32("token_embd.weight", {d, v}, normal(d * v, 1.0));
  w.add_tensor_f32("output_norm.weight", {d}, around_one(d));
  if (!s.tied_output) w.add_tensor_f32("output.weight", {d, v}, normal(d * v, 1.0 / std::sqrt(s.dim)));
  // A layer's GEMM weight, in the spec's type.
  auto gemm = [&](const std::string& name, const std::vector<uint64_t>& dims, std::vector<float> values) {
    std::string type = s.gemm_type;
    if (type == "mixed") {
      const bool high = name.ends_with("attn_v.weight") || name.ends_with("ffn_down.weight");
      type = high ? "q6_k" : "q4_k";
    }
    if (type == "f32") {
      w.add_tensor_f32(name, dims, std::move(values));
      return;
    }
    const GgmlType t = type == "q4_k" ? GgmlType::kQ4_K : type == "q5_k" ? GgmlType::kQ5_K : GgmlType::kQ6_K;
    auto bytes = encode_kquant(t, values);
    BATON_CHECK(bytes.ok(), "%s", bytes.status().to_string().c_str());
    w.add_tensor_raw(name, dims, t, std::move(*bytes));
  };
  for (int l = 0; l < s.n_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    const double in_d = 1.0 / std::sqrt(static_cast<double>(s.dim));
    w.add_tensor_f32(p + "attn_norm.weight", {d}, around_one(d));
    gemm(p + "attn_q.weight", {d, qd}, normal(d * qd, in_d * 2.0));
    gemm(p + "attn_k.weight", {d, kv}, normal(d * kv, in_d * 2.0));
    gemm(p + "attn_v.weight", {d, kv}, normal(d * kv, in_d));
    if (s.arch == "qwen2") {
      w.add_tensor_f32(p + "attn_q.bias", {qd}, normal(qd, 0.1));
      w.add_tensor_f32(p + "attn_k.bias", {kv}, normal(kv, 0.1));
      w.add_tensor_f32(p + "attn_v.bias", {kv}, normal(kv, 0.1));
    }
    if (s.arch == "qwen3") {
      w.add_tensor_f32(p + "attn_q_norm.weight", {static_cast<uint64_t>(hd)}, around_one(hd));
      w.add_tensor_f32(p + "attn_k_norm.weight", {static_cast<uint64_t>(hd)}, around_one(hd));
    }
    gemm(p + "attn_output.weight", {qd, d}, normal(qd * d, 1.0 / std::sqrt(static_cast<double>(qd))));
    w.add_tensor_f32(p + "ffn_norm.weight", {d}, around_one(d));
    gemm(p + "ffn_gate.weight", {d, f}, normal(d * f, in_d));
    gemm(p + "ffn_up.weight", {d, f}, normal(d * f, in_d));
    gemm(p + "ffn_down.weight", {f, d}, normal(f * d, 1.0 / std::sqrt(static_cast<double>(s.ffn_dim))));
  }
  return w;
}

}  // namespace baton
