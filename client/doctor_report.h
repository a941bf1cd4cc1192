// How `batonctl doctor` shows its findings: a table of the roles' processes, a table of the
// prefill → decode links with the measured KV bandwidth and latency, and the problems with their
// fixes (text, for people); the same as JSON (--json F, for scripts). Pure: tested with made-up
// reports in tests/unit/client/doctor_report_test.cpp.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "client/doctor_checks.h"

namespace baton::ctl {

// "1.23 GB/s", "512 MB/s" (decimal units: bytes per second).
std::string format_bandwidth(double bytes_per_second);
// "16.0 MiB", "512 KiB", "100 B".
std::string format_bytes(int64_t bytes);

// The report as text: the node table, the link table, then "N problems:" with each problem's
// subject, what and fix (or "no problems").
std::string doctor_text(const DoctorReport& report, const std::vector<Problem>& problems);

// The report as JSON:
//   ok, kv_bytes, rounds,
//   frontend (or null), workers[]: {role, address, ok, reachable, failed_call, error_code, error,
//     health, model_name, model_fingerprint, kv_dtype, block_size, kv_transport, kv_transports,
//     version, draining, frontend_healthy (or null), clock_offset_seconds, rtt_seconds (or null)},
//   links[]: {prefill, decode, ok, measured, skipped, error_code, error, transport, bytes,
//     seconds[], bandwidth_bytes_per_second, latency_bytes, latency_seconds[],
//     latency_median_seconds},
//   problems[]: {kind, address, subject, problem, fix}.
nlohmann::json doctor_json(const DoctorReport& report, const std::vector<Problem>& problems);

}  // namespace baton::ctl
