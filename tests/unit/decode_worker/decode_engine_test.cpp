// The decode engine on the random test model, with the test acting as the prefill worker:
// prefill in its own KV cache, sample the first token, kv_export every layer and hand it over.
// Disaggregated output must equal single-process Generator output token for token (greedy and
// seeded sampling, alone and batched); every path frees its blocks; refusals name the problem.
#include "decode_worker/decode_engine.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>

#include "kernels/sampling.h"
#include "tests/unit/decode_worker/decode_test_util.h"

using namespace baton;
using namespace baton::decode_test;
using namespace std::chrono_literals;

TEST_CASE("disaggregated decode equals single-process generation", "[decode]") {
  Fixture fx;
  for (const bool greedy : {true, false, false}) {
    for (const bool attach_first : {true, false}) {
      const SamplingParams sp = greedy ? SamplingParams{} : seeded();
      const int n_prompt = 1 + static_cast<int>(rnd() % 60);
      const int max_tokens = 2 + static_cast<int>(rnd() % 30);
      const auto prompt = random_prompt(n_prompt, fx.vocab());
      const std::string id = std::string(greedy ? "greedy" : "seeded") + (attach_first ? "-a" : "-b");
      INFO(id << " prompt " << n_prompt << " max_tokens " << max_tokens << " seed " << sp.seed);

      const GenerateResult want = reference(fx, prompt, max_tokens, sp);
      const Transfer t = prefill(*fx.ref.model, id, prompt, sp, 1 + static_cast<int>(rnd() % 20));
      REQUIRE(t.first_token == want.tokens.front());

      Collector out;
      REQUIRE(fx.engine->admit(admit_for(fx, id, n_prompt, max_tokens, sp)).ok());
      CHECK(fx.engine->load().n_waiting == 1);
      if (attach_first) REQUIRE(fx.engine->attach(id, out.sink()).ok());
      REQUIRE(send(*fx.engine, t).ok());
      if (!attach_first) {
        std::this_thread::sleep_for(std::chrono::milliseconds(rnd() % 20));  // let it run (or finish) unobserved
        REQUIRE(fx.engine->attach(id, out.sink()).ok());
      }
      REQUIRE(out.wait_done());
      CHECK(out.status.ok());
      CHECK(out.tokens == std::vector<int32_t>(want.tokens.begin() + 1, want.tokens.end()));
      CHECK(out.finish_reason == want.finish_reason);
      CHECK(out.first_kv_transfer_seconds >= 0);
      CHECK(out.first_decode_queue_seconds >= 0);
      check_all_free(*fx.engine);
      // Delivered and forgotten: the id can be reused and is no longer attachable.
      CHECK(fx.engine->attach(id, out.sink()).code() == StatusCode::kNotFound);
    }
  }
}

// The same log-probabilities, up to the rounding by which a batched step's logits differ from a
// single sequence's (the sums run in another order): a few float ulps of the logits.
static void check_same_logprobs(const std::vector<TokenLogprobs>& got, const std::vector<TokenLogprobs>& want) {
  REQUIRE(got.size() == want.size());
  auto close = [](float a, float b) { return std::fabs(a - b) <= 1e-4f * (1.0f + std::fabs(b)); };
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("token " << i);
    CHECK(close(got[i].logprob, want[i].logprob));
    REQUIRE(got[i].n_top == want[i].n_top);
    for (int k = 0; k < got[i].n_top; ++k) {
      // Ids may trade places only where their values tie within that rounding.
      if (got[i].top_ids[k] != want[i].top_ids[k]) CHECK(close(got[i].top_logprobs[k], want[i].top_logprobs[k]));
      CHECK(close(got[i].top_logprobs[k], want[i].top_logprobs[k]));
    }
  }
}

