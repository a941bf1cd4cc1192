// `batonctl doctor`'s verdicts (client/doctor_checks.h) on made-up reports: a healthy deployment
// has no problem, and each thing that can be wrong is named on its row with its fix — model
// fingerprint, KV dtype and block size against the frontend or the majority, clocks against the
// bound (random offsets and round trips, fresh each run), unreachable workers, refused discovery,
// failed probes by code, transports a decode worker does not receive.
#include "client/doctor_checks.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <random>

namespace baton::ctl {
namespace {

NodeReport worker(const std::string& role, const std::string& address) {
  NodeReport n;
  n.role = role;
  n.address = address;
  n.reachable = true;
  n.health = "SERVING";
  n.has_report = true;
  n.model_name = "smollm2";
  n.model_fingerprint = "fp-good";
  n.kv_dtype = "f32";
  n.block_size = 16;
  if (role == "prefill") n.kv_transport = "tcp";
  if (role == "decode") n.kv_transports = {"tcp"};
  n.version = "0.1.0";
  n.has_clock = true;
  n.rtt_seconds = 0.001;
  return n;
}

LinkReport link(const NodeReport& p, const NodeReport& d) {
  LinkReport l;
  l.prefill = p.address;
  l.decode = d.address;
  l.transport = "tcp";
  l.bytes = 16 << 20;
  l.seconds = {0.05, 0.04, 0.06};
  l.latency_bytes = 512;
  l.latency_seconds = {0.001, 0.0005, 0.002};
  return l;
}

// Two prefill and two decode workers, every link measured, behind a frontend.
DoctorReport healthy() {
  DoctorReport r;
  NodeReport fe = worker("frontend", "fe:50051");
  fe.kv_dtype.clear();
  fe.block_size = 0;
  fe.kv_transport.clear();
  r.frontend = fe;
  r.prefill = {worker("prefill", "p0:1"), worker("prefill", "p1:1")};
  r.decode = {worker("decode", "d0:1"), worker("decode", "d1:1")};
  for (auto& n : r.prefill) n.frontend_healthy = true;
  for (auto& n : r.decode) n.frontend_healthy = true;
  for (const auto& p : r.prefill) {
    for (const auto& d : r.decode) r.links.push_back(link(p, d));
  }
  r.kv_bytes = 16 << 20;
  r.rounds = 3;
  return r;
}

std::vector<Problem> problems_of(const DoctorReport& r, double skew = 1.0) {
  return doctor_problems(r, DoctorLimits{skew});
}

}  // namespace

TEST_CASE("doctor: a healthy deployment has no problems, and its links are measured", "[client][doctor]") {
  const DoctorReport r = healthy();
  CHECK(problems_of(r).empty());
  const LinkReport& l = r.links[0];
  CHECK(l.measured());
  CHECK(l.bandwidth_bytes_per_second() == Approx((16 << 20) / 0.05));  // the median round
  CHECK(l.latency_median_seconds() == Approx(0.001));
  CHECK(median({}) == 0);
  CHECK(median({3, 1, 2, 4}) == 2);  // the lower middle
}

TEST_CASE("doctor: a model fingerprint unlike the frontend's is named, with the fix", "[client][doctor]") {
  DoctorReport r = healthy();
  r.decode[1].model_fingerprint = "fp-other";
  r.decode[1].model_name = "other";
  const auto problems = problems_of(r);
  REQUIRE(problems.size() == 1);
  CHECK(problems[0].kind == "decode");
  CHECK(problems[0].address == "d1:1");
  CHECK_THAT(problems[0].what, Catch::Contains("fp-other") && Catch::Contains("the frontend serves fingerprint fp-good"));
  CHECK_THAT(problems[0].fix, Catch::Contains("same model file on every role"));
  CHECK(has_problem(problems, "decode", "d1:1"));
  CHECK_FALSE(has_problem(problems, "decode", "d0:1"));
  CHECK(problem_subject(problems[0]) == "decode worker d1:1");

  SECTION("without a frontend the majority is the reference") {
    r.frontend.reset();
    const auto by_majority = problems_of(r);
    REQUIRE(by_majority.size() == 1);
    CHECK(by_majority[0].address == "d1:1");
    CHECK_THAT(by_majority[0].what, Catch::Contains("3 workers serve fingerprint fp-good"));
  }
  SECTION("a tie: the first worker's value, named") {
    r.frontend.reset();
    r.prefill.resize(1);
    r.decode.resize(1);
    r.decode[0].model_fingerprint = "fp-other";
    r.links.resize(1);
    const auto tie = problems_of(r);
    REQUIRE(tie.size() == 1);
    CHECK(tie[0].address == "d0:1");
    CHECK_THAT(tie[0].what, Catch::Contains("prefill worker p0:1 serves fingerprint fp-good"));
  }
}

TEST_CASE("doctor: KV dtype and block size must agree across workers", "[client][doctor]") {
  DoctorReport r = healthy();
  r.prefill[0].kv_dtype = "bf16";
  r.decode[0].block_size = 32;
  const auto problems = problems_of(r);
  REQUIRE(problems.size() == 2);
  CHECK(problems[0].address == "p0:1");
  CHECK_THAT(problems[0].what, Catch::Contains("KV dtype differs") && Catch::Contains("bf16") &&
                                   Catch::Contains("3 workers use f32"));
  CHECK_THAT(problems[0].fix, Catch::Contains("--kv-dtype"));
  CHECK(problems[1].address == "d0:1");
  CHECK_THAT(problems[1].what, Catch::Contains("block size differs"));
  CHECK_THAT(problems[1].fix, Catch::Contains("--block-size"));
}

TEST_CASE("doctor: a clock beyond the bound (after half the round trip) is flagged", "[client][doctor]") {
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_real_distribution<double> offset(-5, 5), rtt(0, 0.5), bound(0.1, 2);
  for (int trial = 0; trial < 500; ++trial) {
    DoctorReport r = healthy();
    NodeReport& n = r.prefill[1];
    n.clock_offset_seconds = offset(rng);
    n.rtt_seconds = rtt(rng);
    const double b = bound(rng);
    const bool off = std::fabs(n.clock_offset_seconds) - n.rtt_seconds / 2 > b;
    const auto problems = problems_of(r, b);
    CAPTURE(n.clock_offset_seconds, n.rtt_seconds, b);
    REQUIRE(problems.size() == (off ? 1u : 0u));
    if (off) {
      CHECK(problems[0].address == "p1:1");
      CHECK_THAT(problems[0].what, Catch::Contains(n.clock_offset_seconds > 0 ? "ahead of" : "behind"));
      CHECK_THAT(problems[0].fix, Catch::Contains("NTP"));
    }
  }
  // A node that reported no clock (an older baton) is not judged on it.
  DoctorReport r = healthy();
  r.decode[0].has_clock = false;
  r.decode[0].clock_offset_seconds = 100;
  CHECK(problems_of(r).empty());
}

TEST_CASE("doctor: an unreachable worker is named with what to check, its links are skipped", "[client][doctor]") {
  DoctorReport r = healthy();
  NodeReport& d = r.decode[0];
  d = NodeReport{};
  d.role = "decode";
  d.address = "d0:1";
  d.failed_call = "health";
  d.error_code = "UNAVAILABLE";
  d.error = "failed to connect to all addresses";
  d.frontend_healthy = false;
  for (auto& l : r.links) {
    if (l.decode == "d0:1") {
      l.seconds.clear();
      l.latency_seconds.clear();
      l.skipped = "decode worker not checked";
    }
  }
  auto problems = problems_of(r);
  REQUIRE(problems.size() == 1);  // that the frontend sees it unhealthy too goes without saying
  CHECK(problems[0].address == "d0:1");
  CHECK_THAT(problems[0].what, Catch::Contains("unreachable") && Catch::Contains("UNAVAILABLE"));
  CHECK_THAT(problems[0].fix, Catch::Contains("NetworkPolicy") && Catch::Contains("--internal-tls-cert"));
  CHECK_FALSE(has_problem(problems, "link", "p0:1 -> d0:1"));  // the worker's own problem says why

  r.internal_tls = true;
  problems = problems_of(r);
  CHECK_THAT(problems[0].fix, Catch::Contains("same internal CA"));

  SECTION("an address that serves another role") {
    d.failed_call = "GetLoad";
    d.reachable = true;
    d.error_code = "UNIMPLEMENTED";
    CHECK_THAT(problems_of(r)[0].what, Catch::Contains("not as a decode worker"));
  }
  SECTION("NOT_SERVING, draining, unhealthy as the frontend sees it") {
    d = worker("decode", "d0:1");
    d.health = "NOT_SERVING";
    r.decode[1].draining = true;
    r.prefill[1].frontend_healthy = false;
    problems = problems_of(r);
    REQUIRE(problems.size() == 3);
    CHECK(problems[0].address == "p1:1");
    CHECK_THAT(problems[0].what, Catch::Contains("frontend sees it unhealthy"));
    CHECK_THAT(problems[1].what, Catch::Contains("NOT_SERVING"));
    CHECK(problems[2].address == "d1:1");
    CHECK_THAT(problems[2].what, Catch::Contains("draining"));
  }
}

TEST_CASE("doctor: refused discovery names the key to give", "[client][doctor]") {
  for (const auto& [code, fix] : {std::pair<std::string, std::string>{"UNAUTHENTICATED", "--api-key"},
                                  {"PERMISSION_DENIED", "add 'admin'"},
                                  {"UNIMPLEMENTED", "--prefill-addresses"}}) {
    DoctorReport r;
    r.frontend = worker("frontend", "fe:50051");
    r.frontend->has_report = false;
    r.frontend->has_clock = false;
    r.frontend->failed_call = "ListWorkers";
    r.frontend->error_code = code;
    const auto problems = problems_of(r);
    CAPTURE(code);
    REQUIRE(problems.size() == 1);  // no "no decode workers": the lists are unknown
    CHECK(problems[0].kind == "frontend");
    CHECK_THAT(problems[0].what, Catch::Contains("ListWorkers refused") && Catch::Contains(code));
    CHECK_THAT(problems[0].fix, Catch::Contains(fix));
  }
  DoctorReport r;
  r.frontend = worker("frontend", "fe:50051");
  r.frontend->failed_call = "health";
  r.frontend->error_code = "UNAVAILABLE";
  CHECK_THAT(problems_of(r)[0].fix, Catch::Contains("--tls-ca"));
}

TEST_CASE("doctor: a failed probe is named on its link with a fix by its code", "[client][doctor]") {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"FAILED_PRECONDITION|comes from model fingerprint 'x'", "same model file"},
      {"FAILED_PRECONDITION|is bf16 but this decode worker's KV cache is f32 (set the same --kv-dtype)", "--kv-dtype"},
      {"UNAVAILABLE|connection refused", "NetworkPolicy"},
      {"DEADLINE_EXCEEDED|deadline", "NetworkPolicy"},
      {"UNIMPLEMENTED|unknown method", "one baton version"},
      {"RESOURCE_EXHAUSTED|busy", "run again"},
      {"DATA_LOSS|checksum mismatch", "corrupts"},
  };
  for (const auto& [failure, fix] : cases) {
    DoctorReport r = healthy();
    LinkReport& l = r.links[3];
    l.error_code = failure.substr(0, failure.find('|'));
    l.error = failure.substr(failure.find('|') + 1);
    l.seconds.clear();
    CAPTURE(failure);
    CHECK_FALSE(l.measured());
    CHECK(l.bandwidth_bytes_per_second() == 0);
    const auto problems = problems_of(r);
    REQUIRE(problems.size() == 1);
    CHECK(problems[0].kind == "link");
    CHECK(problems[0].address == "p1:1 -> d1:1");
    CHECK(problem_subject(problems[0]) == "link p1:1 -> d1:1");
    CHECK_THAT(problems[0].what, Catch::Contains(l.error_code));
    CHECK_THAT(problems[0].fix, Catch::Contains(fix));
  }
  DoctorReport r = healthy();
  r.links[0].seconds.clear();  // answered, but measured nothing
  CHECK(problems_of(r).size() == 1);
}

TEST_CASE("doctor: a transport the decode worker does not receive, and missing roles", "[client][doctor]") {
  DoctorReport r = healthy();
  r.prefill[0].kv_transport = "nccl";
  auto problems = problems_of(r);
  REQUIRE(problems.size() == 2);  // p0 -> d0 and p0 -> d1
  CHECK_THAT(problems[0].what, Catch::Contains("nccl"));
  CHECK_THAT(problems[0].fix, Catch::Contains("--kv-transport"));
  r.decode[0].kv_transports = {"tcp", "cuda_ipc", "nccl"};
  CHECK(problems_of(r).size() == 1);

  DoctorReport empty;
  empty.frontend = worker("frontend", "fe:50051");
  problems = problems_of(empty);
  REQUIRE(problems.size() == 2);
  CHECK(problems[0].kind == "deployment");
  CHECK_THAT(problems[0].what, Catch::Contains("no decode workers"));
  CHECK_THAT(problems[1].what, Catch::Contains("no prefill workers"));
  empty.local_prefill_max_tokens = 512;  // colocated: decode workers prefill
  CHECK(problems_of(empty).size() == 1);
}

}  // namespace baton::ctl
