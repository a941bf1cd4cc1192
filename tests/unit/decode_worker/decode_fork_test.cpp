// The n choices of one prompt on one decode worker: the first choice's KV arrives as usual and
// is held for the forks it announced; each fork shares the prompt's full blocks, copies the rest
// and samples its own first token. Every choice must equal a single-process generation of the
// prompt with its own sampling, token for token; the prompt's full blocks are held once; every
// path gives every block back; refusals name the problem.
#include <catch2/catch.hpp>
#include <thread>

#include "decode_worker/decode_engine.h"
#include "tests/unit/decode_worker/decode_test_util.h"

using namespace baton;
using namespace baton::decode_test;
using namespace std::chrono_literals;

namespace {

constexpr int kBlock = 8;  // the fixture's block size

int blocks_for(int64_t n) {
  return static_cast<int>((n + kBlock - 1) / kBlock);
}

DecodeAdmit fork_admit(const Fixture& fx, const std::string& id, const std::string& of, int n_prompt, int max_tokens,
                       const SamplingParams& sp) {
  DecodeAdmit a = admit_for(fx, id, n_prompt, max_tokens, sp, /*ignore_eos=*/true);
  a.fork_of = of;
  return a;
}

}  // namespace

TEST_CASE("forked choices equal single-process generations and hold the prompt's full blocks once", "[decode]") {
  // Prompt lengths around block boundaries (L - 1 a multiple of the block: nothing to copy) and random.
  std::vector<int> lengths = {1, 2, kBlock, kBlock + 1, 2 * kBlock + 1, 3 * kBlock};
  for (int i = 0; i < 4; ++i) lengths.push_back(1 + static_cast<int>(rnd() % 70));
  for (const int n_prompt : lengths) {
    Fixture fx(/*n_blocks=*/512, /*max_batch=*/32, nullptr, /*start=*/false);
    const int n_choices = 2 + static_cast<int>(rnd() % 4);
    const int max_tokens = 2 + static_cast<int>(rnd() % 24);
    const auto prompt = random_prompt(n_prompt, fx.vocab());
    std::vector<SamplingParams> sp;
    for (int c = 0; c < n_choices; ++c) sp.push_back(c == 0 && rnd() % 2 == 0 ? SamplingParams{} : seeded());
    INFO("prompt " << n_prompt << " choices " << n_choices << " max_tokens " << max_tokens);

    REQUIRE(fx.engine
                ->admit([&] {
                  DecodeAdmit a = admit_for(fx, "lead", n_prompt, max_tokens, sp[0], true);
                  a.n_forks = n_choices - 1;
                  return a;
                }())
                .ok());
    const Transfer t = prefill(*fx.ref.model, "lead", prompt, sp[0], 1 + static_cast<int>(rnd() % 20));
    // Before its KV is complete there is nothing to fork.
    CHECK(fx.engine->admit(fork_admit(fx, "early", "lead", n_prompt, max_tokens, sp[1])).code() ==
          StatusCode::kFailedPrecondition);
    REQUIRE(send(*fx.engine, t).ok());

    std::vector<Collector> out(static_cast<size_t>(n_choices));
    REQUIRE(fx.engine->attach("lead", out[0].sink()).ok());
    const int n_shared = (n_prompt - 1) / kBlock;
    for (int c = 1; c < n_choices; ++c) {
      const std::string id = "fork" + std::to_string(c);
      int64_t reserved = 0;
      REQUIRE(fx.engine->admit(fork_admit(fx, id, "lead", n_prompt, max_tokens, sp[static_cast<size_t>(c)]), &reserved)
                  .ok());
      CHECK(reserved == blocks_for(n_prompt + max_tokens) - n_shared);
      REQUIRE(fx.engine->attach(id, out[static_cast<size_t>(c)].sink()).ok());
    }
    // Nothing has stepped yet: the leader's blocks, plus each fork's own from the partial block on.
    const DecodeLoad l = fx.engine->load();
    CHECK(l.total_blocks - l.free_blocks ==
          blocks_for(n_prompt + max_tokens) + (n_choices - 1) * (blocks_for(n_prompt + max_tokens) - n_shared));
    // Every announced fork came: a further one is refused.
    CHECK(fx.engine->admit(fork_admit(fx, "extra", "lead", n_prompt, max_tokens, sp[1])).code() ==
          StatusCode::kFailedPrecondition);

    fx.engine->start();
    for (int c = 0; c < n_choices; ++c) {
      INFO("choice " << c);
      Collector& o = out[static_cast<size_t>(c)];
      REQUIRE(o.wait_done());
      CHECK(o.status.ok());
      const GenerateResult want = reference(fx, prompt, max_tokens, sp[static_cast<size_t>(c)], true);
      if (c == 0) {
        CHECK(o.tokens == std::vector<int32_t>(want.tokens.begin() + 1, want.tokens.end()));
      } else {
        CHECK(o.first_token_included);
        CHECK(o.first_cached_tokens == n_prompt - 1);
        CHECK(o.tokens == want.tokens);
      }
      CHECK(o.finish_reason == "length");
    }
    check_all_free(*fx.engine);
  }
}

