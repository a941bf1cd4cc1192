// The scheduler against a model of it, on random operation sequences (fresh seed each run, printed;
// BATON_TEST_SEED reruns one).
#include "tests/unit/scheduler/scheduler_harness.h"

using namespace baton;
using namespace baton::scheduler_test;

TEST_CASE("random submit/report/finish/cancel sequences keep every invariant", "[scheduler]") {
  std::mt19937 rng(test_seed("scheduler random test"));
  SchedulerConfig cfg;
  cfg.max_requests = 24;
  cfg.max_queued_prompt_tokens = 1500;
  cfg.max_head_bypass = std::chrono::milliseconds(500 * (rng() % 3));
  // Half the runs give up on a queued request after 2 s without a healthy worker of a role.
  cfg.no_worker_timeout = rng() % 2 ? std::chrono::nanoseconds(2s) : std::chrono::nanoseconds(1h);
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
  int n_placed = 0, n_deadline = 0, n_cancelled = 0, n_refused = 0, n_no_worker = 0;

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
    } else if (s.code() == StatusCode::kUnavailable && s.message().find("no healthy") != std::string::npos) {
      CHECK(h.clock.now() - r.req.arrival >= cfg.no_worker_timeout);  // queued since arrival
      ++n_no_worker;
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
  std::printf("  %zu admitted: %d placed, %d deadline, %d cancelled, %d without a healthy worker in queue; %d refused\n",
              reqs.size(), n_placed, n_deadline, n_cancelled, n_no_worker, n_refused);
  CHECK(n_placed > 0);
}
