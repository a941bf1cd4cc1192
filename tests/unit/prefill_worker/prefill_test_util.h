// Shared by the prefill engine's tests (tests/unit/prefill_worker/): the random test model, a
// probe of what the engine tells one job, random prompts and sampling, and the single-process
// reference a job's first token and KV must equal.
#pragma once

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "model/generator.h"
#include "model/test_model.h"
#include "prefill_worker/prefill_engine.h"
#include "tests/unit/prefill_worker/recording_transport.h"
#include "tests/unit/test_model_fixture.h"

namespace baton::testing {

struct Fixture : LoadedTestModel {
  Fixture() : LoadedTestModel(TestModelSpec{}) {}  // untied head (the default): logits depend on the KV
};

// What the engine told one job, in order.
struct Probe {
  std::mutex mu;
  std::condition_variable cv;
  bool has_first = false;
  int32_t first = -1;
  double queue_s = -1, prefill_s = -1;
  int32_t n_cached = -1;  // prompt tokens the prefix cache supplied
  bool done = false;
  int n_done = 0;
  bool first_after_done = false;
  Status status;
  int64_t bytes = 0;

  void attach(PrefillJob& job) {
    job.on_first_token = [this](int32_t t, double q, double p, int32_t cached, const TokenLogprobs*) {
      std::lock_guard<std::mutex> lock(mu);
      if (done) first_after_done = true;
      has_first = true;
      first = t;
      queue_s = q;
      prefill_s = p;
      n_cached = cached;
    };
    job.on_done = [this](const Status& s, double, int64_t b) {
      // Notified under the lock: the waiter may destroy the probe as soon as it wakes.
      std::lock_guard<std::mutex> lock(mu);
      ++n_done;  // checked to be 1: on_done comes exactly once
      done = true;
      status = s;
      bytes = b;
      cv.notify_all();
    };
  }
  bool wait_done() {
    std::unique_lock<std::mutex> lock(mu);
    const bool ok = cv.wait_for(lock, std::chrono::seconds(30), [this] { return done; });
    return ok && n_done == 1;
  }
};

inline std::vector<int32_t> random_prompt(std::mt19937& rng, int n, int vocab) {
  std::vector<int32_t> p(n);
  for (int32_t& t : p) t = static_cast<int32_t>(rng() % vocab);
  return p;
}

inline SamplingParams random_sampling(std::mt19937& rng) {
  SamplingParams s;
  s.temperature = 0.5f + static_cast<float>(rng() % 100) / 100.0f;
  s.top_k = static_cast<int>(rng() % 3) * 10;
  s.seed = rng();
  return s;
}

// The single-process reference: first token from Generator, KV from a whole-prompt prefill into
// a cache of its own.
struct Reference {
  int32_t first_token = -1;
  Kv kv;
};

inline Reference reference(Model& model, const std::vector<int32_t>& prompt, const SamplingParams& sampling) {
  Reference ref;
  GenerateOptions opt;
  opt.max_tokens = 1;
  opt.sampling = sampling;
  Generator gen(model);
  auto r = gen.generate(prompt, opt);
  REQUIRE(r.ok());
  ref.first_token = r->tokens.at(0);

  const ModelConfig& c = model.config();
  const int block_size = 16;
  const int n_blocks = static_cast<int>((prompt.size() + block_size - 1) / block_size);
  auto cache = model.make_kv_cache(n_blocks, block_size, DType::kF32);
  std::vector<int32_t> table(n_blocks);
  for (int i = 0; i < n_blocks; ++i) table[i] = n_blocks - 1 - i;  // not the identity: the table matters
  StepBatch batch;
  batch.add(prompt, 0, table, Logits::kLast);
  std::vector<float> logits;
  model.forward(batch, *cache, &logits);
  const size_t layer_bytes = prompt.size() * c.n_kv_heads * c.head_dim * sizeof(float);
  for (int l = 0; l < c.n_layers; ++l) {
    std::string k(layer_bytes, '\0'), v(layer_bytes, '\0');
    model.backend().kv_export(*cache, l, table.data(), 0, static_cast<int32_t>(prompt.size()), k.data(), v.data());
    ref.kv.k.push_back(std::move(k));
    ref.kv.v.push_back(std::move(v));
  }
  return ref;
}

inline double max_abs_diff(const std::string& a, const std::string& b) {
  REQUIRE(a.size() == b.size());
  const size_t n = a.size() / sizeof(float);
  double m = 0;
  for (size_t i = 0; i < n; ++i) {
    float x, y;
    std::memcpy(&x, a.data() + i * sizeof(float), sizeof(float));
    std::memcpy(&y, b.data() + i * sizeof(float), sizeof(float));
    m = std::max(m, static_cast<double>(std::abs(x - y)));
  }
  return m;
}

inline void check_kv_close(const Kv& got, const Kv& want) {
  REQUIRE(got.k.size() == want.k.size());
  for (size_t l = 0; l < want.k.size(); ++l) {
    INFO("layer " << l);
    CHECK(max_abs_diff(got.k[l], want.k[l]) <= 1e-4);
    CHECK(max_abs_diff(got.v[l], want.v[l]) <= 1e-4);
  }
}

inline PrefillJob make_job(const std::string& id, const std::vector<int32_t>& tokens, const SamplingParams& sampling,
                           Probe& probe) {
  PrefillJob job;
  job.request_id = id;
  job.tokens = tokens;
  job.sampling = sampling;
  job.decode_address = "decode-" + id + ":1234";
  job.model_fingerprint = "fp-test";
  probe.attach(job);
  return job;
}

// Runs steps on the test's thread until none is left to run.
inline int run_all_steps(PrefillEngine& engine) {
  int n = 0;
  while (engine.run_step_for_test()) ++n;
  return n;
}

}  // namespace baton::testing
