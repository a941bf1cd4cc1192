// Every CUDA op against its CPU twin (the f32 CPU backend) on fresh random inputs, in the dtypes
// the model uses on the GPU (bf16 activations, f32 residual stream and logits). Device outputs
// are poisoned first, so an element a kernel never wrote is NaN and fails the comparison.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "kernels/backend.h"
#include "kernels/sampling.h"
#include "model/batch.h"
#include "tests/common/tolerance.h"
#include "tests/gpu/gpu_test_util.h"

using namespace baton;
using namespace baton::gpu_test;

namespace {

// bf16 operands and fp32 accumulation: tests/common/tolerance.h derives the norm-wise bound.
constexpr double kTol = baton::testing::kBf16NormwiseTolerance;

struct Backends {
  Backends() {
    std::string err;
    cpu = make_backend({"cpu", DType::kF32, 0, {}}, &err);
    REQUIRE(cpu);
    gpu = make_backend({"cuda:0", DType::kBF16, 0, {}}, &err);
    INFO(err);
    REQUIRE(gpu);
  }
  std::unique_ptr<Backend> cpu, gpu;
};

// A host f32 matrix and its copies on both backends (the device one in `dtype`, poisoned first
// when `values` is empty: an output).
struct Pair {
  Pair(Backends& b, int64_t rows, int64_t cols, DType dtype, const std::vector<float>& values = {})
      : gpu_backend(b.gpu.get()) {
    cpu = b.cpu->alloc_tensor(rows, cols, DType::kF32, &cpu_buf);
    gpu = b.gpu->alloc_tensor(rows, cols, dtype, &gpu_buf);
    const size_t n = static_cast<size_t>(rows * cols);
    if (values.empty()) {
      poison(gpu.data, n * dtype_size(dtype));
      std::fill(cpu.f32(), cpu.f32() + n, 0.0f);
      return;
    }
    // Both sides see the same (device-representable) values.
    std::vector<float> v = dtype == DType::kBF16 ? round_bf16(values) : values;
    std::copy(v.begin(), v.end(), cpu.f32());
    set_device(v);
  }
  void set_device(const std::vector<float>& v) {
    if (gpu.dtype == DType::kF32) {
      gpu_backend->upload(gpu.data, v.data(), v.size() * sizeof(float));
    } else {
      std::vector<uint16_t> h(v.size());
      for (size_t i = 0; i < v.size(); ++i) h[i] = fp32_to_bf16(v[i]);
      gpu_backend->upload(gpu.data, h.data(), h.size() * sizeof(uint16_t));
    }
  }
  std::vector<float> device_values() const {
    const size_t n = static_cast<size_t>(gpu.rows * gpu.cols);
    std::vector<float> out(n);
    if (gpu.dtype == DType::kF32) {
      gpu_backend->download(out.data(), gpu.data, n * sizeof(float));
    } else {
      std::vector<uint16_t> h(n);
      gpu_backend->download(h.data(), gpu.data, n * sizeof(uint16_t));
      for (size_t i = 0; i < n; ++i) out[i] = bf16_to_fp32(h[i]);
    }
    return out;
  }
  std::vector<float> cpu_values() const { return std::vector<float>(cpu.f32(), cpu.f32() + cpu.rows * cpu.cols); }
  double error() const { return rel_error(device_values(), cpu_values()); }

  Backend* gpu_backend;
  Buffer cpu_buf, gpu_buf;
  Tensor cpu, gpu;
};

int pick(std::initializer_list<int> options) {
  std::vector<int> v(options);
  return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng())];
}

}  // namespace