TEST_CASE("a fork outlives its source, and every way out gives its blocks back", "[decode]") {
  Fixture fx(/*n_blocks=*/256, 32, nullptr, /*start=*/true, 0, 512, /*fork_hold=*/300ms);
  const int n_prompt = kBlock * 2 + 5;
  const auto prompt = random_prompt(n_prompt, fx.vocab());
  const SamplingParams sp = seeded();
  auto lead = [&](const std::string& id, int n_forks) {
    DecodeAdmit a = admit_for(fx, id, n_prompt, 6, sp, true);
    a.n_forks = n_forks;
    REQUIRE(fx.engine->admit(a).ok());
    REQUIRE(send(*fx.engine, prefill(*fx.ref.model, id, prompt, sp, 7)).ok());
  };

  SECTION("the source ends before its forks come: they still take its prompt") {
    lead("a", 2);
    fx.engine->cancel("a", cancelled("gone"));
    REQUIRE(fx.engine->release("a").ok());
    const SamplingParams other = seeded();
    Collector out;
    REQUIRE(fx.engine->admit(fork_admit(fx, "a1", "a", n_prompt, 6, other)).ok());
    REQUIRE(fx.engine->attach("a1", out.sink()).ok());
    REQUIRE(out.wait_done());
    CHECK(out.status.ok());
    CHECK(out.tokens == reference(fx, prompt, 6, other, true).tokens);
    // One announced fork never comes: the hold lets go after fork_hold.
    check_all_free(*fx.engine);
  }
  SECTION("a fork cancelled before its first step, and one refused for room") {
    Fixture small(/*n_blocks=*/8, 32, nullptr, /*start=*/false);
    DecodeAdmit a = admit_for(small, "b", n_prompt, 6, sp, true);  // 4 blocks (21 + 6 positions), 3 held for forks
    a.n_forks = 3;
    REQUIRE(small.engine->admit(a).ok());
    REQUIRE(send(*small.engine, prefill(*small.ref.model, "b", prompt, sp, 9)).ok());
    REQUIRE(small.engine->admit(fork_admit(small, "b1", "b", n_prompt, 6, sp)).ok());  // 2 of its own
    REQUIRE(small.engine->admit(fork_admit(small, "b2", "b", n_prompt, 6, sp)).ok());  // 2 more: 0 free
    const Status full = small.engine->admit(fork_admit(small, "b3", "b", n_prompt, 6, sp));
    CHECK(full.code() == StatusCode::kResourceExhausted);
    CHECK_THAT(full.message(), Catch::Contains("a fork of b"));
    CHECK(small.engine->load().free_blocks == 0);
    REQUIRE(small.engine->release("b1").ok());
    small.engine->cancel("b2", cancelled("client gone"));
    small.engine->cancel("b", cancelled("client gone"));
    small.engine->start();
    // b3 never came: the hold is dropped after its 10 s, or at stop().
    small.engine->stop();
    CHECK(small.engine->load().free_blocks == small.engine->load().total_blocks);
  }
  SECTION("an id admitted again while its prompt is held for forks is refused, and no block leaks") {
    lead("e", 2);
    Collector out;  // the sequence runs to its end through its stream: it leaves the engine
    REQUIRE(fx.engine->attach("e", out.sink()).ok());
    REQUIRE(out.wait_done());
    // The sequence is gone, its hold is not (300 ms): the same id again would have replaced the
    // hold and leaked its blocks.
    DecodeAdmit again = admit_for(fx, "e", n_prompt, 6, sp, true);
    again.n_forks = 2;
    Status s = fx.engine->admit(again);
    for (int i = 0; i < 50 && s.message().find("already admitted") != std::string::npos; ++i) {
      std::this_thread::sleep_for(2ms);
      s = fx.engine->admit(again);
    }
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(s.message(), Catch::Contains("holds its prompt's KV for forks"));
    check_all_free(*fx.engine);  // the hold expires after fork_hold and gives every block back
  }
  SECTION("refusals") {
    lead("c", 1);
    DecodeAdmit unknown = fork_admit(fx, "x1", "nobody", n_prompt, 6, sp);
    const Status s1 = fx.engine->admit(unknown);
    CHECK(s1.code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(s1.message(), Catch::Contains("admit it with its own KV"));
    CHECK(fx.engine->admit(fork_admit(fx, "x2", "c", n_prompt - 1, 6, sp)).code() == StatusCode::kInvalidArgument);
    DecodeAdmit mine = admit_for(fx, "own", n_prompt, 6, sp, true);
    mine.owner = "ipv4:127.0.0.1";
    mine.n_forks = 1;
    REQUIRE(fx.engine->admit(mine).ok());
    REQUIRE(send(*fx.engine, prefill(*fx.ref.model, "own", prompt, sp, 7)).ok());
    DecodeAdmit other_peer = fork_admit(fx, "x4", "own", n_prompt, 6, sp);
    other_peer.owner = "ipv4:127.0.0.2";
    CHECK(fx.engine->admit(other_peer).code() == StatusCode::kPermissionDenied);
    DecodeAdmit with_tokens = fork_admit(fx, "x5", "c", n_prompt, 6, sp);
    with_tokens.prefill_tokens = prompt;
    CHECK(fx.engine->admit(with_tokens).code() == StatusCode::kInvalidArgument);
    DecodeAdmit too_many = admit_for(fx, "x6", n_prompt, 6, sp, true);
    too_many.n_forks = DecodeAdmit::kMaxForks + 1;
    CHECK(fx.engine->admit(too_many).code() == StatusCode::kInvalidArgument);
    // A source admitted without forks holds nothing.
    lead("d", 0);
    CHECK(fx.engine->admit(fork_admit(fx, "x7", "d", n_prompt, 6, sp)).code() == StatusCode::kFailedPrecondition);
    for (const char* id : {"c", "own", "d"}) fx.engine->cancel(id, cancelled("done"));
    // The holds of c and own (their forks never came) go after fork_hold.
    check_all_free(*fx.engine);
  }
}
