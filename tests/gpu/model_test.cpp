// Whole-model parity, CUDA against the f32 CPU backend: the random test model (both RoPE styles,
// q/k/v bias) and, when BATON_MODEL names it, the real SmolLM2. Compared by top-1 agreement of
// the logits at every prompt position (bf16 weights and activations move logits a little; the
// argmax must stay put almost everywhere), plus decode steps with and without CUDA graphs.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <random>
#include <vector>

#include "kernels/backend.h"
#include "kv/block_pool.h"
#include "model/generator.h"
#include "model/model.h"
#include "model/test_model.h"
#include "model/tokenizer.h"
#include "tests/common/test_skip.h"
#include "tests/common/tolerance.h"
#include "tests/gpu/gpu_test_util.h"

using namespace baton;
using namespace baton::gpu_test;

namespace {

struct Loaded {
  Loaded(const GgufFile& file, const std::string& device, DType dtype) {
    std::string err;
    backend = make_backend({device, dtype, 0, {}}, &err);
    INFO(err);
    REQUIRE(backend);
    auto m = Model::load(file, *backend);
    REQUIRE(m.ok());
    model = std::move(*m);
  }
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Model> model;
};

// Logits of every prompt position, the prompt run in chunks of `chunk` tokens.
std::vector<float> prompt_logits(Model& model, const std::vector<int32_t>& prompt, int chunk) {
  const int block = 16;
  const int n_blocks = static_cast<int>(prompt.size()) / block + 2;
  auto cache = model.make_kv_cache(n_blocks, block, DType::kBF16);
  std::vector<int32_t> table(n_blocks);
  for (int i = 0; i < n_blocks; ++i) table[i] = n_blocks - 1 - i;  // not the identity
  std::vector<float> all, logits;
  StepBatch batch;
  for (size_t s = 0; s < prompt.size(); s += chunk) {
    const size_t n = std::min<size_t>(chunk, prompt.size() - s);
    batch.clear();
    batch.add(std::span(prompt).subspan(s, n), static_cast<int32_t>(s), table, Logits::kAll);
    model.forward(batch, *cache, &logits);
    all.insert(all.end(), logits.begin(), logits.end());
  }
  return all;
}

// Share of rows whose argmax agrees. With `margin` > 0 a row also counts when the reference's
// best two logits are closer than margin × the row's range: a tie that bf16 rounding may flip.
double top1_agreement(const std::vector<float>& got, const std::vector<float>& want, int vocab, double margin = 0.0) {
  const size_t rows = want.size() / vocab;
  size_t same = 0;
  for (size_t r = 0; r < rows; ++r) {
    const auto w = std::span(want).subspan(r * vocab, vocab);
    const int32_t best = argmax(w);
    bool ok = argmax(std::span(got).subspan(r * vocab, vocab)) == best;
    if (!ok && margin > 0) {
      float second = -INFINITY, lo = INFINITY;
      for (int i = 0; i < vocab; ++i) {
        if (i != best) second = std::max(second, w[i]);
        lo = std::min(lo, w[i]);
      }
      ok = w[best] - second < margin * (w[best] - lo);
    }
    same += ok;
  }
  return static_cast<double>(same) / static_cast<double>(rows);
}

std::vector<int32_t> random_prompt(int n, int vocab) {
  std::vector<int32_t> p(n);
  for (int32_t& t : p) t = std::uniform_int_distribution<int32_t>(0, vocab - 1)(rng());
  return p;
}

// The logits' norm-wise error against the f32 CPU is held to kModelBf16OverFloor × the CPU's own
// bf16 error on the same prompt, measured here (tests/common/tolerance.h says why).
void check_model(const GgufFile& file, const std::vector<int32_t>& prompt, double min_agreement, double margin) {
  Loaded cpu(file, "cpu", DType::kF32), gpu(file, "cuda:0", DType::kBF16);
  const int vocab = cpu.model->config().n_vocab;
  const std::vector<float> want = prompt_logits(*cpu.model, prompt, static_cast<int>(prompt.size()));
  double floor = 0;
  {
    Loaded cpu_bf16(file, "cpu", DType::kBF16);
    INFO("the CPU backend runs " << dtype_name(cpu_bf16.backend->compute_dtype())
                                 << " when asked for bf16: this host has no avx512_bf16/AMX, so the bf16 floor cannot be measured");
    REQUIRE(cpu_bf16.backend->compute_dtype() == DType::kBF16);
    floor = rel_error(prompt_logits(*cpu_bf16.model, prompt, static_cast<int>(prompt.size())), want);
  }
  for (int chunk : {static_cast<int>(prompt.size()), 7}) {
    const std::vector<float> got = prompt_logits(*gpu.model, prompt, chunk);
    REQUIRE(got.size() == want.size());
    const double agree = top1_agreement(got, want, vocab, margin);
    INFO("chunk " << chunk << ": top-1 agreement " << agree << ", logits rel. error " << rel_error(got, want)
                  << ", the CPU's bf16 floor " << floor);
    CHECK(agree >= min_agreement);
    CHECK(rel_error(got, want) <= testing::kModelBf16OverFloor * floor);
  }
}

// A random test model with the given shape (head_dim = dim / n_heads: 64 or 128 on CUDA).
std::unique_ptr<GgufFile> gpu_test_model(int dim, int n_heads, int n_kv_heads, int ffn_dim, int n_ctx = 1024) {
  TestModelSpec spec;
  spec.seed = rng()();
  spec.dim = dim;
  spec.n_heads = n_heads;
  spec.n_kv_heads = n_kv_heads;
  spec.ffn_dim = ffn_dim;
  spec.n_ctx = n_ctx;
  auto file = GgufFile::parse(make_test_model(spec).to_bytes());
  REQUIRE(file.ok());
  return std::move(*file);
}

// The model on cuda:0, recording decode steps as CUDA graphs or not.
Loaded load_on_gpu(const GgufFile& file, bool graphs) {
  if (graphs) {
    unsetenv("BATON_CUDA_GRAPHS");
  } else {
    setenv("BATON_CUDA_GRAPHS", "0", 1);  // read when the backend is made
  }
  Loaded gpu(file, "cuda:0", DType::kBF16);
  unsetenv("BATON_CUDA_GRAPHS");
  return gpu;
}

}  // namespace

