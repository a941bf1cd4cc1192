#include "scheduler/worker_registry.h"

#include <catch2/catch.hpp>
#include <cmath>

using namespace baton;
using namespace std::chrono_literals;

namespace {

constexpr auto kDecode = WorkerRole::kDecode;
constexpr auto kPrefill = WorkerRole::kPrefill;

WorkerLoad decode_load(int64_t free_blocks, int64_t total_blocks = 100, int32_t block_size = 16) {
  WorkerLoad l;
  l.free_blocks = free_blocks;
  l.total_blocks = total_blocks;
  l.block_size = block_size;
  return l;
}

WorkerLoad prefill_load(int64_t queued_prompt_tokens) {
  WorkerLoad l;
  l.queued_prompt_tokens = queued_prompt_tokens;
  return l;
}

WorkerSnapshot get(const WorkerRegistry& r, WorkerRole role, const std::string& address) {
  auto s = r.find(role, address);
  REQUIRE(s.has_value());
  return *s;
}

}  // namespace

TEST_CASE("set_addresses adds new workers, keeps known ones and drops the rest", "[scheduler]") {
  FakeClock clock;
  WorkerRegistry r({}, clock);
  r.set_addresses(kDecode, {"b:1", "a:1", "a:1", ""});
  CHECK(r.addresses(kDecode) == std::vector<std::string>{"a:1", "b:1"});
  CHECK(r.addresses(kPrefill).empty());
  r.set_addresses(kPrefill, {"a:1"});  // roles are separate namespaces

  REQUIRE(r.report_load(kDecode, "a:1", decode_load(50), clock.now()).ok());
  REQUIRE(r.reserve_decode("a:1", "r1", 7));
  r.set_addresses(kDecode, {"a:1", "c:1"});
  CHECK(r.addresses(kDecode) == std::vector<std::string>{"a:1", "c:1"});
  // a:1 keeps its report and its reservation.
  const auto a = get(r, kDecode, "a:1");
  CHECK(a.has_report);
  CHECK(a.healthy);
  CHECK(a.reserved_blocks == 7);
  CHECK(a.available_blocks() == 43);
  // c:1 is new: capacity unknown, not placeable yet.
  const auto c = get(r, kDecode, "c:1");
  CHECK_FALSE(c.has_report);
  CHECK_FALSE(c.can_place());
  // b:1 is gone: its late report and new reservations are refused.
  CHECK_FALSE(r.find(kDecode, "b:1").has_value());
  CHECK(r.report_load(kDecode, "b:1", decode_load(50), clock.now()).code() == StatusCode::kNotFound);
  CHECK_FALSE(r.reserve_decode("b:1", "r2", 1));

  r.set_addresses(kDecode, {});
  CHECK(r.snapshot(kDecode).empty());
  CHECK(r.addresses(kPrefill) == std::vector<std::string>{"a:1"});
  // Re-adding a dropped worker starts fresh: no report, no reservation.
  r.set_addresses(kDecode, {"a:1"});
  CHECK_FALSE(get(r, kDecode, "a:1").has_report);
  CHECK(get(r, kDecode, "a:1").reserved_blocks == 0);
}

TEST_CASE("health follows reports, consecutive failures and staleness", "[scheduler]") {
  FakeClock clock;
  WorkerRegistryConfig cfg;
  cfg.unhealthy_after_failures = 2;
  cfg.stale_after = 5s;
  WorkerRegistry r(cfg, clock);
  r.set_addresses(kPrefill, {"p:1"});
  CHECK_FALSE(get(r, kPrefill, "p:1").healthy);  // never reported

  REQUIRE(r.report_load(kPrefill, "p:1", prefill_load(0), clock.now()).ok());
  CHECK(get(r, kPrefill, "p:1").healthy);
  r.report_failure(kPrefill, "p:1");
  CHECK(get(r, kPrefill, "p:1").healthy);  // 1 < 2
  CHECK(get(r, kPrefill, "p:1").n_consecutive_failures == 1);
  r.report_failure(kPrefill, "p:1");
  CHECK_FALSE(get(r, kPrefill, "p:1").healthy);
  r.report_failure(kPrefill, "nobody:1");  // ignored

  REQUIRE(r.report_load(kPrefill, "p:1", prefill_load(0), clock.now()).ok());
  CHECK(get(r, kPrefill, "p:1").healthy);
  CHECK(get(r, kPrefill, "p:1").n_consecutive_failures == 0);

  clock.advance(5s);
  CHECK(get(r, kPrefill, "p:1").healthy);  // exactly stale_after old: still fresh
  clock.advance(1ns);
  CHECK_FALSE(get(r, kPrefill, "p:1").healthy);
  REQUIRE(r.report_load(kPrefill, "p:1", prefill_load(0), clock.now()).ok());
  CHECK(get(r, kPrefill, "p:1").healthy);

  WorkerLoad draining = prefill_load(0);
  draining.draining = true;
  REQUIRE(r.report_load(kPrefill, "p:1", draining, clock.now()).ok());
  CHECK(get(r, kPrefill, "p:1").healthy);
  CHECK_FALSE(get(r, kPrefill, "p:1").can_place());
}

