#include "client/bench_report.h"

#include <algorithm>
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

nlohmann::ordered_json summary_json(const LatencySummary& s) {
  return {{"n", s.n}, {"mean", s.mean}, {"p50", s.p50}, {"p90", s.p90}, {"p99", s.p99}, {"max", s.max}};
}

template <typename T>
nlohmann::ordered_json optional_json(const std::optional<T>& v) {
  return v ? nlohmann::ordered_json(*v) : nlohmann::ordered_json(nullptr);
}

}  // namespace

ServerSegmentsMs server_segments_ms(const RequestSample& s) {
  ServerSegmentsMs m;
  if (!s.has_final) return m;
  m.queue = s.server_queue * 1e3;
  m.prefill = s.server_prefill * 1e3;
  m.kv_transfer = s.server_kv_transfer * 1e3;
  m.decode_queue = s.server_decode_queue * 1e3;
  m.decode = std::max(0.0, s.server_e2e * 1e3 - (m.queue + m.prefill + m.kv_transfer + m.decode_queue));
  return m;
}

SloInput slo_input(const RequestSample& s) {
  return SloInput{s.ok, s.ttft, request_itl_seconds(s.itl)};
}

BenchReport make_report(const BenchConfig& config, std::vector<RequestSample> samples, double wall_seconds) {
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

  for (const RequestSample& s : samples) {
    if (s.ok && s.cached_prompt_tokens)
      r.cached_prompt_tokens = r.cached_prompt_tokens.value_or(0) + *s.cached_prompt_tokens;
  }
  if (config.workload == "chat") {
    r.turns.resize(std::max(config.turns, 0));
    std::vector<std::vector<double>> turn_ttft(r.turns.size());
    for (size_t t = 0; t < r.turns.size(); ++t) r.turns[t].turn = static_cast<int>(t);
    for (const RequestSample& s : samples) {
      if (s.turn < 0 || s.turn >= static_cast<int>(r.turns.size())) continue;
      TurnSummary& t = r.turns[s.turn];
      if (!s.ok) {
        ++t.n_failed;
        continue;
      }
      ++t.n_ok;
      t.prompt_tokens += s.n_prompt_sent;
      if (s.ttft >= 0) turn_ttft[s.turn].push_back(s.ttft * 1e3);
      if (s.cached_prompt_tokens) t.cached_prompt_tokens = t.cached_prompt_tokens.value_or(0) + *s.cached_prompt_tokens;
    }
    for (size_t t = 0; t < r.turns.size(); ++t) {
      if (r.turns[t].n_ok > 0)
        r.turns[t].prompt_tokens_mean = static_cast<double>(r.turns[t].prompt_tokens) / r.turns[t].n_ok;
      r.turns[t].ttft_ms = summarize(turn_ttft[t]);
    }
  }
  std::vector<SloInput> slo_inputs;
  slo_inputs.reserve(samples.size());
  for (const RequestSample& s : samples) slo_inputs.push_back(slo_input(s));
  r.slo = summarize_slo(slo_inputs, config.slo, wall_seconds);
  r.samples = std::move(samples);
  return r;
}

