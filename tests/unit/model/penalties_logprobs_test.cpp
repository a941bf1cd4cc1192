// The sampling penalties and log-probabilities against definitions written out here from their
// sources: OpenAI's (logit -= frequency_penalty · count + presence_penalty · [count > 0], over the
// output) and Hugging Face's repetition penalty (a positive logit divided by it, a negative one
// multiplied, over prompt and output, first); log-probabilities are log_softmax of the raw logits.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "kernels/sampling.h"
#include "model/sampler.h"

using namespace baton;

namespace {

std::mt19937& rng() {
  static std::mt19937 r(std::random_device{}());
  return r;
}

std::vector<float> random_logits(int n) {
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = nd(rng());
  return v;
}

std::vector<int32_t> random_tokens(int n, int vocab) {
  // Few distinct ids, so that tokens repeat and counts exceed one.
  std::uniform_int_distribution<int32_t> id(0, std::max(1, vocab / 8));
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int32_t& t : v) t = id(rng());
  return v;
}

// The penalised logits as the definitions state them, in double.
std::vector<double> penalised(const std::vector<float>& logits, const std::vector<int32_t>& prompt,
                              const std::vector<int32_t>& output, const SamplingParams& p) {
  std::map<int32_t, int> count;
  for (int32_t t : output) ++count[t];
  std::set<int32_t> seen(prompt.begin(), prompt.end());
  seen.insert(output.begin(), output.end());
  std::vector<double> out(logits.begin(), logits.end());
  for (int32_t t : seen) {
    double& l = out[static_cast<size_t>(t)];
    l = l < 0 ? l * p.repetition_penalty : l / p.repetition_penalty;
  }
  for (const auto& [t, c] : count) {
    out[static_cast<size_t>(t)] -= static_cast<double>(p.frequency_penalty) * c + p.presence_penalty;
  }
  return out;
}

SamplingParams random_penalties() {
  std::uniform_real_distribution<float> pen(-2.0f, 2.0f), rep(0.5f, 3.0f);
  SamplingParams p;
  p.presence_penalty = pen(rng());
  p.frequency_penalty = pen(rng());
  p.repetition_penalty = rep(rng());
  return p;
}

}  // namespace

TEST_CASE("penalties: greedy picks the argmax of the penalised logits", "[sampler][penalties]") {
  for (int round = 0; round < 200; ++round) {
    const int vocab = 50 + static_cast<int>(rng()() % 500);
    const std::vector<float> logits = random_logits(vocab);
    const auto prompt = random_tokens(static_cast<int>(rng()() % 40), vocab);
    const auto output = random_tokens(static_cast<int>(rng()() % 40), vocab);
    SamplingParams p = random_penalties();
    Sampler s(p);
    s.set_history(prompt, output);
    const std::vector<double> want = penalised(logits, prompt, output, p);
    const auto best = static_cast<int32_t>(std::max_element(want.begin(), want.end()) - want.begin());
    const int32_t got = s.sample(logits, 0);
    // A different pick may only be a tie within float rounding of the penalised values.
    INFO("round " << round << " got " << got << " want " << best);
    CHECK(want[static_cast<size_t>(got)] >= want[static_cast<size_t>(best)] - 1e-5 * (1 + std::fabs(want[static_cast<size_t>(best)])));
  }
}

TEST_CASE("penalties: sampling follows the softmax of the penalised logits exactly", "[sampler][penalties]") {
  // For a fixed u the pick is the inverse CDF (tokens by penalised logit, descending) at u: any u
  // not within rounding of a boundary must give the reference's token.
  for (int round = 0; round < 40; ++round) {
    const int vocab = 20 + static_cast<int>(rng()() % 200);
    const std::vector<float> logits = random_logits(vocab);
    const auto prompt = random_tokens(static_cast<int>(rng()() % 30), vocab);
    const auto output = random_tokens(1 + static_cast<int>(rng()() % 30), vocab);
    SamplingParams p = random_penalties();
    p.temperature = std::uniform_real_distribution<float>(0.3f, 1.5f)(rng());
    const std::vector<double> adj = penalised(logits, prompt, output, p);
    std::vector<int32_t> order(static_cast<size_t>(vocab));
    for (int i = 0; i < vocab; ++i) order[static_cast<size_t>(i)] = i;
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return adj[a] > adj[b]; });
    std::vector<double> cdf;
    double total = 0;
    for (int32_t t : order) {
      total += std::exp((adj[t] - adj[order[0]]) / p.temperature);
      cdf.push_back(total);
    }
    Sampler s(p);
    s.set_history(prompt, {});
    for (int32_t t : output) s.observe(t);  // observed one by one: the same history
    std::vector<float> row;
    std::vector<LogitAdjust> adjust;
    s.adjustments(0, &adjust);
    for (int i = 0; i < 300; ++i) {
      SampleSpec spec = s.spec_at(i);
      row = logits;
      const int32_t got = sample_row(row, spec, adjust, nullptr);
      const double r = spec.u * total;
      const size_t k = static_cast<size_t>(std::upper_bound(cdf.begin(), cdf.end(), r) - cdf.begin());
      const double gap = std::min(std::fabs(r - (k > 0 ? cdf[k - 1] : 0.0)), std::fabs(cdf[std::min(k, cdf.size() - 1)] - r));
      if (gap < 1e-6 * total) continue;  // within rounding of a boundary
      INFO("round " << round << " draw " << i << " u " << spec.u);
      REQUIRE(got == order[std::min(k, order.size() - 1)]);
    }
  }
}