TEST_CASE("malformed load reports are refused and change nothing", "[scheduler]") {
  FakeClock clock;
  WorkerRegistry r({}, clock);
  r.set_addresses(kDecode, {"d:1"});
  r.set_addresses(kPrefill, {"p:1"});
  CHECK(r.report_load(kDecode, "d:1", decode_load(101, 100), clock.now()).code() == StatusCode::kInvalidArgument);
  CHECK(r.report_load(kDecode, "d:1", decode_load(-1, 100), clock.now()).code() == StatusCode::kInvalidArgument);
  CHECK(r.report_load(kDecode, "d:1", decode_load(10, 100, 0), clock.now()).code() == StatusCode::kInvalidArgument);
  CHECK(r.report_load(kPrefill, "p:1", prefill_load(-5), clock.now()).code() == StatusCode::kInvalidArgument);
  // A step schedule with negative tokens, or a fit that is negative, infinite or not a number.
  const auto with_schedule = [](auto set) {
    WorkerLoad l = prefill_load(5);
    l.step_token_budget = 512;
    l.step_fixed_seconds = 0.5;
    l.step_seconds_per_token = 0.002;
    set(l);
    return l;
  };
  CHECK(r.report_load(kPrefill, "p:1", with_schedule([](WorkerLoad& l) { l.step_token_budget = -1; }), clock.now())
            .code() == StatusCode::kInvalidArgument);
  CHECK(
      r.report_load(kPrefill, "p:1", with_schedule([](WorkerLoad& l) { l.step_tokens_in_progress = -1; }), clock.now())
          .code() == StatusCode::kInvalidArgument);
  CHECK(r.report_load(kPrefill, "p:1", with_schedule([](WorkerLoad& l) { l.step_fixed_seconds = -0.1; }), clock.now())
            .code() == StatusCode::kInvalidArgument);
  CHECK(
      r.report_load(kPrefill, "p:1", with_schedule([](WorkerLoad& l) { l.step_seconds_per_token = NAN; }), clock.now())
          .code() == StatusCode::kInvalidArgument);
  CHECK(r.report_load(kPrefill, "p:1", with_schedule([](WorkerLoad& l) { l.step_elapsed_seconds = INFINITY; }),
                      clock.now())
            .code() == StatusCode::kInvalidArgument);
  CHECK_FALSE(get(r, kDecode, "d:1").has_report);
  CHECK_FALSE(get(r, kPrefill, "p:1").has_report);
  CHECK(r.report_load(kPrefill, "p:1", prefill_load(5), clock.now()).ok());  // block_size 0 is fine for prefill
}

TEST_CASE("a decode reservation counts until a report requested after its Admit was confirmed", "[scheduler]") {
  FakeClock clock;
  WorkerRegistry r({}, clock);
  r.set_addresses(kDecode, {"d:1"});
  REQUIRE(r.report_load(kDecode, "d:1", decode_load(100), clock.now()).ok());

  REQUIRE(r.reserve_decode("d:1", "r1", 10));
  CHECK(get(r, kDecode, "d:1").available_blocks() == 90);
  CHECK(get(r, kDecode, "d:1").n_unreported_requests == 1);

  // Not yet confirmed: a report, however recent, cannot include it (the Admit may be in flight).
  clock.advance(1ms);
  REQUIRE(r.report_load(kDecode, "d:1", decode_load(100), clock.now()).ok());
  CHECK(get(r, kDecode, "d:1").available_blocks() == 90);

  const TimePoint before_confirm = clock.now();
  clock.advance(1ms);
  r.confirm_decode("d:1", "r1");
  // Requested before the confirmation: the worker may have answered before admitting.
  REQUIRE(r.report_load(kDecode, "d:1", decode_load(100), before_confirm).ok());
  CHECK(get(r, kDecode, "d:1").reserved_blocks == 10);
  // Requested at the very time of the confirmation: the order is unknown, so it stays.
  REQUIRE(r.report_load(kDecode, "d:1", decode_load(100), clock.now()).ok());
  CHECK(get(r, kDecode, "d:1").reserved_blocks == 10);
  // Requested after: the report includes the blocks; the local reservation goes.
  clock.advance(1ms);
  REQUIRE(r.report_load(kDecode, "d:1", decode_load(90), clock.now()).ok());
  CHECK(get(r, kDecode, "d:1").reserved_blocks == 0);
  CHECK(get(r, kDecode, "d:1").available_blocks() == 90);
  CHECK(get(r, kDecode, "d:1").n_unreported_requests == 0);

  // Released after the report included it: nothing to undo locally; the next report frees it.
  r.release_decode("d:1", "r1");
  CHECK(get(r, kDecode, "d:1").available_blocks() == 90);
  clock.advance(1ms);
  REQUIRE(r.report_load(kDecode, "d:1", decode_load(100), clock.now()).ok());
  CHECK(get(r, kDecode, "d:1").available_blocks() == 100);
}