TEST_CASE("penalties and log-probabilities: disaggregated decode equals single-process generation, after a failover too",
          "[decode]") {
  Fixture fx;
  for (int round = 0; round < 4; ++round) {
    SamplingParams sp = round % 2 == 0 ? SamplingParams{} : seeded();
    sp.presence_penalty = static_cast<float>(rnd() % 400) / 100.0f - 2.0f;
    sp.frequency_penalty = static_cast<float>(rnd() % 400) / 100.0f - 2.0f;
    sp.repetition_penalty = 0.5f + static_cast<float>(rnd() % 200) / 100.0f;
    sp.top_logprobs = static_cast<int>(rnd() % 21);
    const int n_prompt = 1 + static_cast<int>(rnd() % 40);
    const int max_tokens = 4 + static_cast<int>(rnd() % 20);
    const auto prompt = random_prompt(n_prompt, fx.vocab());
    INFO("round " << round << " prompt " << n_prompt << " max_tokens " << max_tokens << " presence "
                  << sp.presence_penalty << " frequency " << sp.frequency_penalty << " repetition "
                  << sp.repetition_penalty << " top " << sp.top_logprobs);
    const GenerateResult want = reference(fx, prompt, max_tokens, sp, /*ignore_eos=*/true);
    REQUIRE(want.logprobs.size() == want.tokens.size());

    // A fresh request, and one that resumes after k tokens were streamed (a failover): the KV of
    // prompt + those k comes over, and the decode worker counts them as output.
    for (const int k : {0, 1 + static_cast<int>(rnd() % (max_tokens - 2))}) {
      std::vector<int32_t> tokens = prompt;
      tokens.insert(tokens.end(), want.tokens.begin(), want.tokens.begin() + k);
      const std::string id = "pen-" + std::to_string(round) + "-" + std::to_string(k);
      const Transfer t = prefill(*fx.ref.model, id, tokens, sp, 7, k);
      REQUIRE(t.first_token == want.tokens[static_cast<size_t>(k)]);
      check_same_logprobs({t.first_logprobs}, {want.logprobs[static_cast<size_t>(k)]});
      DecodeAdmit a = admit_for(fx, id, static_cast<int>(tokens.size()), max_tokens - k, sp, true);
      a.n_output_tokens = k;
      Collector out;
      REQUIRE(fx.engine->admit(a).ok());
      REQUIRE(fx.engine->attach(id, out.sink()).ok());
      REQUIRE(send(*fx.engine, t).ok());
      REQUIRE(out.wait_done());
      CHECK(out.status.ok());
      CHECK(out.tokens == std::vector<int32_t>(want.tokens.begin() + k + 1, want.tokens.end()));
      check_same_logprobs(out.logprobs, std::vector<TokenLogprobs>(want.logprobs.begin() + k + 1, want.logprobs.end()));
      check_all_free(*fx.engine);
    }
  }
}

TEST_CASE("continuous batching of concurrent requests changes no token", "[decode]") {
  Fixture fx(/*n_blocks=*/512, /*max_batch=*/3);  // more requests than batch slots: some wait their turn
  const int n_req = 7;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<SamplingParams> params;
  std::vector<int> max_tokens;
  std::vector<GenerateResult> want;
  std::vector<Transfer> transfers;
  for (int i = 0; i < n_req; ++i) {
    prompts.push_back(random_prompt(1 + static_cast<int>(rnd() % 50), fx.vocab()));
    params.push_back(i % 2 == 0 ? SamplingParams{} : seeded());
    max_tokens.push_back(2 + static_cast<int>(rnd() % 40));
    want.push_back(reference(fx, prompts[i], max_tokens[i], params[i]));
    transfers.push_back(prefill(*fx.ref.model, "r" + std::to_string(i), prompts[i], params[i], 7));
  }
  std::vector<Collector> outs(n_req);
  for (int i = 0; i < n_req; ++i) {
    const std::string id = "r" + std::to_string(i);
    REQUIRE(fx.engine->admit(admit_for(fx, id, static_cast<int>(prompts[i].size()), max_tokens[i], params[i])).ok());
    REQUIRE(fx.engine->attach(id, outs[i].sink()).ok());
  }
  // KV arrives from several "prefill workers" at once, while earlier requests already decode.
  std::vector<std::thread> senders;
  std::vector<Status> sent(n_req);
  for (int i = 0; i < n_req; ++i) {
    const auto delay = std::chrono::milliseconds(rnd() % 30);
    senders.emplace_back([&, i, delay] {
      std::this_thread::sleep_for(delay);
      sent[i] = send(*fx.engine, transfers[i]);
    });
  }
  for (auto& s : senders) s.join();
  for (int i = 0; i < n_req; ++i) {
    INFO("request " << i << " seed " << params[i].seed);
    REQUIRE(sent[i].ok());
    REQUIRE(outs[i].wait_done());
    CHECK(!outs[i].event_after_done);
    CHECK(outs[i].status.ok());
    CHECK(outs[i].tokens == std::vector<int32_t>(want[i].tokens.begin() + 1, want[i].tokens.end()));
    CHECK(outs[i].finish_reason == want[i].finish_reason);
  }
  check_all_free(*fx.engine);
}