TEST_CASE("gemm: bf16 or f32 in, f32 or bf16 out, overwrite or accumulate, with bias", "[gpu]") {
  Backends b;
  for (int trial = 0; trial < 8; ++trial) {
    const int64_t m = pick({1, 3, 17, 128, 301}), k = pick({64, 576, 1536}), n = pick({64, 192, 1000});
    const DType out_dtype = trial % 2 ? DType::kF32 : DType::kBF16;
    const bool accumulate = trial % 4 >= 2;
    const bool with_bias = trial % 3 == 0;
    INFO("m " << m << " k " << k << " n " << n << " out " << dtype_name(out_dtype) << " accumulate " << accumulate);
    std::vector<float> w = round_bf16(random_vector(n * k));
    std::vector<float> bias = random_vector(n);
    auto wc = b.cpu->make_matrix(w.data(), n, k, MatrixUse::kGemm), wg = b.gpu->make_matrix(w.data(), n, k, MatrixUse::kGemm);
    auto bc = b.cpu->make_matrix(bias.data(), 1, n, MatrixUse::kVector), bg = b.gpu->make_matrix(bias.data(), 1, n, MatrixUse::kVector);
    // f32 inputs (rounded to bf16 on the device first) in a quarter of the trials.
    Pair x(b, m, k, trial % 4 == 3 ? DType::kF32 : DType::kBF16, round_bf16(random_vector(m * k)));
    Pair y(b, m, n, out_dtype, accumulate ? random_vector(m * n) : std::vector<float>{});
    b.cpu->gemm(x.cpu, *wc, with_bias ? bc.get() : nullptr, y.cpu, accumulate);
    b.gpu->gemm(x.gpu, *wg, with_bias ? bg.get() : nullptr, y.gpu, accumulate);
    CHECK(y.error() < kTol);
  }
}

TEST_CASE("rms_norm, silu_mul (16-byte and scalar paths), gather_rows, embed", "[gpu]") {
  Backends b;
  // Widths that take the 16-byte path (multiples of 8) and one that takes the scalar path.
  const int64_t wide = pick({64, 576, 4096});
  for (auto [in, d] : {std::pair{DType::kF32, wide}, std::pair{DType::kBF16, wide}, std::pair{DType::kF32, int64_t{100}},
                       std::pair{DType::kBF16, int64_t{100}}}) {
    const int64_t t = pick({1, 5, 64, 257});
    INFO("rows " << t << " cols " << d << " input " << dtype_name(in));
    std::vector<float> wv = random_vector(d, 0.5f, 1.5f);
    auto wc = b.cpu->make_matrix(wv.data(), 1, d, MatrixUse::kVector), wg = b.gpu->make_matrix(wv.data(), 1, d, MatrixUse::kVector);
    Pair x(b, t, d, in, random_vector(t * d, -3.0f, 3.0f));
    Pair y(b, t, d, DType::kBF16);
    b.cpu->rms_norm(x.cpu, *wc, 1e-5f, y.cpu);
    b.gpu->rms_norm(x.gpu, *wg, 1e-5f, y.gpu);
    CHECK(y.error() < kTol);

    Pair gu(b, t, 2 * d, in, random_vector(t * 2 * d, -4.0f, 4.0f));
    Pair act(b, t, d, DType::kBF16);
    b.cpu->silu_mul(gu.cpu, act.cpu);
    b.gpu->silu_mul(gu.gpu, act.gpu);
    CHECK(act.error() < kTol);

    std::vector<int32_t> rows(std::max<int64_t>(1, t / 2));
    for (int32_t& r : rows) r = std::uniform_int_distribution<int32_t>(0, static_cast<int32_t>(t - 1))(rng());
    Pair sel(b, static_cast<int64_t>(rows.size()), d, in);
    b.cpu->gather_rows(x.cpu, rows.data(), static_cast<int64_t>(rows.size()), sel.cpu);
    b.gpu->gather_rows(x.gpu, rows.data(), static_cast<int64_t>(rows.size()), sel.gpu);
    CHECK(sel.error() == 0.0);
  }
  const int64_t vocab = 1000, d = 576, n = 37;
  std::vector<float> table = round_bf16(random_vector(vocab * d));
  auto tc = b.cpu->make_matrix(table.data(), vocab, d, MatrixUse::kTable), tg = b.gpu->make_matrix(table.data(), vocab, d, MatrixUse::kTable);
  std::vector<int32_t> ids(n);
  for (int32_t& id : ids) id = std::uniform_int_distribution<int32_t>(0, vocab - 1)(rng());
  Pair x(b, n, d, DType::kF32);
  b.cpu->embed(*tc, ids.data(), n, x.cpu);
  b.gpu->embed(*tg, ids.data(), n, x.gpu);
  CHECK(x.error() == 0.0);
}

