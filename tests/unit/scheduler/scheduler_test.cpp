#include "scheduler/scheduler.h"

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <thread>

using namespace baton;
using namespace std::chrono_literals;

namespace {

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
                     bool draining = false) {
    if (std::find(decode_addresses.begin(), decode_addresses.end(), address) == decode_addresses.end()) {
      decode_addresses.push_back(address);
      registry.set_addresses(kDecode, decode_addresses);
    }
    WorkerLoad l;
    l.free_blocks = free_blocks;
    l.total_blocks = total_blocks;
    l.block_size = kBlockSize;
    l.draining = draining;
    REQUIRE(registry.report_load(kDecode, address, l, clock.now()).ok());
  }
  void prefill_worker(const std::string& address, int64_t queued_prompt_tokens = 0, bool draining = false) {
    if (std::find(prefill_addresses.begin(), prefill_addresses.end(), address) == prefill_addresses.end()) {
      prefill_addresses.push_back(address);
      registry.set_addresses(kPrefill, prefill_addresses);
    }
    WorkerLoad l;
    l.queued_prompt_tokens = queued_prompt_tokens;
    l.draining = draining;
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

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

uint32_t test_seed(const char* name) {
  const char* env = std::getenv("BATON_TEST_SEED");
  const uint32_t seed = env != nullptr ? static_cast<uint32_t>(std::strtoul(env, nullptr, 10)) : std::random_device{}();
  std::printf("%s seed %u (rerun with BATON_TEST_SEED=%u)\n", name, seed, seed);
  return seed;
}

}  // namespace

TEST_CASE("over max_requests a request is refused at once; admitted ones proceed", "[scheduler]") {
  SchedulerConfig cfg;
  cfg.max_requests = 2;
  Harness h(cfg);
  h.prefill_worker("p:1");
  h.decode_worker("d:1", 10);

  REQUIRE(h.submit("r1", 32, 10).ok());
  CHECK(h.is_placed("r1"));
  REQUIRE(h.submit("r2", 32, 10).ok());  // admitted, waits for blocks
  CHECK_FALSE(h.is_placed("r2"));
  const Status s = h.submit("r3", 16, 1);
  CHECK(s.code() == StatusCode::kResourceExhausted);
  CHECK(contains(s.message(), "max_requests = 2"));
  CHECK(h.n_callbacks.count("r3") == 0);  // a refusal is the only answer
  CHECK(h.sched.n_admitted() == 2);
  CHECK(h.sched.n_queued() == 1);

  h.sched.finished("r1");  // its reservation was never in a report: the blocks return at once
  CHECK(h.is_placed("r2"));
  CHECK(h.sched.n_admitted() == 1);
  REQUIRE(h.submit("r3", 16, 1).ok());
  CHECK(h.sched.n_admitted() == 2);
}

TEST_CASE("the queued prompt token bound refuses at once; a prompt over the bound is invalid", "[scheduler]") {
  SchedulerConfig cfg;
  cfg.max_queued_prompt_tokens = 100;
  Harness h(cfg);
  h.prefill_worker("p:1");
  h.decode_worker("d:1", 0);  // nothing fits: everything queues

  REQUIRE(h.submit("a", 60, 5).ok());
  const Status s = h.submit("b", 50, 5);
  CHECK(s.code() == StatusCode::kResourceExhausted);
  CHECK(contains(s.message(), "max_queued_prompt_tokens = 100"));
  REQUIRE(h.submit("c", 40, 5).ok());
  CHECK(h.sched.queued_prompt_tokens() == 100);
  CHECK(h.submit("huge", 101, 10).code() == StatusCode::kInvalidArgument);

  h.decode_worker("d:1", 5);  // room for one: placing it frees its prompt tokens from the bound
  h.sched.poll();
  CHECK(h.is_placed("a"));
  CHECK(h.sched.queued_prompt_tokens() == 40);
  REQUIRE(h.submit("b", 50, 5).ok());
}