std::string format_report(const BenchReport& r) {
  const BenchConfig& c = r.config;
  std::string out;
  const bool chat = c.workload == "chat";
  const char* unit = chat ? "conversations" : "req";
  const std::string load = c.concurrency > 0 ? format("concurrency %d%s", c.concurrency, chat ? " conversations" : "")
                                             : format("rate %.2f %s/s (Poisson, at most %d requests in flight)", c.rate,
                                                      unit, c.max_in_flight);
  out += format("batonctl bench: %s, model %s, %s\n", c.address.c_str(), c.model.c_str(), load.c_str());
  if (chat) {
    out += format(
        "  chat: %d conversations x %d turns = %d requests; system prompt %d + %d ids a turn, %d output tokens, "
        "%d warm-up, seed %llu\n",
        c.conversations, c.turns, c.n_requests, c.system_prompt_tokens, c.prompt_tokens, c.output_tokens, c.warmup,
        static_cast<unsigned long long>(c.seed));
  } else if (c.duration > 0) {
    out +=
        format("  requests for %.1f s (%d sent) of %d prompt + %d output tokens, %d warm-up, seed %llu\n", c.duration,
               c.n_requests, c.prompt_tokens, c.output_tokens, c.warmup, static_cast<unsigned long long>(c.seed));
  } else {
    const std::string prompt = c.long_prompt_tokens > 0 ? format("%d (%.0f %% of them %d)", c.prompt_tokens,
                                                                  100 * c.long_fraction, c.long_prompt_tokens)
                                                         : format("%d", c.prompt_tokens);
    out += format("  %d requests of %s prompt + %d output tokens, %d warm-up, seed %llu\n", c.n_requests,
                  prompt.c_str(), c.output_tokens, c.warmup, static_cast<unsigned long long>(c.seed));
  }
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
  if (c.slo.any()) {
    std::string bounds;
    if (c.slo.ttft_seconds) bounds += format("TTFT <= %g ms", *c.slo.ttft_seconds * 1e3);
    if (c.slo.itl_seconds) bounds += format("%sITL <= %g ms", bounds.empty() ? "" : " and ", *c.slo.itl_seconds * 1e3);
    out += format("%-22s%.2f req/s: %zu of %zu requests (%.1f %%) met %s\n", "goodput", r.slo.goodput, r.slo.n_met,
                  r.slo.n_total, r.slo.attainment * 100, bounds.c_str());
    out += format("%-22sTTFT met by %zu, ITL met by %zu (ITL: %s)\n", "", r.slo.n_met_ttft, r.slo.n_met_itl,
                  kSloItlMeasure);
  }
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
  if (r.cached_prompt_tokens) {
    out += format("%-22s%lld of %lld prompt tokens (hit ratio %.1f %%)\n", "cached prompt",
                  static_cast<long long>(*r.cached_prompt_tokens), static_cast<long long>(r.prompt_tokens),
                  r.prompt_tokens > 0 ? 100.0 * static_cast<double>(*r.cached_prompt_tokens) / r.prompt_tokens : 0.0);
  } else if (chat) {
    out += format("%-22snot reported by the server\n", "cached prompt");
  }
  if (!r.turns.empty()) {
    out += format("%-22s%8s%8s%12s%12s%12s%12s\n", "chat turn", "ok", "failed", "prompt tok", "ttft p50", "ttft p99",
                  "cached tok");
    for (const TurnSummary& t : r.turns) {
      const std::string cached =
          t.cached_prompt_tokens ? format("%lld", static_cast<long long>(*t.cached_prompt_tokens)) : "-";
      if (t.ttft_ms.n == 0) {
        out += format("  %-20d%8d%8d%12s%12s%12s%12s\n", t.turn + 1, t.n_ok, t.n_failed, "-", "-", "-", cached.c_str());
      } else {
        out += format("  %-20d%8d%8d%12.1f%12.2f%12.2f%12s\n", t.turn + 1, t.n_ok, t.n_failed, t.prompt_tokens_mean,
                      t.ttft_ms.p50, t.ttft_ms.p99, cached.c_str());
      }
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
      {"long_prompt_tokens", c.long_prompt_tokens},
      {"long_fraction", c.long_fraction},
      {"output_tokens", c.output_tokens},
      {"seed", c.seed},
      {"warmup", c.warmup},
      {"timeout_seconds", c.timeout},
      {"workload", c.workload},
      {"duration_seconds", c.duration},
      {"conversations", c.conversations},
      {"turns", c.turns},
      {"system_prompt_tokens", c.system_prompt_tokens},
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
    lat[key] = summary_json(s);
  }
  j["latency_ms"] = lat;
  j["tokens"]["cached_prompt"] = optional_json(r.cached_prompt_tokens);
  // The prefix cache's hit ratio over the prompt tokens of ok requests.
  j["tokens"]["cached_prompt_ratio"] =
      r.cached_prompt_tokens && r.prompt_tokens > 0
          ? nlohmann::ordered_json(static_cast<double>(*r.cached_prompt_tokens) / static_cast<double>(r.prompt_tokens))
          : nlohmann::ordered_json(nullptr);
  if (c.slo.any()) {
    j["slo"] = {
        {"ttft_seconds", optional_json(c.slo.ttft_seconds)},
        {"itl_seconds", optional_json(c.slo.itl_seconds)},
        {"itl_measure", kSloItlMeasure},
        {"requests", r.slo.n_total},
        {"met", r.slo.n_met},
        {"met_ttft", r.slo.n_met_ttft},
        {"met_itl", r.slo.n_met_itl},
        {"attainment", r.slo.attainment},
        {"goodput_requests_per_second", r.slo.goodput},
    };
  }
  if (!r.turns.empty()) {
    nlohmann::ordered_json turns = nlohmann::ordered_json::array();
    for (const TurnSummary& t : r.turns) {
      turns.push_back({
          {"turn", t.turn + 1},
          {"ok", t.n_ok},
          {"failed", t.n_failed},
          {"prompt_tokens_mean", t.prompt_tokens_mean},
          {"ttft_ms", summary_json(t.ttft_ms)},
          {"cached_prompt_tokens", optional_json(t.cached_prompt_tokens)},
      });
    }
    j["turns"] = turns;
  }
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  for (size_t i = 0; i < r.samples.size(); ++i) {
    const RequestSample& s = r.samples[i];
    nlohmann::ordered_json row = {
        {"index", i},
        {"conversation", s.conversation},
        {"turn", s.turn + 1},
        {"ok", s.ok},
        {"code", s.code},
        {"prompt_tokens", s.n_prompt_sent},
        {"output_tokens", s.n_output},
        {"cached_prompt_tokens", optional_json(s.cached_prompt_tokens)},
        {"arrival_seconds", s.arrival_at},
        {"sent_seconds", s.sent_at},
        {"finished_seconds", s.finished_at},
        {"ttft_ms", s.ttft >= 0 ? nlohmann::ordered_json(s.ttft * 1e3) : nlohmann::ordered_json(nullptr)},
        {"e2e_ms", s.e2e * 1e3},
        {"itl_p99_ms", request_itl_seconds(s.itl) * 1e3},
        {"itl_max_ms", s.itl.empty() ? 0.0 : *std::max_element(s.itl.begin(), s.itl.end()) * 1e3},
    };
    if (s.has_final) {
      const ServerSegmentsMs m = server_segments_ms(s);
      row["server_prompt_tokens"] = s.n_prompt;
      row["server_ms"] = {
          {"queue", m.queue},
          {"prefill", m.prefill},
          {"kv_transfer", m.kv_transfer},
          {"decode_queue", m.decode_queue},
          {"decode", m.decode},
          {"ttft", s.server_ttft * 1e3},
          {"e2e", s.server_e2e * 1e3},
      };
    } else {
      row["server_prompt_tokens"] = nullptr;
      row["server_ms"] = nullptr;
    }
    if (c.slo.any()) row["slo_met"] = meets_slo(slo_input(s), c.slo);
    rows.push_back(std::move(row));
  }
  j["per_request"] = std::move(rows);
  return j;
}

}  // namespace baton::ctl