TEST_CASE("rope: adjacent and NeoX pairs, scaling and frequency factors, long positions", "[gpu]") {
  Backends b;
  for (bool neox : {false, true}) {
    const int hd = pick({64, 128}), n_head = 8, n_kv = 2;
    const int64_t t = pick({1, 9, 100});
    RopeConfig r;
    r.theta = neox ? 1000000.0f : 10000.0f;
    r.n_rot = hd;
    r.neox = neox;
    r.freq_scale = neox ? 1.0f : 0.5f;
    if (!neox) r.freq_factors = random_vector(hd / 2, 1.0f, 8.0f);
    std::vector<int32_t> pos(t);
    for (int32_t& p : pos) p = std::uniform_int_distribution<int32_t>(0, 100000)(rng());
    INFO("neox " << neox << " head_dim " << hd << " tokens " << t);
    Pair q(b, t, n_head * hd, DType::kBF16, random_vector(t * n_head * hd));
    Pair k(b, t, n_kv * hd, DType::kBF16, random_vector(t * n_kv * hd));
    b.cpu->rope(q.cpu, k.cpu, pos.data(), hd, r);
    b.gpu->rope(q.gpu, k.gpu, pos.data(), hd, r);
    CHECK(q.error() < kTol);
    CHECK(k.error() < kTol);
  }
}

namespace {

// A step of several sequences over a shuffled block table: kv_write, then attention, on both
// backends from the same bf16 q/k/v; then the KV hand-off copies.
void check_attention_step(Backends& b, int hd, int n_head, int n_kv, int block_size, const std::vector<std::pair<int, int>>& seqs) {
  const int n_blocks_total = 4096;
  KvCacheConfig kc{1, n_kv, hd, block_size, n_blocks_total, DType::kBF16};
  auto cache_c = b.cpu->make_kv_cache(kc), cache_g = b.gpu->make_kv_cache(kc);
  std::vector<int32_t> free_blocks(n_blocks_total);
  std::iota(free_blocks.begin(), free_blocks.end(), 0);
  std::shuffle(free_blocks.begin(), free_blocks.end(), rng());
  size_t next_block = 0;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));

  // Each sequence's cached prefix is written by one step, then the new tokens by a second.
  std::vector<std::vector<int32_t>> tables(seqs.size());
  for (int phase = 0; phase < 2; ++phase) {
    StepBatch batch;
    std::vector<std::vector<int32_t>> toks(seqs.size());
    for (size_t i = 0; i < seqs.size(); ++i) {
      const auto [offset, n_new] = seqs[i];
      const int start = phase == 0 ? 0 : offset, n = phase == 0 ? offset : n_new;
      if (n == 0) continue;
      const int need = (start + n + block_size - 1) / block_size;
      while (static_cast<int>(tables[i].size()) < need) tables[i].push_back(free_blocks[next_block++]);
      toks[i].assign(n, 1);
      batch.add(toks[i], start, tables[i], Logits::kNone);
    }
    if (batch.empty()) continue;
    const int64_t t = batch.n_tokens();
    Pair q(b, t, n_head * hd, DType::kBF16, random_vector(t * n_head * hd, -2.0f, 2.0f));
    Pair k(b, t, n_kv * hd, DType::kBF16, random_vector(t * n_kv * hd, -2.0f, 2.0f));
    Pair v(b, t, n_kv * hd, DType::kBF16, random_vector(t * n_kv * hd));
    Pair out(b, t, n_head * hd, DType::kBF16);
    const BatchView view = batch.view();
    b.cpu->kv_write(*cache_c, 0, k.cpu, v.cpu, view);
    b.gpu->kv_write(*cache_g, 0, k.gpu, v.gpu, view);
    if (phase == 1) {
      b.cpu->attention(q.cpu, *cache_c, 0, view, n_head, scale, out.cpu);
      b.gpu->attention(q.gpu, *cache_g, 0, view, n_head, scale, out.gpu);
      CHECK(out.error() < kTol);
    }
  }
  // kv_export gives the same bytes; kv_import into fresh blocks round-trips.
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int len = seqs[i].first + seqs[i].second;
    if (len == 0) continue;
    const size_t row = static_cast<size_t>(n_kv) * hd;
    std::vector<uint16_t> kc(len * row), vc(len * row), kg(len * row), vg(len * row);
    b.cpu->kv_export(*cache_c, 0, tables[i].data(), 0, len, kc.data(), vc.data());
    b.gpu->kv_export(*cache_g, 0, tables[i].data(), 0, len, kg.data(), vg.data());
    CHECK(kc == kg);
    CHECK(vc == vg);
    std::vector<int32_t> fresh;
    while (static_cast<int>(fresh.size()) * block_size < len) fresh.push_back(free_blocks[next_block++]);
    b.gpu->kv_import(*cache_g, 0, fresh.data(), 0, len, kg.data(), vg.data());
    std::vector<uint16_t> k2(len * row), v2(len * row);
    b.gpu->kv_export(*cache_g, 0, fresh.data(), 0, len, k2.data(), v2.data());
    CHECK(k2 == kg);
    CHECK(v2 == vg);
  }
}

}  // namespace

