// The prefill engine with its prefix cache, on the random test model: a prompt that shares a
// prefix with an earlier one (nothing, part of one block, whole blocks, all but its last token,
// everything) gets the first token and KV of a prefill without the cache and reuses exactly the
// shared whole blocks; the same after evictions under pressure; blocks shared by jobs in flight
// are never written and are held until no job and no transfer reads them; cancelled, failed and
// refused jobs give every block back; the load report and the metrics say what is cached.
#include <algorithm>
#include <catch2/catch.hpp>
#include <random>
#include <set>
#include <tuple>

#include "common/metrics.h"
#include "kv/prefix_hash.h"
#include "tests/unit/prefill_worker/prefill_test_util.h"

using namespace baton;
using namespace baton::testing;

namespace {

struct Seeded {
  uint32_t seed = std::random_device{}();
  std::mt19937 rng{seed};
};

// Leading tokens two prompts share.
size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}

// Tokens the cache should supply to `q` when every full block of `earlier` is cached: the shared
// whole blocks, but never the block holding q's last token.
int32_t expected_cached(const std::vector<int32_t>& earlier, const std::vector<int32_t>& q, int bs) {
  const size_t blocks = std::min(common_prefix(earlier, q) / bs, (q.size() - 1) / bs);
  return static_cast<int32_t>(blocks * bs);
}

// `tokens` from `from` on replaced by fresh ones (the first of them differs from what it replaces).
std::vector<int32_t> diverge(std::mt19937& rng, std::vector<int32_t> tokens, size_t from, size_t n_total, int vocab) {
  const std::vector<int32_t> orig = tokens;
  tokens.resize(from);
  while (tokens.size() < n_total) tokens.push_back(static_cast<int32_t>(rng() % vocab));
  if (from < orig.size() && from < tokens.size() && tokens[from] == orig[from]) tokens[from] = (orig[from] + 1) % vocab;
  return tokens;
}

struct Outcome {
  Status status;
  int32_t first = -1;
  int32_t n_cached = -1;
  Kv kv;
};

// Submits one job, runs the steps on this thread, waits for its transfer.
Outcome run_job(PrefillEngine& engine, RecordingTransport& transport, const std::string& id,
                const std::vector<int32_t>& tokens, const SamplingParams& sampling) {
  Probe probe;
  REQUIRE(engine.submit(make_job(id, tokens, sampling, probe)).ok());
  run_all_steps(engine);
  REQUIRE(probe.wait_done());
  Outcome o{probe.status, probe.first, probe.n_cached, {}};
  if (transport.has(id)) o.kv = transport.get(id).kv;
  return o;
}

double counter(prometheus::Family<prometheus::Counter>& f, const prometheus::Labels& labels) {
  return f.Add(labels).Value();
}

}  // namespace

TEST_CASE("prefix cache: the first token and KV equal a prefill without it, whatever the prompts share",
          "[prefill][prefix]") {
  Fixture fx;
  Seeded s;
  INFO("seed " << s.seed);
  const ModelConfig& c = fx.model->config();
  const int vocab = c.n_vocab;
  enum Share { kNothing, kPartOfABlock, kWholeBlocks, kAllButTheLastToken, kEverything };
  for (const Share share : {kNothing, kPartOfABlock, kWholeBlocks, kAllButTheLastToken, kEverything}) {
    for (const bool greedy : {true, false}) {
      const int bs = 4 << (s.rng() % 3);  // 4, 8 or 16
      const size_t n_p = bs * (2 + s.rng() % 4) + s.rng() % bs;
      const auto p = random_prompt(s.rng, static_cast<int>(n_p), vocab);
      std::vector<int32_t> q;
      switch (share) {
        case kNothing: q = diverge(s.rng, p, 0, bs * (1 + s.rng() % 4) + s.rng() % bs + 1, vocab); break;
        case kPartOfABlock: q = diverge(s.rng, p, 1 + s.rng() % (bs - 1), n_p + s.rng() % (2 * bs), vocab); break;
        case kWholeBlocks: {
          const size_t n = bs * (1 + s.rng() % (n_p / bs));
          q = diverge(s.rng, p, n, n + 1 + s.rng() % (2 * bs), vocab);
          break;
        }
        case kAllButTheLastToken: q = diverge(s.rng, p, n_p - 1, n_p, vocab); break;
        case kEverything: q = p; break;
      }
      const SamplingParams sampling = greedy ? SamplingParams{} : random_sampling(s.rng);
      INFO("share " << share << ", block size " << bs << ", prompts of " << p.size() << " and " << q.size()
                    << ", shared " << common_prefix(p, q) << (greedy ? ", greedy" : ", sampled"));
      const Reference ref = reference(*fx.model, q, sampling);

      RecordingTransport with, without;
      PrefillConfig config;
      config.block_size = bs;
      config.token_budget = 8 + static_cast<int>(s.rng() % 24);  // chunked too
      PrefillEngine cached(*fx.model, with, config);
      config.prefix_cache_blocks = 0;
      PrefillEngine plain(*fx.model, without, config);

      REQUIRE(run_job(cached, with, "p", p, sampling).status.ok());
      const Outcome a = run_job(cached, with, "q", q, sampling);
      const Outcome b = run_job(plain, without, "q", q, sampling);
      REQUIRE(a.status.ok());
      REQUIRE(b.status.ok());
      CHECK(a.n_cached == expected_cached(p, q, bs));
      CHECK(b.n_cached == 0);
      if (share == kWholeBlocks || share == kEverything) CHECK(a.n_cached > 0);  // the case is what it says
      if (share == kNothing || share == kPartOfABlock) CHECK(a.n_cached == 0);
      CHECK(a.first == b.first);
      CHECK(a.first == ref.first_token);
      check_kv_close(a.kv, ref.kv);
      check_kv_close(a.kv, b.kv);
      CHECK(cached.load().free_blocks == cached.load().total_blocks);
    }
  }
}

