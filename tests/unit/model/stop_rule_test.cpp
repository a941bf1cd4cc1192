#include "model/stop_rule.h"

#include <catch2/catch.hpp>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "model/token_checks.h"

using namespace baton;

namespace {

uint32_t test_seed() {
  const char* env = std::getenv("BATON_TEST_SEED");
  const uint32_t seed = env != nullptr ? static_cast<uint32_t>(std::strtoul(env, nullptr, 10)) : std::random_device{}();
  std::printf("stop_rule_test seed %u (rerun with BATON_TEST_SEED=%u)\n", seed, seed);
  return seed;
}

bool naive_is_stop(const std::vector<int32_t>& stop_ids, int32_t id) {
  for (int32_t s : stop_ids) {
    if (s == id) return true;
  }
  return false;
}

// How the decode engine decided before StopRule: the stop id first, then the length.
FinishReason naive_after(const std::vector<int32_t>& stop_ids, bool ignore_eos, int64_t max_tokens, int32_t id,
                         int64_t n_generated) {
  if (!ignore_eos && naive_is_stop(stop_ids, id)) return FinishReason::kStop;
  if (n_generated >= max_tokens) return FinishReason::kLength;
  return FinishReason::kNone;
}

// How the request pipeline cut offered ids before StopRule: up to max_tokens, then at the first
// stop id.
StopRule::Taken naive_take(const std::vector<int32_t>& stop_ids, bool ignore_eos, int64_t max_tokens,
                           const std::vector<int32_t>& ids, int64_t n_before) {
  size_t n = std::min(static_cast<size_t>(max_tokens - n_before), ids.size());
  if (!ignore_eos) {
    for (size_t i = 0; i < n; ++i) {
      if (naive_is_stop(stop_ids, ids[i])) return {i + 1, FinishReason::kStop};
    }
  }
  return {n, n_before + static_cast<int64_t>(n) >= max_tokens ? FinishReason::kLength : FinishReason::kNone};
}

ModelConfig config_with(int n_vocab, int n_ctx) {
  ModelConfig c;
  c.n_vocab = n_vocab;
  c.n_ctx = n_ctx;
  return c;
}

}  // namespace

TEST_CASE("finish reasons have the API's names", "[stop_rule]") {
  CHECK(std::string(finish_reason_name(FinishReason::kStop)) == "stop");
  CHECK(std::string(finish_reason_name(FinishReason::kLength)) == "length");
  CHECK(std::string(finish_reason_name(FinishReason::kNone)).empty());
}

TEST_CASE("a stop id ends generation unless ignore_eos, and max_tokens ends it at length", "[stop_rule]") {
  std::mt19937 rng(test_seed());
  const std::vector<int32_t> stop_ids = {2, 7};
  const int64_t max_tokens = 5 + static_cast<int64_t>(rng() % 50);
  StopRule rule{stop_ids, false, max_tokens};
  CHECK(rule.is_stop(2));
  CHECK(rule.is_stop(7));
  CHECK_FALSE(rule.is_stop(3));
  CHECK(rule.after(7, 1) == FinishReason::kStop);
  CHECK(rule.after(3, 1) == FinishReason::kNone);
  CHECK(rule.after(3, max_tokens - 1) == FinishReason::kNone);
  CHECK(rule.after(3, max_tokens) == FinishReason::kLength);
  // The stop id as the max_tokens-th token: "stop", as the decode engine has always said.
  CHECK(rule.after(2, max_tokens) == FinishReason::kStop);

  rule.ignore_eos = true;
  CHECK_FALSE(rule.is_stop(2));
  CHECK(rule.after(2, 1) == FinishReason::kNone);
  CHECK(rule.after(2, max_tokens) == FinishReason::kLength);

  const StopRule no_stop_ids{{}, false, max_tokens};
  CHECK(no_stop_ids.after(2, 1) == FinishReason::kNone);
}

TEST_CASE("take keeps ids up to max_tokens and up to the first stop id, that id included", "[stop_rule]") {
  const std::vector<int32_t> stop_ids = {0};
  const StopRule rule{stop_ids, false, 10};
  auto take = [&](std::vector<int32_t> ids, int64_t n_before) { return rule.take(ids, n_before); };

  // Nothing ends: everything is kept.
  StopRule::Taken t = take({5, 6, 7}, 2);
  CHECK(t.n == 3);
  CHECK(t.end == FinishReason::kNone);
  // At the first stop id, which is kept; the second one is not reached.
  t = take({5, 0, 6, 0}, 2);
  CHECK(t.n == 2);
  CHECK(t.end == FinishReason::kStop);
  // Cut at max_tokens: a stop id past it does not count.
  t = take({5, 6, 7, 0}, 7);
  CHECK(t.n == 3);
  CHECK(t.end == FinishReason::kLength);
  // Exactly reaching max_tokens.
  t = take({5, 6, 7}, 7);
  CHECK(t.n == 3);
  CHECK(t.end == FinishReason::kLength);
  // A stop id as the max_tokens-th token: kept, and "stop".
  t = take({5, 6, 0, 8}, 7);
  CHECK(t.n == 3);
  CHECK(t.end == FinishReason::kStop);
  // Already at max_tokens: nothing more is kept.
  t = take({5}, 10);
  CHECK(t.n == 0);
  CHECK(t.end == FinishReason::kLength);
  t = take({}, 3);
  CHECK(t.n == 0);
  CHECK(t.end == FinishReason::kNone);
  // ignore_eos: stop ids are ordinary tokens.
  const StopRule ignoring{stop_ids, true, 10};
  t = ignoring.take(std::vector<int32_t>{0, 0, 0}, 2);
  CHECK(t.n == 3);
  CHECK(t.end == FinishReason::kNone);
}

