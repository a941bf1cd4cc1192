// Local prefill on the decode engine (DecodeAdmit with prefill_tokens): prompts prefilled in the
// decode steps, beside requests whose KV a prefill worker sends, must equal single-process
// generation; refusals, cancellation mid-prompt, and no KV transfer into a locally prefilled request.
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
StatusCode code(const Status& s) { return s.code(); }
}  // namespace

TEST_CASE("local prefill: prompts prefilled in the decode steps, beside KV-fed requests, equal single-process generation",
          "[decode][local]") {
  const int budget = 3 + static_cast<int>(rnd() % 20);  // small: prompts take several steps, mixed with decodes
  Fixture fx(/*n_blocks=*/512, /*max_batch=*/32, nullptr, true, /*local_prefill_max_tokens=*/200, budget);
  INFO("local prefill token budget " << budget);
  const int n_req = 6;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<SamplingParams> params;
  std::vector<int> max_tokens;
  std::vector<GenerateResult> want;
  std::vector<Collector> out(n_req);
  for (int i = 0; i < n_req; ++i) {
    prompts.push_back(random_prompt(1 + static_cast<int>(rnd() % 60), fx.vocab()));
    params.push_back(i % 3 == 0 ? SamplingParams{} : seeded());
    max_tokens.push_back(2 + static_cast<int>(rnd() % 25));
    want.push_back(reference(fx, prompts[i], max_tokens[i], params[i]));
  }
  // Odd requests come with their KV from a "prefill worker"; even ones are prefilled here.
  for (int i = 0; i < n_req; ++i) {
    const std::string id = "r" + std::to_string(i);
    DecodeAdmit a = admit_for(fx, id, static_cast<int>(prompts[i].size()), max_tokens[i], params[i]);
    if (i % 2 == 0) a.prefill_tokens = prompts[i];
    REQUIRE(fx.engine->admit(a).ok());
    REQUIRE(fx.engine->attach(id, out[i].sink()).ok());
    if (i % 2 == 1) REQUIRE(send(*fx.engine, prefill(*fx.ref.model, id, prompts[i], params[i], 7)).ok());
  }
  for (int i = 0; i < n_req; ++i) {
    INFO("request " << i << (i % 2 == 0 ? " (local)" : " (KV)") << ", prompt " << prompts[i].size());
    REQUIRE(out[i].wait_done());
    CHECK(out[i].status.ok());
    const auto& w = want[i].tokens;
    // A locally prefilled request's stream starts with its first token; a KV-fed one's after it.
    CHECK(out[i].tokens == (i % 2 == 0 ? w : std::vector<int32_t>(w.begin() + 1, w.end())));
    CHECK(out[i].first_token_included == (i % 2 == 0));
    CHECK_FALSE(out[i].first_token_included_later);
    if (i % 2 == 0) CHECK(out[i].first_prefill_seconds > 0);
    CHECK(out[i].finish_reason == want[i].finish_reason);
  }
  check_all_free(*fx.engine);
}

TEST_CASE("local prefill: refusals, cancellation mid-prompt, no KV transfer into it", "[decode][local]") {
  Fixture fx(/*n_blocks=*/256, /*max_batch=*/32, nullptr, true, /*local_prefill_max_tokens=*/64,
             /*local_prefill_token_budget=*/2);
  const auto prompt = random_prompt(60, fx.vocab());
  auto local = [&](const std::string& id, const std::vector<int32_t>& p) {
    DecodeAdmit a = admit_for(fx, id, static_cast<int>(p.size()), 10, {});
    a.prefill_tokens = p;
    return a;
  };
  SECTION("refusals") {
    CHECK(code(fx.engine->admit(local("long", random_prompt(65, fx.vocab())))) == StatusCode::kFailedPrecondition);
    DecodeAdmit mismatch = local("mismatch", prompt);
    mismatch.n_prompt_tokens = 59;
    CHECK(code(fx.engine->admit(mismatch)) == StatusCode::kInvalidArgument);
    auto bad = prompt;
    bad[7] = fx.vocab();
    CHECK(code(fx.engine->admit(local("bad", bad))) == StatusCode::kInvalidArgument);
    bad[7] = -1;
    CHECK(code(fx.engine->admit(local("bad", bad))) == StatusCode::kInvalidArgument);
    check_all_free(*fx.engine);
    // A worker without local prefill refuses any.
    Fixture plain;
    DecodeAdmit a = admit_for(plain, "p", 5, 5, {});
    a.prefill_tokens = random_prompt(5, plain.vocab());
    CHECK(code(plain.engine->admit(a)) == StatusCode::kFailedPrecondition);
  }
  SECTION("a KV transfer for a request prefilled here is refused") {
    REQUIRE(fx.engine->admit(local("x", prompt)).ok());
    const Transfer t = prefill(*fx.ref.model, "x", prompt, {}, 16);
    CHECK(code(fx.engine->kv_begin(t.header)) == StatusCode::kFailedPrecondition);
    fx.engine->cancel("x", cancelled("test"));
    check_all_free(*fx.engine);
  }
  SECTION("cancel and release mid-prompt") {
    for (const bool release : {false, true}) {
      // Two tokens a step: 30 steps to prefill; it is cancelled well before.
      const std::string id = release ? "rel" : "can";
      REQUIRE(fx.engine->admit(local(id, prompt)).ok());
      Collector out;
      REQUIRE(fx.engine->attach(id, out.sink()).ok());
      REQUIRE(wait_for([&] { return fx.engine->load().n_waiting == 1; }));
      if (release) {
        REQUIRE(fx.engine->release(id).ok());
      } else {
        fx.engine->cancel(id, cancelled("the client went away"));
      }
      REQUIRE(out.wait_done());
      CHECK(out.status.code() == StatusCode::kCancelled);
      CHECK(out.tokens.empty());
      check_all_free(*fx.engine);
    }
  }
}
