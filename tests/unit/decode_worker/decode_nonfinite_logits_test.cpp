// Non-finite logits on the decode engine: a step whose logits turn NaN or infinite ends the
// request INTERNAL with no token of that step, and the other requests go on.
#include "decode_worker/decode_engine.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <limits>

#include "kernels/sampling.h"
#include "tests/unit/decode_worker/decode_test_util.h"

using namespace baton;
using namespace baton::decode_test;
using namespace std::chrono_literals;

namespace {

// The CPU backend, except that sample call number `poison_at` (1-based: one call per decode step)
// finds a NaN in the first row of its logits, as an overflowing step would leave them.
class NanLogitsBackend final : public Backend {
 public:
  NanLogitsBackend(std::unique_ptr<Backend> inner, int poison_at) : inner_(std::move(inner)), poison_at_(poison_at) {}
  std::string name() const override { return inner_->name(); }
  DType compute_dtype() const override { return inner_->compute_dtype(); }
  DType activation_dtype() const override { return inner_->activation_dtype(); }
  bool supports_kv_dtype(DType dtype) const override { return inner_->supports_kv_dtype(dtype); }
  bool host_memory() const override { return inner_->host_memory(); }
  Buffer alloc(size_t bytes) override { return inner_->alloc(bytes); }
  void upload(void* dst, const void* src, size_t bytes) override { inner_->upload(dst, src, bytes); }
  void download(void* dst, const void* src, size_t bytes) override { inner_->download(dst, src, bytes); }
  void download_f32(const Tensor& t, float* host) override { inner_->download_f32(t, host); }
  void synchronize() override { inner_->synchronize(); }
  std::unique_ptr<Matrix> make_matrix(const float* host, int64_t rows, int64_t cols, MatrixUse use) override {
    return inner_->make_matrix(host, rows, cols, use);
  }
  std::unique_ptr<Matrix> make_quantized_matrix(std::span<const QuantizedPart> parts, int64_t cols,
                                                const float* dense) override {
    return inner_->make_quantized_matrix(parts, cols, dense);
  }
  bool native_weights_fast() const override { return inner_->native_weights_fast(); }
  std::unique_ptr<KvCache> make_kv_cache(const KvCacheConfig& config) override { return inner_->make_kv_cache(config); }
  void gemm(const Tensor& x, const Matrix& w, const Matrix* bias, const Tensor& y, bool accumulate) override {
    inner_->gemm(x, w, bias, y, accumulate);
  }
  void rms_norm(const Tensor& x, const Matrix& w, float eps, const Tensor& out) override {
    inner_->rms_norm(x, w, eps, out);
  }
  void embed(const Matrix& table, const int32_t* ids, int64_t n, const Tensor& out) override {
    inner_->embed(table, ids, n, out);
  }
  void rope(const Tensor& q, const Tensor& k, const int32_t* positions, int head_dim, const RopeConfig& rope) override {
    inner_->rope(q, k, positions, head_dim, rope);
  }
  void silu_mul(const Tensor& gate_up, const Tensor& out) override { inner_->silu_mul(gate_up, out); }
  void gather_rows(const Tensor& x, const int32_t* rows, int64_t n, const Tensor& out) override {
    inner_->gather_rows(x, rows, n, out);
  }
  void kv_write(KvCache& cache, int layer, const Tensor& k, const Tensor& v, const BatchView& batch) override {
    inner_->kv_write(cache, layer, k, v, batch);
  }
  void kv_export(const KvCache& cache, int layer, const int32_t* table, int32_t start, int32_t n, void* k,
                 void* v) override {
    inner_->kv_export(cache, layer, table, start, n, k, v);
  }
  void kv_import(KvCache& cache, int layer, const int32_t* table, int32_t start, int32_t n, const void* k,
                 const void* v) override {
    inner_->kv_import(cache, layer, table, start, n, k, v);
  }
  void attention(const Tensor& q, const KvCache& cache, int layer, const BatchView& batch, int n_head, float scale,
                 const Tensor& out) override {
    inner_->attention(q, cache, layer, batch, n_head, scale, out);
  }
  void begin_step(const BatchView& batch, std::span<const int32_t> logit_rows) override {
    inner_->begin_step(batch, logit_rows);
  }
  void end_step() override { inner_->end_step(); }
  void run_step(const BatchView& batch, uint64_t key, const std::function<void()>& body) override {
    inner_->run_step(batch, key, body);
  }
  void sample(const Tensor& logits, std::span<const SampleSpec> specs, std::span<const LogitAdjust> adjust,
              int32_t* tokens, TokenLogprobs* logprobs) override {
    if (++n_samples_ != poison_at_) {
      inner_->sample(logits, specs, adjust, tokens, logprobs);
      return;
    }
    std::vector<float> host(static_cast<size_t>(logits.rows * logits.cols));
    inner_->download_f32(logits, host.data());
    host[rnd() % logits.cols] = std::numeric_limits<float>::quiet_NaN();
    for (size_t i = 0; i < specs.size(); ++i) {
      tokens[i] = sample_logits(std::span<const float>(host).subspan(i * logits.cols, logits.cols), specs[i]);
    }
  }
  int n_samples() const { return n_samples_; }

