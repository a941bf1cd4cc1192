// How `batonctl doctor` prints its findings (client/doctor_report.h): rows marked OK or PROBLEM
// as the verdicts say, measured links with their bandwidth, each problem with its fix, and the
// JSON fields scripts read.
#include "client/doctor_report.h"

#include <catch2/catch.hpp>
#include <random>
#include <sstream>

namespace baton::ctl {
namespace {

NodeReport node(const std::string& role, const std::string& address) {
  NodeReport n;
  n.role = role;
  n.address = address;
  n.reachable = true;
  n.health = "SERVING";
  n.has_report = true;
  n.model_name = "m";
  n.model_fingerprint = "0123456789abcdef";
  n.kv_dtype = "bf16";
  n.block_size = 16;
  n.kv_transport = role == "prefill" ? "tcp" : "";
  if (role == "decode") n.kv_transports = {"tcp", "nccl"};
  n.version = "0.1.0";
  n.has_clock = true;
  n.clock_offset_seconds = 0.002;
  n.rtt_seconds = 0.0004;
  return n;
}

// The line of `text` that starts with `prefix`.
std::string line_of(const std::string& text, const std::string& prefix) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(prefix, 0) == 0) return line;
  }
  return "";
}

}  // namespace

TEST_CASE("doctor report: sizes and rates in readable units", "[client][doctor]") {
  CHECK(format_bandwidth(1.234e9) == "1.23 GB/s");
  CHECK(format_bandwidth(373.3e6) == "373.3 MB/s");
  CHECK(format_bandwidth(2500) == "2.5 kB/s");
  CHECK(format_bandwidth(12) == "12 B/s");
  CHECK(format_bytes(16 << 20) == "16.0 MiB");
  CHECK(format_bytes(1536) == "1.5 KiB");
  CHECK(format_bytes(100) == "100 B");
  CHECK(format_bytes(int64_t{3} << 30) == "3.0 GiB");
}

TEST_CASE("doctor report: tables, problems with fixes, and JSON", "[client][doctor]") {
  std::mt19937_64 rng(std::random_device{}());
  DoctorReport r;
  r.frontend = node("frontend", "fe:50051");
  r.prefill = {node("prefill", "p0:1")};
  r.decode = {node("decode", "d0:1"), node("decode", "d1:1")};
  r.decode[1].reachable = false;
  r.decode[1].has_report = false;
  r.decode[1].has_clock = false;
  r.kv_bytes = 16 << 20;
  r.rounds = 2;
  LinkReport good;
  good.prefill = "p0:1";
  good.decode = "d0:1";
  good.transport = "tcp";
  good.bytes = 1 + static_cast<int64_t>(rng() % (64 << 20));
  good.seconds = {0.01 + (rng() % 100) * 1e-3, 0.5};
  good.latency_bytes = 512;
  good.latency_seconds = {0.001, 0.002};
  LinkReport skipped;
  skipped.prefill = "p0:1";
  skipped.decode = "d1:1";
  skipped.skipped = "decode worker not checked";
  r.links = {good, skipped};
  const std::vector<Problem> problems = {{"decode", "d1:1", "unreachable (UNAVAILABLE: refused)", "check the address"}};

  const std::string text = doctor_text(r, problems);
  CHECK_THAT(line_of(text, "frontend"), Catch::Contains("fe:50051") && Catch::Contains("OK") &&
                                            Catch::Contains("SERVING") && Catch::Contains("+0.002 s"));
  CHECK_THAT(line_of(text, "prefill"), Catch::Contains("OK") && Catch::Contains("bf16, 16/block") &&
                                           Catch::Contains("tcp") && Catch::Contains("m (01234567)"));
  CHECK_THAT(line_of(text, "decode    d0:1"), Catch::Contains("OK") && Catch::Contains("receives tcp,nccl"));
  CHECK_THAT(line_of(text, "decode    d1:1"), Catch::Contains("PROBLEM") && Catch::Contains("unreachable"));
  CHECK_THAT(line_of(text, "p0:1 -> d0:1"),
             Catch::Contains("OK") && Catch::Contains(format_bandwidth(good.bandwidth_bytes_per_second())) &&
                 Catch::Contains("1.00 ms") && Catch::Contains("x 2"));
  CHECK_THAT(line_of(text, "p0:1 -> d1:1"), Catch::Contains("SKIPPED") && Catch::Contains("decode worker not checked"));
  CHECK_THAT(text, Catch::Contains("1 problem:") && Catch::Contains("- decode worker d1:1: unreachable") &&
                       Catch::Contains("fix: check the address"));
  CHECK_THAT(doctor_text(r, {}), Catch::Contains("no problems"));

  const nlohmann::json j = doctor_json(r, problems);
  CHECK(j["ok"] == false);
  CHECK(j["kv_bytes"] == 16 << 20);
  CHECK(j["rounds"] == 2);
  CHECK(j["frontend"]["address"] == "fe:50051");
  CHECK(j["frontend"]["ok"] == true);
  REQUIRE(j["workers"].size() == 3);
  CHECK(j["workers"][0]["role"] == "prefill");
  CHECK(j["workers"][0]["kv_dtype"] == "bf16");
  CHECK(j["workers"][0]["clock_offset_seconds"] == Approx(0.002));
  CHECK(j["workers"][2]["ok"] == false);
  CHECK(j["workers"][2]["reachable"] == false);
  CHECK(j["workers"][2]["clock_offset_seconds"].is_null());
  REQUIRE(j["links"].size() == 2);
  CHECK(j["links"][0]["ok"] == true);
  CHECK(j["links"][0]["measured"] == true);
  CHECK(j["links"][0]["bandwidth_bytes_per_second"] == Approx(good.bandwidth_bytes_per_second()));
  CHECK(j["links"][0]["seconds"].size() == 2);
  CHECK(j["links"][0]["latency_median_seconds"] == Approx(0.001));
  CHECK(j["links"][1]["ok"] == false);
  CHECK(j["links"][1]["skipped"] == "decode worker not checked");
  REQUIRE(j["problems"].size() == 1);
  CHECK(j["problems"][0]["subject"] == "decode worker d1:1");
  CHECK(j["problems"][0]["fix"] == "check the address");
  CHECK(doctor_json(r, {})["ok"] == true);
}

}  // namespace baton::ctl