TEST_CASE("prefix cache: after evictions under pressure every prompt still gets its own KV", "[prefill][prefix]") {
  Fixture fx;
  Seeded s;
  INFO("seed " << s.seed);
  const int vocab = fx.model->config().n_vocab;
  const int bs = 4;
  RecordingTransport transport;
  Metrics metrics;
  PrefillConfig config;
  config.block_size = bs;
  config.token_budget = 16;
  config.n_blocks = 24;                                            // room for two of the longest prompts
  config.prefix_cache_blocks = 8 + static_cast<int>(s.rng() % 8);  // fewer than the prompts' blocks
  config.name = "p";
  PrefillEngine engine(*fx.model, transport, config, &metrics);
  std::vector<std::vector<int32_t>> roots;
  for (int i = 0; i < 3; ++i) roots.push_back(random_prompt(s.rng, 9 * bs, vocab));
  std::vector<std::vector<int32_t>> seen;
  int64_t reused = 0;
  for (int i = 0; i < 24; ++i) {
    // A root cut somewhere, then a fresh tail; every fourth prompt an earlier one again.
    std::vector<int32_t> q;
    if (i % 4 == 3) {
      q = seen[s.rng() % seen.size()];
    } else {
      const auto& root = roots[s.rng() % roots.size()];
      q = diverge(s.rng, root, s.rng() % root.size(), 1 + s.rng() % (10 * bs), vocab);
    }
    seen.push_back(q);
    const SamplingParams sampling = i % 2 == 0 ? SamplingParams{} : random_sampling(s.rng);
    const Reference ref = reference(*fx.model, q, sampling);
    const Outcome o = run_job(engine, transport, "q" + std::to_string(i), q, sampling);
    INFO("prompt " << i << " of " << q.size() << " tokens, " << o.n_cached << " cached");
    REQUIRE(o.status.ok());
    CHECK(o.first == ref.first_token);
    check_kv_close(o.kv, ref.kv);
    CHECK(o.n_cached % bs == 0);
    CHECK(o.n_cached < static_cast<int32_t>(q.size()));
    reused += o.n_cached;
    CHECK(engine.load().n_cached_blocks <= config.prefix_cache_blocks);
  }
  const auto labels = Metrics::role_labels("prefill", "p");
  CHECK(reused > 0);
  CHECK(counter(metrics.prefix_cache_evicted_blocks_total, labels) > 0);
  CHECK(counter(metrics.prefix_cache_hit_tokens_total, labels) == static_cast<double>(reused));
  CHECK(engine.load().free_blocks == engine.load().total_blocks);
}