TEST_CASE("malformed, unservable and duplicate requests are refused with the right code", "[scheduler]") {
  Harness h;
  CHECK(h.submit("r", 10, 1).code() == StatusCode::kUnavailable);  // no workers at all
  h.decode_worker("d:1", 10, 64);                                  // holds 64 × 16 = 1024 positions
  CHECK(h.submit("r", 10, 1).code() == StatusCode::kUnavailable);  // no prefill worker
  h.prefill_worker("p:1");

  const Status too_big = h.submit("big", 10, 65);
  CHECK(too_big.code() == StatusCode::kInvalidArgument);
  CHECK(contains(too_big.message(), "1024"));
  CHECK(h.submit("", 10, 1).code() == StatusCode::kInvalidArgument);
  CHECK(h.submit("empty", 0, 1).code() == StatusCode::kInvalidArgument);
  CHECK(h.submit("short", 32, 1).code() == StatusCode::kInvalidArgument);  // total 16 < prompt 32
  CHECK(h.submit("late", 10, 1, 0, 0ns).code() == StatusCode::kDeadlineExceeded);
  REQUIRE(h.submit("ok", 10, 1).ok());
  CHECK(h.submit("ok", 10, 1).code() == StatusCode::kInvalidArgument);  // id in use
  CHECK(h.sched.n_admitted() == 1);
  CHECK(h.n_callbacks.size() == 1);
}

TEST_CASE("a request waits while no decode worker has reported, and is placed when one does", "[scheduler]") {
  Harness h;
  h.prefill_worker("p:1");
  h.registry.set_addresses(kDecode, {"d:1"});
  REQUIRE(h.submit("r", 10, 1000).ok());  // size unknown yet: admitted
  CHECK(h.sched.n_queued() == 1);
  h.decode_worker("d:1", 2000, 2000);
  h.sched.poll();
  CHECK(h.is_placed("r"));
  CHECK(h.placed["r"].decode_blocks == 1000);
  CHECK(h.placed["r"].decode_address == "d:1");
  CHECK(h.placed["r"].prefill_address == "p:1");
}

TEST_CASE("a queued request is placed when a load report shows room", "[scheduler]") {
  Harness h;
  h.prefill_worker("p:1");
  h.decode_worker("d:1", 5);
  REQUIRE(h.submit("r", 10, 8).ok());
  h.sched.poll();
  CHECK_FALSE(h.is_placed("r"));
  h.decode_worker("d:1", 8);
  CHECK_FALSE(h.is_placed("r"));  // the registry does not call the scheduler: poll() does the work
  h.sched.poll();
  CHECK(h.is_placed("r"));
  CHECK(h.worker(kDecode, "d:1").reserved_blocks == 8);
  CHECK(h.worker(kDecode, "d:1").available_blocks() == 0);
  CHECK(h.sched.n_queued() == 0);
  CHECK(h.sched.n_admitted() == 1);
}

TEST_CASE("finishing a request frees its blocks for the queue, through the registry's accounting", "[scheduler]") {
  Harness h;
  h.prefill_worker("p:1");
  h.decode_worker("d:1", 10);
  REQUIRE(h.submit("a", 10, 10).ok());
  REQUIRE(h.submit("b", 10, 10).ok());
  REQUIRE(h.submit("c", 10, 10).ok());
  CHECK(h.placed_order == std::vector<std::string>{"a"});

  // a's reservation was never in a report: finishing it frees the blocks at once.
  h.sched.finished("a");
  CHECK(h.placed_order == std::vector<std::string>{"a", "b"});

  // b is admitted by the worker and a later report includes it (0 free): the reservation is
  // dropped. Finishing b then cannot free anything until the worker says so.
  h.sched.decode_admitted("b");
  h.clock.advance(1ms);
  h.decode_worker("d:1", 0);
  CHECK(h.worker(kDecode, "d:1").reserved_blocks == 0);
  h.sched.finished("b");
  CHECK(h.placed_order.size() == 2);
  h.clock.advance(1ms);
  h.decode_worker("d:1", 10);
  h.sched.poll();
  CHECK(h.placed_order == std::vector<std::string>{"a", "b", "c"});
  h.sched.finished("c");
  h.sched.finished("c");  // twice: ignored
  CHECK(h.sched.n_admitted() == 0);
  CHECK(h.worker(kDecode, "d:1").reserved_blocks == 0);
  CHECK(h.worker(kPrefill, "p:1").unreported_prompt_tokens == 0);
}