 private:
  std::unique_ptr<Backend> inner_;
  const int poison_at_;
  std::atomic<int> n_samples_{0};
};

}  // namespace

TEST_CASE("logits that turn non-finite at a decode step end the request INTERNAL, with no token of that step",
          "[decode]") {
  Fixture fx(/*n_blocks=*/256, /*max_batch=*/32, /*metrics=*/nullptr, /*start=*/false);  // the reference and stop ids
  for (const bool greedy : {true, false}) {
    const SamplingParams sp = greedy ? SamplingParams{} : seeded();
    INFO((greedy ? "greedy" : "seeded") << " seed " << sp.seed);
    std::string err;
    auto cpu = make_backend({"cpu", DType::kF32, 0, {}}, &err);
    REQUIRE(cpu);
    NanLogitsBackend backend(std::move(cpu), /*poison_at=*/2);  // the second decode step goes wrong
    auto file = GgufFile::parse(make_test_model({}).to_bytes());
    REQUIRE(file.ok());
    auto model = Model::load(**file, backend);
    REQUIRE(model.ok());
    DecodeConfig cfg;
    cfg.n_blocks = 64;
    cfg.block_size = 8;
    cfg.name = "test-decode";
    auto engine = DecodeEngine::create(**model, fx.stop_ids, cfg);
    REQUIRE(engine.ok());
    (*engine)->start();

    const int n_prompt = 1 + static_cast<int>(rnd() % 40);
    const int max_tokens = 4 + static_cast<int>(rnd() % 8);
    const auto prompt = random_prompt(n_prompt, fx.vocab());
    const GenerateResult want = reference(fx, prompt, max_tokens, sp, /*ignore_eos=*/true);
    REQUIRE(static_cast<int>(want.tokens.size()) == max_tokens);
    const Transfer t = prefill(*fx.ref.model, "bad-step", prompt, sp, 1 + static_cast<int>(rnd() % 16));
    Collector out;
    REQUIRE((*engine)->admit(admit_for(fx, "bad-step", n_prompt, max_tokens, sp, /*ignore_eos=*/true)).ok());
    REQUIRE((*engine)->attach("bad-step", out.sink()).ok());
    REQUIRE(send(**engine, t).ok());
    REQUIRE(out.wait_done());
    CHECK(out.status.code() == StatusCode::kInternal);
    CHECK(out.status.message().find("not finite") != std::string::npos);
    // Step 1's token (the second of the request) went out; step 2 produced none, nor anything after.
    CHECK(out.tokens == std::vector<int32_t>{want.tokens[1]});
    CHECK(out.finish_reason.empty());
    CHECK_FALSE(out.event_after_done);
    CHECK(backend.n_samples() == 2);
    check_all_free(**engine);

    // The engine goes on: the next request is decoded in full.
    const Transfer t2 = prefill(*fx.ref.model, "next", prompt, sp, 8);
    Collector out2;
    REQUIRE((*engine)->admit(admit_for(fx, "next", n_prompt, max_tokens, sp, /*ignore_eos=*/true)).ok());
    REQUIRE((*engine)->attach("next", out2.sink()).ok());
    REQUIRE(send(**engine, t2).ok());
    REQUIRE(out2.wait_done());
    CHECK(out2.status.ok());
    CHECK(out2.tokens == std::vector<int32_t>(want.tokens.begin() + 1, want.tokens.end()));
    check_all_free(**engine);
    (*engine)->stop();
  }
}