TEST_CASE("prefix cache: blocks shared by jobs in flight are never written and held until the last reader is done",
          "[prefill][prefix]") {
  Fixture fx;
  Seeded s;
  INFO("seed " << s.seed);
  const ModelConfig& c = fx.model->config();
  const int bs = 8;
  const int budget = 16;
  RecordingTransport transport;
  PrefillConfig config;
  config.block_size = bs;
  config.token_budget = budget;
  // Small chunks: the cached part alone takes several per layer.
  const int64_t row = int64_t{c.n_kv_heads} * c.head_dim * 4;
  config.kv_chunk_bytes = 2 * 2 * row;
  PrefillEngine engine(*fx.model, transport, config);
  const auto p = random_prompt(s.rng, 3 * bs + 3, c.n_vocab);
  const size_t shared = bs * (1 + s.rng() % 3);
  const auto q = diverge(s.rng, p, shared, shared + budget + 1 + s.rng() % budget, c.n_vocab);  // two steps of its own
  const SamplingParams sampling = random_sampling(s.rng);
  const Reference ref_p = reference(*fx.model, p, sampling);
  const Reference ref_q = reference(*fx.model, q, sampling);

  transport.close_gate();  // both transfers wait: p's blocks stay held by its transfer
  Probe pp, pq;
  REQUIRE(engine.submit(make_job("p", p, sampling, pp)).ok());
  run_all_steps(engine);
  REQUIRE(transport.wait_held(1));
  CHECK(pp.has_first);
  const int p_blocks = (static_cast<int>(p.size()) + bs - 1) / bs;
  CHECK(engine.load().free_blocks == engine.load().total_blocks - p_blocks);
  REQUIRE(engine.submit(make_job("q", q, sampling, pq)).ok());
  CHECK(engine.load().queued_prompt_tokens == static_cast<int64_t>(q.size() - shared));  // its cached part excluded
  REQUIRE(engine.run_step_for_test());
  const int q_blocks = (static_cast<int>(q.size()) + bs - 1) / bs;
  const int q_fresh = q_blocks - static_cast<int>(shared / bs);
  CHECK(engine.load().free_blocks == engine.load().total_blocks - p_blocks - q_fresh);  // the shared ones once
  run_all_steps(engine);
  REQUIRE(transport.wait_held(2));
  CHECK(pq.n_cached == static_cast<int32_t>(shared));
  transport.open_gate();
  REQUIRE(pp.wait_done());
  REQUIRE(pq.wait_done());
  REQUIRE(pp.status.ok());
  REQUIRE(pq.status.ok());
  // p's KV, read after q ran on its blocks: q wrote only its own.
  CHECK(pp.first == ref_p.first_token);
  check_kv_close(transport.get("p").kv, ref_p.kv);
  CHECK(pq.first == ref_q.first_token);
  check_kv_close(transport.get("q").kv, ref_q.kv);
  // q's transfer sent the cached part first, every layer of it, as one stretch.
  std::vector<std::pair<int32_t, int32_t>> taken;
  REQUIRE(transport.wait_taken("q", [&](const auto& t) {
    taken = t;
    return true;
  }));
  const int per_layer = static_cast<int>((shared + 1) / 2);  // chunks of two tokens
  REQUIRE(static_cast<int>(taken.size()) >= c.n_layers * per_layer);
  for (int i = 0; i < c.n_layers * per_layer; ++i) {
    INFO("chunk " << i);
    CHECK(taken[i].first == i / per_layer);
    CHECK(taken[i].second <= static_cast<int32_t>(shared));
  }
  CHECK(engine.load().free_blocks == engine.load().total_blocks);
}

