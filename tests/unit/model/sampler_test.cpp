#include "model/sampler.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <map>
#include <random>

using namespace baton;

TEST_CASE("greedy sampling is argmax with the lowest index on ties", "[sampler]") {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> nd;
  std::vector<float> logits(1000);
  for (float& x : logits) x = nd(rng);
  Sampler s({});
  const int32_t best = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  CHECK(s.sample(logits) == best);
  CHECK(argmax(std::vector<float>{1, 3, 3, 2}) == 1);
}

TEST_CASE("seeded sampling repeats and follows the softmax", "[sampler]") {
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f, -1.0f};
  SamplingParams p{1.0f, 0, 1.0f, 42};
  Sampler a(p), b(p);
  std::map<int32_t, int> counts;
  const int n = 40000;
  for (int i = 0; i < n; ++i) {
    const int32_t x = a.sample(logits);
    REQUIRE(x == b.sample(logits));
    ++counts[x];
  }
  double z = 0;
  for (float l : logits) z += std::exp(l);
  for (int i = 0; i < 4; ++i) {
    const double expected = std::exp(logits[i]) / z;
    CHECK(counts[i] / double(n) == Approx(expected).margin(0.01));
  }
}

TEST_CASE("top-k and top-p restrict the candidates", "[sampler]") {
  const std::vector<float> logits = {0.0f, 5.0f, 4.9f, 1.0f, -3.0f};
  Sampler k2({1.0f, 2, 1.0f, std::random_device{}()});
  for (int i = 0; i < 2000; ++i) {
    const int32_t x = k2.sample(logits);
    CHECK((x == 1 || x == 2));
  }
  Sampler k1({5.0f, 1, 1.0f, 7});
  for (int i = 0; i < 100; ++i) CHECK(k1.sample(logits) == 1);
  // p(1) ≈ 0.50, p(2) ≈ 0.45 at T=1: top_p 0.5 keeps token 1 (and maybe 2), never the tail.
  Sampler p({1.0f, 0, 0.9f, std::random_device{}()});
  for (int i = 0; i < 2000; ++i) {
    const int32_t x = p.sample(logits);
    CHECK((x == 1 || x == 2));
  }
}

TEST_CASE("sampling parameters are validated by name", "[sampler]") {
  CHECK(validate_sampling({}).ok());
  CHECK_THAT(validate_sampling({-1.0f, 0, 1.0f, 0}).message(), Catch::Contains("temperature"));
  CHECK_THAT(validate_sampling({NAN, 0, 1.0f, 0}).message(), Catch::Contains("temperature"));
  CHECK_THAT(validate_sampling({1.0f, -2, 1.0f, 0}).message(), Catch::Contains("top_k"));
  CHECK_THAT(validate_sampling({1.0f, 0, 0.0f, 0}).message(), Catch::Contains("top_p"));
  CHECK_THAT(validate_sampling({1.0f, 0, 1.5f, 0}).message(), Catch::Contains("top_p"));
}

TEST_CASE("skip continues the random stream where a previous sampler left it", "[sampler]") {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> nd;
  std::vector<float> logits(50);
  for (float& x : logits) x = nd(rng);
  const SamplingParams p{0.9f, 0, 0.95f, rng()};
  Sampler whole(p);
  std::vector<int32_t> expected;
  for (int i = 0; i < 20; ++i) expected.push_back(whole.sample(logits));
  Sampler first(p);
  std::vector<int32_t> got = {first.sample(logits)};
  Sampler rest(p);
  rest.skip(1);
  for (int i = 1; i < 20; ++i) got.push_back(rest.sample(logits));
  CHECK(got == expected);
}
