#include "scheduler/placement.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <tuple>

using namespace baton;

namespace {

WorkerSnapshot decode_worker(std::string address, int64_t free_blocks, int64_t total_blocks = 100,
                             int32_t block_size = 16) {
  WorkerSnapshot w;
  w.address = std::move(address);
  w.role = WorkerRole::kDecode;
  w.has_report = true;
  w.healthy = true;
  w.load.free_blocks = free_blocks;
  w.load.total_blocks = total_blocks;
  w.load.block_size = block_size;
  return w;
}

WorkerSnapshot prefill_worker(std::string address, int64_t queued_prompt_tokens) {
  WorkerSnapshot w;
  w.address = std::move(address);
  w.role = WorkerRole::kPrefill;
  w.has_report = true;
  w.healthy = true;
  w.load.queued_prompt_tokens = queued_prompt_tokens;
  return w;
}

// A request needing n_blocks blocks of 16 positions on decode.
PlacementRequest needing_blocks(int64_t n_blocks) {
  return {16, n_blocks * 16, {}};
}

uint32_t test_seed() {
  const char* env = std::getenv("BATON_TEST_SEED");
  const uint32_t seed = env != nullptr ? static_cast<uint32_t>(std::strtoul(env, nullptr, 10)) : std::random_device{}();
  std::printf("placement_test seed %u (rerun with BATON_TEST_SEED=%u)\n", seed, seed);
  return seed;
}

}  // namespace

TEST_CASE("blocks_for rounds up", "[scheduler]") {
  CHECK(blocks_for(0, 16) == 0);
  CHECK(blocks_for(1, 16) == 1);
  CHECK(blocks_for(16, 16) == 1);
  CHECK(blocks_for(17, 16) == 2);
  CHECK(blocks_for(4096, 1) == 4096);
}

TEST_CASE("decode placement picks the worker with the most free blocks that fits", "[scheduler]") {
  const DecodePlacement policy;
  const std::vector<WorkerSnapshot> ws = {decode_worker("a:1", 10), decode_worker("b:1", 40), decode_worker("c:1", 25)};
  CHECK(policy.pick(ws, needing_blocks(5)) == "b:1");
  CHECK(policy.pick(ws, needing_blocks(40)) == "b:1");
  CHECK_FALSE(policy.pick(ws, needing_blocks(41)).has_value());
  CHECK(policy.pick(ws, PlacementRequest{16, 40 * 16 + 1, {}}) == std::nullopt);  // one position over
  CHECK_FALSE(policy.pick({}, needing_blocks(1)).has_value());
}

TEST_CASE("decode placement subtracts this frontend's unreported reservations", "[scheduler]") {
  const DecodePlacement policy;
  std::vector<WorkerSnapshot> ws = {decode_worker("a:1", 30), decode_worker("b:1", 40)};
  ws[1].reserved_blocks = 15;  // b: 25 available
  CHECK(policy.pick(ws, needing_blocks(10)) == "a:1");
  CHECK(policy.pick(ws, needing_blocks(26)) == "a:1");
  CHECK_FALSE(policy.pick(ws, needing_blocks(31)).has_value());
  ws[0].reserved_blocks = 40;  // more than reported free (another frontend filled it): never chosen
  CHECK(policy.pick(ws, needing_blocks(1)) == "b:1");
  CHECK(policy.pick(ws, needing_blocks(0)) == "b:1");
}

TEST_CASE("placement skips unhealthy, draining and never-reported workers", "[scheduler]") {
  const DecodePlacement decode;
  std::vector<WorkerSnapshot> ws = {decode_worker("a:1", 90), decode_worker("b:1", 80), decode_worker("c:1", 70),
                                    decode_worker("d:1", 10)};
  ws[0].healthy = false;
  ws[1].load.draining = true;
  ws[2].has_report = false;
  ws[2].healthy = false;
  CHECK(decode.pick(ws, needing_blocks(5)) == "d:1");
  CHECK_FALSE(decode.pick(ws, needing_blocks(11)).has_value());

  const PrefillPlacement prefill;
  std::vector<WorkerSnapshot> ps = {prefill_worker("p:1", 0), prefill_worker("p:2", 0), prefill_worker("p:3", 500)};
  ps[0].healthy = false;
  ps[1].load.draining = true;
  CHECK(prefill.pick(ps, needing_blocks(1)) == "p:3");
  ps[2].healthy = false;
  CHECK_FALSE(prefill.pick(ps, needing_blocks(1)).has_value());
}

TEST_CASE("decode ties go to fewer sequences, then to address order", "[scheduler]") {
  const DecodePlacement policy;
  std::vector<WorkerSnapshot> ws = {decode_worker("a:1", 50), decode_worker("b:1", 50), decode_worker("c:1", 50)};
  CHECK(policy.pick(ws, needing_blocks(1)) == "a:1");
  ws[0].load.n_running = 3;
  ws[1].load.n_running = 1;
  ws[2].load.n_running = 1;
  CHECK(policy.pick(ws, needing_blocks(1)) == "b:1");
  ws[1].n_unreported_requests = 1;
  CHECK(policy.pick(ws, needing_blocks(1)) == "c:1");
}

