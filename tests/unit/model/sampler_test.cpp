#include "model/sampler.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <map>
#include <random>

#include "grammar/json_schema.h"

using namespace baton;

TEST_CASE("greedy sampling is argmax with the lowest index on ties", "[sampler]") {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> nd;
  std::vector<float> logits(1000);
  for (float& x : logits) x = nd(rng);
  Sampler s({});
  const int32_t best = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  CHECK(s.sample(logits, 0) == best);
  CHECK(s.sample(logits, 12345) == best);
  CHECK(argmax(std::vector<float>{1, 3, 3, 2}) == 1);
}

TEST_CASE("seeded sampling repeats and follows the softmax", "[sampler]") {
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f, -1.0f};
  SamplingParams p{1.0f, 0, 1.0f, 42};
  Sampler a(p), b(p);
  std::map<int32_t, int> counts;
  const int n = 40000;
  for (int i = 0; i < n; ++i) {
    const int32_t x = a.sample(logits, i);
    REQUIRE(x == b.sample(logits, i));
    ++counts[x];
  }
  double z = 0;
  for (float l : logits) z += std::exp(l);
  for (int i = 0; i < 4; ++i) {
    const double expected = std::exp(logits[i]) / z;
    CHECK(counts[i] / double(n) == Approx(expected).margin(0.01));
  }
}

// Draws n tokens and returns each token's share.
std::map<int32_t, double> shares(Sampler& s, const std::vector<float>& logits, int n) {
  std::map<int32_t, double> out;
  for (int i = 0; i < n; ++i) out[s.sample(logits, i)] += 1.0 / n;
  return out;
}

TEST_CASE("top-k and top-p restrict the candidates and renormalise the softmax over them", "[sampler]") {
  const std::vector<float> logits = {0.0f, 5.0f, 4.9f, 1.0f, -3.0f};
  // Over {1, 2} alone: p(1) = 1 / (1 + e^-0.1) = 0.525, p(2) = 0.475. With n = 20000 draws a share's
  // standard deviation is 0.0035: a margin of 0.02 is 5.7 σ. An argmax-only sampler (always 1),
  // or one that ignores the cut (p(1) = 0.50 over all five) fails.
  const double p1 = 1.0 / (1.0 + std::exp(-0.1));
  const int n = 20000;
  Sampler k2({1.0f, 2, 1.0f, std::random_device{}()});
  auto got = shares(k2, logits, n);
  CHECK(got.size() == 2);
  CHECK(got[1] == Approx(p1).margin(0.02));
  CHECK(got[2] == Approx(1 - p1).margin(0.02));

  // top_k 1 is greedy whatever the temperature.
  Sampler k1({5.0f, 1, 1.0f, 7});
  for (int i = 0; i < 100; ++i) CHECK(k1.sample(logits, i) == 1);

  // At T = 1 the full softmax is p(1) = 0.500, p(2) = 0.452, then 0.037, 0.009, 0.0002: top_p 0.9
  // keeps the smallest prefix reaching 0.9, {1, 2}, renormalised as above.
  Sampler p({1.0f, 0, 0.9f, std::random_device{}()});
  got = shares(p, logits, n);
  CHECK(got.size() == 2);
  CHECK(got[1] == Approx(p1).margin(0.02));
  CHECK(got[2] == Approx(1 - p1).margin(0.02));

  // top_p 0.4 is reached by token 1 alone.
  Sampler p_one({1.0f, 0, 0.4f, std::random_device{}()});
  for (int i = 0; i < 200; ++i) CHECK(p_one.sample(logits, i) == 1);

  // Temperature divides the logits first: at T = 0.1 over {1, 2}, p(1) = 1 / (1 + e^-1) = 0.731.
  Sampler cold({0.1f, 2, 1.0f, std::random_device{}()});
  got = shares(cold, logits, n);
  CHECK(got[1] == Approx(1.0 / (1.0 + std::exp(-1.0))).margin(0.02));
}

TEST_CASE("sampling parameters are validated by name", "[sampler]") {
  CHECK(validate_sampling({}).ok());
  CHECK_THAT(validate_sampling({-1.0f, 0, 1.0f, 0}).message(), Catch::Contains("temperature"));
  CHECK_THAT(validate_sampling({NAN, 0, 1.0f, 0}).message(), Catch::Contains("temperature"));
  CHECK_THAT(validate_sampling({1.0f, -2, 1.0f, 0}).message(), Catch::Contains("top_k"));
  CHECK_THAT(validate_sampling({1.0f, 0, 0.0f, 0}).message(), Catch::Contains("top_p"));
  CHECK_THAT(validate_sampling({1.0f, 0, 1.5f, 0}).message(), Catch::Contains("top_p"));
}

TEST_CASE("a draw depends on the seed and the position only", "[sampler]") {
  std::mt19937_64 rng(std::random_device{}());
  std::normal_distribution<float> nd;
  std::vector<float> logits(50);
  for (float& x : logits) x = nd(rng);
  const SamplingParams p{0.9f, 0, 0.95f, rng()};
  // One process samples positions 100..139; another (a decode worker after a failover) picks
  // up at 120 with a sampler of its own: the same tokens.
  const Sampler whole(p), rest(p);
  for (int64_t pos = 120; pos < 140; ++pos) CHECK(whole.sample(logits, pos) == rest.sample(logits, pos));
  // Neighbouring positions and neighbouring seeds draw unrelated numbers: over 20000 positions
  // the uniforms of (seed, pos), (seed, pos + 1) and (seed + 1, pos) have mean 1/2 (σ 0.002)
  // and pairwise correlation ~0 (σ 0.007); a stream that ignored the position, or that shifted
  // by one draw per position, fails.
  const uint64_t seed = rng();
  const int n = 20000;
  double mean = 0, cov_pos = 0, cov_seed = 0;
  for (int i = 0; i < n; ++i) {
    const double u = sample_uniform(seed, i), u_next = sample_uniform(seed, i + 1), u_seed = sample_uniform(seed + 1, i);
    REQUIRE(u >= 0.0);
    REQUIRE(u < 1.0);
    mean += u / n;
    cov_pos += (u - 0.5) * (u_next - 0.5) / n;
    cov_seed += (u - 0.5) * (u_seed - 0.5) / n;
  }
  CHECK(mean == Approx(0.5).margin(0.015));
  // correlation = cov / (1/12)
  CHECK(std::abs(cov_pos * 12) < 0.05);
  CHECK(std::abs(cov_seed * 12) < 0.05);
  CHECK(sample_uniform(seed, 7) == sample_uniform(seed, 7));
}

