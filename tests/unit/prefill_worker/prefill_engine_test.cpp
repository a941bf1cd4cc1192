// The prefill step loop on the random test model with an in-process transport that records what
// it is sent: first tokens equal single-process generation, the KV equals a single-prompt
// prefill's, whether prompts run alone, chunked or batched; cancellation and transport failures
// return every block.
#include "prefill_worker/prefill_engine.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "common/metrics.h"
#include "model/generator.h"
#include "model/test_model.h"
#include "tests/unit/prefill_worker/prefill_test_util.h"

using namespace baton;
using namespace baton::testing;

TEST_CASE("prefill engine: first token and KV equal a single-prompt prefill", "[prefill]") {
  Fixture fx;
  std::mt19937 rng(std::random_device{}());
  const ModelConfig& c = fx.model->config();
  const auto prompt = random_prompt(rng, 20 + static_cast<int>(rng() % 100), c.n_vocab);
  const SamplingParams sampling = random_sampling(rng);
  const Reference ref = reference(*fx.model, prompt, sampling);

  RecordingTransport transport;
  Metrics metrics;
  PrefillConfig config;
  config.name = "prefill-test";
  PrefillEngine engine(*fx.model, transport, config, &metrics);
  engine.start();
  Probe probe;
  REQUIRE(engine.submit(make_job("r1", prompt, sampling, probe)).ok());
  REQUIRE(probe.wait_done());
  engine.stop();

  INFO(probe.status.to_string());
  REQUIRE(probe.status.ok());
  CHECK(probe.has_first);
  CHECK_FALSE(probe.first_after_done);
  CHECK(probe.first == ref.first_token);
  CHECK(probe.queue_s >= 0);
  CHECK(probe.prefill_s > 0);
  const auto sent = transport.get("r1");
  CHECK(sent.address == "decode-r1:1234");
  CHECK(sent.header.request_id == "r1");
  CHECK(sent.header.model_fingerprint == "fp-test");
  CHECK(sent.header.dtype == "f32");
  CHECK(sent.header.n_layers == c.n_layers);
  CHECK(sent.header.n_kv_heads == c.n_kv_heads);
  CHECK(sent.header.head_dim == c.head_dim);
  CHECK(sent.header.n_tokens == static_cast<int32_t>(prompt.size()));
  CHECK(sent.first_token == ref.first_token);
  CHECK(sent.header.token_ids == prompt);
  CHECK(probe.bytes == int64_t{2} * c.n_layers * static_cast<int64_t>(prompt.size()) * c.n_kv_heads * c.head_dim * 4);
  check_kv_close(sent.kv, ref.kv);
  CHECK(engine.load().free_blocks == engine.load().total_blocks);
  const auto labels = Metrics::role_labels("prefill", "prefill-test");
  CHECK(metrics.histogram(metrics.prefill_step_tokens, labels).Collect().histogram.sample_count == 1);
  auto transfer_labels = labels;
  transfer_labels["src"] = "prefill-test";
  transfer_labels["dst"] = "decode-r1:1234";
  transfer_labels["transport"] = "recording";
  CHECK(metrics.histogram(metrics.kv_transfer_seconds, transfer_labels).Collect().histogram.sample_count == 1);
  CHECK(metrics.kv_transfer_bytes_total.Add(transfer_labels).Value() == static_cast<double>(probe.bytes));
}