TEST_CASE("test model: CUDA logits agree with the CPU (llama and qwen2 styles)", "[gpu]") {
  for (const char* arch : {"llama", "qwen2"}) {
    TestModelSpec spec;
    spec.arch = arch;
    spec.seed = rng()();
    spec.dim = 256;  // head_dim 64, as the CUDA kernels need
    spec.n_heads = 4;
    spec.n_kv_heads = 2;
    spec.ffn_dim = 512;
    auto file = GgufFile::parse(make_test_model(spec).to_bytes());
    REQUIRE(file.ok());
    INFO(arch);
    auto vocab = static_cast<int>((*file)->tensor("token_embd.weight")->dims[1]);
    // A random model's logits have near-ties; those within 1 % of the row's range may flip.
    check_model(**file, random_prompt(300, vocab), 0.99, 0.01);
  }
}

TEST_CASE("decode steps: CUDA graphs replay what eager launches compute", "[gpu]") {
  auto file = gpu_test_model(512, 8, 2, 1024);
  auto run = [&](bool graphs) {
    Loaded gpu = load_on_gpu(*file, graphs);
    GenerateOptions opt;
    opt.max_tokens = 40;
    opt.ignore_eos = true;
    opt.kv_dtype = DType::kBF16;
    opt.sampling.temperature = 0.8f;
    opt.sampling.seed = 42;
    Generator gen(*gpu.model);
    auto r = gen.generate(std::vector<int32_t>(37, 3), opt);
    REQUIRE(r.ok());
    // With graphs on, decode steps were recorded and replayed (else this compares eager to eager).
    INFO(gpu.backend->stats());
    CHECK((gpu.backend->stats().find("graph_replays=0") == std::string::npos) == graphs);
    return r->tokens;
  };
  const std::vector<int32_t> eager = run(false), graphed = run(true);
  CHECK(graphed == eager);
}