TEST_CASE("releasing an unreported reservation gives its blocks back at once", "[scheduler]") {
  FakeClock clock;
  WorkerRegistry r({}, clock);
  r.set_addresses(kDecode, {"d:1"});
  REQUIRE(r.report_load(kDecode, "d:1", decode_load(100), clock.now()).ok());
  REQUIRE(r.reserve_decode("d:1", "r1", 30));
  REQUIRE(r.reserve_decode("d:1", "r2", 20));
  r.confirm_decode("d:1", "r2");
  CHECK(get(r, kDecode, "d:1").available_blocks() == 50);
  r.release_decode("d:1", "r1");  // never admitted (e.g. Admit failed)
  CHECK(get(r, kDecode, "d:1").available_blocks() == 80);
  r.release_decode("d:1", "r2");  // admitted, finished before any report saw it
  CHECK(get(r, kDecode, "d:1").available_blocks() == 100);
  r.release_decode("d:1", "r2");  // twice: no effect
  r.release_decode("d:1", "never");
  r.confirm_decode("d:1", "never");
  CHECK(get(r, kDecode, "d:1").available_blocks() == 100);
  CHECK(get(r, kDecode, "d:1").reserved_blocks == 0);
}

TEST_CASE("a report answered out of order is ignored", "[scheduler]") {
  FakeClock clock;
  WorkerRegistry r({}, clock);
  r.set_addresses(kDecode, {"d:1"});
  const TimePoint t1 = clock.now();
  clock.advance(1s);
  const TimePoint t2 = clock.now();
  REQUIRE(r.report_load(kDecode, "d:1", decode_load(40), t2).ok());
  REQUIRE(r.report_load(kDecode, "d:1", decode_load(80), t1).ok());
  CHECK(get(r, kDecode, "d:1").load.free_blocks == 40);
  REQUIRE(r.report_load(kDecode, "d:1", decode_load(60), t2).ok());  // same request time: applied
  CHECK(get(r, kDecode, "d:1").load.free_blocks == 60);
}

TEST_CASE("prefill tokens count until a report requested after they were sent", "[scheduler]") {
  FakeClock clock;
  WorkerRegistry r({}, clock);
  r.set_addresses(kPrefill, {"p:1"});
  REQUIRE(r.report_load(kPrefill, "p:1", prefill_load(100), clock.now()).ok());
  const TimePoint poll_sent = clock.now();
  clock.advance(1ms);
  REQUIRE(r.add_prefill_tokens("p:1", "r1", 50));
  REQUIRE(r.add_prefill_tokens("p:1", "r2", 25));
  CHECK(get(r, kPrefill, "p:1").outstanding_prompt_tokens() == 175);
  // The answer to a poll sent before the prompts cannot include them.
  REQUIRE(r.report_load(kPrefill, "p:1", prefill_load(100), poll_sent).ok());
  CHECK(get(r, kPrefill, "p:1").outstanding_prompt_tokens() == 175);
  r.remove_prefill_tokens("p:1", "r2");
  CHECK(get(r, kPrefill, "p:1").outstanding_prompt_tokens() == 150);
  clock.advance(1ms);
  REQUIRE(r.report_load(kPrefill, "p:1", prefill_load(150), clock.now()).ok());
  CHECK(get(r, kPrefill, "p:1").outstanding_prompt_tokens() == 150);
  CHECK(get(r, kPrefill, "p:1").unreported_prompt_tokens == 0);
  r.remove_prefill_tokens("p:1", "r1");  // already in the report: the worker's next report drops it
  CHECK(get(r, kPrefill, "p:1").outstanding_prompt_tokens() == 150);
  CHECK_FALSE(r.add_prefill_tokens("nobody:1", "r3", 5));
}

TEST_CASE("registry config validation names the bad field", "[scheduler]") {
  WorkerRegistryConfig cfg;
  CHECK(cfg.validate().ok());
  cfg.unhealthy_after_failures = 0;
  CHECK(cfg.validate().message().find("unhealthy_after_failures") != std::string::npos);
  cfg = {};
  cfg.stale_after = 0s;
  CHECK(cfg.validate().message().find("stale_after") != std::string::npos);
}
