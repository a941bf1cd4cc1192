// client/bench_report.h: the chat turn summaries, cached tokens, SLO summary and per-request rows
// of the report and its JSON against naive recomputations from random samples; the JSON keeps
// every key earlier versions wrote.
#include "client/bench_report.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <random>

#include "tests/unit/client/random_samples.h"

namespace baton::ctl {
namespace {

// Nearest rank, the definition: smallest x with at least p% of the samples <= x.
double naive_percentile(const std::vector<double>& v, double p) {
  double best = 0;
  bool found = false;
  for (double x : v) {
    size_t n_le = 0;
    for (double y : v) n_le += y <= x;
    if (100.0 * static_cast<double>(n_le) >= p * static_cast<double>(v.size()) && (!found || x < best)) {
      best = x;
      found = true;
    }
  }
  return best;
}

BenchConfig chat_config(int turns) {
  BenchConfig c;
  c.address = "127.0.0.1:1";
  c.model = "m";
  c.workload = "chat";
  c.turns = turns;
  c.conversations = 3;
  c.concurrency = 2;
  c.output_tokens = 8;
  return c;
}

TEST_CASE("chat turns, cached tokens and SLOs of the report match naive recomputations") {
  std::mt19937_64 rng(std::random_device{}());
  for (int trial = 0; trial < 40; ++trial) {
    const int turns = std::uniform_int_distribution<int>(1, 6)(rng);
    const size_t n = std::uniform_int_distribution<size_t>(0, 120)(rng);
    const bool cached = trial % 2 == 0;
    const std::vector<RequestSample> samples = baton::test::random_samples(rng, n, turns, 0.1, cached);
    BenchConfig c = chat_config(turns);
    c.slo.ttft_seconds = 0.05 + 0.2 * std::uniform_real_distribution<double>(0, 1)(rng);
    if (trial % 3 != 0) c.slo.itl_seconds = 0.01 + 0.04 * std::uniform_real_distribution<double>(0, 1)(rng);
    const double wall = 3.5;
    const BenchReport r = make_report(c, samples, wall);

    REQUIRE(r.turns.size() == static_cast<size_t>(turns));
    std::optional<int64_t> cached_total;
    int64_t prompt_total = 0;
    size_t met = 0;
    for (int t = 0; t < turns; ++t) {
      std::vector<double> ttft;
      int n_ok = 0, n_failed = 0;
      int64_t prompt = 0;
      std::optional<int64_t> turn_cached;
      for (const RequestSample& s : samples) {
        if (s.turn != t) continue;
        if (!s.ok) {
          ++n_failed;
          continue;
        }
        ++n_ok;
        prompt += s.n_prompt_sent;
        ttft.push_back(s.ttft * 1e3);
        if (s.cached_prompt_tokens) turn_cached = turn_cached.value_or(0) + *s.cached_prompt_tokens;
      }
      const TurnSummary& ts = r.turns[t];
      CHECK(ts.turn == t);
      CHECK(ts.n_ok == n_ok);
      CHECK(ts.n_failed == n_failed);
      CHECK(ts.prompt_tokens == prompt);
      CHECK(ts.cached_prompt_tokens == turn_cached);
      CHECK(ts.ttft_ms.n == ttft.size());
      if (!ttft.empty()) {
        CHECK(ts.ttft_ms.p50 == naive_percentile(ttft, 50));
        CHECK(ts.ttft_ms.p99 == naive_percentile(ttft, 99));
        CHECK(ts.prompt_tokens_mean == Approx(static_cast<double>(prompt) / n_ok));
      }
      if (turn_cached) cached_total = cached_total.value_or(0) + *turn_cached;
      prompt_total += prompt;
    }
    CHECK(r.cached_prompt_tokens == cached_total);
    for (const RequestSample& s : samples) {
      const double itl = s.itl.empty() ? 0 : naive_percentile(s.itl, 99);
      met += s.ok && s.ttft <= *c.slo.ttft_seconds && (!c.slo.itl_seconds || itl <= *c.slo.itl_seconds);
    }
    CHECK(r.slo.n_met == met);
    CHECK(r.slo.goodput == Approx(static_cast<double>(met) / wall));

    const nlohmann::json j = nlohmann::json::parse(report_to_json(r).dump());
    CHECK(j["slo"]["met"] == met);
    CHECK(j["slo"]["goodput_requests_per_second"].get<double>() == Approx(static_cast<double>(met) / wall));
    CHECK(j["slo"]["ttft_seconds"].get<double>() == *c.slo.ttft_seconds);
    CHECK(j["slo"]["itl_seconds"].is_null() == !c.slo.itl_seconds);
    CHECK(j["tokens"]["cached_prompt"].is_null() == !cached_total);
    CHECK(j["tokens"]["cached_prompt_ratio"].is_null() == (!cached_total || prompt_total == 0));
    if (cached_total && prompt_total > 0) {
      CHECK(j["tokens"]["cached_prompt_ratio"].get<double>() ==
            Approx(static_cast<double>(*cached_total) / static_cast<double>(prompt_total)));
    }
    REQUIRE(j["turns"].size() == static_cast<size_t>(turns));
    REQUIRE(j["per_request"].size() == n);
    size_t n_slo_met = 0;
    for (size_t i = 0; i < n; ++i) {
      const nlohmann::json& row = j["per_request"][i];
      const RequestSample& s = samples[i];
      CHECK(row["index"] == i);
      CHECK(row["turn"] == s.turn + 1);
      CHECK(row["ok"] == s.ok);
      CHECK(row["prompt_tokens"] == s.n_prompt_sent);
      CHECK(row["sent_seconds"].get<double>() == s.sent_at);
      CHECK(row["finished_seconds"].get<double>() == s.finished_at);
      n_slo_met += row["slo_met"].get<bool>();
      if (!s.has_final) {
        CHECK(row["server_ms"].is_null());
        continue;
      }
      const nlohmann::json& m = row["server_ms"];
      const double parts = (s.server_queue + s.server_prefill + s.server_kv_transfer + s.server_decode_queue) * 1e3;
      CHECK(m["queue"].get<double>() == Approx(s.server_queue * 1e3));
      CHECK(m["kv_transfer"].get<double>() == Approx(s.server_kv_transfer * 1e3));
      CHECK(m["decode"].get<double>() == Approx(std::max(0.0, s.server_e2e * 1e3 - parts)).margin(1e-9));
      CHECK(m["decode"].get<double>() >= 0);
    }
    CHECK(n_slo_met == met);
  }
}

TEST_CASE("the JSON keeps every key of the earlier report") {
  std::mt19937_64 rng(std::random_device{}());
  BenchConfig c;
  c.concurrency = 4;
  const nlohmann::json j =
      nlohmann::json::parse(report_to_json(make_report(c, baton::test::random_samples(rng, 20, 0), 1.0)).dump());
  for (const char* key : {"address", "model", "requests", "mode", "concurrency", "rate", "max_in_flight",
                          "prompt_tokens", "output_tokens", "seed", "warmup", "timeout_seconds"}) {
    CHECK(j["config"].contains(key));
  }
  for (const char* key : {"total", "ok", "failed", "failed_by_code", "short", "delayed_arrivals"})
    CHECK(j["requests"].contains(key));
  CHECK(j["wall_seconds"].is_number());
  CHECK(j["tokens"]["prompt"].is_number());
  CHECK(j["tokens"]["output"].is_number());
  for (const char* key : {"requests_per_second", "output_tokens_per_second", "total_tokens_per_second"}) {
    CHECK(j["throughput"][key].is_number());
  }
  for (const char* key : {"ttft", "tpot", "itl", "e2e", "server_queue", "server_prefill", "server_kv_transfer",
                          "server_decode_queue", "server_ttft"}) {
    for (const char* stat : {"n", "mean", "p50", "p90", "p99", "max"}) CHECK(j["latency_ms"][key][stat].is_number());
  }
  // Without SLOs there is no goodput to report, and a random workload has no turns.
  CHECK(!j.contains("slo"));
  CHECK(!j.contains("turns"));
  CHECK(!j["per_request"][0].contains("slo_met"));
}

}  // namespace
}  // namespace baton::ctl
