// Shared by the decode worker's tests: the random test model loaded twice (the engine's and the
// test's own, which plays the prefill worker and runs the single-process reference), a prefill
// that exports KV as a prefill worker would, and a Stream-like event collector.
#pragma once

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <random>
#include <thread>

#include "common/metrics.h"
#include "decode_worker/decode_engine.h"
#include "kv/block_pool.h"
#include "kv/kv_incoming.h"
#include "model/batch.h"
#include "model/generator.h"
#include "model/test_model.h"
#include "model/tokenizer.h"
#include "tests/unit/test_model_fixture.h"

namespace baton::decode_test {

using namespace std::chrono_literals;

using LoadedModel = testing::LoadedTestModel;

// The engine gets its own model: Model::forward is not reentrant, and the test prefills and runs
// the reference Generator on `ref` while the engine thread decodes.
struct Fixture {
  // local_prefill_max_tokens / local_prefill_token_budget: DecodeConfig's (0: no local prefill).
  explicit Fixture(int n_blocks = 256, int max_batch = 32, Metrics* metrics = nullptr, bool start = true,
                   int local_prefill_max_tokens = 0, int local_prefill_token_budget = 512,
                   std::chrono::milliseconds fork_hold = 10s, std::chrono::milliseconds slot_wait_beat = 500ms) {
    auto tok = Tokenizer::from_gguf(*ref.file);
    REQUIRE(tok.ok());
    stop_ids = (*tok)->stop_ids();
    REQUIRE(!stop_ids.empty());
    DecodeConfig cfg;
    cfg.n_blocks = n_blocks;
    cfg.block_size = 8;
    cfg.max_batch = max_batch;
    cfg.name = "test-decode";
    cfg.local_prefill_max_tokens = local_prefill_max_tokens;
    cfg.local_prefill_token_budget = local_prefill_token_budget;
    cfg.fork_hold = fork_hold;
    cfg.slot_wait_beat = slot_wait_beat;
    auto e = DecodeEngine::create(*dec.model, stop_ids, cfg, metrics);
    REQUIRE(e.ok());
    engine = std::move(*e);
    if (start) engine->start();
  }
  int vocab() const { return ref.model->config().n_vocab; }
  const std::string& fingerprint() const { return ref.model->fingerprint(); }

  LoadedModel ref;
  LoadedModel dec;
  std::vector<int32_t> stop_ids;
  std::unique_ptr<DecodeEngine> engine;
};

// Fresh randomness each run (test thread only).
inline uint32_t rnd() {
  static std::mt19937 r(std::random_device{}());
  return r();
}

inline std::vector<int32_t> random_prompt(int n, int vocab) {
  std::vector<int32_t> p(n);
  for (int32_t& t : p) t = static_cast<int32_t>(rnd() % vocab);
  return p;
}

// What a prefill worker hands over.
struct Transfer {
  KvTransferHeader header;
  std::vector<KvChunk> chunks;
  int32_t first_token = 0;  // the end's: sampled at the prompt's last position
  TokenLogprobs first_logprobs;
};

// Prefills `prompt` in a cache of its own, samples the first token as the prefill worker does (a
// fresh Sampler's first draw, penalised by the prompt and its last `n_output` tokens as earlier
// output) and exports every layer in chunks of `chunk_tokens`.
inline Transfer prefill(Model& model, const std::string& id, const std::vector<int32_t>& prompt,
                        const SamplingParams& sampling, int chunk_tokens, int n_output = 0) {
  const ModelConfig& c = model.config();
  const int n = static_cast<int>(prompt.size());
  BlockPool pool(64, 16);
  auto cache = model.make_kv_cache(pool.n_total(), pool.block_size(), DType::kF32);
  std::vector<int32_t> table;
  REQUIRE(pool.grow_to(table, n));
  StepBatch batch;
  batch.add(prompt, 0, table, Logits::kLast);
  std::vector<float> logits;
  model.forward(batch, *cache, &logits);
  Sampler sampler(sampling);
  const std::span<const int32_t> all(prompt);
  sampler.set_history(all.first(all.size() - n_output), all.last(n_output));

  Transfer t;
  KvTransferHeader& h = t.header;
  h.request_id = id;
  h.model_fingerprint = model.fingerprint();
  h.dtype = "f32";
  h.n_layers = c.n_layers;
  h.n_kv_heads = c.n_kv_heads;
  h.head_dim = c.head_dim;
  h.n_tokens = n;
  t.first_token = sampler.sample(logits, n, &t.first_logprobs);
  h.token_ids = prompt;
  for (int layer = 0; layer < c.n_layers; ++layer) {
    for (int s = 0; s < n; s += chunk_tokens) {
      KvChunk ch;
      ch.layer = layer;
      ch.token_start = s;
      ch.token_count = std::min(chunk_tokens, n - s);
      ch.k.resize(static_cast<size_t>(kv_chunk_bytes(h, ch.token_count)));
      ch.v.resize(ch.k.size());
      model.backend().kv_export(*cache, layer, table.data(), s, ch.token_count, ch.k.data(), ch.v.data());
      ch.checksum = kv_checksum(ch.k, ch.v);
      t.chunks.push_back(std::move(ch));
    }
  }
  pool.release(table);
  return t;
}

// Drives a receiver as a transport does, through a KvIncoming: the first refusal aborts the
// transfer.
inline Status send(KvReceiver& r, const Transfer& t) {
  KvIncoming incoming(r, nullptr);
  BATON_RETURN_IF_ERROR(incoming.begin(t.header));
  for (const KvChunk& c : t.chunks) BATON_RETURN_IF_ERROR(incoming.chunk(c));
  return incoming.end(t.first_token);
}

// A Stream subscriber: collects events, lets the test wait for the final one.
struct Collector {
  DecodeSink sink() {
    return [this](const DecodeOutput& o) {
      std::lock_guard lk(mu);
      if (done) event_after_done = true;  // checked by the test thread (Catch2 asserts are not thread-safe)
      tokens.insert(tokens.end(), o.token_ids.begin(), o.token_ids.end());
      logprobs.insert(logprobs.end(), o.logprobs.begin(), o.logprobs.end());
      if (o.token_ids.empty() && !o.done) {
        ++n_beats;  // waiting for a batch slot: no tokens, no timings
        cv.notify_all();
        return;
      }
      if (n_events == 0) {
        first_kv_transfer_seconds = o.kv_transfer_seconds;
        first_decode_queue_seconds = o.decode_queue_seconds;
        first_token_included = o.first_token_included;
        first_prefill_seconds = o.prefill_seconds;
        first_cached_tokens = o.cached_tokens;
      } else if (o.first_token_included) {
        first_token_included_later = true;
      }
      ++n_events;
      if (o.done) {
        done = true;
        status = o.status;
        finish_reason = o.finish_reason;
      }
      cv.notify_all();
    };
  }
  bool wait_done(std::chrono::milliseconds timeout = 30s) {
    std::unique_lock lk(mu);
    return cv.wait_for(lk, timeout, [&] { return done; });
  }
  bool wait_tokens(size_t n, std::chrono::milliseconds timeout = 30s) {
    std::unique_lock lk(mu);
    return cv.wait_for(lk, timeout, [&] { return tokens.size() >= n || done; });
  }

