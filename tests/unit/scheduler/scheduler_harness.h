// Shared fixture of the scheduler tests: a fake clock, a registry with workers that report on
// demand, and recorded callbacks.
#pragma once

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <thread>

#include "scheduler/scheduler.h"

namespace baton::scheduler_test {

using namespace std::chrono_literals;

constexpr auto kDecode = WorkerRole::kDecode;
constexpr auto kPrefill = WorkerRole::kPrefill;
constexpr int32_t kBlockSize = 16;

// A scheduler over a registry, fake time, and workers whose load the test reports by hand.
// Records every callback.
struct Harness {
  FakeClock clock;
  WorkerRegistry registry;
  Scheduler sched;
  std::vector<std::string> decode_addresses, prefill_addresses;
  std::map<std::string, Placement> placed;
  std::vector<std::string> placed_order;
  std::map<std::string, Status> failed;
  std::map<std::string, int> n_callbacks;

  explicit Harness(SchedulerConfig cfg = {}, WorkerRegistryConfig rcfg = {})
      : registry(rcfg, clock), sched(cfg, registry, clock) {}

  // Registers (if new) and reports a decode worker with `free_blocks` of `total_blocks` free.
  void decode_worker(const std::string& address, int64_t free_blocks, int64_t total_blocks = 100,
                     bool draining = false, int32_t local_prefill_max_tokens = 0, double step_seconds = 0) {
    if (std::find(decode_addresses.begin(), decode_addresses.end(), address) == decode_addresses.end()) {
      decode_addresses.push_back(address);
      registry.set_addresses(kDecode, decode_addresses);
    }
    WorkerLoad l;
    l.free_blocks = free_blocks;
    l.total_blocks = total_blocks;
    l.block_size = kBlockSize;
    l.step_seconds = step_seconds;
    l.draining = draining;
    l.local_prefill_max_tokens = local_prefill_max_tokens;
    REQUIRE(registry.report_load(kDecode, address, l, clock.now()).ok());
  }
  void prefill_worker(const std::string& address, int64_t queued_prompt_tokens = 0, bool draining = false,
                      double step_seconds = 0, double prefill_tokens_per_second = 0) {
    if (std::find(prefill_addresses.begin(), prefill_addresses.end(), address) == prefill_addresses.end()) {
      prefill_addresses.push_back(address);
      registry.set_addresses(kPrefill, prefill_addresses);
    }
    WorkerLoad l;
    l.queued_prompt_tokens = queued_prompt_tokens;
    l.draining = draining;
    l.step_seconds = step_seconds;
    l.prefill_tokens_per_second = prefill_tokens_per_second;
    REQUIRE(registry.report_load(kPrefill, address, l, clock.now()).ok());
  }

  // Submits a request of n_prompt tokens needing n_blocks decode blocks in total.
  Status submit(const std::string& id, int64_t n_prompt, int64_t n_blocks, int32_t priority = 0,
                std::optional<std::chrono::nanoseconds> deadline_in = std::nullopt) {
    PendingRequest r;
    r.id = id;
    r.n_prompt_tokens = n_prompt;
    r.n_total_tokens = n_blocks * kBlockSize;
    r.priority = priority;
    r.arrival = clock.now();
    if (deadline_in.has_value()) r.deadline = clock.now() + *deadline_in;
    return submit(std::move(r));
  }
  // Submits `r` as it is, recording its callbacks.
  Status submit(PendingRequest r) {
    const std::string id = r.id;
    return sched.submit(
        std::move(r),
        [this, id](const Placement& p) {
          ++n_callbacks[id];
          CHECK(p.request_id == id);
          placed[id] = p;
          placed_order.push_back(id);
        },
        [this, id](const Status& s) {
          ++n_callbacks[id];
          CHECK_FALSE(s.ok());
          failed[id] = s;
        });
  }

  bool is_placed(const std::string& id) const { return placed.count(id) != 0; }
  StatusCode failure(const std::string& id) const {
    auto it = failed.find(id);
    return it == failed.end() ? StatusCode::kOk : it->second.code();
  }
  WorkerSnapshot worker(WorkerRole role, const std::string& address) const {
    auto s = registry.find(role, address);
    REQUIRE(s.has_value());
    return *s;
  }
};

inline bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

inline uint32_t test_seed(const char* name) {
  const char* env = std::getenv("BATON_TEST_SEED");
  const uint32_t seed = env != nullptr ? static_cast<uint32_t>(std::strtoul(env, nullptr, 10)) : std::random_device{}();
  std::printf("%s seed %u (rerun with BATON_TEST_SEED=%u)\n", name, seed, seed);
  return seed;
}


}  // namespace baton::scheduler_test