TEST_CASE("a sequence that waits for a batch slot hears beats until its turn, then its tokens and timings",
          "[decode]") {
  // One slot: the second request waits while the first generates.
  Fixture fx(/*n_blocks=*/256, /*max_batch=*/1, nullptr, /*start=*/false, 0, 512, 10s, /*slot_wait_beat=*/1ms);
  const int n_prompt = 1 + static_cast<int>(rnd() % 30);
  const auto prompt = random_prompt(n_prompt, fx.vocab());
  const SamplingParams sp = seeded();
  const int long_tokens = 200, short_tokens = 2 + static_cast<int>(rnd() % 20);
  Collector first, second;
  REQUIRE(fx.engine->admit(admit_for(fx, "first", n_prompt, long_tokens, sp, true)).ok());
  REQUIRE(fx.engine->admit(admit_for(fx, "second", n_prompt, short_tokens, sp, true)).ok());
  REQUIRE(fx.engine->attach("first", first.sink()).ok());
  REQUIRE(fx.engine->attach("second", second.sink()).ok());
  REQUIRE(send(*fx.engine, prefill(*fx.ref.model, "first", prompt, sp, 9)).ok());
  REQUIRE(send(*fx.engine, prefill(*fx.ref.model, "second", prompt, sp, 9)).ok());
  fx.engine->start();
  REQUIRE(first.wait_done());
  REQUIRE(second.wait_done());
  CHECK(first.n_beats == 0);  // it had the slot from the start
  CHECK(second.n_beats > 0);
  {
    std::lock_guard lk(second.mu);
    CHECK(second.first_decode_queue_seconds > 0);  // the timings went on its first tokens, not on a beat
  }
  const GenerateResult want = reference(fx, prompt, short_tokens, sp, true);
  CHECK(second.tokens == std::vector<int32_t>(want.tokens.begin() + 1, want.tokens.end()));
  check_all_free(*fx.engine);
}

TEST_CASE("a stop id as the first token ends the request at once", "[decode]") {
  Fixture fx;
  const auto prompt = random_prompt(10, fx.vocab());
  for (const int32_t stop : fx.stop_ids) {
    Transfer t = prefill(*fx.ref.model, "eos", prompt, {}, 16);
    t.first_token = stop;
    REQUIRE(fx.engine->admit(admit_for(fx, "eos", 10, 20, {})).ok());
    Collector out;
    REQUIRE(fx.engine->attach("eos", out.sink()).ok());
    REQUIRE(send(*fx.engine, t).ok());
    REQUIRE(out.wait_done());
    CHECK(out.status.ok());
    CHECK(out.finish_reason == "stop");
    CHECK(out.tokens.empty());
    check_all_free(*fx.engine);
  }

  // ignore_eos: the stop id is an ordinary input and generation runs to max_tokens.
  Transfer t = prefill(*fx.ref.model, "ign", prompt, {}, 16);
  t.first_token = fx.stop_ids.front();
  REQUIRE(fx.engine->admit(admit_for(fx, "ign", 10, 6, {}, /*ignore_eos=*/true)).ok());
  Collector out;
  REQUIRE(fx.engine->attach("ign", out.sink()).ok());
  REQUIRE(send(*fx.engine, t).ok());
  REQUIRE(out.wait_done());
  CHECK(out.finish_reason == "length");
  CHECK(out.tokens.size() == 5);

  // max_tokens 1: the first token was all of it.
  Transfer one = prefill(*fx.ref.model, "one", prompt, {}, 16);
  REQUIRE(fx.engine->admit(admit_for(fx, "one", 10, 1, {})).ok());
  Collector out1;
  REQUIRE(fx.engine->attach("one", out1.sink()).ok());
  REQUIRE(send(*fx.engine, one).ok());
  REQUIRE(out1.wait_done());
  CHECK(out1.status.ok());
  CHECK(out1.tokens.empty());
  CHECK(out1.finish_reason ==
        (std::find(fx.stop_ids.begin(), fx.stop_ids.end(), one.first_token) != fx.stop_ids.end() ? "stop"
                                                                                                        : "length"));
  check_all_free(*fx.engine);
}