TEST_CASE("higher priority is placed first, FCFS within a priority", "[scheduler]") {
  Harness h;
  h.prefill_worker("p:1");
  h.decode_worker("d:1", 0);
  REQUIRE(h.submit("a0", 10, 4, 0).ok());
  h.clock.advance(1ms);
  REQUIRE(h.submit("b1", 10, 4, 1).ok());
  h.clock.advance(1ms);
  REQUIRE(h.submit("c0", 10, 4, 0).ok());
  h.clock.advance(1ms);
  REQUIRE(h.submit("d1", 10, 4, 1).ok());
  REQUIRE(h.submit("e2", 10, 4, 2).ok());
  // Room for exactly one request at a time.
  for (int i = 0; i < 5; ++i) {
    h.clock.advance(1ms);
    h.decode_worker("d:1", 4);
    h.sched.poll();
    REQUIRE(h.placed_order.size() == static_cast<size_t>(i + 1));
    h.sched.finished(h.placed_order.back());
  }
  CHECK(h.placed_order == std::vector<std::string>{"e2", "b1", "d1", "a0", "c0"});
}

TEST_CASE("a queued request whose deadline passes fails with DEADLINE_EXCEEDED", "[scheduler]") {
  Harness h;
  h.prefill_worker("p:1");
  h.decode_worker("d:1", 0);
  REQUIRE(h.submit("short", 10, 4, 0, 100ms).ok());
  REQUIRE(h.submit("long", 10, 4, 0, 10s).ok());
  REQUIRE(h.submit("none", 10, 4).ok());
  h.clock.advance(99ms);
  h.sched.poll();
  CHECK(h.failed.empty());
  h.clock.advance(1ms);
  h.sched.poll();
  CHECK(h.failure("short") == StatusCode::kDeadlineExceeded);
  CHECK(contains(h.failed["short"].message(), "deadline"));
  CHECK(h.failed.size() == 1);
  CHECK(h.sched.n_queued() == 2);
  CHECK(h.sched.queued_prompt_tokens() == 20);
  h.decode_worker("d:1", 4);
  h.sched.poll();
  CHECK(h.is_placed("long"));
  // A placed request's deadline is the frontend's business (it cancels the workers' calls).
  h.clock.advance(1h);
  h.sched.poll();
  CHECK(h.failure("long") == StatusCode::kOk);
  CHECK(h.failure("none") == StatusCode::kOk);  // no deadline: it waits
  CHECK(h.sched.n_queued() == 1);
}

TEST_CASE("cancel removes a queued request with CANCELLED and frees what a placed one holds", "[scheduler]") {
  Harness h;
  h.prefill_worker("p:1");
  h.decode_worker("d:1", 10);
  REQUIRE(h.submit("placed", 30, 10).ok());
  REQUIRE(h.submit("queued", 20, 10).ok());
  REQUIRE(h.submit("behind", 25, 10).ok());
  CHECK(h.sched.queued_prompt_tokens() == 45);

  h.sched.cancel("queued");
  CHECK(h.failure("queued") == StatusCode::kCancelled);
  CHECK(h.sched.n_queued() == 1);
  CHECK(h.sched.queued_prompt_tokens() == 25);
  CHECK(h.worker(kPrefill, "p:1").unreported_prompt_tokens == 30);

  h.sched.cancel("placed");  // no second callback for it; its blocks and prompt tokens go
  CHECK(h.n_callbacks["placed"] == 1);
  CHECK(h.failure("placed") == StatusCode::kOk);
  CHECK(h.is_placed("behind"));
  CHECK(h.worker(kPrefill, "p:1").unreported_prompt_tokens == 25);
  h.sched.cancel("nobody");
  h.sched.cancel("queued");
  CHECK(h.n_callbacks["queued"] == 1);

  h.sched.prefill_done("behind");
  CHECK(h.worker(kPrefill, "p:1").unreported_prompt_tokens == 0);
  h.sched.cancel("behind");
  CHECK(h.sched.n_admitted() == 0);
  CHECK(h.worker(kDecode, "d:1").reserved_blocks == 0);
}

TEST_CASE("decode placement spreads by free blocks and never overfills between reports", "[scheduler]") {
  Harness h;
  h.prefill_worker("p:1");
  h.decode_worker("a:1", 30);
  h.decode_worker("b:1", 20);
  for (const char* id : {"r1", "r2", "r3", "r4"}) REQUIRE(h.submit(id, 10, 15).ok());
  CHECK(h.placed["r1"].decode_address == "a:1");  // 30 vs 20
  CHECK(h.placed["r2"].decode_address == "b:1");  // 15 vs 20
  CHECK(h.placed["r3"].decode_address == "a:1");  // 15 vs 5
  CHECK_FALSE(h.is_placed("r4"));
  CHECK(h.worker(kDecode, "a:1").available_blocks() == 0);
  CHECK(h.worker(kDecode, "b:1").available_blocks() == 5);
}