TEST_CASE("decode steps of changing batch size and context: recorded graphs stay right", "[gpu]") {
  // Batch sizes and context bounds change between steps, so graphs are recorded, replayed, and
  // invalidated when a workspace grows (batch 1 recorded, then 8 with long contexts, then 1 again).
  auto file = gpu_test_model(256, 4, 1, 512, 4096);
  const int vocab = static_cast<int>(file->tensor("token_embd.weight")->dims[1]);
  const std::vector<int> schedule = {1, 1, 1, 1, 8, 8, 8, 1, 1, 1, 3, 3, 1, 1};
  auto run = [&](bool graphs) {
    Loaded gpu = load_on_gpu(*file, graphs);
    Model& model = *gpu.model;
    BlockPool pool(4096, 16);
    auto cache = model.make_kv_cache(pool.n_total(), pool.block_size(), DType::kBF16);
    // Eight sequences with prompts of 20 .. 1500 tokens (contexts across several bounds).
    std::mt19937_64 g(1234);
    std::vector<std::vector<int32_t>> tables(8), tokens(8);
    std::vector<int32_t> pos(8);
    for (int i = 0; i < 8; ++i) {
      const int n = i == 0 ? 20 : 200 * i;
      std::vector<int32_t> prompt(n);
      for (int32_t& t : prompt) t = static_cast<int32_t>(g() % vocab);
      REQUIRE(pool.grow_to(tables[i], n + 64));
      StepBatch b;
      b.add(prompt, 0, tables[i], Logits::kLast);
      std::vector<float> logits;
      model.forward(b, *cache, &logits);
      tokens[i].push_back(argmax(logits));
      pos[i] = n;
    }
    std::vector<int32_t> sampled;
    for (int batch : schedule) {
      StepBatch b;
      for (int i = 0; i < batch; ++i) b.add(std::span(&tokens[i].back(), 1), pos[i], tables[i], Logits::kLast);
      std::vector<SampleSpec> specs(batch);
      model.forward_sample(b, *cache, specs, {}, &sampled, nullptr);
      for (int i = 0; i < batch; ++i) {
        tokens[i].push_back(sampled[i]);
        ++pos[i];
      }
    }
    INFO(gpu.backend->stats());
    CHECK((gpu.backend->stats().find("graph_replays=0") == std::string::npos) == graphs);
    return tokens;
  };
  CHECK(run(true) == run(false));
}

TEST_CASE("SmolLM2: CUDA logits agree with the CPU (top-1 >= 99 %)", "[gpu][model][smollm2]") {
  const char* path = std::getenv("BATON_MODEL");
  if (path == nullptr) BATON_SKIP("BATON_MODEL is not set (scripts/fetch-model.sh prints the path)");
  auto file = GgufFile::open(path);
  REQUIRE(file.ok());
  auto tok = Tokenizer::from_gguf(**file);
  REQUIRE(tok.ok());
  auto ids = (*tok)->encode(
      "<|im_start|>user\nExplain why the sky is blue, then list three capitals of Europe and write a short "
      "Python function that reverses a string.<|im_end|>\n<|im_start|>assistant\nThe sky looks blue because "
      "sunlight is scattered by the molecules of the air, and shorter wavelengths scatter much more than longer "
      "ones. Three capitals of Europe are Paris, Berlin and Madrid. Here is the function:\n\n```python\n"
      "def reverse(s: str) -> str:\n    return s[::-1]\n```\nIt uses slicing with a step of -1. Slicing builds a new "
      "string from the old one, walking it from the last character to the first, so the original is left as it was. "
      "If you need to reverse a list in place instead, call its reverse() method, which changes the list itself and "
      "returns None. For very long strings both ways take time proportional to the length, and the slice also needs "
      "memory for the copy.<|im_end|>\n<|im_start|>user\nThanks! What is the tallest mountain in Africa?<|im_end|>\n"
      "<|im_start|>assistant\nThe tallest mountain in Africa is Mount Kilimanjaro in Tanzania, about 5,895 metres "
      "above sea level. It is a dormant volcano with three cones: Kibo, Mawenzi and Shira.");
  REQUIRE(ids.ok());
  // Positions whose best two logits lie within 0.2 % of the row's range count as ties.
  check_model(**file, *ids, 0.99, 0.002);
}