TEST_CASE("cancel, release and abort free the blocks", "[decode]") {
  Fixture fx;
  const auto prompt = random_prompt(30, fx.vocab());
  const int64_t total = fx.engine->load().total_blocks;

  SECTION("cancel a running sequence") {
    Transfer t = prefill(*fx.ref.model, "c", prompt, {}, 8);
    REQUIRE(fx.engine->admit(admit_for(fx, "c", 30, 900, {}, /*ignore_eos=*/true)).ok());
    CHECK(fx.engine->load().free_blocks < total);
    Collector out;
    REQUIRE(fx.engine->attach("c", out.sink()).ok());
    REQUIRE(send(*fx.engine, t).ok());
    REQUIRE(out.wait_tokens(3));
    fx.engine->cancel("c", cancelled("client went away"));
    REQUIRE(out.wait_done());
    CHECK(out.status.code() == StatusCode::kCancelled);
    CHECK(out.tokens.size() < 899);
    check_all_free(*fx.engine);
  }
  SECTION("cancel while waiting for KV, then the KV is refused") {
    REQUIRE(fx.engine->admit(admit_for(fx, "w", 30, 50, {})).ok());
    Collector out;
    REQUIRE(fx.engine->attach("w", out.sink()).ok());
    fx.engine->cancel("w", deadline_exceeded("too late"));
    REQUIRE(out.wait_done());
    CHECK(out.status.code() == StatusCode::kDeadlineExceeded);
    CHECK(fx.engine->kv_begin(prefill(*fx.ref.model, "w", prompt, {}, 8).header).code() ==
          StatusCode::kFailedPrecondition);
    check_all_free(*fx.engine);
  }
  SECTION("release a reservation whose KV never comes") {
    REQUIRE(fx.engine->admit(admit_for(fx, "r", 30, 50, {})).ok());
    CHECK(fx.engine->load().n_waiting == 1);
    REQUIRE(fx.engine->release("r").ok());
    check_all_free(*fx.engine);
    REQUIRE(fx.engine->release("r").ok());  // idempotent
    REQUIRE(fx.engine->release("never-admitted").ok());
  }
  SECTION("stream and release only from the peer that admitted") {
    DecodeAdmit a = admit_for(fx, "o", 30, 50, {});
    a.owner = "ipv4:10.0.0.1 as frontend-a";
    REQUIRE(fx.engine->admit(a).ok());
    Collector thief;
    CHECK(fx.engine->attach("o", thief.sink(), std::nullopt, "ipv4:10.0.0.9 as frontend-a").code() ==
          StatusCode::kPermissionDenied);
    CHECK(fx.engine->release("o", "ipv4:10.0.0.1 as someone-else").code() == StatusCode::kPermissionDenied);
    CHECK(fx.engine->load().n_waiting == 1);  // nothing was done for them
    Collector out;
    REQUIRE(fx.engine->attach("o", out.sink(), std::nullopt, a.owner).ok());
    REQUIRE(fx.engine->release("o", a.owner).ok());
    REQUIRE(out.wait_done());
    CHECK(out.status.code() == StatusCode::kCancelled);
    check_all_free(*fx.engine);
  }
  SECTION("KV only from the prefill worker the Admit named") {
    const GenerateResult want = reference(fx, prompt, 6, {});
    DecodeAdmit a = admit_for(fx, "k", 30, 6, {});
    a.kv_senders = {"ipv4:10.0.0.5", "ipv6:[fd00::5]"};
    REQUIRE(fx.engine->admit(a).ok());
    Transfer t = prefill(*fx.ref.model, "k", prompt, {}, 8);
    t.header.sender = "ipv4:10.0.0.6";
    const Status refused = fx.engine->kv_begin(t.header);
    CHECK(refused.code() == StatusCode::kPermissionDenied);
    CHECK_THAT(refused.message(), Catch::Contains("not from the prefill worker"));
    Collector out;
    REQUIRE(fx.engine->attach("k", out.sink()).ok());
    t.header.sender = "ipv6:[fd00::5]";
    REQUIRE(send(*fx.engine, t).ok());  // the named one is still welcome: the refusal changed nothing
    REQUIRE(out.wait_done());
    CHECK(out.tokens == std::vector<int32_t>(want.tokens.begin() + 1, want.tokens.end()));
    check_all_free(*fx.engine);
  }
  SECTION("an aborted transfer keeps the reservation; a retry succeeds; release after abort frees") {
    Transfer t = prefill(*fx.ref.model, "a", prompt, {}, 8);
    const GenerateResult want = reference(fx, prompt, 12, {});
    REQUIRE(fx.engine->admit(admit_for(fx, "a", 30, 12, {})).ok());
    const int64_t reserved_free = fx.engine->load().free_blocks;
    REQUIRE(fx.engine->kv_begin(t.header).ok());
    REQUIRE(fx.engine->kv_chunk("a", t.chunks[0]).ok());
    fx.engine->kv_abort("a");
    CHECK(fx.engine->load().free_blocks == reserved_free);
    CHECK(fx.engine->load().n_waiting == 1);
    // kv_end without a transfer in progress is refused.
    CHECK(fx.engine->kv_end("a", 0).code() == StatusCode::kFailedPrecondition);
    Collector out;
    REQUIRE(fx.engine->attach("a", out.sink()).ok());
    REQUIRE(send(*fx.engine, t).ok());
    REQUIRE(out.wait_done());
    CHECK(out.tokens == std::vector<int32_t>(want.tokens.begin() + 1, want.tokens.end()));
    check_all_free(*fx.engine);

    REQUIRE(fx.engine->admit(admit_for(fx, "b", 30, 12, {})).ok());
    t.header.request_id = "b";
    REQUIRE(fx.engine->kv_begin(t.header).ok());
    fx.engine->kv_abort("b");
    REQUIRE(fx.engine->release("b").ok());
    check_all_free(*fx.engine);
  }
  SECTION("stop fails live requests with UNAVAILABLE and frees everything") {
    Transfer t = prefill(*fx.ref.model, "s1", prompt, {}, 8);
    REQUIRE(fx.engine->admit(admit_for(fx, "s1", 30, 900, {}, true)).ok());
    REQUIRE(fx.engine->admit(admit_for(fx, "s2", 30, 50, {})).ok());
    Collector o1, o2;
    REQUIRE(fx.engine->attach("s1", o1.sink()).ok());
    REQUIRE(fx.engine->attach("s2", o2.sink()).ok());
    REQUIRE(send(*fx.engine, t).ok());
    REQUIRE(o1.wait_tokens(2));
    fx.engine->stop();
    REQUIRE(o1.wait_done(1ms));
    REQUIRE(o2.wait_done(1ms));
    CHECK(o1.status.code() == StatusCode::kUnavailable);
    CHECK(o2.status.code() == StatusCode::kUnavailable);
    check_all_free(*fx.engine);
    CHECK(fx.engine->admit(admit_for(fx, "s3", 30, 5, {})).code() == StatusCode::kUnavailable);
  }
}