TEST_CASE("decode placement compares free positions when block sizes differ", "[scheduler]") {
  const DecodePlacement policy;
  // a: 30 blocks × 16 = 480 positions; b: 40 blocks × 8 = 320 positions.
  const std::vector<WorkerSnapshot> ws = {decode_worker("a:1", 30, 100, 16), decode_worker("b:1", 40, 100, 8)};
  CHECK(policy.pick(ws, PlacementRequest{10, 100, {}}) == "a:1");
  CHECK(policy.pick(ws, PlacementRequest{10, 480, {}}) == "a:1");
  CHECK_FALSE(policy.pick(ws, PlacementRequest{10, 481, {}}).has_value());
}

TEST_CASE("prefill placement picks the fewest outstanding prompt tokens, reported plus unreported", "[scheduler]") {
  const PrefillPlacement policy;
  std::vector<WorkerSnapshot> ps = {prefill_worker("p:1", 100), prefill_worker("p:2", 300), prefill_worker("p:3", 200)};
  CHECK(policy.pick(ps, needing_blocks(1)) == "p:1");
  ps[0].unreported_prompt_tokens = 150;  // 250
  CHECK(policy.pick(ps, needing_blocks(1)) == "p:3");
  ps[2].unreported_prompt_tokens = 50;  // 250: tie with p:1, which comes first
  CHECK(policy.pick(ps, needing_blocks(1)) == "p:1");
}

TEST_CASE("two placements in a row through the registry do not overfill a worker", "[scheduler]") {
  FakeClock clock;
  WorkerRegistry registry({}, clock);
  registry.set_addresses(WorkerRole::kDecode, {"a:1", "b:1"});
  WorkerLoad la;
  la.free_blocks = 30;
  la.total_blocks = 100;
  la.block_size = 16;
  WorkerLoad lb = la;
  lb.free_blocks = 20;
  REQUIRE(registry.report_load(WorkerRole::kDecode, "a:1", la, clock.now()).ok());
  REQUIRE(registry.report_load(WorkerRole::kDecode, "b:1", lb, clock.now()).ok());

  const DecodePlacement policy;
  std::vector<std::string> picks;
  for (int i = 0; i < 4; ++i) {
    const auto pick = policy.pick(registry.snapshot(WorkerRole::kDecode), needing_blocks(15));
    if (!pick.has_value()) break;
    REQUIRE(registry.reserve_decode(*pick, "r" + std::to_string(i), 15));
    picks.push_back(*pick);
  }
  // Without the local reservations all four would go to a:1 (30 free in every report).
  CHECK(picks == std::vector<std::string>{"a:1", "b:1", "a:1"});
  for (const auto& w : registry.snapshot(WorkerRole::kDecode)) CHECK(w.available_blocks() >= 0);
}

TEST_CASE("decode and prefill placement agree with a naive reference on random workers", "[scheduler]") {
  std::mt19937 rng(test_seed());
  const DecodePlacement decode;
  const PrefillPlacement prefill;
  for (int iter = 0; iter < 2000; ++iter) {
    std::vector<WorkerSnapshot> ws;
    const int n = static_cast<int>(rng() % 6);
    for (int i = 0; i < n; ++i) {
      const int32_t bs = (rng() % 2 == 0) ? 8 : 16;
      const int64_t total = 1 + rng() % 20;
      WorkerSnapshot w =
          decode_worker("w" + std::to_string(i) + ":1", static_cast<int64_t>(rng() % (total + 1)), total, bs);
      w.reserved_blocks = rng() % 4 == 0 ? static_cast<int64_t>(rng() % 8) : 0;
      w.n_unreported_requests = w.reserved_blocks > 0 ? 1 : 0;
      w.load.n_running = static_cast<int32_t>(rng() % 3);
      w.load.queued_prompt_tokens = static_cast<int64_t>(rng() % 5);
      w.unreported_prompt_tokens = static_cast<int64_t>(rng() % 3);
      w.healthy = rng() % 6 != 0;
      w.load.draining = rng() % 8 == 0;
      ws.push_back(w);
    }
    const int64_t n_total = 1 + static_cast<int64_t>(rng() % 200);
    const PlacementRequest req{1, n_total, {}};

    // Reference: sort the eligible workers by the policy's key and take the first.
    std::vector<std::tuple<int64_t, int64_t, int, std::string>> decode_eligible;  // (-free positions, sequences, index)
    std::vector<std::tuple<int64_t, int, std::string>> prefill_eligible;          // (outstanding, index)
    for (int i = 0; i < n; ++i) {
      const auto& w = ws[i];
      if (!w.healthy || w.load.draining) continue;
      prefill_eligible.emplace_back(w.load.queued_prompt_tokens + w.unreported_prompt_tokens, i, w.address);
      const int64_t available = w.load.free_blocks - w.reserved_blocks;
      if (available * w.load.block_size < n_total) continue;  // same as available < ceil(n_total / bs)
      decode_eligible.emplace_back(-available * w.load.block_size, w.load.n_running + w.n_unreported_requests, i,
                                   w.address);
    }
    std::sort(decode_eligible.begin(), decode_eligible.end());
    std::sort(prefill_eligible.begin(), prefill_eligible.end());
    const auto d = decode.pick(ws, req);
    const auto p = prefill.pick(ws, req);
    INFO("iteration " << iter);
    if (decode_eligible.empty()) {
      CHECK_FALSE(d.has_value());
    } else {
      CHECK(d == std::get<3>(decode_eligible.front()));
    }
    if (prefill_eligible.empty()) {
      CHECK_FALSE(p.has_value());
    } else {
      CHECK(p == std::get<2>(prefill_eligible.front()));
    }
  }
}