TEST_CASE("penalties: the history set at once equals the history observed token by token", "[sampler][penalties]") {
  const int vocab = 300;
  const auto prompt = random_tokens(50, vocab);
  const auto output = random_tokens(60, vocab);
  const SamplingParams p = random_penalties();
  const size_t k = rng()() % output.size();
  Sampler resumed(p), live(p);
  // After a failover the worker learns the first k outputs at once; the live one saw each.
  resumed.set_history(prompt, std::vector<int32_t>(output.begin(), output.begin() + static_cast<std::ptrdiff_t>(k)));
  live.set_history(prompt, {});
  for (size_t i = 0; i < output.size(); ++i) {
    if (i >= k) resumed.observe(output[i]);
    live.observe(output[i]);
  }
  std::vector<LogitAdjust> a, b;
  resumed.adjustments(3, &a);
  live.adjustments(3, &b);
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].row == 3);
    CHECK(a[i].token == b[i].token);
    CHECK(a[i].repetition == b[i].repetition);
    CHECK(a[i].subtract == b[i].subtract);
  }
  // No penalty, no entries (and no history kept).
  Sampler none(SamplingParams{});
  none.set_history(prompt, output);
  std::vector<LogitAdjust> c;
  none.adjustments(0, &c);
  CHECK(c.empty());
}

TEST_CASE("log-probabilities are log_softmax of the raw logits, whatever temperature, top-k/p and penalties do",
          "[sampler][logprobs]") {
  for (int round = 0; round < 100; ++round) {
    const int vocab = 30 + static_cast<int>(rng()() % 3000);
    const std::vector<float> logits = random_logits(vocab);
    SamplingParams p = random_penalties();
    p.temperature = round % 3 == 0 ? 0.0f : std::uniform_real_distribution<float>(0.2f, 2.0f)(rng());
    p.top_k = static_cast<int>(rng()() % 50);
    p.top_p = std::uniform_real_distribution<float>(0.1f, 1.0f)(rng());
    p.top_logprobs = static_cast<int>(rng()() % 21);
    Sampler s(p);
    s.set_history(random_tokens(20, vocab), random_tokens(20, vocab));
    TokenLogprobs lp;
    const int32_t token = s.sample(logits, round, &lp);
    REQUIRE(token >= 0);
    // The reference: log_softmax in long double.
    long double mx = *std::max_element(logits.begin(), logits.end()), sum = 0;
    for (float l : logits) sum += std::exp(static_cast<long double>(l) - mx);
    const long double lse = mx + std::log(sum);
    auto ref = [&](int32_t t) { return static_cast<double>(logits[static_cast<size_t>(t)] - lse); };
    // A float's rounding of a value of this size, plus the sum's.
    auto tol = [](double v) { return 1e-6 * (1 + std::fabs(v)); };
    INFO("round " << round << " vocab " << vocab << " token " << token);
    CHECK(std::fabs(lp.logprob - ref(token)) <= tol(ref(token)));
    REQUIRE(lp.n_top == std::min(p.top_logprobs, vocab));
    std::vector<int32_t> by_logit(static_cast<size_t>(vocab));
    for (int i = 0; i < vocab; ++i) by_logit[static_cast<size_t>(i)] = i;
    std::stable_sort(by_logit.begin(), by_logit.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
    for (int k = 0; k < lp.n_top; ++k) {
      CHECK(lp.top_ids[k] == by_logit[static_cast<size_t>(k)]);
      CHECK(std::fabs(lp.top_logprobs[k] - ref(by_logit[static_cast<size_t>(k)])) <= tol(ref(by_logit[static_cast<size_t>(k)])));
    }
  }
}

TEST_CASE("penalties and top_logprobs are validated by name", "[sampler][penalties]") {
  auto message = [](auto set) {
    SamplingParams p;
    set(p);
    return validate_sampling(p).message();
  };
  CHECK_THAT(message([](SamplingParams& p) { p.presence_penalty = 2.5f; }), Catch::StartsWith("presence_penalty"));
  CHECK_THAT(message([](SamplingParams& p) { p.frequency_penalty = NAN; }), Catch::StartsWith("frequency_penalty"));
  CHECK_THAT(message([](SamplingParams& p) { p.repetition_penalty = 0.0f; }), Catch::StartsWith("repetition_penalty"));
  CHECK_THAT(message([](SamplingParams& p) { p.repetition_penalty = INFINITY; }), Catch::StartsWith("repetition_penalty"));
  CHECK_THAT(message([](SamplingParams& p) { p.top_logprobs = 21; }), Catch::StartsWith("top_logprobs"));
  CHECK_THAT(message([](SamplingParams& p) { p.top_logprobs = -2; }), Catch::StartsWith("top_logprobs"));
  SamplingParams ok;
  ok.presence_penalty = -2.0f;
  ok.frequency_penalty = 2.0f;
  ok.repetition_penalty = 1.3f;
  ok.top_logprobs = 20;
  CHECK(validate_sampling(ok).ok());
}