TEST_CASE("kv_write + attention through the backend: prefill chunks, mixed steps, decode", "[gpu]") {
  Backends b;
  for (int hd : {64, 128}) {
    INFO("head_dim " << hd);
    // Prefill chunks mid-sequence mixed with decode rows.
    check_attention_step(b, hd, 8, 2, 16, {{0, 77}, {40, 13}, {300, 1}, {0, 1}});
    // A pure decode step (the split-K path), short and long contexts.
    check_attention_step(b, hd, 12, 4, 16, {{5, 1}, {4000, 1}, {1023, 1}});
    // An odd block size, and one token per block.
    check_attention_step(b, hd, 4, 4, 7, {{33, 65}, {9, 1}});
    check_attention_step(b, hd, 8, 2, 1, {{20, 5}, {7, 1}});
    check_attention_step(b, hd, 8, 2, 1, {{300, 1}, {7, 1}});
  }
}

TEST_CASE("sample: greedy matches argmax, temperature/top-k/top-p match the CPU definition", "[gpu]") {
  Backends b;
  const int64_t rows = 40, vocab = 50000;
  std::vector<float> logits = random_vector(rows * vocab, -8.0f, 8.0f);
  // A tie at the maximum in row 0: the lower index must win.
  logits[10] = logits[20] = 100.0f;
  Pair l(b, rows, vocab, DType::kF32, logits);
  std::vector<SampleSpec> specs(rows);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int64_t i = 0; i < rows; ++i) {
    SampleSpec& s = specs[i];
    if (i % 4 == 0) continue;  // greedy
    s.temperature = static_cast<float>(0.3 + 0.4 * (i % 3));
    s.top_k = i % 5 == 1 ? 40 : 0;
    s.top_p = i % 3 == 2 ? 0.9f : 1.0f;
    s.u = u(rng());
  }
  std::vector<int32_t> got(rows);
  b.gpu->sample(l.gpu, specs, {}, got.data(), nullptr);
  int agree = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const int32_t want = sample_logits(std::span<const float>(logits).subspan(i * vocab, vocab), specs[i]);
    if (specs[i].temperature == 0.0f) CHECK(got[i] == want);
    agree += got[i] == want;
  }
  CHECK(got[0] == 10);
  // Random draws may differ only where u falls within rounding of a cumulative boundary.
  CHECK(agree >= rows - 1);

  // All-greedy batches take the argmax path.
  std::vector<SampleSpec> greedy(rows);
  b.gpu->sample(l.gpu, greedy, {}, got.data(), nullptr);
  for (int64_t i = 0; i < rows; ++i) CHECK(got[i] == argmax(std::span<const float>(logits).subspan(i * vocab, vocab)));
}