  std::mutex mu;
  std::condition_variable cv;
  std::vector<int32_t> tokens;
  std::vector<TokenLogprobs> logprobs;
  int n_events = 0;  // with tokens, or the end
  int n_beats = 0;   // empty: it waited for a batch slot
  bool done = false;
  bool event_after_done = false;
  Status status;
  std::string finish_reason;
  double first_kv_transfer_seconds = -1;
  double first_decode_queue_seconds = -1;
  bool first_token_included = false;        // on the first event
  bool first_token_included_later = false;  // on any other (a bug)
  double first_prefill_seconds = -1;
  int32_t first_cached_tokens = -1;
};

inline DecodeAdmit admit_for(const Fixture& fx, const std::string& id, int n_prompt, int max_tokens,
                             const SamplingParams& sp, bool ignore_eos = false) {
  DecodeAdmit a;
  a.request_id = id;
  a.n_prompt_tokens = n_prompt;
  a.max_tokens = max_tokens;
  a.sampling = sp;
  a.ignore_eos = ignore_eos;
  a.model_fingerprint = fx.fingerprint();
  return a;
}

inline GenerateResult reference(Fixture& fx, const std::vector<int32_t>& prompt, int max_tokens,
                                const SamplingParams& sp, bool ignore_eos = false) {
  GenerateOptions opt;
  opt.max_tokens = max_tokens;
  opt.sampling = sp;
  opt.stop_ids = fx.stop_ids;
  opt.ignore_eos = ignore_eos;
  Generator gen(*fx.ref.model);
  auto r = gen.generate(prompt, opt);
  REQUIRE(r.ok());
  return std::move(*r);
}

inline SamplingParams seeded() {
  return SamplingParams{1.0f, static_cast<int>(rnd() % 3) * 20, 0.95f, static_cast<uint64_t>(rnd()) << 32 | rnd()};
}

inline bool wait_for(const std::function<bool()>& pred, std::chrono::milliseconds timeout = 10s) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

inline void check_all_free(DecodeEngine& e) {
  // Blocks come back when the engine thread finishes a sequence; the final event may precede it
  // by nothing, but a deferred free (an import in flight) can lag a moment.
  CHECK(wait_for([&] { return e.load().free_blocks == e.load().total_blocks; }));
  const DecodeLoad l = e.load();
  CHECK(l.free_blocks == l.total_blocks);
  CHECK(l.n_running == 0);
  CHECK(l.n_waiting == 0);
}

}  // namespace baton::decode_test