TEST_CASE("deadlines end requests with DEADLINE_EXCEEDED", "[decode]") {
  Fixture fx;
  const auto prompt = random_prompt(20, fx.vocab());

  // Waiting for KV that never comes.
  DecodeAdmit a = admit_for(fx, "late", 20, 50, {});
  a.deadline = std::chrono::steady_clock::now() + 50ms;
  REQUIRE(fx.engine->admit(a).ok());
  Collector out;
  REQUIRE(fx.engine->attach("late", out.sink()).ok());
  REQUIRE(out.wait_done(5s));
  CHECK(out.status.code() == StatusCode::kDeadlineExceeded);
  check_all_free(*fx.engine);

  // Generating, with the deadline given at attach (the Stream call's), which passes mid-stream.
  Transfer t = prefill(*fx.ref.model, "slow", prompt, {}, 8);
  REQUIRE(fx.engine->admit(admit_for(fx, "slow", 20, 1000, {}, /*ignore_eos=*/true)).ok());
  REQUIRE(send(*fx.engine, t).ok());
  REQUIRE(wait_for([&] { return fx.engine->load().n_running == 1; }));
  Collector out2;
  REQUIRE(fx.engine->attach("slow", out2.sink(), std::chrono::steady_clock::now() + 1ms).ok());
  REQUIRE(out2.wait_done(10s));
  CHECK(out2.status.code() == StatusCode::kDeadlineExceeded);
  CHECK(out2.tokens.size() < 999);
  check_all_free(*fx.engine);
}