namespace {

// Both backends take log_softmax in double and round it to f32 once, so a log-probability differs
// by at most an f32 ulp (2u|want|) plus the difference of the doubles: the log-sum-exp's sum in
// another order (n·u_f64 of the sum, at worst) and a few u_f64 roundings of magnitudes below
// |want| + |lse|, where |lse| <= max|logit| + log(n).
double logprob_tolerance(float want, int64_t vocab, float max_abs_logit) {
  const double magnitude = 1 + std::abs(want) + max_abs_logit + std::log(static_cast<double>(vocab));
  return 2 * baton::testing::kUnitRoundoffF32 * std::abs(want) + (vocab + 4) * 0x1p-53 * magnitude;
}

// The CUDA backend's sample() against sample_row on the CPU: random specs (greedy and random,
// asking for 0..20 alternatives or none), random penalties (`with_adjust`) and log-probabilities
// (`with_logprobs`), and one row holding a NaN.
void check_sample_rows(Backends& b, int64_t rows, int64_t vocab, bool with_adjust, bool with_logprobs,
                       bool with_masks = false) {
  INFO("rows " << rows << " vocab " << vocab << " adjust " << with_adjust << " logprobs " << with_logprobs << " masks "
               << with_masks);
  constexpr float kMaxLogit = 8.0f;
  std::vector<float> logits = random_vector(rows * vocab, -kMaxLogit, kMaxLogit);
  const int64_t nan_row = rows / 2;
  logits[nan_row * vocab + vocab / 3] = NAN;
  Pair l(b, rows, vocab, DType::kF32, logits);

  std::vector<SampleSpec> specs(rows);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::uniform_int_distribution<int32_t> n_top(-1, kMaxTopLogprobs);
  for (int64_t i = 0; i < rows; ++i) {
    SampleSpec& s = specs[i];
    if (with_logprobs) s.top_logprobs = i == nan_row ? kMaxTopLogprobs : n_top(rng());
    if (i % 3 == 0) continue;  // greedy
    s.temperature = static_cast<float>(0.3 + 0.4 * (i % 3));
    s.top_k = i % 4 == 1 ? 40 : 0;
    s.top_p = i % 5 == 2 ? 0.9f : 1.0f;
    s.u = u(rng());
  }

  // Structured output: every other row allows a random subset of the tokens (1 to about half), so
  // the pick, top-k and top-p must all stay inside it.
  const int64_t n_words = (vocab + 31) / 32;
  std::vector<uint32_t> masks(static_cast<size_t>(rows * n_words), 0u);
  if (with_masks) {
    for (int64_t i = 0; i < rows; i += 2) {
      uint32_t* m = masks.data() + i * n_words;
      const int64_t n = 1 + std::uniform_int_distribution<int64_t>(0, vocab / 2)(rng());
      for (int64_t k = 0; k < n; ++k) {
        const int64_t t = std::uniform_int_distribution<int64_t>(0, vocab - 1)(rng());
        m[t / 32] |= 1u << (t % 32);
      }
      specs[i].allowed = m;
    }
  }

  // Up to 50 distinct tokens a row, in random order. A repetition below 1 lifts a positive logit
  // above the others, so many sampled tokens are penalised ones, whose log-probability is the raw
  // logit's.
  std::vector<LogitAdjust> adjust;
  if (with_adjust) {
    std::uniform_int_distribution<int64_t> n_entries(0, std::min<int64_t>(50, vocab));
    std::uniform_real_distribution<float> repetition(0.5f, 2.0f), subtract(-1.0f, 1.0f);
    std::vector<int32_t> ids(vocab);
    for (int64_t i = 0; i < rows; ++i) {
      std::iota(ids.begin(), ids.end(), 0);
      const int64_t n = n_entries(rng());
      for (int64_t k = 0; k < n; ++k) {
        std::swap(ids[k], ids[std::uniform_int_distribution<int64_t>(k, vocab - 1)(rng())]);
        adjust.push_back({static_cast<int32_t>(i), ids[k], repetition(rng()), subtract(rng())});
      }
    }
  }

  // Rows that do not ask, and the NaN row, must keep what they held.
  TokenLogprobs sentinel;
  sentinel.logprob = 1.0f;
  sentinel.n_top = -7;
  std::vector<TokenLogprobs> got_lp(rows, sentinel), want_lp(rows, sentinel);
  std::vector<int32_t> got(rows), want(rows);
  b.gpu->sample(l.gpu, specs, adjust, got.data(), with_logprobs ? got_lp.data() : nullptr);
  size_t a = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const size_t first = a;
    while (a < adjust.size() && adjust[a].row == i) ++a;
    std::vector<float> row(logits.begin() + i * vocab, logits.begin() + (i + 1) * vocab);
    want[i] = sample_row(row, specs[i], std::span<const LogitAdjust>(adjust).subspan(first, a - first), &want_lp[i]);
  }