TEST_CASE("prefill placement follows outstanding prompt tokens until prefill is done", "[scheduler]") {
  Harness h;
  h.prefill_worker("p:1", 100);
  h.prefill_worker("p:2", 0);
  h.decode_worker("d:1", 100);
  REQUIRE(h.submit("a", 150, 10).ok());  // p:2 (0 < 100)
  REQUIRE(h.submit("b", 10, 1).ok());    // p:1 (100 < 150)
  REQUIRE(h.submit("c", 10, 1).ok());    // p:1 (110 < 150)
  CHECK(h.placed["a"].prefill_address == "p:2");
  CHECK(h.placed["b"].prefill_address == "p:1");
  CHECK(h.placed["c"].prefill_address == "p:1");
  h.sched.prefill_done("a");  // p:2 back to 0
  h.sched.prefill_done("a");  // twice: ignored
  REQUIRE(h.submit("d", 10, 1).ok());
  CHECK(h.placed["d"].prefill_address == "p:2");
  CHECK(h.worker(kPrefill, "p:1").outstanding_prompt_tokens() == 120);
}

TEST_CASE("unhealthy, stale and draining workers get no new requests", "[scheduler]") {
  WorkerRegistryConfig rcfg;
  rcfg.unhealthy_after_failures = 1;
  rcfg.stale_after = 1s;
  Harness h({}, rcfg);
  h.prefill_worker("p:1");
  h.prefill_worker("p:2", 1000);
  h.decode_worker("a:1", 90);
  h.decode_worker("b:1", 50);
  h.decode_worker("c:1", 10);

  h.registry.report_failure(kDecode, "a:1");
  h.registry.report_failure(kPrefill, "p:1");
  REQUIRE(h.submit("r1", 10, 1).ok());
  CHECK(h.placed["r1"].decode_address == "b:1");
  CHECK(h.placed["r1"].prefill_address == "p:2");

  h.decode_worker("b:1", 50, 100, /*draining=*/true);
  REQUIRE(h.submit("r2", 10, 1).ok());
  CHECK(h.placed["r2"].decode_address == "c:1");

  h.clock.advance(1500ms);  // every report is now stale
  REQUIRE(h.submit("r3", 10, 1).ok());
  CHECK_FALSE(h.is_placed("r3"));
  h.decode_worker("a:1", 90);  // a fresh report makes a:1 healthy again
  h.prefill_worker("p:1");
  h.sched.poll();
  CHECK(h.placed["r3"].decode_address == "a:1");
  CHECK(h.placed["r3"].prefill_address == "p:1");
}

TEST_CASE("address updates: queued requests fail when all workers of a role are gone", "[scheduler]") {
  Harness h;
  h.prefill_worker("p:1");
  h.decode_worker("d:1", 1, 8);
  h.decode_worker("e:1", 1, 100);
  REQUIRE(h.submit("placed", 10, 1).ok());
  REQUIRE(h.submit("big", 10, 50).ok());   // fits only e:1 (total 100), which is full now
  REQUIRE(h.submit("small", 10, 5).ok());  // fits d:1 or e:1 someday
  const std::string placed_on = h.placed["placed"].decode_address;

  // e:1 leaves: "big" can never fit the remaining workers.
  h.registry.set_addresses(kDecode, {"d:1"});
  h.sched.poll();
  CHECK(h.failure("big") == StatusCode::kInvalidArgument);
  CHECK_FALSE(h.failed.count("small"));

  h.registry.set_addresses(kDecode, {});
  h.sched.poll();
  CHECK(h.failure("small") == StatusCode::kUnavailable);
  CHECK(h.sched.n_queued() == 0);
  // A placed request whose worker was dropped still finishes cleanly.
  h.sched.finished("placed");
  CHECK(h.sched.n_admitted() == 0);
  CHECK(placed_on.size() > 0);
}

