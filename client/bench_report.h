// What `batonctl bench` measured and how it is shown: per-request samples in, a summary out, as a
// table (stdout) and as JSON (--json). No gRPC here: samples carry status codes by name.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "client/latency_stats.h"

namespace baton::ctl {

// The load that was offered (echoed in the report).
struct BenchConfig {
  std::string address;
  std::string model;      // as ListModels reports it
  int n_requests = 0;     // measured requests (after warm-up)
  int concurrency = 0;    // closed loop: requests in flight; 0 in --rate mode
  double rate = 0;        // open loop: Poisson arrivals per second; 0 in --concurrency mode
  int max_in_flight = 0;  // --rate mode: bound on requests in flight
  int prompt_tokens = 0;  // per request
  int output_tokens = 0;  // per request (ignore_eos, so exactly this many)
  uint64_t seed = 0;      // prompt token ids and arrival times
  int warmup = 0;         // requests run first and not measured
  double timeout = 0;     // per-request deadline, seconds (0: none)
};

// One request as the client saw it. Times in seconds from the moment the call was started.
struct RequestSample {
  bool ok = false;
  std::string code;         // gRPC status code name ("OK", "UNAVAILABLE", ...)
  std::string error;        // status message when !ok
  double ttft = -1;         // first message that carried tokens; < 0: none arrived
  double e2e = 0;           // until the call finished (status received)
  std::vector<double> itl;  // gaps between successive token-carrying messages
  int n_output = 0;         // token ids received
  int n_prompt = 0;         // usage.prompt_tokens of the final message
  bool has_final = false;   // the server's breakdown below is valid
  double server_queue = 0;
  double server_prefill = 0;
  double server_kv_transfer = 0;
  double server_decode_queue = 0;
  double server_ttft = 0;
  double server_e2e = 0;
};

struct BenchReport {
  BenchConfig config;
  int n_ok = 0;
  int n_failed = 0;
  std::map<std::string, int> failed_by_code;
  std::string first_error;    // "<CODE>: <message>" of the first failure, for the error line
  int n_short = 0;            // ok requests that returned fewer tokens than asked
  int n_delayed = 0;          // --rate: arrivals sent late because max_in_flight calls were running
  double wall_seconds = 0;    // first measured request sent → last one finished
  int64_t prompt_tokens = 0;  // over ok requests
  int64_t output_tokens = 0;  // over ok requests
  double requests_per_second = 0;
  double output_tokens_per_second = 0;
  double total_tokens_per_second = 0;
  // Latencies in milliseconds, ok requests only; ordered as the table prints them.
  std::vector<std::pair<std::string, LatencySummary>> latencies_ms;
};

BenchReport make_report(const BenchConfig& config, const std::vector<RequestSample>& samples, double wall_seconds);

// The human-readable table.
std::string format_report(const BenchReport& report);

nlohmann::ordered_json report_to_json(const BenchReport& report);

}  // namespace baton::ctl
