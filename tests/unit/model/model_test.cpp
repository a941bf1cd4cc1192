// The forward pass on the random test model: chunked prefill, several prompts batched into one
// step, and prefill mixed with decode all give the logits of one prompt run alone.
#include "model/model.h"

#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "kv/block_pool.h"
#include "model/generator.h"
#include "model/sampler.h"
#include "model/test_model.h"
#include "tests/unit/test_model_fixture.h"

using namespace baton;

namespace {

using Fixture = testing::LoadedTestModel;

std::vector<int32_t> random_prompt(std::mt19937& rng, int n, int vocab) {
  std::vector<int32_t> p(n);
  for (int32_t& t : p) t = static_cast<int32_t>(rng() % vocab);
  return p;
}

// Last-position logits of `prompt` prefilled in chunks of `chunk` (0: whole) with fresh KV.
std::vector<float> prefill_logits(Model& model, const std::vector<int32_t>& prompt, int chunk) {
  GenerateOptions opt;
  opt.max_tokens = 0;
  opt.prefill_chunk = chunk;
  opt.block_size = 8;
  Generator gen(model);
  auto r = gen.generate(prompt, opt);
  REQUIRE(r.ok());
  return r->last_logits;
}

double max_abs_diff(const std::vector<float>& a, const float* b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, static_cast<double>(std::abs(a[i] - b[i])));
  return m;
}

}  // namespace

TEST_CASE("chunked prefill equals whole-prompt prefill", "[model]") {
  for (const char* arch : {"llama", "qwen2"}) {
    TestModelSpec spec;
    spec.arch = arch;
    spec.n_layers = 3;
    spec.tied_output = std::string(arch) == "llama";
    Fixture fx(spec);
    std::mt19937 rng(std::random_device{}());
    const auto prompt = random_prompt(rng, 150, fx.model->config().n_vocab);
    const auto whole = prefill_logits(*fx.model, prompt, 0);
    for (int chunk : {1, 7, 64}) {
      const auto chunked = prefill_logits(*fx.model, prompt, chunk);
      INFO(arch << " chunk " << chunk);
      CHECK(max_abs_diff(whole, chunked.data()) <= 1e-4);
    }
  }
}

TEST_CASE("several prompts in one step, mixed with a decode token, match each alone", "[model]") {
  Fixture fx(TestModelSpec{});
  Model& model = *fx.model;
  std::mt19937 rng(std::random_device{}());
  const int vocab = model.config().n_vocab;
  const std::vector<int> lengths = {37, 1, 90, 12};
  std::vector<std::vector<int32_t>> prompts;
  for (int n : lengths) prompts.push_back(random_prompt(rng, n, vocab));

  BlockPool pool(256, 8);
  auto cache = model.make_kv_cache(pool.n_total(), pool.block_size(), DType::kF32);
  std::vector<std::vector<int32_t>> tables(prompts.size() + 1);
  StepBatch batch;
  for (size_t i = 0; i < prompts.size(); ++i) {
    REQUIRE(pool.grow_to(tables[i], static_cast<int64_t>(prompts[i].size())));
    batch.add(prompts[i], 0, tables[i], Logits::kLast);
  }
  std::vector<float> logits;
  model.forward(batch, *cache, &logits);
  REQUIRE(logits.size() == prompts.size() * static_cast<size_t>(vocab));
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto alone = prefill_logits(model, prompts[i], 0);
    INFO("prompt " << i);
    CHECK(max_abs_diff(alone, logits.data() + i * vocab) <= 1e-4);
  }

  // Next step: a decode token for prompt 0 beside a fresh 20-token prompt, in one forward.
  const int32_t next = static_cast<int32_t>(rng() % vocab);
  const auto fresh = random_prompt(rng, 20, vocab);
  REQUIRE(pool.grow_to(tables[0], static_cast<int64_t>(prompts[0].size()) + 1));
  REQUIRE(pool.grow_to(tables.back(), 20));
  StepBatch step;
  step.add(std::span(&next, 1), static_cast<int32_t>(prompts[0].size()), tables[0], Logits::kLast);
  step.add(fresh, 0, tables.back(), Logits::kLast);
  model.forward(step, *cache, &logits);
  auto extended = prompts[0];
  extended.push_back(next);
  CHECK(max_abs_diff(prefill_logits(model, extended, 0), logits.data()) <= 1e-4);
  CHECK(max_abs_diff(prefill_logits(model, fresh, 0), logits.data() + vocab) <= 1e-4);
  for (auto& t : tables) pool.release(t);
  CHECK(pool.n_free() == pool.n_total());
}