TEST_CASE("admission and KV refusals", "[decode]") {
  Fixture fx(/*n_blocks=*/20);  // 20 blocks of 8 tokens: 160 positions
  const int n_prompt = 12;
  const auto prompt = random_prompt(n_prompt, fx.vocab());
  const Transfer good = prefill(*fx.ref.model, "x", prompt, {}, 4);
  auto code = [](const Status& s) { return s.code(); };

  SECTION("admit") {
    DecodeAdmit a = admit_for(fx, "x", n_prompt, 10, {});
    a.model_fingerprint = "another-model";
    CHECK(code(fx.engine->admit(a)) == StatusCode::kFailedPrecondition);
    CHECK(code(fx.engine->admit(admit_for(fx, "x", 0, 10, {}))) == StatusCode::kInvalidArgument);
    CHECK(code(fx.engine->admit(admit_for(fx, "x", n_prompt, 0, {}))) == StatusCode::kInvalidArgument);
    CHECK(code(fx.engine->admit(admit_for(fx, "", n_prompt, 10, {}))) == StatusCode::kInvalidArgument);
    CHECK(code(fx.engine->admit(admit_for(fx, "x", n_prompt, fx.ref.model->config().n_ctx, {}))) ==
          StatusCode::kInvalidArgument);
    CHECK(code(fx.engine->admit(admit_for(fx, "x", n_prompt, 10, SamplingParams{1.0f, 0, 0.0f, 0}))) ==
          StatusCode::kInvalidArgument);
    // More than the whole pool, then more than what is free.
    const Status huge = fx.engine->admit(admit_for(fx, "x", n_prompt, 500, {}));
    CHECK(code(huge) == StatusCode::kResourceExhausted);
    CHECK_THAT(huge.message(), Catch::Contains("KV blocks"));
    int64_t reserved = 0;
    REQUIRE(fx.engine->admit(admit_for(fx, "x", n_prompt, 100, {}), &reserved).ok());
    CHECK(reserved == 14);  // ceil(112 / 8)
    CHECK(code(fx.engine->admit(admit_for(fx, "x", n_prompt, 10, {}))) == StatusCode::kInvalidArgument);  // duplicate
    const Status full = fx.engine->admit(admit_for(fx, "y", n_prompt, 50, {}));
    CHECK(code(full) == StatusCode::kResourceExhausted);
    CHECK_THAT(full.message(), Catch::Contains("free"));
    REQUIRE(fx.engine->release("x").ok());
    CHECK(fx.engine->admit(admit_for(fx, "y", n_prompt, 50, {})).ok());
    REQUIRE(fx.engine->release("y").ok());
    CHECK(code(fx.engine->attach("nope", [](const DecodeOutput&) {})) == StatusCode::kNotFound);
  }

  SECTION("kv_begin") {
    CHECK(code(fx.engine->kv_begin(good.header)) == StatusCode::kFailedPrecondition);  // not admitted
    REQUIRE(fx.engine->admit(admit_for(fx, "x", n_prompt, 10, {})).ok());
    auto refused = [&](auto mutate) {  // as a transport hands it over
      KvTransferHeader h = good.header;
      mutate(h);
      KvIncoming incoming(*fx.engine, nullptr);
      return code(incoming.begin(h));
    };
    CHECK(refused([](KvTransferHeader& h) { h.model_fingerprint = "other"; }) == StatusCode::kFailedPrecondition);
    CHECK(refused([](KvTransferHeader& h) { h.dtype = "bf16"; }) == StatusCode::kFailedPrecondition);
    CHECK(refused([](KvTransferHeader& h) { h.n_layers += 1; }) == StatusCode::kFailedPrecondition);
    CHECK(refused([](KvTransferHeader& h) { h.n_kv_heads *= 2; }) == StatusCode::kFailedPrecondition);
    CHECK(refused([](KvTransferHeader& h) { h.head_dim /= 2; }) == StatusCode::kFailedPrecondition);
    // More tokens than admitted (and a consistent token list): does not fit the reservation.
    CHECK(refused([](KvTransferHeader& h) {
            h.n_tokens = 1000;
            h.token_ids.resize(1000, 1);
          }) == StatusCode::kInvalidArgument);
    CHECK(refused([](KvTransferHeader& h) { h.token_ids.pop_back(); }) == StatusCode::kInvalidArgument);
    CHECK(refused([&](KvTransferHeader& h) { h.token_ids[0] = -1; }) == StatusCode::kInvalidArgument);
    // Hostile shapes, refused before anything is sized by them: 2^31 - 1 layers (8 GiB of
    // per-layer bookkeeping once), and products of the shape that wrap int64.
    const int32_t big = std::numeric_limits<int32_t>::max();
    CHECK(refused([&](KvTransferHeader& h) { h.n_layers = big; }) == StatusCode::kInvalidArgument);
    CHECK(refused([&](KvTransferHeader& h) { h.n_layers = kMaxKvLayers + 1; }) == StatusCode::kInvalidArgument);
    CHECK(refused([&](KvTransferHeader& h) {
            h.n_kv_heads = big;
            h.head_dim = big;
          }) == StatusCode::kInvalidArgument);
    CHECK(refused([&](KvTransferHeader& h) {
            h.dtype = "f32";
            h.n_kv_heads = 1 << 30;
            h.head_dim = 1 << 30;
          }) == StatusCode::kInvalidArgument);
    {
      KvTransferHeader h = good.header;
      h.n_kv_heads = big;
      h.head_dim = big;
      CHECK(kv_chunk_bytes(h, big) == std::numeric_limits<int64_t>::max());  // saturates, does not wrap
    }
    // None of that disturbed the reservation: the real transfer goes through.
    CHECK(send(*fx.engine, good).ok());
    CHECK(code(fx.engine->kv_begin(good.header)) == StatusCode::kFailedPrecondition);  // already running
  }

  SECTION("kv_chunk and kv_end") {
    REQUIRE(fx.engine->admit(admit_for(fx, "x", n_prompt, 10, {})).ok());
    CHECK(code(fx.engine->kv_chunk("x", good.chunks[0])) == StatusCode::kFailedPrecondition);  // before begin
    KvIncoming incoming(*fx.engine, nullptr);  // as a transport drives the engine
    REQUIRE(incoming.begin(good.header).ok());
    CHECK(code(fx.engine->kv_begin(good.header)) == StatusCode::kFailedPrecondition);  // twice
    auto refused = [&](auto mutate) {
      KvChunk c = good.chunks[0];
      mutate(c);
      return code(incoming.chunk(c));
    };
    CHECK(refused([](KvChunk& c) { c.checksum ^= 1; }) == StatusCode::kDataLoss);
    CHECK(refused([](KvChunk& c) { c.k[5] ^= 0x40; }) == StatusCode::kDataLoss);
    CHECK(refused([](KvChunk& c) { c.layer = 99; }) == StatusCode::kInvalidArgument);
    CHECK(refused([](KvChunk& c) { c.layer = -1; }) == StatusCode::kInvalidArgument);
    CHECK(refused([&](KvChunk& c) { c.token_start = n_prompt - 1; }) == StatusCode::kInvalidArgument);
    CHECK(refused([](KvChunk& c) { c.token_count = 0; }) == StatusCode::kInvalidArgument);
    CHECK(refused([](KvChunk& c) {
            c.k.pop_back();
            c.checksum = kv_checksum(c.k, c.v);
          }) == StatusCode::kInvalidArgument);
    CHECK(refused([](KvChunk& c) {
            c.token_start = 0;
            c.token_count = 1 << 30;
          }) == StatusCode::kInvalidArgument);
    CHECK(code(fx.engine->kv_chunk("y", good.chunks[0])) == StatusCode::kFailedPrecondition);
    // All but the last chunk: the end is refused and names the short layer.
    for (size_t i = 0; i + 1 < good.chunks.size(); ++i) REQUIRE(incoming.chunk(good.chunks[i]).ok());
    const Status short_end = incoming.end(good.first_token);
    CHECK(code(short_end) == StatusCode::kInvalidArgument);
    CHECK_THAT(short_end.message(), Catch::Contains("layer " + std::to_string(good.chunks.back().layer)));
    REQUIRE(incoming.chunk(good.chunks.back()).ok());
    // A first token outside the vocabulary is refused; the transfer can still end properly.
    CHECK(code(incoming.end(fx.vocab())) == StatusCode::kInvalidArgument);
    CHECK(code(incoming.end(-1)) == StatusCode::kInvalidArgument);
    REQUIRE(incoming.end(good.first_token).ok());
    Collector out;
    REQUIRE(fx.engine->attach("x", out.sink()).ok());
    REQUIRE(out.wait_done());
    CHECK(out.status.ok());
  }
  check_all_free(*fx.engine);
}