TEST_CASE("a row with a NaN or an infinity yields no token, whatever the spec", "[sampler]") {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> nd;
  std::vector<float> logits(300);
  for (float& x : logits) x = nd(rng);
  const SampleSpec greedy{}, sampled{0.8f, 0, 0.95f, 0.5};
  CHECK(sample_logits(logits, greedy) >= 0);
  CHECK(sample_logits(logits, sampled) >= 0);
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    auto row = logits;
    row[rng() % row.size()] = bad;
    CHECK(sample_logits(row, greedy) == kNonFiniteLogits);
    CHECK(sample_logits(row, sampled) == kNonFiniteLogits);
    CHECK_FALSE(all_finite(row));
  }
  CHECK(all_finite(logits));
}

TEST_CASE("a mask limits every kind of draw to the allowed tokens, as sampling only those would", "[sampler]") {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  const int vocab = 1000;
  for (int round = 0; round < 300; ++round) {
    std::vector<float> logits(vocab);
    for (float& x : logits) x = nd(rng);
    std::vector<uint32_t> mask((vocab + 31) / 32, 0u);
    std::vector<int32_t> allowed_ids;
    const int n = 1 + static_cast<int>(rng() % 60);
    for (int k = 0; k < n; ++k) {
      const int t = static_cast<int>(rng() % vocab);
      mask[t / 32] |= 1u << (t % 32);
    }
    std::vector<float> kept;  // the reference: the allowed logits alone, in index order
    for (int t = 0; t < vocab; ++t) {
      if ((mask[t / 32] >> (t % 32)) & 1u) {
        allowed_ids.push_back(t);
        kept.push_back(logits[t]);
      }
    }
    SampleSpec spec;
    spec.temperature = round % 4 == 0 ? 0.0f : 0.5f + static_cast<float>(round % 3);
    spec.top_k = round % 5 == 1 ? 5 : (round % 5 == 2 ? 500 : 0);
    spec.top_p = round % 7 == 3 ? 0.8f : 1.0f;
    spec.u = ud(rng);
    spec.top_logprobs = 3;
    const int32_t want = allowed_ids[static_cast<size_t>(sample_logits(kept, spec))];
    std::vector<float> row = logits;
    spec.allowed = mask.data();
    TokenLogprobs lp;
    INFO("round " << round << " temperature " << spec.temperature << " top_k " << spec.top_k);
    REQUIRE(sample_row(row, spec, {}, &lp) == want);
    // Log-probabilities are the raw row's, the mask notwithstanding.
    TokenLogprobs raw;
    token_logprobs(logits, want, 3, &raw);
    CHECK(lp.logprob == Approx(raw.logprob));
    CHECK(lp.top_ids[0] == raw.top_ids[0]);
  }
  // A NaN still fails the step under a mask.
  std::vector<float> bad(64, 0.0f);
  bad[5] = NAN;
  std::vector<uint32_t> mask(2, 0u);
  mask[0] = 1u;
  SampleSpec spec;
  spec.allowed = mask.data();
  CHECK(sample_row(bad, spec, {}, nullptr) == kNonFiniteLogits);
}

TEST_CASE("a constrained sampler's grammar follows its output, and set_history rebuilds it after a failover",
          "[sampler]") {
  std::vector<std::string> bytes;
  for (int b = 0; b < 256; ++b) bytes.emplace_back(1, static_cast<char>(b));
  for (const char* piece : {"{\"", "\":", "true", "}", " "}) bytes.emplace_back(piece);
  bytes.emplace_back();  // the stop token
  const auto stop = static_cast<int32_t>(bytes.size() - 1);
  auto vocab = grammar::TokenVocabulary::create(bytes, {stop});
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = std::random_device{}();
  p.constraint = std::make_shared<grammar::TokenConstraint>(grammar::json_object_grammar(), vocab);
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> nd;
  Sampler live(p);
  std::vector<int32_t> out;
  for (int pos = 0; pos < 200; ++pos) {
    std::vector<float> logits(bytes.size());
    for (float& x : logits) x = nd(rng);
    const int32_t t = live.sample(logits, pos);
    const uint32_t* allowed = live.spec_at(pos).allowed;
    REQUIRE(allowed != nullptr);
    REQUIRE(((allowed[t / 32] >> (t % 32)) & 1u) == 1u);
    // A worker taking over from here gets the output so far and must allow what this one does.
    Sampler taken_over(p);
    taken_over.set_history({}, out);
    REQUIRE(taken_over.spec_at(pos).allowed == allowed);
    if (t == stop) break;
    out.push_back(t);
    live.observe(t);
  }
  std::string text;
  for (int32_t t : out) text += bytes[static_cast<size_t>(t)];
  INFO(text);
  CHECK((text.empty() || text.find('{') != std::string::npos));
}