TEST_CASE("forward_sample draws what the host sampler draws from forward's logits", "[model]") {
  Fixture fx(TestModelSpec{});
  Model& model = *fx.model;
  std::mt19937 rng(std::random_device{}());
  const int vocab = model.config().n_vocab;
  BlockPool pool(256, 8);
  auto cache = model.make_kv_cache(pool.n_total(), pool.block_size(), DType::kF32);
  std::vector<std::vector<int32_t>> prompts, tables(6);
  StepBatch batch;
  std::vector<SamplingParams> params(6);
  for (size_t i = 0; i < params.size(); ++i) {
    prompts.push_back(random_prompt(rng, 1 + static_cast<int>(rng() % 30), vocab));
    REQUIRE(pool.grow_to(tables[i], static_cast<int64_t>(prompts[i].size())));
    batch.add(prompts[i], 0, tables[i], Logits::kLast);
    params[i].temperature = i == 0 ? 0.0f : 0.5f + static_cast<float>(i) * 0.2f;
    params[i].top_k = i % 2 ? 10 : 0;
    params[i].top_p = i % 3 ? 0.8f : 1.0f;
    params[i].seed = rng();
  }
  std::vector<float> logits;
  model.forward(batch, *cache, &logits);
  std::vector<SampleSpec> specs;
  std::vector<int32_t> want;
  for (size_t i = 0; i < params.size(); ++i) {
    const Sampler sampler(params[i]);
    const auto pos = static_cast<int64_t>(prompts[i].size());
    want.push_back(sampler.sample(std::span<const float>(logits).subspan(i * vocab, vocab), pos));
    specs.push_back(sampler.spec_at(pos));
  }
  std::vector<int32_t> got;
  model.forward_sample(batch, *cache, specs, {}, &got, nullptr);  // rewrites the same KV with the same values
  CHECK(got == want);
  for (auto& t : tables) pool.release(t);
}

TEST_CASE("generation is deterministic for a seed and validates its input", "[model]") {
  Fixture fx(TestModelSpec{});
  Generator gen(*fx.model);
  GenerateOptions opt;
  opt.max_tokens = 20;
  opt.sampling = {0.8f, 20, 0.9f, 1234};
  std::vector<int32_t> prompt = {5, 6, 7, 8};
  auto a = gen.generate(prompt, opt);
  auto b = gen.generate(prompt, opt);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(a->tokens == b->tokens);
  CHECK(a->tokens.size() == 20);

  CHECK(gen.generate({}, opt).status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(gen.generate({5, 100000}, opt).status().message(), Catch::Contains("outside the vocabulary"));
  opt.max_tokens = fx.model->config().n_ctx;
  CHECK_THAT(gen.generate(prompt, opt).status().message(), Catch::Contains("context"));
  opt.max_tokens = 5;
  opt.sampling.top_p = 0.0f;
  CHECK_THAT(gen.generate(prompt, opt).status().message(), Catch::Contains("top_p"));
}

TEST_CASE("a model file with a misshapen tensor is refused by name", "[model]") {
  TestModelSpec spec;
  GgufWriter w = make_test_model(spec);
  w.add_tensor_f32("blk.0.attn_q.weight.extra", {4}, {0, 0, 0, 0});  // harmless extra tensor
  auto f = GgufFile::parse(w.to_bytes());
  REQUIRE(f.ok());
  std::string err;
  auto be = make_backend({"cpu", DType::kF32, 0, {}}, &err);
  CHECK(Model::load(**f, *be).ok());

  // Remove a layer: block_count claims one more than exists.
  spec.n_layers = 2;
  GgufWriter w2 = make_test_model(spec);
  w2.add_u32("llama.block_count_unused", 0);
  auto bytes = w2.to_bytes();
  const std::string key = "llama.block_count";
  auto it = std::search(bytes.begin(), bytes.end(), key.begin(), key.end());
  REQUIRE(it != bytes.end());
  uint32_t three = 3;
  std::memcpy(&*(it + key.size() + 4), &three, 4);
  auto f2 = GgufFile::parse(bytes);
  REQUIRE(f2.ok());
  CHECK_THAT(Model::load(**f2, *be).status().message(), Catch::Contains("blk.2.attn_norm.weight"));
}
