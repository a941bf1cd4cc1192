// The n choices of one prompt through the request pipeline (scheduler/choice_group.h), against the
// fake workers of pipeline_world.h: the prompt is prefilled once, the other choices fork its KV on
// the leader's decode worker, and every way the leader or a fork can fail still streams each
// choice's whole output once and leaves nothing behind.
#include "scheduler/choice_group.h"

#include <catch2/catch.hpp>
#include <memory>
#include <random>

#include "scheduler/request_pipeline.h"
#include "tests/unit/scheduler/pipeline_world.h"

using namespace baton;
using namespace baton::scheduler_test;
using namespace baton::pipeline_test;

namespace {

struct Group {
  std::vector<std::shared_ptr<RecordingSink>> sinks;
  std::vector<std::shared_ptr<RequestPipeline>> pipelines;
  std::vector<int32_t> ref;
};

// n choices of `prompt`, started in a random order (a follower may start before its leader).
Group start_group(World& w, std::mt19937& rng, const std::vector<int32_t>& prompt, int n, int32_t max_tokens,
                  bool ignore_eos = false) {
  Group g;
  g.ref = reference(prompt, max_tokens, ignore_eos);
  auto group = std::make_shared<ChoiceGroup>(n);
  std::vector<int> order(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  std::shuffle(order.begin(), order.end(), rng);
  g.sinks.resize(static_cast<size_t>(n));
  g.pipelines.resize(static_cast<size_t>(n));
  for (int c : order) {
    g.sinks[static_cast<size_t>(c)] = std::make_shared<RecordingSink>();
    g.pipelines[static_cast<size_t>(c)] =
        w.start(g.sinks[static_cast<size_t>(c)], prompt, max_tokens, ignore_eos, "req-" + std::to_string(c), group, c);
  }
  return g;
}

}  // namespace

TEST_CASE("choice group: publish reaches every follower once, before or after it follows", "[pipeline]") {
  ChoiceGroup g(4);
  std::vector<std::optional<ChoiceGroup::Source>> seen;
  g.follow([&](const std::optional<ChoiceGroup::Source>& s) { seen.push_back(s); });
  g.publish(ChoiceGroup::Source{"d:0", "abc", 7});
  g.publish(std::nullopt);  // a second publish changes nothing
  g.follow([&](const std::optional<ChoiceGroup::Source>& s) { seen.push_back(s); });
  REQUIRE(seen.size() == 2);
  for (const auto& s : seen) {
    REQUIRE(s.has_value());
    CHECK(s->decode_address == "d:0");
    CHECK(s->request_id == "abc");
    CHECK(s->n_prompt_tokens == 7);
  }
}

TEST_CASE("pipeline: n choices prefill the prompt once and fork its KV on the leader's decode worker", "[pipeline]") {
  std::mt19937 rng(test_seed("choice group undisturbed"));
  for (const int32_t local : {0, 64}) {  // through a prefill worker, and prefilled by the decode worker
    INFO("local prefill up to " << local);
    World w(2, 3, 2, {}, false, local);
    for (int round = 0; round < 10; ++round) {
      const int n = 2 + static_cast<int>(rng() % 5);
      // A leader whose first token ends it (end-of-sequence) ends before its KV is placed: its
      // followers then run alone (the next test); here every leader lives on.
      std::vector<int32_t> prompt;
      do {
        prompt = random_prompt(rng, 1 + static_cast<int>(rng() % 20));
      } while (next_token(prompt) == kEos);
      const int32_t max_tokens = 2 + static_cast<int32_t>(rng() % 30);
      const int prefills_before = w.workers.n_prefill_calls, forks_before = w.workers.n_forks_admitted;
      Group g = start_group(w, rng, prompt, n, max_tokens);
      w.run(&rng);
      for (int c = 0; c < n; ++c) {
        INFO("choice " << c << " of " << n);
        const RecordingSink& s = *g.sinks[static_cast<size_t>(c)];
        REQUIRE(s.n_end == 1);
        CHECK(s.status.ok());
        CHECK(s.tokens == g.ref);
        CHECK(s.outcome.decode_address == g.sinks[0]->outcome.decode_address);
        if (c > 0) {
          CHECK(s.outcome.prefill_address.empty());
          CHECK(s.outcome.cached_prompt_tokens == static_cast<int32_t>(prompt.size()) - 1);
        }
      }
      CHECK(w.workers.n_prefill_calls - prefills_before == (local > 0 ? 0 : 1));
      CHECK(w.workers.n_forks_admitted - forks_before == n - 1);
    }
    w.check_clean();
    for (const auto& [addr, held] : w.workers.holds) CHECK(held.empty());  // every announced fork came
  }
}

TEST_CASE("pipeline: a leader that fails before its KV is placed, or a fork refused, sends choices on alone",
          "[pipeline]") {
  std::mt19937 rng(test_seed("choice group leader fails"));
  SECTION("the leader's prefill worker dies before the first token") {
    World w(2, 2);
    const auto prompt = prompt_without_eos(rng, 12);
    Group g = start_group(w, rng, prompt, 3, 12);
    // Deliver the Admits, then kill the prefill worker the leader was sent to.
    for (int i = 0; i < 200 && w.workers.n_prefill_calls == 0; ++i) w.workers.step(w.workers.ready().front());
    REQUIRE(w.workers.n_prefill_calls == 1);
    for (const auto& [id, c] : w.workers.calls) {
      if (c->kind == FakeWorkers::Call::Kind::kPrefill) {
        w.workers.kill(c->address);
        break;
      }
    }
    w.run(&rng);
    for (const auto& s : g.sinks) {
      REQUIRE(s->n_end == 1);
      CHECK(s->status.ok());
      CHECK(s->tokens == g.ref);
    }
    CHECK(w.workers.n_forks_admitted == 0);
    CHECK(w.workers.n_prefill_calls == 4);  // the leader's twice, each follower's once
    w.check_clean();
  }
  SECTION("the leader's first token ends it: nothing is held, every choice runs alone") {
    World w(2, 2);
    std::vector<int32_t> prompt;
    do {
      prompt = random_prompt(rng, 6);
    } while (next_token(prompt) != kEos);
    Group g = start_group(w, rng, prompt, 3, 8);
    w.run(&rng);
    for (const auto& s : g.sinks) {
      REQUIRE(s->n_end == 1);
      CHECK(s->status.ok());
      CHECK(s->tokens == std::vector<int32_t>{kEos});
    }
    CHECK(w.workers.n_forks_admitted == 0);
    w.check_clean();
  }
  SECTION("the hold is gone when the forks come (the decode worker restarted)") {
    World w(1, 1);
    const auto prompt = prompt_without_eos(rng, 10);
    Group g = start_group(w, rng, prompt, 3, 10);
    // Run until the leader's KV is placed (the hold exists), then drop the holds as a restart would.
    for (int i = 0; i < 500 && w.workers.holds["d:0"].empty(); ++i) w.workers.step(w.workers.ready().front());
    REQUIRE(!w.workers.holds["d:0"].empty());
    w.workers.holds.clear();
    w.run(&rng);
    for (const auto& s : g.sinks) {
      REQUIRE(s->n_end == 1);
      CHECK(s->status.ok());
      CHECK(s->tokens == g.ref);
      CHECK(s->outcome.failovers == 0);  // a refused fork is not a failure
    }
    CHECK(w.workers.n_forks_admitted == 0);
    w.check_clean();
  }
}

TEST_CASE("pipeline: random kills, errors and cancellations across choice groups lose, leak and repeat nothing",
          "[pipeline]") {
  const uint32_t seed = test_seed("choice group random faults");
  std::mt19937 rng(seed);
  for (int round = 0; round < 20; ++round) {
    const int32_t local = round % 2 == 1 ? 6 : 0;
    INFO("round " << round << " (seed " << seed << "), local prefill up to " << local);
    World w(2, 2 + static_cast<int>(rng() % 2), /*max_failovers=*/3, {}, false, local);
    std::vector<Group> groups;
    std::vector<bool> cancelled_group;
    for (int i = 0; i < 4; ++i) {
      const auto prompt = random_prompt(rng, 1 + static_cast<int>(rng() % 12));
      groups.push_back(start_group(w, rng, prompt, 2 + static_cast<int>(rng() % 4),
                                   1 + static_cast<int32_t>(rng() % 30), rng() % 3 == 0));
      cancelled_group.push_back(false);
    }
    // A refused fork (FAILED_PRECONDITION at its Admit) runs the choice on alone; elsewhere the
    // same code is a refusal that ends the choice.
    const Status errs[] = {failed_precondition("no such hold"), data_loss("KV checksum"), unavailable("stream reset")};
    w.run_with_faults(
        rng, errs,
        [&] {
          const size_t gi = rng() % groups.size();
          cancelled_group[gi] = true;
          Group& g = groups[gi];
          g.pipelines[rng() % g.pipelines.size()]->cancel(cancelled("the client cancelled the request"));
        },
        [&] {
          for (const Group& g : groups) {
            for (const auto& s : g.sinks) {
              if (s->n_end != 1) return false;
            }
          }
          return true;
        });
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      for (const auto& s : groups[gi].sinks) {
        REQUIRE(s->n_end == 1);
        const auto& ref = groups[gi].ref;
        REQUIRE(s->tokens.size() <= ref.size());
        CHECK(std::equal(s->tokens.begin(), s->tokens.end(), ref.begin()));
        if (s->status.ok()) {
          CHECK(s->tokens == ref);
        } else {
          const auto code = s->status.code();
          CHECK((code == StatusCode::kUnavailable || code == StatusCode::kCancelled ||
                 code == StatusCode::kFailedPrecondition));
          if (code == StatusCode::kCancelled) CHECK(cancelled_group[gi]);
        }
      }
    }
    w.check_clean();
  }
}
