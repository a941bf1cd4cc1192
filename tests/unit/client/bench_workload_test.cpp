// client/bench_workload.h: the chat workload against a model of what it must send (system
// prompt, then every earlier user message and answer, then the new message), driven in a random
// order of conversations with random answers; the random workload's counts and id range.
#include "client/bench_workload.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <map>
#include <random>

namespace baton::ctl {
namespace {

std::vector<int32_t> random_ids(std::mt19937_64& rng, int n) {
  std::vector<int32_t> ids(n);
  for (int32_t& id : ids) id = std::uniform_int_distribution<int32_t>(0, 50000)(rng);
  return ids;
}

bool starts_with(const std::vector<int32_t>& v, const std::vector<int32_t>& prefix) {
  return v.size() >= prefix.size() && std::equal(prefix.begin(), prefix.end(), v.begin());
}

TEST_CASE("chat turns send the whole history after one shared system prompt") {
  std::mt19937_64 rng(std::random_device{}());
  for (int trial = 0; trial < 50; ++trial) {
    ChatWorkloadConfig c;
    c.conversations = std::uniform_int_distribution<int>(1, 6)(rng);
    c.turns = std::uniform_int_distribution<int>(1, 5)(rng);
    c.system_prompt_tokens = std::uniform_int_distribution<int>(0, 40)(rng);
    c.prompt_tokens = std::uniform_int_distribution<int>(1, 20)(rng);
    c.vocab_size = std::uniform_int_distribution<int>(kMinPromptId + 1, 5000)(rng);
    c.seed = rng();
    auto w = make_chat_workload(c);

    // What each conversation sent last, and the answers it got; conversations advance in a random order.
    std::map<int, WorkloadTurn> latest;
    std::map<int, std::vector<int32_t>> last_answer;
    std::vector<int32_t> system;
    int n_sent = 0;
    std::vector<int> live;
    auto check_ids = [&](const std::vector<int32_t>& ids) {
      for (int32_t id : ids) {
        REQUIRE(id >= kMinPromptId);
        REQUIRE(id < c.vocab_size);
      }
    };
    for (;;) {
      const bool start = live.empty() || std::uniform_int_distribution<int>(0, 2)(rng) == 0;
      if (start) {
        std::optional<WorkloadTurn> t = w->start_conversation();
        if (!t) {
          if (live.empty()) break;
          continue;
        }
        ++n_sent;
        CHECK(t->turn == 0);
        CHECK(t->conversation == static_cast<int>(latest.size()));
        REQUIRE(t->prompt_ids.size() == static_cast<size_t>(c.system_prompt_tokens + c.prompt_tokens));
        check_ids(t->prompt_ids);
        const std::vector<int32_t> sys(t->prompt_ids.begin(), t->prompt_ids.begin() + c.system_prompt_tokens);
        if (latest.empty()) system = sys;
        CHECK(sys == system);  // identical across conversations
        latest[t->conversation] = *t;
        live.push_back(t->conversation);
        continue;
      }
      const size_t pick = std::uniform_int_distribution<size_t>(0, live.size() - 1)(rng);
      const int conv = live[pick];
      const std::vector<int32_t> answer = random_ids(rng, std::uniform_int_distribution<int>(0, 12)(rng));
      std::optional<WorkloadTurn> t = w->next_turn(conv, answer);
      const WorkloadTurn& before = latest[conv];
      if (before.turn + 1 == c.turns) {
        CHECK(!t);
        live.erase(live.begin() + static_cast<long>(pick));
        continue;
      }
      REQUIRE(t);
      ++n_sent;
      CHECK(t->conversation == conv);
      CHECK(t->turn == before.turn + 1);
      // previous prompt + its answer + a new user message of prompt_tokens ids.
      std::vector<int32_t> expected_prefix = before.prompt_ids;
      expected_prefix.insert(expected_prefix.end(), answer.begin(), answer.end());
      CHECK(starts_with(t->prompt_ids, expected_prefix));
      REQUIRE(t->prompt_ids.size() == expected_prefix.size() + c.prompt_tokens);
      check_ids(
          std::vector<int32_t>(t->prompt_ids.begin() + static_cast<long>(expected_prefix.size()), t->prompt_ids.end()));
      latest[conv] = *t;
    }
    CHECK(n_sent == c.conversations * c.turns);
    CHECK(static_cast<int>(latest.size()) == c.conversations);
  }
}

TEST_CASE("chat user messages depend on the seed and the conversation, not on the order of turns") {
  ChatWorkloadConfig c{3, 2, 8, 6, 1000, 42};
  auto a = make_chat_workload(c);
  auto b = make_chat_workload(c);
  const std::vector<int32_t> answer = {500, 501};
  std::vector<WorkloadTurn> first_a, first_b;
  for (int i = 0; i < 3; ++i) first_a.push_back(*a->start_conversation());
  for (int i = 0; i < 3; ++i) first_b.push_back(*b->start_conversation());
  // Advance a's conversations 2, 0, 1 and b's 0, 1, 2.
  const std::vector<int32_t> a2 = a->next_turn(2, answer)->prompt_ids;
  const std::vector<int32_t> a0 = a->next_turn(0, answer)->prompt_ids;
  CHECK(b->next_turn(0, answer)->prompt_ids == a0);
  b->next_turn(1, answer);
  CHECK(b->next_turn(2, answer)->prompt_ids == a2);
  CHECK(first_a[0].prompt_ids != first_a[1].prompt_ids);  // conversations' user messages differ
  c.seed = 43;
  CHECK(make_chat_workload(c)->start_conversation()->prompt_ids != first_a[0].prompt_ids);
  CHECK(chat_longest_prompt(ChatWorkloadConfig{3, 4, 10, 5, 1000, 0}, 7) == 10 + 4 * 5 + 3 * 7);
}

TEST_CASE("random workload: n one-turn requests of prompt_tokens ids from kMinPromptId up to the vocabulary") {
  std::mt19937_64 rng(std::random_device{}());
  const int n = std::uniform_int_distribution<int>(0, 30)(rng);
  const int vocab = std::uniform_int_distribution<int>(kMinPromptId + 1, 300)(rng);
  auto w = make_random_workload(RandomWorkloadConfig{n, 17, vocab, rng()});
  for (int i = 0; i < n; ++i) {
    std::optional<WorkloadTurn> t = w->start_conversation();
    REQUIRE(t);
    CHECK(t->conversation == i);
    CHECK(t->turn == 0);
    REQUIRE(t->prompt_ids.size() == 17);
    for (int32_t id : t->prompt_ids) CHECK((id >= kMinPromptId && id < vocab));
    CHECK(!w->next_turn(i, {1, 2, 3}));
  }
  CHECK(!w->start_conversation());
  auto unbounded = make_random_workload(RandomWorkloadConfig{-1, 3, vocab, 1});
  for (int i = 0; i < 1000; ++i) REQUIRE(unbounded->start_conversation());
}

TEST_CASE("random workload, mixed: a share of the prompts long, drawn from the seed") {
  std::mt19937_64 rng(std::random_device{}());
  const double fraction = std::uniform_real_distribution<double>(0.1, 0.9)(rng);
  const uint64_t seed = rng();
  const auto lengths = [&] {
    auto w = make_random_workload(RandomWorkloadConfig{2000, 16, 1000, seed, 200, fraction});
    std::vector<size_t> out;
    while (auto t = w->start_conversation()) out.push_back(t->prompt_ids.size());
    return out;
  };
  const std::vector<size_t> a = lengths();
  REQUIRE(a.size() == 2000);
  const auto n_long = std::count(a.begin(), a.end(), size_t{200});
  CHECK(std::count(a.begin(), a.end(), size_t{16}) + n_long == 2000);
  // Binomial(2000, f): within 5 standard deviations.
  const double sd = std::sqrt(2000 * fraction * (1 - fraction));
  CHECK(std::abs(static_cast<double>(n_long) - 2000 * fraction) < 5 * sd);
  CHECK(lengths() == a);  // the same seed, the same mix
}

}  // namespace
}  // namespace baton::ctl