TEST_CASE("prefill engine: prompts longer than the budget are chunked, same first token and KV", "[prefill]") {
  Fixture fx;
  std::mt19937 rng(std::random_device{}());
  const ModelConfig& c = fx.model->config();
  for (const bool stream : {false, true}) {
    INFO("stream_kv " << stream);
    const int budget = 8 + static_cast<int>(rng() % 16);
    const int n = 3 * budget + 1 + static_cast<int>(rng() % budget);
    const auto prompt = random_prompt(rng, n, c.n_vocab);
    const SamplingParams sampling = random_sampling(rng);
    const Reference ref = reference(*fx.model, prompt, sampling);

    RecordingTransport transport;
    PrefillConfig config;
    config.token_budget = budget;
    config.block_size = 8;
    config.stream_kv = stream;
    // Small chunks (3 tokens of K+V): the hand-off splits every layer into many chunks.
    const int64_t row = int64_t{c.n_kv_heads} * c.head_dim * 4;
    config.kv_chunk_bytes = 3 * 2 * row + 5;
    transport.max_chunk_bytes = config.kv_chunk_bytes;
    PrefillEngine engine(*fx.model, transport, config);
    Probe probe;
    REQUIRE(engine.submit(make_job("long", prompt, sampling, probe)).ok());
    CHECK(engine.load().queued_prompt_tokens == n);
    REQUIRE(engine.run_step_for_test());
    CHECK(engine.load().queued_prompt_tokens == n - budget);  // mid-prompt: counted until prefilled
    CHECK(engine.load().n_running == 1);
    CHECK_FALSE(probe.has_first);
    const int steps = 1 + run_all_steps(engine);
    CHECK(steps == (n + budget - 1) / budget);
    CHECK(engine.n_steps() == steps);
    REQUIRE(probe.wait_done());
    REQUIRE(probe.status.ok());
    CHECK(probe.first == ref.first_token);
    const auto sent = transport.get("long");
    CHECK(sent.first_token == ref.first_token);
    // After the prompt, the whole KV at once; streamed, each stretch the sender found (a step's
    // tokens, or several steps' when it fell behind) cut into chunks of 3.
    if (!stream) CHECK(sent.n_chunks == c.n_layers * ((n + 2) / 3));
    if (stream) CHECK(sent.n_chunks >= c.n_layers * ((n + 2) / 3));
    check_kv_close(sent.kv, ref.kv);
    CHECK(engine.load().free_blocks == engine.load().total_blocks);
  }
}

TEST_CASE("prefill engine: streamed KV leaves while the prompt is still being prefilled", "[prefill]") {
  Fixture fx;
  std::mt19937 rng(std::random_device{}());
  const ModelConfig& c = fx.model->config();
  const int budget = 8 + static_cast<int>(rng() % 16);
  const int n = 2 * budget + 1 + static_cast<int>(rng() % budget);  // three steps
  const auto prompt = random_prompt(rng, n, c.n_vocab);
  const SamplingParams sampling = random_sampling(rng);
  const Reference ref = reference(*fx.model, prompt, sampling);
  RecordingTransport transport;
  PrefillConfig config;
  config.token_budget = budget;
  PrefillEngine engine(*fx.model, transport, config);
  Probe probe;
  REQUIRE(engine.submit(make_job("s", prompt, sampling, probe)).ok());
  // Each step's KV, every layer of it, reaches the transport before the next step runs.
  for (int step = 1; step <= 2; ++step) {
    REQUIRE(engine.run_step_for_test());
    INFO("step " << step);
    CHECK(transport.wait_taken("s", [&](const auto& taken) {
      std::vector<int32_t> covered(c.n_layers, 0);
      for (const auto& [layer, end] : taken) covered[layer] = std::max(covered[layer], end);
      return std::all_of(covered.begin(), covered.end(), [&](int32_t e) { return e == step * budget; });
    }));
    CHECK_FALSE(probe.has_first);
    CHECK_FALSE(probe.done);  // the end (the first token) waits for the last step
  }
  REQUIRE(engine.run_step_for_test());
  REQUIRE(probe.wait_done());
  REQUIRE(probe.status.ok());
  CHECK_FALSE(probe.first_after_done);
  const auto sent = transport.get("s");
  CHECK(sent.first_token == ref.first_token);
  check_kv_close(sent.kv, ref.kv);
  CHECK(engine.load().free_blocks == engine.load().total_blocks);
}