  int agree = 0;
  for (int64_t i = 0; i < rows; ++i) {
    INFO("row " << i << " temperature " << specs[i].temperature << " top_logprobs " << specs[i].top_logprobs);
    if (specs[i].temperature == 0.0f) CHECK(got[i] == want[i]);
    agree += got[i] == want[i];
    const TokenLogprobs& g = got_lp[i];
    const TokenLogprobs& w = want_lp[i];
    if (specs[i].top_logprobs < 0 || want[i] == kNonFiniteLogits) {
      CHECK(g.n_top == sentinel.n_top);
      CHECK(g.logprob == sentinel.logprob);
      continue;
    }
    CHECK(g.n_top == w.n_top);
    for (int j = 0; j < std::min(g.n_top, w.n_top); ++j) {
      CHECK(g.top_ids[j] == w.top_ids[j]);
      CHECK(std::abs(g.top_logprobs[j] - w.top_logprobs[j]) <= logprob_tolerance(w.top_logprobs[j], vocab, kMaxLogit));
    }
    // The sampled token's log-probability, where both drew the same token.
    if (got[i] == want[i]) CHECK(std::abs(g.logprob - w.logprob) <= logprob_tolerance(w.logprob, vocab, kMaxLogit));
  }
  CHECK(got[nan_row] == kNonFiniteLogits);
  for (int64_t i = 0; i < rows; ++i) {
    if (specs[i].allowed != nullptr && i != nan_row) CHECK(((specs[i].allowed[got[i] / 32] >> (got[i] % 32)) & 1u) == 1u);
  }
  // Random draws may differ only where u falls within rounding of a cumulative boundary.
  CHECK(agree >= rows - 1);
}

}  // namespace

TEST_CASE("sample with penalties and log-probabilities matches sample_row", "[gpu]") {
  Backends b;
  check_sample_rows(b, 24, 32000, true, true);
  check_sample_rows(b, 24, 32000, true, false);
  check_sample_rows(b, 24, 32000, false, true);
  // Fewer tokens than alternatives asked for: n_top is the vocabulary.
  check_sample_rows(b, 6, 12, true, true);
  // Structured output's masks, with and without the rest.
  check_sample_rows(b, 24, 32000, true, true, true);
  check_sample_rows(b, 24, 32000, false, false, true);
  check_sample_rows(b, 6, 12, false, true, true);
}