TEST_CASE("head-of-line: small requests backfill past a large head only within max_head_bypass", "[scheduler]") {
  SchedulerConfig cfg;
  cfg.max_head_bypass = 1s;
  Harness h(cfg);
  h.prefill_worker("p:1");
  h.decode_worker("d:1", 20, 100);
  REQUIRE(h.submit("big", 10, 50).ok());
  REQUIRE(h.submit("small1", 10, 10).ok());
  CHECK(h.is_placed("small1"));  // the head does not fit; small1 does, within the allowance
  CHECK_FALSE(h.is_placed("big"));

  h.clock.advance(1s);
  REQUIRE(h.submit("small2", 10, 10).ok());
  CHECK_FALSE(h.is_placed("small2"));  // big has waited long enough: it holds everything behind it
  h.sched.poll();
  CHECK_FALSE(h.is_placed("small2"));

  // Blocks accumulate for the head; once it fits it goes first, then the rest.
  h.sched.finished("small1");
  h.clock.advance(1ms);
  h.decode_worker("d:1", 60);
  h.sched.poll();
  CHECK(h.placed_order == std::vector<std::string>{"small1", "big", "small2"});
}

TEST_CASE("head-of-line: max_head_bypass = 0 is strict FCFS", "[scheduler]") {
  SchedulerConfig cfg;
  cfg.max_head_bypass = 0s;
  Harness h(cfg);
  h.prefill_worker("p:1");
  h.decode_worker("d:1", 20, 100);
  REQUIRE(h.submit("big", 10, 50).ok());
  REQUIRE(h.submit("small", 10, 10).ok());
  CHECK(h.placed.empty());
  h.decode_worker("d:1", 60);
  h.sched.poll();
  CHECK(h.placed_order == std::vector<std::string>{"big", "small"});
}

TEST_CASE("callbacks run without the scheduler's lock and may call back into it", "[scheduler]") {
  Harness h;
  h.prefill_worker("p:1");
  h.decode_worker("d:1", 10);
  int n_seen = -1;
  PendingRequest r;
  r.id = "first";
  r.n_prompt_tokens = 10;
  r.n_total_tokens = 10 * kBlockSize;
  r.arrival = h.clock.now();
  // Finishing from inside on_placed (a std::mutex would deadlock if it were held) places the next.
  REQUIRE(h.sched
              .submit(
                  r,
                  [&](const Placement& p) {
                    n_seen = h.sched.n_admitted();
                    h.sched.finished(p.request_id);
                  },
                  [](const Status&) { FAIL("on_failed"); })
              .ok());
  CHECK(n_seen == 1);
  CHECK(h.sched.n_admitted() == 0);
  REQUIRE(h.submit("second", 10, 10).ok());
  CHECK(h.is_placed("second"));
}

TEST_CASE("concurrent submit, finish, cancel and load reports keep the books", "[scheduler]") {
  SchedulerConfig cfg;
  cfg.max_requests = 64;
  Harness h(cfg);
  h.prefill_worker("p:1");
  h.prefill_worker("p:2");
  h.decode_worker("d:1", 50);
  h.decode_worker("d:2", 50);
  constexpr int kThreads = 4;
  constexpr int kPerThread = 300;
  std::atomic<int> n_placed{0}, n_failed{0}, n_refused{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<uint32_t>(t));
      for (int i = 0; i < kPerThread; ++i) {
        const std::string id = std::to_string(t) + "-" + std::to_string(i);
        PendingRequest r;
        r.id = id;
        r.n_prompt_tokens = 1 + rng() % 64;
        r.n_total_tokens = r.n_prompt_tokens + rng() % (20 * kBlockSize);
        r.arrival = h.clock.now();
        const bool finish_inline = rng() % 2 == 0;
        const Status s = h.sched.submit(
            r,
            [&, finish_inline](const Placement& p) {
              ++n_placed;
              if (finish_inline) h.sched.finished(p.request_id);
            },
            [&](const Status&) { ++n_failed; });
        if (!s.ok()) {
          ++n_refused;
          continue;
        }
        if (!finish_inline || rng() % 4 == 0) h.sched.cancel(id);
      }
    });
  }
  std::thread poller([&] {
    while (!stop.load()) {
      h.sched.poll();
      std::this_thread::yield();
    }
  });
  for (auto& th : threads) th.join();
  stop = true;
  poller.join();
  h.sched.poll();
  CHECK(n_placed + n_failed + n_refused == kThreads * kPerThread);
  CHECK(h.sched.n_admitted() == 0);
  CHECK(h.sched.n_queued() == 0);
  CHECK(h.sched.queued_prompt_tokens() == 0);
  for (const char* d : {"d:1", "d:2"}) CHECK(h.worker(kDecode, d).reserved_blocks == 0);
  for (const char* p : {"p:1", "p:2"}) CHECK(h.worker(kPrefill, p).unreported_prompt_tokens == 0);
}

