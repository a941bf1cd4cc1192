// What `batonctl bench` measured and how it is shown: per-request samples in, a summary out, as a
// table (stdout) and as JSON (--json). No gRPC here: samples carry status codes by name.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "client/latency_stats.h"
#include "client/slo.h"

namespace baton::ctl {

// The load that was offered (echoed in the report).
struct BenchConfig {
  std::string address;
  std::string model;                // as ListModels reports it
  std::string workload = "random";  // "random" or "chat"
  int n_requests = 0;               // measured requests sent (after warm-up); chat: conversations × turns
  double duration = 0;              // --duration: seconds of issuing requests (0: a count, --requests)
  int concurrency = 0;              // closed loop: requests (chat: conversations) in flight; 0 in --rate mode
  double rate = 0;                  // open loop: Poisson arrivals (chat: of conversations) per second
  int max_in_flight = 0;            // --rate mode: bound on requests in flight
  int prompt_tokens = 0;            // random: per request; chat: per user message
  int long_prompt_tokens = 0;       // random, mixed: the long prompts' length (0: none)
  double long_fraction = 0;         // random, mixed: their share
  int output_tokens = 0;            // per request (ignore_eos, so exactly this many)
  int conversations = 0;            // chat
  int turns = 0;                    // chat: per conversation
  int system_prompt_tokens = 0;     // chat: shared by every conversation
  uint64_t seed = 0;                // prompt token ids and arrival times
  int warmup = 0;                   // requests run first and not measured
  double timeout = 0;               // per-request deadline, seconds (0: none)
  Slo slo;                          // --slo-ttft / --slo-itl
};

// One request as the client saw it. Latencies in seconds from the moment the call was started;
// *_at times in seconds from the start of the run (the first request's scheduled send).
struct RequestSample {
  int conversation = 0;                         // the workload's (random: = the request's index)
  int turn = 0;                                 // 0-based turn within its conversation (random: 0)
  int n_prompt_sent = 0;                        // prompt token ids sent
  double arrival_at = 0;                        // when it was due: its Poisson arrival (--rate), or when it was sent
  double sent_at = 0;                           // when the call started
  double finished_at = 0;                       // when its status arrived
  std::vector<int32_t> output_ids;              // the ids received (the next chat turn appends them)
  std::optional<int64_t> cached_prompt_tokens;  // the server's count, when its final message has one
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

// The server's breakdown of one request as sequential segments, in ms: queue, prefill, KV
// transfer, decode queue, then decode = the rest of the server's e2e (the decode steps, and what
// the others leave out: hand-off to the first token's write, admission) — never negative.
struct ServerSegmentsMs {
  double queue = 0;
  double prefill = 0;
  double kv_transfer = 0;
  double decode_queue = 0;
  double decode = 0;
};
ServerSegmentsMs server_segments_ms(const RequestSample& s);

// A chat turn's requests (turn is 0-based, printed 1-based).
struct TurnSummary {
  int turn = 0;
  int n_ok = 0;
  int n_failed = 0;
  double prompt_tokens_mean = 0;                // ids sent, ok requests
  LatencySummary ttft_ms;                       // ok requests
  std::optional<int64_t> cached_prompt_tokens;  // sum over ok requests, when the server reports it
  int64_t prompt_tokens = 0;                    // sum of ids sent by ok requests
};

struct BenchReport {
  BenchConfig config;
  std::vector<RequestSample> samples;  // every sent request, in the order they were issued
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
  // Prompt tokens the server served from its prefix cache, over ok requests: set when any
  // final message reported the count.
  std::optional<int64_t> cached_prompt_tokens;
  std::vector<TurnSummary> turns;  // chat: one per turn; random: empty
  SloSummary slo;                  // meaningful when config.slo.any()
};

// How the ITL SLO is measured, in the report's words.
constexpr const char* kSloItlMeasure = "per-request p99 of its inter-token gaps (nearest rank; max below 100 gaps)";

// The SLOs' view of one request.
SloInput slo_input(const RequestSample& s);

BenchReport make_report(const BenchConfig& config, std::vector<RequestSample> samples, double wall_seconds);

// The human-readable table.
std::string format_report(const BenchReport& report);

nlohmann::ordered_json report_to_json(const BenchReport& report);

}  // namespace baton::ctl