TEST_CASE("prefill engine: a transfer that fails mid-prompt stops the prefill and returns the blocks", "[prefill]") {
  Fixture fx;
  std::mt19937 rng(std::random_device{}());
  const ModelConfig& c = fx.model->config();
  RecordingTransport transport;
  transport.result = failed_precondition("the decode worker refused the KV");
  transport.fail_after_chunks = static_cast<int>(rng() % c.n_layers);  // within the first step's
  PrefillConfig config;
  config.token_budget = 8;
  PrefillEngine engine(*fx.model, transport, config);
  Probe probe;
  REQUIRE(engine.submit(make_job("f", random_prompt(rng, 40, c.n_vocab), SamplingParams{}, probe)).ok());
  REQUIRE(engine.run_step_for_test());
  REQUIRE(transport.wait_taken("f", [&](const auto& taken) {
    return static_cast<int>(taken.size()) > transport.fail_after_chunks;
  }));
  // The engine drops the prompt at its next step boundary: no more steps, no first token.
  for (int i = 0; i < 1000 && !probe.done; ++i) {
    engine.run_step_for_test();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  REQUIRE(probe.wait_done());
  CHECK(probe.status.code() == StatusCode::kFailedPrecondition);
  CHECK_FALSE(probe.has_first);
  CHECK(engine.n_steps() < 5);  // 40 tokens would take 5 steps
  CHECK(engine.load().free_blocks == engine.load().total_blocks);
  CHECK(engine.load().n_running == 0);
}

TEST_CASE("prefill engine: jobs batched into one step give the results of each alone", "[prefill]") {
  Fixture fx;
  std::mt19937 rng(std::random_device{}());
  const ModelConfig& c = fx.model->config();
  std::vector<std::vector<int32_t>> prompts;
  std::vector<SamplingParams> samplings;
  std::vector<Reference> refs;
  int total = 0;
  for (int i = 0; i < 4; ++i) {
    prompts.push_back(random_prompt(rng, 2 + static_cast<int>(rng() % 40), c.n_vocab));
    samplings.push_back(random_sampling(rng));
    refs.push_back(reference(*fx.model, prompts.back(), samplings.back()));
    total += static_cast<int>(prompts.back().size());
  }

  for (const bool all_in_one : {true, false}) {
    DYNAMIC_SECTION((all_in_one ? "one step" : "budget cuts through a prompt")) {
      RecordingTransport transport;
      PrefillConfig config;
      // One step for everything, or a budget that makes a later prompt straddle two steps.
      config.token_budget = all_in_one ? total : std::max(1, total - static_cast<int>(prompts.back().size()) / 2 - 1);
      PrefillEngine engine(*fx.model, transport, config);
      std::vector<Probe> probes(prompts.size());
      for (size_t i = 0; i < prompts.size(); ++i) {
        REQUIRE(engine.submit(make_job(std::to_string(i) + "-batched", prompts[i], samplings[i], probes[i])).ok());
      }
      REQUIRE(engine.run_step_for_test());
      if (all_in_one) {
        for (auto& p : probes) CHECK(p.has_first);  // all first tokens out of the one step
        CHECK_FALSE(engine.run_step_for_test());
        CHECK(engine.n_steps() == 1);
      } else {
        CHECK_FALSE(probes.back().has_first);
        CHECK(run_all_steps(engine) >= 1);
      }
      for (size_t i = 0; i < prompts.size(); ++i) {
        INFO("job " << i << " of " << prompts[i].size() << " tokens");
        REQUIRE(probes[i].wait_done());
        REQUIRE(probes[i].status.ok());
        CHECK(probes[i].first == refs[i].first_token);
        check_kv_close(transport.get(std::to_string(i) + "-batched").kv, refs[i].kv);
      }
      CHECK(engine.load().free_blocks == engine.load().total_blocks);
    }
  }
}

TEST_CASE("prefill engine: cancel drops queued, running and sending jobs and returns their blocks", "[prefill]") {
  Fixture fx;
  std::mt19937 rng(std::random_device{}());
  const int vocab = fx.model->config().n_vocab;
  RecordingTransport transport;
  PrefillConfig config;
  config.token_budget = 16;
  PrefillEngine engine(*fx.model, transport, config);
  const SamplingParams greedy;

  SECTION("queued") {
    Probe a, b;
    REQUIRE(engine.submit(make_job("a", random_prompt(rng, 10, vocab), greedy, a)).ok());
    REQUIRE(engine.submit(make_job("b", random_prompt(rng, 10, vocab), greedy, b)).ok());
    engine.cancel("b");
    CHECK(b.done);  // at once, before cancel returned
    CHECK(b.status.code() == StatusCode::kCancelled);
    CHECK(engine.load().n_queued == 1);
    CHECK(engine.load().queued_prompt_tokens == 10);
    run_all_steps(engine);
    REQUIRE(a.wait_done());
    CHECK(a.status.ok());
    CHECK_FALSE(b.has_first);
    CHECK_FALSE(transport.has("b"));
  }
  SECTION("mid-prompt") {
    Probe a;
    REQUIRE(engine.submit(make_job("a", random_prompt(rng, 40, vocab), greedy, a)).ok());
    REQUIRE(engine.run_step_for_test());
    CHECK(engine.load().free_blocks < engine.load().total_blocks);  // holds blocks for the whole prompt
    // Its transfer has begun (a busy machine may schedule the sender thread late).
    REQUIRE(transport.wait_taken("a", [](const auto& taken) { return !taken.empty(); }));
    engine.cancel("a");
    CHECK_FALSE(a.done);  // dropped at the next step boundary, once its transfer let go
    REQUIRE(engine.run_step_for_test());
    REQUIRE(a.wait_done());
    CHECK(a.status.code() == StatusCode::kCancelled);
    REQUIRE(transport.has("a"));
    CHECK_FALSE(transport.get("a").first_token);  // the transfer was abandoned
    CHECK_FALSE(a.has_first);
    CHECK_FALSE(engine.run_step_for_test());
    CHECK(engine.n_steps() == 1);
  }
  SECTION("during the KV transfer") {
    transport.close_gate();
    Probe a;
    REQUIRE(engine.submit(make_job("a", random_prompt(rng, 12, vocab), greedy, a)).ok());
    REQUIRE(engine.run_step_for_test());
    CHECK(a.has_first);
    REQUIRE(transport.wait_held(1));
    CHECK(engine.load().n_sending == 1);
    engine.cancel("a");
    transport.open_gate();
    REQUIRE(a.wait_done());
    CHECK(a.status.code() == StatusCode::kCancelled);
    CHECK(transport.get("a").n_chunks == 0);  // the transfer ended before any chunk
  }
  SECTION("unknown ids are ignored") {
    engine.cancel("nobody");
    CHECK_FALSE(engine.run_step_for_test());
  }
  engine.stop();
  CHECK(engine.load().free_blocks == engine.load().total_blocks);
}

TEST_CASE("prefill engine: a transport failure reaches on_done and returns the blocks", "[prefill]") {
  Fixture fx;
  std::mt19937 rng(std::random_device{}());
  RecordingTransport transport;
  transport.result = unavailable("decode worker down");
  Metrics metrics;
  PrefillConfig config;
  config.name = "p0";
  PrefillEngine engine(*fx.model, transport, config, &metrics);
  engine.start();
  Probe a;
  REQUIRE(engine.submit(make_job("a", random_prompt(rng, 30, fx.model->config().n_vocab), SamplingParams{}, a)).ok());
  REQUIRE(a.wait_done());
  CHECK(a.has_first);  // the first token went out before the transfer failed
  CHECK(a.status.code() == StatusCode::kUnavailable);
  CHECK(engine.load().free_blocks == engine.load().total_blocks);
  CHECK(engine.load().n_sending == 0);
  auto labels = Metrics::role_labels("prefill", "p0");
  labels["src"] = "p0";
  labels["dst"] = "decode-a:1234";
  labels["transport"] = "recording";
  CHECK(metrics.kv_transfer_errors_total.Add(labels).Value() == 1);
  // The id is free again: a retry (failover) is accepted.
  Probe retry;
  transport.result = {};
  REQUIRE(
      engine.submit(make_job("a", random_prompt(rng, 30, fx.model->config().n_vocab), SamplingParams{}, retry)).ok());
  REQUIRE(retry.wait_done());
  CHECK(retry.status.ok());
}

TEST_CASE("prefill engine: a job waits until the pool can hold its whole prompt", "[prefill]") {
  Fixture fx;
  std::mt19937 rng(std::random_device{}());
  const int vocab = fx.model->config().n_vocab;
  RecordingTransport transport;
  PrefillConfig config;
  config.block_size = 8;
  config.n_blocks = 5;  // 40 tokens: one 30-token prompt at a time
  PrefillEngine engine(*fx.model, transport, config);
  transport.close_gate();
  Probe a, b;
  REQUIRE(engine.submit(make_job("a", random_prompt(rng, 30, vocab), SamplingParams{}, a)).ok());
  REQUIRE(engine.submit(make_job("b", random_prompt(rng, 30, vocab), SamplingParams{}, b)).ok());
  REQUIRE(engine.run_step_for_test());
  CHECK(a.has_first);
  REQUIRE(transport.wait_held(1));
  CHECK_FALSE(engine.run_step_for_test());  // b does not fit while a's KV is being sent
  CHECK(engine.load().n_queued == 1);
  transport.open_gate();
  REQUIRE(a.wait_done());
  REQUIRE(engine.run_step_for_test());
  REQUIRE(b.wait_done());
  CHECK(b.status.ok());
  CHECK(engine.load().free_blocks == 5);
}

TEST_CASE("prefill engine: submit refuses what it can never run", "[prefill]") {
  Fixture fx;
  std::mt19937 rng(std::random_device{}());
  const ModelConfig& c = fx.model->config();
  RecordingTransport transport;
  PrefillConfig config;
  config.block_size = 8;
  config.n_blocks = 4;
  config.max_queued_tokens = 40;
  PrefillEngine engine(*fx.model, transport, config);
  Probe p;
  auto job = [&](std::vector<int32_t> tokens) { return make_job("x", std::move(tokens), SamplingParams{}, p); };

  CHECK(engine.submit(job({})).code() == StatusCode::kInvalidArgument);
  CHECK(engine.submit(job({1, c.n_vocab})).code() == StatusCode::kInvalidArgument);
  CHECK(engine.submit(job({-1})).code() == StatusCode::kInvalidArgument);
  CHECK(engine.submit(job(random_prompt(rng, 33, c.n_vocab))).code() == StatusCode::kInvalidArgument);  // > 4 blocks
  {
    PrefillConfig big = config;
    big.n_blocks = c.n_ctx;  // the pool is not the limit here, the context is
    PrefillEngine e2(*fx.model, transport, big);
    CHECK(e2.submit(job(random_prompt(rng, c.n_ctx, c.n_vocab))).code() == StatusCode::kInvalidArgument);
  }
  auto bad_sampling = job({1, 2});
  bad_sampling.sampling.top_p = 0;
  CHECK(engine.submit(bad_sampling).code() == StatusCode::kInvalidArgument);
  auto no_address = job({1, 2});
  no_address.decode_address.clear();
  CHECK(engine.submit(no_address).code() == StatusCode::kInvalidArgument);
  CHECK_FALSE(p.done);  // refused jobs never call back

  Probe q1, q2, q3;
  REQUIRE(engine.submit(make_job("q1", random_prompt(rng, 30, c.n_vocab), SamplingParams{}, q1)).ok());
  CHECK(engine.submit(make_job("q1", random_prompt(rng, 3, c.n_vocab), SamplingParams{}, q2)).code() ==
        StatusCode::kFailedPrecondition);
  CHECK(engine.submit(make_job("q3", random_prompt(rng, 11, c.n_vocab), SamplingParams{}, q3)).code() ==
        StatusCode::kResourceExhausted);  // 30 + 11 > 40 queued tokens
  engine.stop();
  CHECK(q1.done);
  CHECK(q1.status.code() == StatusCode::kUnavailable);
  CHECK(engine.submit(make_job("late", {1}, SamplingParams{}, q3)).code() == StatusCode::kUnavailable);
}

TEST_CASE("prefill engine: after a failover the seeded stream continues where it stopped", "[prefill]") {
  Fixture fx;
  std::mt19937 rng(std::random_device{}());
  const ModelConfig& c = fx.model->config();
  const auto prompt = random_prompt(rng, 5 + static_cast<int>(rng() % 30), c.n_vocab);
  SamplingParams sampling = random_sampling(rng);
  sampling.temperature = 1.5f;  // flat enough that skipping draws matters
  const int n_generated = 1 + static_cast<int>(rng() % 5);
  // Single process: the prompt, then n_generated + 1 tokens.
  GenerateOptions opt;
  opt.max_tokens = n_generated + 1;
  opt.ignore_eos = true;
  opt.sampling = sampling;
  Generator gen(*fx.model);
  auto r = gen.generate(prompt, opt);
  REQUIRE(r.ok());
  REQUIRE(static_cast<int>(r->tokens.size()) == n_generated + 1);

  RecordingTransport transport;
  PrefillEngine engine(*fx.model, transport, PrefillConfig{});
  Probe probe;
  std::vector<int32_t> tokens = prompt;
  tokens.insert(tokens.end(), r->tokens.begin(), r->tokens.begin() + n_generated);
  PrefillJob job = make_job("failover", tokens, sampling, probe);
  job.n_generated = n_generated;
  REQUIRE(engine.submit(std::move(job)).ok());
  run_all_steps(engine);
  REQUIRE(probe.wait_done());
  CHECK(probe.first == r->tokens.back());
  CHECK(transport.get("failover").header.token_ids == tokens);
}

TEST_CASE("prefill engine: a step loop with work that does not move is stalled, an idle one is not", "[prefill]") {
  Fixture fx;
  RecordingTransport transport;
  PrefillConfig config;
  const auto limit = std::chrono::seconds(60);
  const auto later = [&] { return std::chrono::steady_clock::now() + limit + std::chrono::seconds(1); };
  {
    PrefillEngine idle(*fx.model, transport, config);
    idle.start();
    CHECK_FALSE(idle.stalled(later() + std::chrono::hours(1), limit));
    idle.stop();
  }
  // No engine thread: a queued prompt does not move.
  PrefillEngine engine(*fx.model, transport, config);
  Probe probe;
  REQUIRE(engine.submit(make_job("s", {5, 6, 7, 8}, SamplingParams{}, probe)).ok());
  CHECK_FALSE(engine.stalled(std::chrono::steady_clock::now(), limit));
  CHECK(engine.stalled(later(), limit));
  run_all_steps(engine);
  CHECK_FALSE(engine.stalled(later(), limit));  // nothing left to run
  engine.stop();
}