TEST_CASE("take over any split of a stream ends where generating it token by token ends", "[stop_rule]") {
  std::mt19937 rng(test_seed());
  for (int round = 0; round < 2000; ++round) {
    // A small vocabulary, so stop ids come up often; sometimes none at all.
    const int32_t n_vocab = 2 + static_cast<int32_t>(rng() % 20);
    std::vector<int32_t> stop_ids;
    for (int i = static_cast<int>(rng() % 3); i > 0; --i) stop_ids.push_back(static_cast<int32_t>(rng() % n_vocab));
    const bool ignore_eos = rng() % 4 == 0;
    const int64_t max_tokens = 1 + static_cast<int64_t>(rng() % 40);
    std::vector<int32_t> stream(static_cast<size_t>(rng() % 60));
    for (int32_t& id : stream) id = static_cast<int32_t>(rng() % n_vocab);
    const StopRule rule{stop_ids, ignore_eos, max_tokens};
    INFO("round " << round << ", max_tokens " << max_tokens << ", ignore_eos " << ignore_eos);

    // Token by token, as the decode engine and the generator go, against the old engine's test.
    size_t n_want = stream.size();
    FinishReason want = FinishReason::kNone;
    for (size_t i = 0; i < stream.size(); ++i) {
      const FinishReason end = rule.after(stream[i], static_cast<int64_t>(i) + 1);
      REQUIRE(end == naive_after(stop_ids, ignore_eos, max_tokens, stream[i], static_cast<int64_t>(i) + 1));
      if (end != FinishReason::kNone) {
        n_want = i + 1;
        want = end;
        break;
      }
    }

    // In random pieces, as the pipeline receives them, against the old pipeline's cut.
    size_t n_kept = 0;
    FinishReason got = FinishReason::kNone;
    while (got == FinishReason::kNone && n_kept < stream.size()) {
      const size_t n_piece = 1 + rng() % (stream.size() - n_kept);
      const std::vector<int32_t> piece(stream.begin() + static_cast<std::ptrdiff_t>(n_kept),
                                       stream.begin() + static_cast<std::ptrdiff_t>(n_kept + n_piece));
      const StopRule::Taken t = rule.take(piece, static_cast<int64_t>(n_kept));
      const StopRule::Taken naive = naive_take(stop_ids, ignore_eos, max_tokens, piece, static_cast<int64_t>(n_kept));
      REQUIRE(t.n == naive.n);
      REQUIRE(t.end == naive.end);
      REQUIRE(t.n <= piece.size());
      n_kept += t.n;
      got = t.end;
    }
    CHECK(n_kept == n_want);
    CHECK(got == want);
  }
}

TEST_CASE("token ids outside the vocabulary are refused, the first one named", "[token_checks]") {
  std::mt19937 rng(test_seed());
  const int n_vocab = 2 + static_cast<int>(rng() % 1000);
  const ModelConfig model = config_with(n_vocab, 1024);
  std::vector<int32_t> ids(1 + rng() % 50);
  for (int32_t& id : ids) id = static_cast<int32_t>(rng() % n_vocab);
  CHECK(check_token_ids(ids, model, "prompt_token_ids").ok());
  CHECK(check_token_ids({}, model, "prompt_token_ids").ok());
  CHECK(check_token_id(0, model, "first_token").ok());
  CHECK(check_token_id(n_vocab - 1, model, "first_token").ok());

  // One bad id at a random place (and maybe another after it): the first is the one named.
  const size_t at = rng() % ids.size();
  const int32_t bad = rng() % 2 == 0 ? -1 - static_cast<int32_t>(rng() % 5) : n_vocab + static_cast<int32_t>(rng() % 5);
  ids[at] = bad;
  if (at + 1 < ids.size()) ids.back() = n_vocab;
  const Status st = check_token_ids(ids, model, "prompt_token_ids");
  CHECK(st.code() == StatusCode::kInvalidArgument);
  const std::string vocab = "[0, " + std::to_string(n_vocab) + ")";
  CHECK_THAT(st.message(), Catch::StartsWith("prompt_token_ids[" + std::to_string(at) + "] = " + std::to_string(bad)));
  CHECK_THAT(st.message(), Catch::Contains("outside the vocabulary " + vocab));

  const Status one = check_token_id(n_vocab, model, "first_token");
  CHECK(one.code() == StatusCode::kInvalidArgument);
  CHECK(one.message() == "first_token = " + std::to_string(n_vocab) + " is outside the vocabulary " + vocab);
  CHECK(check_token_id(-1, model, "first_token").code() == StatusCode::kInvalidArgument);
}

TEST_CASE("the positions a request occupies must fit the model's context", "[token_checks]") {
  std::mt19937 rng(test_seed());
  const int n_ctx = 1 + static_cast<int>(rng() % 4096);
  const ModelConfig model = config_with(100, n_ctx);
  CHECK(check_context(n_ctx, model, "prompt (1 tokens) + max_tokens (1)").ok());
  CHECK(check_context(1 + static_cast<int64_t>(rng() % n_ctx), model, "x").ok());
  const int64_t over = n_ctx + 1 + static_cast<int64_t>(rng() % 100);
  const Status st = check_context(over, model, "max_tokens (9) + prompt (3 tokens)");
  CHECK(st.code() == StatusCode::kInvalidArgument);
  // `what` leads, so a field name there names the field to the client.
  CHECK_THAT(st.message(), Catch::StartsWith("max_tokens (9) + prompt (3 tokens): " + std::to_string(over)));
  CHECK_THAT(st.message(), Catch::Contains("context of " + std::to_string(n_ctx)));
}
