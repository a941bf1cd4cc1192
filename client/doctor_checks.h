// `batonctl doctor`'s findings and the verdicts on them, without gRPC: what was learned about each
// role's process and each prefill → decode link (doctor_gather.h fills it in), and the problems
// it shows, each with the fix named. Pure functions over plain structs, so every verdict is
// tested with made-up reports (tests/unit/client/doctor_checks_test.cpp).
//
// What is a problem:
//   frontend   unreachable, or ListWorkers refused (a key without `admin`, ...); NOT_SERVING;
//              clock off
//   worker     unreachable (connect, TLS, wrong role at the address: its GetLoad fails);
//              NOT_SERVING; draining; the frontend sees it unhealthy; model fingerprint, KV
//              dtype or block size unlike the reference (the frontend's model when known, else
//              the value most workers have, the first one's on a tie); clock off
//   link       the KV probe failed (the refusal or the transport's error, with a fix by its
//              code); a prefill worker's transport the decode worker does not receive
//   deployment no decode workers; no prefill workers where nobody else prefills
// A clock is off when |offset| - rtt / 2 > max_clock_skew: the offset is measured against this
// machine's clock at the middle of the call, so half the round trip is its uncertainty.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace baton::ctl {

// One role's process, as doctor saw it.
struct NodeReport {
  std::string role;     // "frontend" | "prefill" | "decode"
  std::string address;  // host:port
  bool reachable = false;  // the health check answered
  // The first call that failed ("" when none): "health", "GetLoad", "ListWorkers"; its status.
  std::string failed_call;
  std::string error_code;  // canonical gRPC code name ("UNAVAILABLE")
  std::string error;       // its message, one line
  std::string health;      // grpc.health.v1: "SERVING", "NOT_SERVING", "UNKNOWN" ("" when not asked)
  bool has_report = false;  // GetLoad (workers) or ListWorkers (frontend) answered: the fields below are set
  std::string model_name;
  std::string model_fingerprint;
  std::string kv_dtype;                    // workers
  int32_t block_size = 0;                  // workers
  std::string kv_transport;                // prefill: the transport it sends KV with
  std::vector<std::string> kv_transports;  // decode: the transports it receives KV over
  std::string version;
  bool draining = false;
  std::optional<bool> frontend_healthy;  // with --frontend: whether the frontend sees it healthy
  bool has_clock = false;
  double clock_offset_seconds = 0;  // its wall clock minus this machine's, at the middle of the call
  double rtt_seconds = 0;           // that call's round trip
};

// One prefill → decode link.
struct LinkReport {
  std::string prefill;  // addresses
  std::string decode;
  std::string skipped;  // why the probe did not run ("" when it did)
  std::string error_code;  // the probe's failure ("" when it answered)
  std::string error;
  std::string transport;                // the prefill worker's, as it reported
  int64_t bytes = 0;                    // each large transfer's K and V bytes
  std::vector<double> seconds;          // per round
  int64_t latency_bytes = 0;            // each minimal transfer's
  std::vector<double> latency_seconds;  // per round

  bool measured() const { return skipped.empty() && error_code.empty() && !seconds.empty(); }
  // bytes / the median round's seconds (0 when not measured).
  double bandwidth_bytes_per_second() const;
  // The median minimal transfer's seconds (0 when not measured).
  double latency_median_seconds() const;
};

struct DoctorReport {
  std::optional<NodeReport> frontend;  // with --frontend
  int32_t local_prefill_max_tokens = 0;  // the frontend's: decode workers prefill prompts themselves
  std::vector<NodeReport> prefill;
  std::vector<NodeReport> decode;
  std::vector<LinkReport> links;  // every prefill × decode pair, prefill-major
  bool internal_tls = false;      // doctor spoke mutual TLS to the workers (--internal-tls-*)
  int64_t kv_bytes = 0;           // asked per large transfer
  int32_t rounds = 0;
};

struct DoctorLimits {
  double max_clock_skew_seconds = 1.0;
};

// A problem and what fixes it. `kind` and `address` name the row it belongs to.
struct Problem {
  std::string kind;     // "frontend" | "prefill" | "decode" | "link" | "deployment"
  std::string address;  // the node's, or "P -> D" for a link, "" for the deployment
  std::string what;     // "serves model fingerprint X but the frontend serves Y"
  std::string fix;      // "deploy the same model file on every role"
};

// "prefill worker 10.0.0.5:50051", "frontend 10.0.0.2:50051", "link A -> B", "deployment".
std::string problem_subject(const Problem& p);
// "A -> B": a link's address in Problem and the tables.
std::string link_name(const LinkReport& link);

// Every problem of the report, in table order (frontend, prefill and decode workers, links,
// deployment).
std::vector<Problem> doctor_problems(const DoctorReport& report, const DoctorLimits& limits);

// Whether `problems` names the row of `kind` at `address`.
bool has_problem(const std::vector<Problem>& problems, const std::string& kind, const std::string& address);

// The median of `v` (the lower middle for an even count); 0 when empty.
double median(std::vector<double> v);

}  // namespace baton::ctl