TEST_CASE("prefix cache: cancelled, failed and refused jobs give every block back", "[prefill][prefix]") {
  Fixture fx;
  Seeded s;
  INFO("seed " << s.seed);
  const ModelConfig& c = fx.model->config();
  const int bs = 8;
  RecordingTransport transport;
  PrefillConfig config;
  config.block_size = bs;
  config.token_budget = 16;
  PrefillEngine engine(*fx.model, transport, config);
  const auto p = random_prompt(s.rng, 6 * bs + 1, c.n_vocab);  // four steps
  const SamplingParams greedy;

  SECTION("a job cancelled while another reuses its blocks") {
    for (const bool cancel_first : {true, false}) {
      INFO((cancel_first ? "the earlier job cancelled" : "the later job cancelled"));
      Probe a, b;
      const std::string ida = cancel_first ? "a1" : "a2", idb = cancel_first ? "b1" : "b2";
      const auto pa = diverge(s.rng, p, 0, p.size(), c.n_vocab);  // a fresh prompt each round
      REQUIRE(engine.submit(make_job(ida, pa, greedy, a)).ok());
      REQUIRE(engine.run_step_for_test());  // pa's first two blocks are cached now
      const auto pb = diverge(s.rng, pa, 2 * bs, 5 * bs, c.n_vocab);
      REQUIRE(engine.submit(make_job(idb, pb, greedy, b)).ok());
      REQUIRE(engine.run_step_for_test());  // both run: b on a's blocks
      engine.cancel(cancel_first ? ida : idb);
      run_all_steps(engine);
      REQUIRE(a.wait_done());
      REQUIRE(b.wait_done());
      Probe& survivor = cancel_first ? b : a;
      Probe& gone = cancel_first ? a : b;
      CHECK(gone.status.code() == StatusCode::kCancelled);
      REQUIRE(survivor.status.ok());
      const auto& kept = cancel_first ? pb : pa;
      const Reference ref = reference(*fx.model, kept, greedy);
      CHECK(survivor.first == ref.first_token);
      check_kv_close(transport.get(cancel_first ? idb : ida).kv, ref.kv);
      if (cancel_first) CHECK(b.n_cached == 2 * bs);
      CHECK(engine.load().free_blocks == engine.load().total_blocks);
    }
  }
  SECTION("a failed transfer, then a job that reuses what the failed one cached") {
    transport.result = unavailable("decode worker down");
    Probe a;
    REQUIRE(engine.submit(make_job("a", p, greedy, a)).ok());
    run_all_steps(engine);
    REQUIRE(a.wait_done());
    CHECK(a.status.code() == StatusCode::kUnavailable);
    CHECK(engine.load().free_blocks == engine.load().total_blocks);
    transport.result = {};
    const Outcome o = run_job(engine, transport, "b", p, greedy);
    REQUIRE(o.status.ok());
    CHECK(o.n_cached == expected_cached(p, p, bs));
    const Reference ref = reference(*fx.model, p, greedy);
    CHECK(o.first == ref.first_token);
    check_kv_close(o.kv, ref.kv);
  }
  SECTION("a transfer refused mid-prompt") {
    transport.result = failed_precondition("the decode worker refused the KV");
    transport.fail_after_chunks = static_cast<int>(s.rng() % c.n_layers);
    REQUIRE(run_job(engine, transport, "warm", p, greedy).status.code() == StatusCode::kFailedPrecondition);
    Probe b;
    REQUIRE(engine.submit(make_job("b", p, greedy, b)).ok());  // reuses what "warm" cached before it stopped
    for (int i = 0; i < 1000 && !b.done; ++i) {
      engine.run_step_for_test();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    REQUIRE(b.wait_done());
    CHECK(b.status.code() == StatusCode::kFailedPrecondition);
    CHECK(engine.load().n_running == 0);
  }
  SECTION("a job still queued at shutdown") {
    Probe a, b;
    REQUIRE(engine.submit(make_job("a", p, greedy, a)).ok());
    REQUIRE(engine.run_step_for_test());
    REQUIRE(engine.submit(make_job("b", p, greedy, b)).ok());
    engine.stop();
    REQUIRE(a.wait_done());
    REQUIRE(b.wait_done());
    CHECK(b.status.code() == StatusCode::kUnavailable);
  }
  engine.stop();
  CHECK(engine.load().free_blocks == engine.load().total_blocks);
}

TEST_CASE("prefix cache: the load report and the metrics say what is cached", "[prefill][prefix]") {
  Fixture fx;
  Seeded s;
  INFO("seed " << s.seed);
  const ModelConfig& c = fx.model->config();
  const int bs = 4 << (s.rng() % 3);
  const auto p = random_prompt(s.rng, bs * (2 + s.rng() % 4) + static_cast<int>(s.rng() % bs), c.n_vocab);
  const uint64_t seed = prefix_hash_seed(fx.model->fingerprint(), "f32", bs);
  const auto hashes = prefix_block_hashes(seed, bs, p);
  for (const int bound : {-1, 0}) {
    INFO("prefix_cache_blocks " << bound);
    RecordingTransport transport;
    Metrics metrics;
    PrefillConfig config;
    config.block_size = bs;
    config.prefix_cache_blocks = bound;
    config.name = "w";
    PrefillEngine engine(*fx.model, transport, config, &metrics);
    const auto labels = Metrics::role_labels("prefill", "w");
    const Outcome first = run_job(engine, transport, "p1", p, SamplingParams{});
    const Outcome again = run_job(engine, transport, "p2", p, SamplingParams{});
    REQUIRE(first.status.ok());
    REQUIRE(again.status.ok());
    CHECK(again.first == first.first);
    const PrefillLoad load = engine.load();
    CHECK(load.prefix_hash_seed == seed);
    CHECK(load.free_blocks == load.total_blocks);
    const std::set<uint64_t> reported(load.cached_block_hashes.begin(), load.cached_block_hashes.end());
    if (bound == 0) {
      CHECK(load.prefix_cache_blocks == 0);
      CHECK(load.n_cached_blocks == 0);
      CHECK(reported.empty());
      CHECK(again.n_cached == 0);
      CHECK(counter(metrics.prefix_cache_lookup_tokens_total, labels) == 0);
      continue;
    }
    CHECK(load.prefix_cache_blocks == load.total_blocks);  // -1: the whole pool
    CHECK(load.n_cached_blocks == static_cast<int>(hashes.size()));
    CHECK(reported == std::set<uint64_t>(hashes.begin(), hashes.end()));
    CHECK(load.cached_block_hashes.front() == hashes.front());  // the most recently used first
    CHECK(again.n_cached == expected_cached(p, p, bs));
    CHECK(counter(metrics.prefix_cache_lookup_tokens_total, labels) == 2.0 * p.size());
    CHECK(counter(metrics.prefix_cache_hit_tokens_total, labels) == again.n_cached);
    CHECK(counter(metrics.prefix_cache_inserted_blocks_total, labels) == hashes.size());
    CHECK(counter(metrics.prefix_cache_evicted_blocks_total, labels) == 0);
    CHECK(metrics.prefix_cache_blocks.Add(labels).Value() == hashes.size());
    CHECK(metrics.kv_blocks_free.Add(labels).Value() == load.total_blocks);
    // A waiting job's queued tokens leave out what the cache holds of it.
    Probe w;
    REQUIRE(engine.submit(make_job("w", p, SamplingParams{}, w)).ok());
    CHECK(engine.load().queued_prompt_tokens == static_cast<int64_t>(p.size()) - again.n_cached);
    run_all_steps(engine);
    REQUIRE(w.wait_done());
  }
}

TEST_CASE("prefix cache: prompts that arrive together with one prefix compute it once", "[prefill][prefix]") {
  Fixture fx;
  Seeded s;
  INFO("seed " << s.seed);
  const ModelConfig& c = fx.model->config();
  const int bs = 8;
  for (const int budget : {512, 16}) {  // the prefix in one step, or chunked over several
    INFO("budget " << budget);
    RecordingTransport transport;
    Metrics metrics;
    PrefillConfig config;
    config.block_size = bs;
    config.token_budget = budget;
    config.name = "w";
    PrefillEngine engine(*fx.model, transport, config, &metrics);
    const auto prefix = random_prompt(s.rng, 4 * bs + static_cast<int>(s.rng() % bs), c.n_vocab);
    const auto q1 = diverge(s.rng, prefix, prefix.size(), prefix.size() + 1 + s.rng() % 20, c.n_vocab);
    const auto q2 = diverge(s.rng, prefix, prefix.size(), prefix.size() + 1 + s.rng() % 20, c.n_vocab);
    const auto q3 = random_prompt(s.rng, 5 + static_cast<int>(s.rng() % 20), c.n_vocab);  // shares nothing
    const SamplingParams greedy;
    Probe p1, p2, p3;
    REQUIRE(engine.submit(make_job("q1", q1, greedy, p1)).ok());
    REQUIRE(engine.submit(make_job("q2", q2, greedy, p2)).ok());
    REQUIRE(engine.submit(make_job("q3", q3, greedy, p3)).ok());
    REQUIRE(engine.run_step_for_test());
    CHECK(engine.load().n_queued == 2);  // q2 waits for the prefix q1 computes; q3 behind it
    run_all_steps(engine);
    for (Probe* p : {&p1, &p2, &p3}) {
      REQUIRE(p->wait_done());
      REQUIRE(p->status.ok());
    }
    CHECK(p1.n_cached == 0);
    CHECK(p2.n_cached == expected_cached(q1, q2, bs));
    CHECK(p2.n_cached == static_cast<int32_t>(prefix.size() / bs * bs));
    CHECK(p3.n_cached == 0);
    const auto labels = Metrics::role_labels("prefill", "w");
    const double computed = metrics.histogram(metrics.prefill_step_tokens, labels).Collect().histogram.sample_sum;
    CHECK(computed == static_cast<double>(q1.size() + q2.size() - p2.n_cached + q3.size()));
    for (const auto& [id, q, p] : {std::tuple{"q1", q1, &p1}, std::tuple{"q2", q2, &p2}, std::tuple{"q3", q3, &p3}}) {
      const Reference ref = reference(*fx.model, q, greedy);
      CHECK(p->first == ref.first_token);
      check_kv_close(transport.get(id).kv, ref.kv);
    }
    CHECK(engine.load().free_blocks == engine.load().total_blocks);
  }
}