TEST_CASE("decode gauges follow the engine", "[decode]") {
  Metrics metrics;
  Fixture fx(/*n_blocks=*/256, /*max_batch=*/32, &metrics);
  const auto labels = Metrics::role_labels("decode", "test-decode");
  auto value = [&](prometheus::Family<prometheus::Gauge>& family) { return family.Add(labels).Value(); };
  CHECK(value(metrics.kv_blocks_total) == 256);
  CHECK(value(metrics.kv_blocks_free) == 256);

  const auto prompt = random_prompt(20, fx.vocab());
  REQUIRE(fx.engine->admit(admit_for(fx, "m", 20, 900, {}, /*ignore_eos=*/true)).ok());
  CHECK(value(metrics.queue_depth) == 1);
  CHECK(value(metrics.kv_blocks_free) == 256 - 115);  // ceil(920 / 8)
  Collector out;
  REQUIRE(fx.engine->attach("m", out.sink()).ok());
  REQUIRE(send(*fx.engine, prefill(*fx.ref.model, "m", prompt, {}, 8)).ok());
  CHECK(wait_for([&] { return value(metrics.running_sequences) == 1; }));
  CHECK(value(metrics.queue_depth) == 0);
  fx.engine->cancel("m", cancelled("enough"));
  REQUIRE(out.wait_done());
  CHECK(wait_for([&] { return value(metrics.running_sequences) == 0 && value(metrics.kv_blocks_free) == 256; }));
}

