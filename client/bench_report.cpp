#include "client/bench_report.h"

#include <cstdio>
#include <nlohmann/json.hpp>

namespace baton::ctl {
namespace {

std::string format(const char* fmt, auto... args) {
  char buf[512];
  std::snprintf(buf, sizeof(buf), fmt, args...);
  return buf;
}

// Table rows and JSON keys of the latency summaries.
struct LatencyRow {
  const char* key;    // JSON key
  const char* label;  // table label
};
constexpr LatencyRow kRows[] = {
    {"ttft", "ttft"},
    {"tpot", "tpot"},
    {"itl", "itl"},
    {"e2e", "e2e"},
    {"server_queue", "server queue"},
    {"server_prefill", "server prefill"},
    {"server_kv_transfer", "server kv transfer"},
    {"server_decode_queue", "server decode queue"},
    {"server_ttft", "server ttft"},
};

}  // namespace

BenchReport make_report(const BenchConfig& config, const std::vector<RequestSample>& samples, double wall_seconds) {
  BenchReport r;
  r.config = config;
  r.wall_seconds = wall_seconds;
  std::vector<double> ttft, tpot, itl, e2e, queue, prefill, kv, decode_queue, server_ttft;
  for (const RequestSample& s : samples) {
    if (!s.ok) {
      ++r.n_failed;
      ++r.failed_by_code[s.code];
      if (r.first_error.empty()) r.first_error = s.code + ": " + s.error;
      continue;
    }
    ++r.n_ok;
    r.prompt_tokens += s.n_prompt;
    r.output_tokens += s.n_output;
    if (s.n_output < config.output_tokens) ++r.n_short;
    if (s.ttft >= 0) ttft.push_back(s.ttft * 1e3);
    // Time per output token after the first (vLLM's TPOT): the decode rate one request saw.
    if (s.n_output > 1 && s.ttft >= 0) tpot.push_back((s.e2e - s.ttft) * 1e3 / (s.n_output - 1));
    for (double gap : s.itl) itl.push_back(gap * 1e3);
    e2e.push_back(s.e2e * 1e3);
    if (s.has_final) {
      queue.push_back(s.server_queue * 1e3);
      prefill.push_back(s.server_prefill * 1e3);
      kv.push_back(s.server_kv_transfer * 1e3);
      decode_queue.push_back(s.server_decode_queue * 1e3);
      server_ttft.push_back(s.server_ttft * 1e3);
    }
  }
  if (wall_seconds > 0) {
    r.requests_per_second = r.n_ok / wall_seconds;
    r.output_tokens_per_second = static_cast<double>(r.output_tokens) / wall_seconds;
    r.total_tokens_per_second = static_cast<double>(r.prompt_tokens + r.output_tokens) / wall_seconds;
  }
  std::vector<double>* columns[] = {&ttft, &tpot, &itl, &e2e, &queue, &prefill, &kv, &decode_queue, &server_ttft};
  for (size_t i = 0; i < std::size(kRows); ++i) r.latencies_ms.emplace_back(kRows[i].key, summarize(*columns[i]));
  return r;
}

std::string format_report(const BenchReport& r) {
  const BenchConfig& c = r.config;
  std::string out;
  const std::string load = c.concurrency > 0
                               ? format("concurrency %d", c.concurrency)
                               : format("rate %.2f req/s (Poisson, at most %d in flight)", c.rate, c.max_in_flight);
  out += format("batonctl bench: %s, model %s, %s\n", c.address.c_str(), c.model.c_str(), load.c_str());
  out += format("  %d requests of %d prompt + %d output tokens, %d warm-up, seed %llu\n", c.n_requests, c.prompt_tokens,
                c.output_tokens, c.warmup, static_cast<unsigned long long>(c.seed));
  out += format("%-22s%d ok, %d failed", "requests", r.n_ok, r.n_failed);
  if (r.n_failed > 0) {
    std::string codes;
    for (const auto& [code, n] : r.failed_by_code)
      codes += (codes.empty() ? "" : ", ") + format("%s %d", code.c_str(), n);
    out += " (" + codes + ")";
  }
  out += "\n";
  if (r.n_short > 0) out += format("%-22s%d ok requests returned fewer tokens than asked\n", "", r.n_short);
  if (r.n_delayed > 0) {
    out += format("%-22s%d arrivals waited for a free slot (--max-in-flight %d): the offered rate was not met\n", "",
                  r.n_delayed, c.max_in_flight);
  }
  out += format("%-22s%.3f s\n", "wall time", r.wall_seconds);
  out += format("%-22s%.2f req/s | %.1f output tok/s | %.1f total tok/s\n", "throughput", r.requests_per_second,
                r.output_tokens_per_second, r.total_tokens_per_second);
  out += format("%-22s%lld prompt, %lld output\n", "tokens", static_cast<long long>(r.prompt_tokens),
                static_cast<long long>(r.output_tokens));
  out += format("%-22s%10s%10s%10s%10s%10s%8s\n", "latency (ms)", "mean", "p50", "p90", "p99", "max", "n");
  for (size_t i = 0; i < r.latencies_ms.size(); ++i) {
    const LatencySummary& s = r.latencies_ms[i].second;
    if (s.n == 0) {
      out += format("  %-20s%10s%10s%10s%10s%10s%8d\n", kRows[i].label, "-", "-", "-", "-", "-", 0);
    } else {
      out += format("  %-20s%10.2f%10.2f%10.2f%10.2f%10.2f%8zu\n", kRows[i].label, s.mean, s.p50, s.p90, s.p99, s.max,
                    s.n);
    }
  }
  return out;
}

nlohmann::ordered_json report_to_json(const BenchReport& r) {
  const BenchConfig& c = r.config;
  nlohmann::ordered_json j;
  j["config"] = {
      {"address", c.address},
      {"model", c.model},
      {"requests", c.n_requests},
      {"mode", c.concurrency > 0 ? "concurrency" : "rate"},
      {"concurrency", c.concurrency},
      {"rate", c.rate},
      {"max_in_flight", c.max_in_flight},
      {"prompt_tokens", c.prompt_tokens},
      {"output_tokens", c.output_tokens},
      {"seed", c.seed},
      {"warmup", c.warmup},
      {"timeout_seconds", c.timeout},
  };
  j["requests"] = {
      {"total", r.n_ok + r.n_failed},       {"ok", r.n_ok},       {"failed", r.n_failed},
      {"failed_by_code", r.failed_by_code}, {"short", r.n_short}, {"delayed_arrivals", r.n_delayed},
  };
  if (!r.first_error.empty()) j["requests"]["first_error"] = r.first_error;
  j["wall_seconds"] = r.wall_seconds;
  j["tokens"] = {{"prompt", r.prompt_tokens}, {"output", r.output_tokens}};
  j["throughput"] = {
      {"requests_per_second", r.requests_per_second},
      {"output_tokens_per_second", r.output_tokens_per_second},
      {"total_tokens_per_second", r.total_tokens_per_second},
  };
  nlohmann::ordered_json lat = nlohmann::ordered_json::object();
  for (const auto& [key, s] : r.latencies_ms) {
    lat[key] = {{"n", s.n}, {"mean", s.mean}, {"p50", s.p50}, {"p90", s.p90}, {"p99", s.p99}, {"max", s.max}};
  }
  j["latency_ms"] = lat;
  return j;
}

}  // namespace baton::ctl
