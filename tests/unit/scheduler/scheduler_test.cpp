#include "tests/unit/scheduler/scheduler_harness.h"

using namespace baton;
using namespace baton::scheduler_test;

TEST_CASE("over max_requests a request is refused at once, admitted ones proceed", "[scheduler]") {
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

TEST_CASE("a request's n choices count against max_requests while it is admitted", "[scheduler][limits]") {
  SchedulerConfig cfg;
  cfg.max_requests = 8;
  Harness h(cfg);
  h.prefill_worker("p:1");
  h.decode_worker("d:1", 100);
  auto with_followers = [&](const std::string& id, int32_t n_followers, const std::string& counted_by = {}) {
    PendingRequest r;
    r.id = id;
    r.n_prompt_tokens = 16;
    r.n_total_tokens = 2 * kBlockSize;
    r.n_followers = n_followers;
    r.counted_by = counted_by;
    r.arrival = h.clock.now();
    return h.submit(std::move(r));
  };
  REQUIRE(with_followers("n5", 4).ok());  // 5 choices: 5 of the 8
  CHECK(h.sched.n_admitted() == 5);
  const Status full = with_followers("n4", 3);  // 4 more would be 9
  CHECK(full.code() == StatusCode::kResourceExhausted);
  CHECK(contains(full.message(), "4 choices"));
  REQUIRE(with_followers("n3", 2).ok());
  CHECK(h.sched.n_admitted() == 8);
  CHECK(h.submit("one", 16, 1).code() == StatusCode::kResourceExhausted);
  // More choices than the bound can ever hold: the request itself is wrong.
  CHECK(with_followers("n9", 8).code() == StatusCode::kInvalidArgument);
  h.sched.finished("n5");
  CHECK(h.sched.n_admitted() == 3);
  REQUIRE(with_followers("n4", 3).ok());
  h.sched.cancel("n4");
  h.sched.finished("n3");
  CHECK(h.sched.n_admitted() == 0);

  // A follower whose fork was refused comes back on its own: its leader counted it, so the count
  // moves over (no bound check, no second count) while the leader has a follower left to count.
  REQUIRE(with_followers("lead", 6).ok());  // 7 of the 8
  REQUIRE(h.submit("one", 16, 1).ok());    // 8
  auto refused_fork = [&](const std::string& id, const std::string& leader) { return with_followers(id, 0, leader); };
  for (int i = 0; i < 6; ++i) REQUIRE(refused_fork("f" + std::to_string(i), "lead").ok());
  CHECK(h.sched.n_admitted() == 8);
  // The leader has no follower left to count: a seventh is counted as any request (and refused).
  CHECK(refused_fork("f6", "lead").code() == StatusCode::kResourceExhausted);
  h.sched.finished("lead");  // the leader ends before its followers: they stay counted
  CHECK(h.sched.n_admitted() == 7);
  REQUIRE(refused_fork("f6", "lead").ok());  // its leader is gone: counted on its own
  CHECK(h.sched.n_admitted() == 8);
  for (const char* id : {"one", "f0", "f1", "f2", "f3", "f4", "f5", "f6"}) h.sched.finished(id);
  CHECK(h.sched.n_admitted() == 0);
}

TEST_CASE("the queued prompt token bound refuses at once, a prompt over the bound is invalid", "[scheduler]") {
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
  h.prefill_worker("p:1");  // the workers stay healthy (and full)
  h.decode_worker("d:1", 0);
  h.sched.poll();
  CHECK(h.failure("long") == StatusCode::kOk);
  CHECK(h.failure("none") == StatusCode::kOk);  // no deadline: it waits
  CHECK(h.sched.n_queued() == 1);
}

TEST_CASE("a queued request fails UNAVAILABLE after no_worker_timeout without a healthy worker of a role",
          "[scheduler]") {
  SchedulerConfig cfg;
  cfg.no_worker_timeout = 5s;
  Harness h(cfg);
  h.prefill_worker("p:1");
  h.decode_worker("d:1", 0);  // healthy but full: requests wait, however long
  REQUIRE(h.submit("full", 10, 4).ok());
  h.clock.advance(4s);
  h.prefill_worker("p:1");
  h.decode_worker("d:1", 0);
  h.registry.report_down(kDecode, "d:1");  // then the decode worker's connection breaks
  REQUIRE(h.submit("later", 10, 4).ok());
  h.clock.advance(1s);
  h.prefill_worker("p:1");
  h.sched.poll();
  // 5 s queued, and no healthy decode worker: fails. `later` has waited 1 s only.
  CHECK(h.failure("full") == StatusCode::kUnavailable);
  CHECK(contains(h.failed["full"].message(), "no healthy decode worker"));
  CHECK(h.failure("later") == StatusCode::kOk);
  // A report asked for before the worker was seen down does not heal it; a later one does.
  WorkerLoad l;
  l.free_blocks = 10;
  l.total_blocks = 100;
  l.block_size = kBlockSize;
  REQUIRE(h.registry.report_load(kDecode, "d:1", l, h.clock.now() - 2s).ok());
  CHECK_FALSE(h.worker(kDecode, "d:1").healthy);
  h.decode_worker("d:1", 10);
  CHECK(h.worker(kDecode, "d:1").healthy);
  h.sched.poll();
  CHECK(h.is_placed("later"));
}

TEST_CASE("a request avoids the workers it names while another fits, and takes them when none does",
          "[scheduler]") {
  Harness h;
  h.prefill_worker("p:1");
  h.prefill_worker("p:2", 1000);  // busier: the policy's own choice is p:1
  h.decode_worker("d:1", 50);
  h.decode_worker("d:2", 10);  // fewer free blocks: the policy's own choice is d:1
  auto submit_avoiding = [&](const std::string& id, int64_t n_blocks, std::vector<std::string> avoid_d,
                             std::vector<std::string> avoid_p) {
    PendingRequest r;
    r.id = id;
    r.n_prompt_tokens = 10;
    r.n_total_tokens = n_blocks * kBlockSize;
    r.arrival = h.clock.now();
    r.avoid_decode = std::move(avoid_d);
    r.avoid_prefill = std::move(avoid_p);
    return h.sched.submit(std::move(r), [&h, id](const Placement& p) { h.placed[id] = p; },
                          [&h, id](const Status& s) { h.failed[id] = s; });
  };
  REQUIRE(submit_avoiding("moved", 4, {"d:1"}, {"p:1"}).ok());
  REQUIRE(h.is_placed("moved"));
  CHECK(h.placed["moved"].decode_address == "d:2");
  CHECK(h.placed["moved"].prefill_address == "p:2");
  // d:2 has 6 blocks left: a request of 20 fits only on the worker it avoids.
  REQUIRE(submit_avoiding("big", 20, {"d:1"}, {}).ok());
  REQUIRE(h.is_placed("big"));
  CHECK(h.placed["big"].decode_address == "d:1");
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

TEST_CASE("local prefill: short prompts go to decode workers that prefill them, the rest to prefill workers",
          "[scheduler][local]") {
  SchedulerConfig cfg;
  cfg.local_prefill_max_tokens = 100;
  Harness h(cfg);
  // No prefill worker yet: a decode worker that has not reported may still turn out to prefill.
  h.registry.set_addresses(kDecode, {"d:1"});
  REQUIRE(h.submit("early", 50, 10).ok());
  CHECK_FALSE(h.is_placed("early"));
  h.decode_worker("d:1", 50, 100, false, /*local_prefill_max_tokens=*/80);
  h.sched.poll();
  REQUIRE(h.is_placed("early"));
  CHECK(h.placed["early"].prefill_address.empty());  // local
  CHECK(h.placed["early"].decode_address == "d:1");

  // Longer than the worker's limit (80) or the frontend's (100): a prefill worker is needed, and
  // there is none to be had.
  CHECK(h.submit("over-worker", 90, 10).code() == StatusCode::kUnavailable);
  CHECK(h.submit("over-frontend", 120, 10).code() == StatusCode::kUnavailable);
  h.prefill_worker("p:1");
  REQUIRE(h.submit("mid", 90, 10).ok());
  REQUIRE(h.is_placed("mid"));
  CHECK(h.placed["mid"].prefill_address == "p:1");
  REQUIRE(h.submit("short", 80, 10).ok());
  REQUIRE(h.is_placed("short"));
  CHECK(h.placed["short"].prefill_address.empty());
  // A local request holds no prefill tokens; finishing it frees its decode blocks only.
  const auto p = h.registry.snapshot(kPrefill).at(0);
  CHECK(p.outstanding_prompt_tokens() == 90);
  h.sched.prefill_done("short");  // ignored: nothing outstanding
  h.sched.finished("short");
  h.sched.finished("early");
  CHECK(h.registry.snapshot(kPrefill).at(0).outstanding_prompt_tokens() == 90);

  // The frontend's limit 0: never local, whatever the worker allows.
  Harness plain;
  plain.decode_worker("d:1", 50, 100, false, 80);
  plain.prefill_worker("p:1");
  REQUIRE(plain.submit("r", 10, 4).ok());
  REQUIRE(plain.is_placed("r"));
  CHECK(plain.placed["r"].prefill_address == "p:1");
}

TEST_CASE("local prefill: with every prompt local, no prefill worker is needed and none is waited for",
          "[scheduler][local]") {
  SchedulerConfig cfg;
  cfg.local_prefill_max_tokens = 1 << 20;
  cfg.no_worker_timeout = std::chrono::seconds(1);
  Harness h(cfg);
  h.decode_worker("d:1", 40, 100, false, 1 << 20);
  REQUIRE(h.submit("a", 500, 40).ok());
  CHECK(h.is_placed("a"));
  REQUIRE(h.submit("b", 500, 40).ok());  // waits for blocks, not for a prefill worker
  h.clock.advance(std::chrono::seconds(5));
  h.sched.poll();
  CHECK_FALSE(h.failed.count("b"));
  h.sched.finished("a");
  CHECK(h.is_placed("b"));
  CHECK(h.placed["b"].prefill_address.empty());
}
