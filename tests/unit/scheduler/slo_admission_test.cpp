// Admission to a TTFT target (--ttft-slo) and the adaptive choice of where to prefill: each
// rejection reason with its retry-after, priority deciding who is refused first, prompts held at
// the frontend while a target is set, the margin the predictor's recent misses ask for. (The
// predictor itself: ttft_predictor_test.cpp.)
#include "tests/unit/scheduler/slo_test_support.h"

namespace baton::scheduler_test {

TEST_CASE("slo admission: a request predicted late is refused naming the prefill queue, with a retry-after",
          "[scheduler][slo]") {
  Harness h(with_slo(1.0));
  Recorded rec;
  two_workers(h, rec, 1000, 0);

  REQUIRE(h.submit(request(h, "a", 500, 4)).ok());  // 0.5 s
  REQUIRE(h.is_placed("a"));
  // 500 ahead on the worker: 0.9 s, admitted; but the worker already holds 0.5 s of work, the
  // hold fraction of the target: b waits here.
  REQUIRE(h.submit(request(h, "b", 400, 4)).ok());
  CHECK_FALSE(h.is_placed("b"));
  CHECK(h.sched.n_queued() == 1);
  // 500 on the worker + 400 queued here + 200 of its own: 1.1 s > 1 s.
  const Status c = h.submit(request(h, "c", 200, 4));
  REQUIRE(c.code() == StatusCode::kResourceExhausted);
  CHECK(contains(c.message(), "prefill queue"));
  CHECK(contains(c.message(), "900 prompt tokens ahead"));
  CHECK(contains(c.message(), "1.1 s"));
  CHECK(contains(c.message(), "TTFT target of 1 s"));
  CHECK(c.retry_after_seconds() == 1);
  CHECK(h.n_callbacks.count("c") == 0);  // refused at once: no callback
  CHECK(rec.rejected[SloRejection::kPrefillQueue] == 1);

  // Priority decides who is refused first: the same prompt at a higher priority has only the
  // worker's 500 tokens ahead of it (b will wait behind it), 0.7 s: admitted.
  REQUIRE(h.submit(request(h, "d", 200, 4, /*priority=*/5)).ok());
  CHECK_FALSE(h.is_placed("d"));
  CHECK(h.submit(request(h, "c2", 200, 4)).code() == StatusCode::kResourceExhausted);

  // a's first token: the worker holds nothing; d goes first, then b (200 tokens = 0.2 s < 0.5 s).
  h.clock.advance(secs(0.6));
  h.sched.first_token("a", 0.5, 0);
  REQUIRE(h.placed_order.size() == 3);
  CHECK(h.placed_order[1] == "d");
  CHECK(h.placed_order[2] == "b");
  // The predicted-vs-seen sample of a: 0.5 s predicted, 0.6 s seen.
  REQUIRE(rec.ttft.size() == 1);
  CHECK(rec.ttft[0].first == Approx(0.5));
  CHECK(rec.ttft[0].second == Approx(0.6));
}

TEST_CASE("slo admission: a predictor that has erred low is trusted less (the p99 of its recent misses)",
          "[scheduler][slo]") {
  Harness h(with_slo(1.0));
  Recorded rec;
  two_workers(h, rec, 1000, 0);
  // 0.9 s predicted: admitted while too few first tokens have been seen to judge the predictor.
  REQUIRE(h.submit(request(h, "first", 900, 4)).ok());
  h.clock.advance(secs(0.9));
  h.sched.first_token("first", 0.9, 0);
  h.sched.finished("first");
  // Then 60 requests predicted at 0.5 s whose first tokens come at 0.65 s (1.3×; the prefill itself
  // at the rate predicted: the time went elsewhere).
  for (int i = 0; i < 60; ++i) {
    const std::string id = "r" + std::to_string(i);
    report(h, kPrefill, "p:1", prefill_load(0, 1000));
    report(h, kDecode, "d:1", decode_load(1000));
    REQUIRE(h.submit(request(h, id, 500, 4)).ok());
    h.clock.advance(secs(0.65));
    h.sched.first_token(id, 0.5, 0);
    h.sched.finished(id);
  }
  REQUIRE(rec.ttft.size() == 61);
  // 0.9 s predicted × 1.3 misses the target: refused, saying so.
  report(h, kPrefill, "p:1", prefill_load(0, 1000));
  report(h, kDecode, "d:1", decode_load(1000));
  const Status s = h.submit(request(h, "late", 900, 4));
  REQUIRE(s.code() == StatusCode::kResourceExhausted);
  CHECK(contains(s.message(), "predicted time to first token 0.9 s (× 1.30"));
  CHECK(s.retry_after_seconds() == 1);
  // 0.7 s × 1.3 meets it.
  CHECK(h.submit(request(h, "in time", 700, 4)).ok());
}

TEST_CASE("slo admission: the retry-after is how far the prediction misses the target", "[scheduler][slo]") {
  Harness h(with_slo(2.0));
  Recorded rec;
  two_workers(h, rec, 1000, 10000);  // 10 s of work ahead
  const Status s = h.submit(request(h, "x", 1000, 4));
  REQUIRE(s.code() == StatusCode::kResourceExhausted);
  CHECK(s.retry_after_seconds() == 9);  // 10 + 1 − 2
  CHECK(contains(s.message(), "11 s"));
}

TEST_CASE("slo admission: no room for the KV and none freed lately is refused naming decode KV",
          "[scheduler][slo]") {
  Harness h(with_slo(1.0));
  Recorded rec;
  two_workers(h, rec, 2, 0);
  const Status s = h.submit(request(h, "x", 100, 4));
  REQUIRE(s.code() == StatusCode::kResourceExhausted);
  CHECK(contains(s.message(), "decode KV"));
  CHECK(contains(s.message(), "none freed blocks recently"));
  CHECK(rec.rejected[SloRejection::kDecodeKv] == 1);
  CHECK(rec.rejected[SloRejection::kPrefillQueue] == 0);

  // One block freed in the last 10 s: 0.1 blocks/s, and x (7 blocks) is 5 short: about 50 s.
  REQUIRE(h.submit(request(h, "y", 10, 1)).ok());
  REQUIRE(h.is_placed("y"));
  h.sched.finished("y");
  report(h, kDecode, "d:1", decode_load(2));
  const Status again = h.submit(request(h, "x", 100, 4));
  REQUIRE(again.code() == StatusCode::kResourceExhausted);
  CHECK(contains(again.message(), "decode KV"));
  CHECK(contains(again.message(), "about 50 s"));
  CHECK(again.retry_after_seconds() == 50);  // 50 + 0.1 − 1, rounded up
  // A worker with room: admitted.
  report(h, kDecode, "d:1", decode_load(100));
  CHECK(h.submit(request(h, "x", 100, 4)).ok());
}

TEST_CASE("slo admission: without a target nothing is refused or held, but a request's own target applies (the tighter)",
          "[scheduler][slo]") {
  {
    Harness h;
    Recorded rec;
    record(h, rec);
    report(h, kDecode, "d:1", decode_load(1000));
    report(h, kPrefill, "p:1", prefill_load(100000, 1000));  // 100 s ahead
    for (const char* id : {"a", "b", "c"}) {
      REQUIRE(h.submit(request(h, id, 500, 4)).ok());
      CHECK(h.is_placed(id));
    }
    CHECK(rec.rejected.empty());
    // The client's own target refuses it even so.
    const Status own = h.submit(request(h, "d", 500, 4, 0, /*slo=*/5));
    CHECK(own.code() == StatusCode::kResourceExhausted);
    CHECK(contains(own.message(), "TTFT target of 5 s"));
  }
  SchedulerConfig cfg;
  cfg.ttft_slo_seconds = 10;
  Harness h(cfg);
  report(h, kDecode, "d:1", decode_load(1000));
  report(h, kPrefill, "p:1", prefill_load(500, 1000));  // 0.5 s ahead
  CHECK(h.submit(request(h, "tight", 500, 4, 0, 0.8)).code() == StatusCode::kResourceExhausted);
  CHECK(h.submit(request(h, "loose", 500, 4, 0, 60)).ok());  // the server's 10 s applies
  // Not measured yet: nothing to predict by, admitted.
  Harness fresh(cfg);
  report(fresh, kDecode, "d:1", decode_load(1000));
  report(fresh, kPrefill, "p:1", prefill_load(1000000, 0));
  CHECK(fresh.submit(request(fresh, "r", 500, 4, 0, 0.01)).ok());
}

TEST_CASE("adaptive placement: the decode worker prefills when it saves more TTFT than it costs the batch",
          "[scheduler][slo][local]") {
  SchedulerConfig cfg;
  cfg.prefill_choice = PrefillChoice::kAdaptive;
  cfg.local_prefill_max_tokens = 1 << 20;
  {
    // A long prefill queue, an idle decode worker: local.
    Harness h(cfg);
    report(h, kDecode, "d:1", decode_load(1000, /*n_running=*/0, /*local_rate=*/1000, 1 << 20));
    report(h, kPrefill, "p:1", prefill_load(5000, 1000));
    REQUIRE(h.submit(request(h, "a", 100, 4)).ok());
    REQUIRE(h.is_placed("a"));
    CHECK(h.placed["a"].prefill_address.empty());
  }
  {
    // 0.2 s saved against 8 running sequences × 0.1 s: the prefill worker.
    Harness h(cfg);
    report(h, kDecode, "d:1", decode_load(1000, 8, 1000, 1 << 20));
    report(h, kPrefill, "p:1", prefill_load(200, 1000));
    REQUIRE(h.submit(request(h, "a", 100, 4)).ok());
    REQUIRE(h.is_placed("a"));
    CHECK(h.placed["a"].prefill_address == "p:1");
    // The weight 0: any saving wins.
    SchedulerConfig zero = cfg;
    zero.local_prefill_itl_weight = 0;
    Harness z(zero);
    report(z, kDecode, "d:1", decode_load(1000, 8, 1000, 1 << 20));
    report(z, kPrefill, "p:1", prefill_load(200, 1000));
    REQUIRE(z.submit(request(z, "a", 100, 4)).ok());
    CHECK(z.placed["a"].prefill_address.empty());
  }
  {
    // With a target: the prefill worker while it meets it, even with an idle decode batch; local
    // when it misses and the decode worker meets it, at a cost the saving outweighs.
    SchedulerConfig slo = cfg;
    slo.ttft_slo_seconds = 1.0;
    Harness h(slo);
    report(h, kDecode, "d:1", decode_load(1000, 8, 1000, 1 << 20));
    report(h, kPrefill, "p:1", prefill_load(200, 1000));
    REQUIRE(h.submit(request(h, "meets", 100, 4)).ok());
    CHECK(h.placed["meets"].prefill_address == "p:1");
    report(h, kPrefill, "p:1", prefill_load(5000, 1000));
    REQUIRE(h.submit(request(h, "late", 100, 4)).ok());
    CHECK(h.placed["late"].prefill_address.empty());
    Harness idle(slo);
    report(idle, kDecode, "d:1", decode_load(1000, 0, 1000, 1 << 20));
    report(idle, kPrefill, "p:1", prefill_load(200, 1000));
    REQUIRE(idle.submit(request(idle, "meets", 100, 4)).ok());
    CHECK(idle.placed["meets"].prefill_address == "p:1");
    // Missing on the prefill worker, but 80 running sequences × 0.1 s outweigh the 5 s saved.
    Harness busy(slo);
    report(busy, kDecode, "d:1", decode_load(1000, 80, 1000, 1 << 20));
    report(busy, kPrefill, "p:1", prefill_load(5000, 1000));
    CHECK(busy.submit(request(busy, "late", 100, 4)).code() == StatusCode::kResourceExhausted);
    // Static placement with the same workers would have been refused: only the prefill worker.
    SchedulerConfig fixed_slo = slo;
    fixed_slo.prefill_choice = PrefillChoice::kStatic;
    fixed_slo.local_prefill_max_tokens = 0;
    Harness s(fixed_slo);
    report(s, kDecode, "d:1", decode_load(1000, 8, 1000, 1 << 20));
    report(s, kPrefill, "p:1", prefill_load(5000, 1000));
    CHECK(s.submit(request(s, "late", 100, 4)).code() == StatusCode::kResourceExhausted);
  }
  {
    // A decode worker that has not prefilled yet is taken at the prefill worker's measured rate.
    Harness h(cfg);
    report(h, kDecode, "d:1", decode_load(1000, 0, /*local_rate=*/0, 1 << 20));
    report(h, kPrefill, "p:1", prefill_load(5000, 1000));
    REQUIRE(h.submit(request(h, "a", 100, 4)).ok());
    CHECK(h.placed["a"].prefill_address.empty());
  }
}

// A prefill worker scripted as an FCFS server whose per-token speed falls with prompt length (as
// attention's share grows), under Poisson arrivals of mixed lengths: the scheduler's predictions
// (made at admission) against the TTFT each request then saw.
}  // namespace baton::scheduler_test