TEST_CASE("scheduler config validation names the bad field", "[scheduler]") {
  SchedulerConfig cfg;
  CHECK(cfg.validate().ok());
  cfg.max_requests = 0;
  CHECK(contains(cfg.validate().message(), "max_requests"));
  cfg = {};
  cfg.max_queued_prompt_tokens = 0;
  CHECK(contains(cfg.validate().message(), "max_queued_prompt_tokens"));
  cfg = {};
  cfg.max_head_bypass = -1ns;
  CHECK(contains(cfg.validate().message(), "max_head_bypass"));
}

// A model of the workers (what each really holds) and of every request, driven by random
// operations; after each one the scheduler's books must agree with the model, no decode worker may
// hold more than it has, and the local estimate of free blocks may never exceed the truth.
TEST_CASE("random submit/report/finish/cancel sequences keep every invariant", "[scheduler]") {
  std::mt19937 rng(test_seed("scheduler random test"));
  SchedulerConfig cfg;
  cfg.max_requests = 24;
  cfg.max_queued_prompt_tokens = 1500;
  cfg.max_head_bypass = std::chrono::milliseconds(500 * (rng() % 3));
  WorkerRegistryConfig rcfg;
  rcfg.unhealthy_after_failures = 2;
  rcfg.stale_after = 3s;
  Harness h(cfg, rcfg);

  struct FakeDecode {
    int64_t total;
    int32_t block_size;
    std::map<std::string, int64_t> held = {};  // admitted requests → blocks
    bool draining = false;
  };
  struct FakePrefill {
    std::map<std::string, int64_t> queued = {};  // requests sent here, prefill not done → prompt tokens
  };
  std::map<std::string, FakeDecode> decode = {{"d:1", {40, 16}}, {"d:2", {80, 8}}, {"d:3", {25, 16}}};
  std::map<std::string, FakePrefill> prefill = {{"p:1", {}}, {"p:2", {}}};
  const int64_t capacity = 640;  // largest total × block_size
  auto decode_load = [&](const FakeDecode& d) {
    WorkerLoad l;
    l.total_blocks = d.total;
    l.free_blocks = d.total;
    for (const auto& [id, b] : d.held) l.free_blocks -= b;
    l.block_size = d.block_size;
    l.n_running = static_cast<int32_t>(d.held.size());
    l.draining = d.draining;
    return l;
  };
  auto prefill_load = [&](const FakePrefill& p) {
    WorkerLoad l;
    for (const auto& [id, n] : p.queued) l.queued_prompt_tokens += n;
    return l;
  };
  h.registry.set_addresses(kDecode, {"d:1", "d:2", "d:3"});
  h.registry.set_addresses(kPrefill, {"p:1", "p:2"});
  for (auto& [a, d] : decode) REQUIRE(h.registry.report_load(kDecode, a, decode_load(d), h.clock.now()).ok());
  for (auto& [a, p] : prefill) REQUIRE(h.registry.report_load(kPrefill, a, prefill_load(p), h.clock.now()).ok());

  enum class State { kQueued, kPlaced, kDone };
  struct Req {
    PendingRequest req;
    State state = State::kQueued;
    Placement placement;
    bool admitted = false, prefilled = false, cancel_requested = false;
    int n_callbacks = 0;
  };
  std::map<std::string, Req> reqs;
  struct InFlightReport {
    WorkerRole role;
    std::string address;
    WorkerLoad load;
    TimePoint requested_at;
  };
  std::vector<InFlightReport> in_flight;
  int n_placed = 0, n_deadline = 0, n_cancelled = 0, n_refused = 0;

  auto live_blocks_on = [&](const std::string& address) {
    int64_t n = 0;
    for (const auto& [id, r] : reqs) {
      if (r.state == State::kPlaced && r.placement.decode_address == address) n += r.placement.decode_blocks;
    }
    return n;
  };
  auto on_placed = [&](const Placement& p) {
    Req& r = reqs.at(p.request_id);
    CHECK(++r.n_callbacks == 1);
    REQUIRE(r.state == State::kQueued);
    r.state = State::kPlaced;
    r.placement = p;
    ++n_placed;
    CHECK(p.decode_blocks == blocks_for(r.req.n_total_tokens, decode.at(p.decode_address).block_size));
    const WorkerSnapshot d = h.worker(kDecode, p.decode_address);
    CHECK(d.can_place());
    CHECK(d.reserved_blocks <= d.load.free_blocks);  // reservations never exceed the reported free blocks
    CHECK(h.worker(kPrefill, p.prefill_address).can_place());
    prefill.at(p.prefill_address).queued[p.request_id] = r.req.n_prompt_tokens;  // the Prefill call
  };
  auto on_failed = [&](const std::string& id, const Status& s) {
    Req& r = reqs.at(id);
    CHECK(++r.n_callbacks == 1);
    REQUIRE(r.state == State::kQueued);
    r.state = State::kDone;
    if (s.code() == StatusCode::kDeadlineExceeded) {
      REQUIRE(r.req.deadline.has_value());
      CHECK(h.clock.now() >= *r.req.deadline);
      ++n_deadline;
    } else if (s.code() == StatusCode::kCancelled) {
      CHECK(r.cancel_requested);
      ++n_cancelled;
    } else {
      FAIL("unexpected failure " << s.to_string());
    }
  };
  // The request leaves both workers (finished or cancelled after placement).
  auto end_placed = [&](Req& r) {
    decode.at(r.placement.decode_address).held.erase(r.req.id);
    prefill.at(r.placement.prefill_address).queued.erase(r.req.id);
    r.state = State::kDone;
  };
  auto pick = [&](State state, auto pred) -> Req* {
    std::vector<Req*> v;
    for (auto& [id, r] : reqs) {
      if (r.state == state && pred(r)) v.push_back(&r);
    }
    return v.empty() ? nullptr : v[rng() % v.size()];
  };
  auto check_books = [&] {
    int32_t n_queued = 0, n_live = 0;
    int64_t queued_tokens = 0;
    for (const auto& [id, r] : reqs) {
      n_queued += r.state == State::kQueued;
      n_live += r.state != State::kDone;
      if (r.state == State::kQueued) queued_tokens += r.req.n_prompt_tokens;
    }
    REQUIRE(h.sched.n_queued() == n_queued);
    REQUIRE(h.sched.n_admitted() == n_live);
    REQUIRE(h.sched.queued_prompt_tokens() == queued_tokens);
    for (const auto& [a, d] : decode) {
      const int64_t live = live_blocks_on(a);
      REQUIRE(live <= d.total);                                            // never overcommitted
      REQUIRE(h.worker(kDecode, a).available_blocks() <= d.total - live);  // the estimate is never optimistic
    }
  };

  int next_id = 0;
  for (int step = 0; step < 4000; ++step) {
    const int op = static_cast<int>(rng() % 100);
    INFO("step " << step << " op " << op);
    if (op < 25) {
      const std::string id = "r" + std::to_string(next_id++);
      Req r;
      r.req.id = id;
      r.req.n_prompt_tokens = 1 + rng() % 200;
      r.req.n_total_tokens = r.req.n_prompt_tokens + rng() % 400 + (rng() % 20 == 0 ? 1000 : 0);
      r.req.priority = static_cast<int32_t>(rng() % 3);
      r.req.arrival = h.clock.now();
      if (rng() % 2 == 0) r.req.deadline = h.clock.now() + std::chrono::milliseconds(rng() % 3000);
      const int32_t live_before = h.sched.n_admitted();
      const int64_t queued_before = h.sched.queued_prompt_tokens();
      const PendingRequest req = r.req;
      reqs.emplace(id, std::move(r));
      const Status s = h.sched.submit(req, on_placed, [&, id](const Status& st) { on_failed(id, st); });
      const bool over_bound =
          live_before >= cfg.max_requests || queued_before + req.n_prompt_tokens > cfg.max_queued_prompt_tokens;
      if (!s.ok()) {
        ++n_refused;
        CHECK(reqs.at(id).n_callbacks == 0);
        reqs.erase(id);
        switch (s.code()) {
          case StatusCode::kInvalidArgument: CHECK(req.n_total_tokens > capacity); break;
          case StatusCode::kDeadlineExceeded: CHECK(*req.deadline <= h.clock.now()); break;
          case StatusCode::kResourceExhausted: CHECK(over_bound); break;
          default: FAIL("unexpected refusal " << s.to_string());
        }
      } else {
        CHECK(req.n_total_tokens <= capacity);
        CHECK_FALSE(over_bound);
      }
    } else if (op < 35) {
      h.clock.advance(std::chrono::milliseconds(rng() % 400));
    } else if (op < 45) {
      h.sched.poll();
    } else if (op < 60) {  // poll a worker's load; the answer travels for a while
      const bool is_decode = rng() % 2 == 0;
      auto it_d = std::next(decode.begin(), static_cast<long>(rng() % decode.size()));
      auto it_p = std::next(prefill.begin(), static_cast<long>(rng() % prefill.size()));
      const std::string& address = is_decode ? it_d->first : it_p->first;
      if (rng() % 10 == 0) {
        h.registry.report_failure(is_decode ? kDecode : kPrefill, address);
      } else {
        in_flight.push_back({is_decode ? kDecode : kPrefill, address,
                             is_decode ? decode_load(it_d->second) : prefill_load(it_p->second), h.clock.now()});
      }
    } else if (op < 70) {  // an answer arrives, not necessarily in order
      if (!in_flight.empty()) {
        const size_t i = rng() % in_flight.size();
        const InFlightReport rep = in_flight[i];
        in_flight.erase(in_flight.begin() + static_cast<long>(i));
        REQUIRE(h.registry.report_load(rep.role, rep.address, rep.load, rep.requested_at).ok());
        if (rng() % 2 == 0) h.sched.poll();
      }
    } else if (op < 78) {  // D.Admit returns
      if (Req* r = pick(State::kPlaced, [](const Req& q) { return !q.admitted; })) {
        r->admitted = true;
        decode.at(r->placement.decode_address).held[r->req.id] = r->placement.decode_blocks;
        h.sched.decode_admitted(r->req.id);
      }
    } else if (op < 85) {  // first token: prefill done
      if (Req* r = pick(State::kPlaced, [](const Req& q) { return !q.prefilled; })) {
        r->prefilled = true;
        prefill.at(r->placement.prefill_address).queued.erase(r->req.id);
        h.sched.prefill_done(r->req.id);
      }
    } else if (op < 93) {  // the stream ends
      if (Req* r = pick(State::kPlaced, [](const Req&) { return true; })) {
        end_placed(*r);
        h.sched.finished(r->req.id);
      }
    } else if (op < 98) {  // the client cancels, queued or placed
      Req* r = rng() % 2 == 0 ? pick(State::kQueued, [](const Req&) { return true; })
                              : pick(State::kPlaced, [](const Req&) { return true; });
      if (r != nullptr) {
        const std::string id = r->req.id;
        if (r->state == State::kPlaced) {
          end_placed(*r);
        } else {
          r->cancel_requested = true;
        }
        h.sched.cancel(id);
        CHECK(reqs.at(id).state == State::kDone);
      }
    } else {  // a decode worker starts or stops draining (seen at its next report)
      auto it = std::next(decode.begin(), static_cast<long>(rng() % decode.size()));
      it->second.draining = !it->second.draining;
    }
    check_books();
  }

  // Wind down: cancel what waits, finish what runs.
  for (auto& [id, r] : reqs) {
    if (r.state == State::kQueued) {
      r.cancel_requested = true;
      h.sched.cancel(id);
    }
  }
  for (auto& [id, r] : reqs) {
    if (r.state == State::kPlaced) {
      end_placed(r);
      h.sched.finished(id);
    }
  }
  check_books();
  for (const auto& [id, r] : reqs) {
    INFO("request " << id);
    CHECK(r.n_callbacks == 1);
    CHECK(r.state == State::kDone);
  }
  CHECK(h.sched.n_admitted() == 0);
  CHECK(h.sched.n_queued() == 0);
  CHECK(h.sched.queued_prompt_tokens() == 0);
  for (const auto& [a, d] : decode) CHECK(h.worker(kDecode, a).reserved_blocks == 0);
  for (const auto& [a, p] : prefill) CHECK(h.worker(kPrefill, a).unreported_prompt_tokens == 0);
  std::printf("  %zu admitted: %d placed, %d deadline, %d cancelled in queue; %d refused\n", reqs.size(), n_placed,
              n_deadline, n_cancelled, n_refused);
  CHECK(n_placed > 0);
}