TEST_CASE("decode config is validated in one place", "[decode]") {
  DecodeConfig c;
  c.n_blocks = 10;
  CHECK(validate_decode_config(c).ok());
  c.max_batch = 0;
  CHECK_THAT(validate_decode_config(c).message(), Catch::Contains("max_batch"));
  c.max_batch = 4;
  c.block_size = 0;
  CHECK_THAT(validate_decode_config(c).message(), Catch::Contains("block_size"));
  c.block_size = 16;
  c.n_blocks = 0;
  CHECK_THAT(validate_decode_config(c).message(), Catch::Contains("n_blocks"));

  ModelConfig m;
  m.n_layers = 30;
  m.n_kv_heads = 3;
  m.head_dim = 64;
  CHECK(decode_kv_block_bytes(m, 16, DType::kBF16) == 2 * 30 * 16 * 3 * 64 * 2);
}

TEST_CASE("decode engine: a step loop with work that does not move is stalled, an idle one is not", "[decode]") {
  const auto now = DecodeClock::now();
  const auto limit = std::chrono::seconds(60);
  {
    Fixture idle;
    CHECK_FALSE(idle.engine->stalled(now + std::chrono::hours(1), limit));  // waiting for work
  }
  // An engine whose loop never runs (not started) holds a sequence ready to step: stalled once
  // the limit has passed, and no longer once the loop has stepped it to the end.
  Fixture fx(256, 32, nullptr, /*start=*/false);
  const std::vector<int32_t> prompt = {5, 6, 7, 8, 9, 10, 11, 12};
  REQUIRE(fx.engine->admit(admit_for(fx, "s", 8, 4, {}, true)).ok());
  Collector out;
  REQUIRE(fx.engine->attach("s", out.sink()).ok());
  REQUIRE(send(*fx.engine, prefill(*fx.ref.model, "s", prompt, {}, 8)).ok());
  CHECK_FALSE(fx.engine->stalled(DecodeClock::now(), limit));
  CHECK(fx.engine->stalled(DecodeClock::now() + limit + std::chrono::seconds(1), limit));
  fx.engine->start();
  REQUIRE(out.wait_done());
  CHECK_FALSE(fx.engine->stalled(DecodeClock::now() + std::chrono::hours(1), limit));
}
