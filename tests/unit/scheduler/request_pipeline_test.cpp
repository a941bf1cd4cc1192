// The request pipeline against fake workers: a toy deterministic "model", workers that can be
// killed and revived, calls that can be failed one at a time, and every event delivered in an
// order the test chooses (deterministic, or drawn at random). The scheduler and the worker
// registry are the real ones. Each test checks the client's stream against the uninterrupted
// output and that nothing is left behind: no reservation on any worker, nothing admitted in
// the scheduler, no open call.
#include <catch2/catch.hpp>
#include <map>
#include <memory>
#include <random>
#include <regex>
#include <set>

#include "scheduler/request_pipeline.h"
#include "tests/unit/scheduler/pipeline_world.h"

using namespace baton;
using namespace baton::scheduler_test;
using namespace baton::pipeline_test;

TEST_CASE("pipeline: an undisturbed request streams the model's output once and leaves nothing behind",
          "[pipeline]") {
  std::mt19937 rng(test_seed("pipeline undisturbed"));
  World w(2, 2);
  for (int i = 0; i < 20; ++i) {
    auto sink = std::make_shared<RecordingSink>();
    const auto prompt = random_prompt(rng, 1 + static_cast<int>(rng() % 20));
    const int32_t max_tokens = 1 + static_cast<int32_t>(rng() % 40);
    auto p = w.start(sink, prompt, max_tokens);
    w.run(&rng);
    REQUIRE(sink->n_end == 1);
    CHECK(sink->status.ok());
    CHECK(sink->tokens == reference(prompt, max_tokens, false));
    CHECK(sink->outcome.n_generated == static_cast<int32_t>(sink->tokens.size()));
    CHECK(sink->outcome.failovers == 0);
    CHECK(sink->outcome.cached_prompt_tokens == static_cast<int32_t>(prompt.size() / 2));  // the prefill worker's count
    CHECK(p->state() == PipelineState::kEnded);
  }
  w.check_clean();
}

// Drives one request until the pipeline is in `state`, then applies `fault`.
enum class Fault {
  kKillDecode,
  kKillPrefill,
  kDecodeError,
  kPrefillError,
  kAdmitError,
  kAdmitFull,
  kWorkerInternal,
  kClientCancel
};

const char* fault_name(Fault f) {
  switch (f) {
    case Fault::kKillDecode: return "kill decode worker";
    case Fault::kKillPrefill: return "kill prefill worker";
    case Fault::kDecodeError: return "decode stream reset";
    case Fault::kWorkerInternal: return "decode worker INTERNAL";
    case Fault::kPrefillError: return "prefill DATA_LOSS";
    case Fault::kAdmitError: return "admit UNAVAILABLE";
    case Fault::kAdmitFull: return "admit RESOURCE_EXHAUSTED";
    case Fault::kClientCancel: return "client cancels";
  }
  return "?";
}

TEST_CASE("pipeline: every failure in every state fails over, or ends as it must, without loss or leak",
          "[pipeline]") {
  std::mt19937 rng(test_seed("pipeline state x fault"));
  const PipelineState states[] = {PipelineState::kAdmitting, PipelineState::kPrefilling, PipelineState::kDecoding};
  const Fault faults[] = {Fault::kKillDecode, Fault::kKillPrefill, Fault::kDecodeError,    Fault::kPrefillError,
                          Fault::kAdmitError, Fault::kAdmitFull,   Fault::kWorkerInternal, Fault::kClientCancel};
  int n_failed_over = 0;
  for (PipelineState target : states) {
    for (Fault fault : faults) {
      INFO(pipeline_state_name(target) << " × " << fault_name(fault));
      World w(2, 2);
      auto sink = std::make_shared<RecordingSink>();
      const auto prompt = prompt_without_eos(rng, 30);
      auto p = w.start(sink, prompt, 30);
      // Step until the target state (and, for decoding, some tokens out).
      for (int guard = 0; guard < 1000; ++guard) {
        const auto st = p->state();
        if (st == target && (target != PipelineState::kDecoding || sink->tokens.size() >= 5)) break;
        const auto ready = w.workers.ready();
        REQUIRE_FALSE(ready.empty());
        w.workers.step(ready.front());
      }
      REQUIRE(p->state() == target);
      const std::string attempt = p->attempt_id();
      bool applicable = true;
      switch (fault) {
        case Fault::kKillDecode:
        case Fault::kKillPrefill: {
          // The worker of the current attempt (placement is known from the first call it got).
          const auto kind = fault == Fault::kKillDecode ? FakeWorkers::Call::Kind::kAdmit : FakeWorkers::Call::Kind::kPrefill;
          std::string addr;
          for (const auto& [id, c] : w.workers.calls) {
            if (c->request_id == attempt && (c->kind == kind || (fault == Fault::kKillDecode && c->kind == FakeWorkers::Call::Kind::kStream))) {
              addr = c->address;
            }
          }
          if (addr.empty()) {
            applicable = false;  // no call on that role in this state (e.g. prefill before Admit returned)
            break;
          }
          w.workers.kill(addr);
          break;
        }
        case Fault::kDecodeError:
          applicable = w.workers.inject(rng, FakeWorkers::Call::Kind::kStream, unavailable("stream reset"));
          break;
        case Fault::kWorkerInternal:
          applicable = w.workers.inject(rng, FakeWorkers::Call::Kind::kStream, internal_error("logits not finite"));
          break;
        case Fault::kPrefillError:
          applicable = w.workers.inject(rng, FakeWorkers::Call::Kind::kPrefill, data_loss("KV chunk checksum"));
          break;
        case Fault::kAdmitError:
          applicable = w.workers.inject(rng, FakeWorkers::Call::Kind::kAdmit, unavailable("connection refused"));
          break;
        case Fault::kAdmitFull:
          applicable = w.workers.inject(rng, FakeWorkers::Call::Kind::kAdmit, resource_exhausted("no free blocks"));
          break;
        case Fault::kClientCancel:
          p->cancel(cancelled("the client cancelled the request"));
          break;
      }
      if (!applicable) continue;
      w.run(&rng);
      REQUIRE(sink->n_end == 1);
      const auto ref = reference(prompt, 30, false);
      if (fault == Fault::kClientCancel || fault == Fault::kWorkerInternal) {
        // Ended, not failed over: a worker's INTERNAL would repeat on any other.
        CHECK(sink->status.code() ==
              (fault == Fault::kClientCancel ? StatusCode::kCancelled : StatusCode::kInternal));
        CHECK(sink->failovers.empty());
        CHECK(std::equal(sink->tokens.begin(), sink->tokens.end(), ref.begin()));  // a prefix
      } else if (fault == Fault::kAdmitFull) {
        // Queued again until a worker has room: the same output, and no failover.
        CHECK(sink->status.ok());
        CHECK(sink->tokens == ref);
        CHECK(sink->outcome.failovers == 0);
      } else {
        CHECK(sink->status.ok());
        CHECK(sink->tokens == ref);
        CHECK(sink->outcome.failovers == 1);
        CHECK(sink->failovers.size() == 1);
        ++n_failed_over;
      }
      w.check_clean();
    }
  }
  CHECK(n_failed_over >= 8);  // the combinations that apply were exercised
}

TEST_CASE("pipeline: after max_failovers the request ends UNAVAILABLE with the history", "[pipeline]") {
  std::mt19937 rng(test_seed("pipeline max failovers"));
  World w(1, 3, /*max_failovers=*/1);
  auto sink = std::make_shared<RecordingSink>();
  const auto prompt = prompt_without_eos(rng, 20);
  auto p = w.start(sink, prompt, 20);
  // Every decode stream breaks: the first attempt's and its one failover's.
  for (int guard = 0; guard < 10000 && p->state() != PipelineState::kEnded; ++guard) {
    (void)w.workers.inject(rng, FakeWorkers::Call::Kind::kStream, unavailable("stream reset"));
    const auto ready = w.workers.ready();
    if (ready.empty()) {
      w.poll();
      continue;
    }
    w.workers.step(ready.front());
  }
  w.run(&rng);
  REQUIRE(sink->n_end == 1);
  CHECK(sink->status.code() == StatusCode::kUnavailable);
  CHECK(contains(sink->status.message(), "after 2 attempts"));
  CHECK(contains(sink->status.message(), "attempt 1: decode"));
  CHECK(contains(sink->status.message(), "attempt 2: decode"));
  CHECK(sink->failovers.size() == 1);
  w.check_clean();
}

TEST_CASE("pipeline: with no healthy worker a request fails UNAVAILABLE after no_worker_timeout", "[pipeline]") {
  SchedulerConfig sc;
  sc.no_worker_timeout = std::chrono::seconds(5);
  World w(1, 1, 2, sc);
  w.workers.kill("p:0");
  for (int i = 0; i < 3; ++i) w.poll();  // three failed polls: unhealthy
  auto sink = std::make_shared<RecordingSink>();
  std::mt19937 rng(test_seed("pipeline no worker"));
  auto p = w.start(sink, random_prompt(rng, 5), 5);
  w.h.clock.advance(std::chrono::milliseconds(4900));
  w.h.sched.poll();
  CHECK(sink->n_end == 0);
  CHECK(p->state() == PipelineState::kQueued);
  w.h.clock.advance(std::chrono::milliseconds(200));
  w.h.sched.poll();
  REQUIRE(sink->n_end == 1);
  CHECK(sink->status.code() == StatusCode::kUnavailable);
  CHECK(contains(sink->status.message(), "no healthy prefill worker"));
  w.check_clean();
}

TEST_CASE("pipeline: random kills, revivals, errors and cancellations lose, leak and repeat nothing",
          "[pipeline]") {
  const uint32_t seed = test_seed("pipeline random faults");
  std::mt19937 rng(seed);
  for (int round = 0; round < 20; ++round) {
    // Odd rounds: prompts of up to 6 tokens (and re-prefills that short) are prefilled by the
    // decode workers themselves, the rest go through prefill workers.
    const int32_t local = round % 2 == 1 ? 6 : 0;
    INFO("round " << round << " (seed " << seed << "), local prefill up to " << local);
    World w(2 + static_cast<int>(rng() % 2), 2 + static_cast<int>(rng() % 2), /*max_failovers=*/3, {}, false, local);
    struct Req {
      std::shared_ptr<RecordingSink> sink;
      std::shared_ptr<RequestPipeline> p;
      std::vector<int32_t> ref;
      bool cancelled = false;
    };
    std::vector<Req> reqs;
    const int n = 12;
    for (int i = 0; i < n; ++i) {
      Req r;
      r.sink = std::make_shared<RecordingSink>();
      const auto prompt = random_prompt(rng, 1 + static_cast<int>(rng() % 12));
      const int32_t max_tokens = 1 + static_cast<int32_t>(rng() % 40);
      const bool ignore_eos = rng() % 3 == 0;
      r.ref = reference(prompt, max_tokens, ignore_eos);
      r.p = w.start(r.sink, prompt, max_tokens, ignore_eos);
      reqs.push_back(std::move(r));
    }
    const Status errs[] = {internal_error("logits not finite"), data_loss("KV checksum"), unavailable("stream reset")};
    w.run_with_faults(
        rng, errs,
        [&] {
          Req& r = reqs[rng() % reqs.size()];
          r.cancelled = true;
          r.p->cancel(cancelled("the client cancelled the request"));
        },
        [&] {
          bool all_ended = true;
          for (const Req& r : reqs) all_ended = all_ended && r.sink->n_end == 1;
          return all_ended;
        });
    int n_ok = 0;
    for (const Req& r : reqs) {
      REQUIRE(r.sink->n_end == 1);
      // Whatever happened, the client never saw a token twice or one out of place.
      REQUIRE(r.sink->tokens.size() <= r.ref.size());
      CHECK(std::equal(r.sink->tokens.begin(), r.sink->tokens.end(), r.ref.begin()));
      if (r.sink->status.ok()) {
        ++n_ok;
        CHECK(r.sink->tokens == r.ref);
      } else {
        const auto code = r.sink->status.code();
        CHECK((code == StatusCode::kUnavailable || code == StatusCode::kCancelled || code == StatusCode::kInternal));
        if (code == StatusCode::kCancelled) CHECK(r.cancelled);
      }
    }
    CHECK(n_ok > 0);
    w.check_clean();
  }
}

TEST_CASE("pipeline: local prefill on the decode worker, colocated: no prefill worker, failover included",
          "[pipeline][local]") {
  std::mt19937 rng(test_seed("pipeline local prefill"));
  World w(/*n_prefill=*/0, /*n_decode=*/2, /*max_failovers=*/2, {}, false, /*local_prefill=*/1 << 20);
  for (int i = 0; i < 10; ++i) {
    auto sink = std::make_shared<RecordingSink>();
    const auto prompt = prompt_without_eos(rng, 12);
    auto p = w.start(sink, prompt, 12);
    // Halfway through its answer (or not at all), its decode worker dies: the request is prefilled
    // again, prompt + streamed tokens, on the other one.
    const bool kill = i % 2 == 1;
    bool killed = false;
    for (int step = 0; step < 10000 && sink->n_end == 0; ++step) {
      if (step % 7 == 0) w.poll();
      if (kill && !killed && sink->tokens.size() >= 5) {
        w.workers.kill(w.workers.decode["d:0"].count(p->attempt_id()) ? "d:0" : "d:1");  // the one holding it
        killed = true;
      }
      const auto ready = w.workers.ready();
      if (ready.empty()) {
        w.h.clock.advance(std::chrono::milliseconds(50));
        continue;
      }
      w.workers.step(ready[rng() % ready.size()]);
    }
    w.workers.dead.clear();
    w.run(&rng);
    INFO("request " << i << (kill ? " (decode worker killed)" : ""));
    REQUIRE(sink->n_end == 1);
    CHECK(sink->status.ok());
    CHECK(sink->tokens == reference(prompt, 12, false));
    CHECK(sink->outcome.prefill_address.empty());
    CHECK(sink->outcome.failovers == (kill ? 1 : 0));
    CHECK(sink->outcome.cached_prompt_tokens == 0);  // no prefix cache on the decode worker
    for (const auto& [id, c] : w.workers.calls) CHECK(c->kind != FakeWorkers::Call::Kind::kPrefill);
  }
  w.check_clean();
}

TEST_CASE("pipeline: what a client reads names the request by its label, never an attempt id or a worker address",
          "[pipeline]") {
  // Workers' and gRPC's messages name the attempt id, the worker's own address and peers' IP
  // addresses; none of it may reach the client's status or failover history.
  using Kind = FakeWorkers::Call::Kind;
  struct Case {
    const char* name;
    int32_t max_failovers;
    PipelineState at;  // the state the fault is injected in
    Kind kind;         // on which call
    StatusCode code;   // what the worker says
    int n_faults;      // on consecutive attempts
    StatusCode ends;   // how the request ends
    const char* role;  // what the client's text names instead
  };
  const Case cases[] = {
      {"decode stream breaks, no failover left", 0, PipelineState::kDecoding, Kind::kStream, StatusCode::kUnavailable,
       1, StatusCode::kUnavailable, "the decode worker"},
      {"decode stream breaks on both attempts", 1, PipelineState::kDecoding, Kind::kStream, StatusCode::kUnavailable, 2,
       StatusCode::kUnavailable, "the decode worker"},
      {"decode stream breaks, the failover finishes", 2, PipelineState::kDecoding, Kind::kStream,
       StatusCode::kUnavailable, 1, StatusCode::kOk, "the decode worker"},
      {"decode worker INTERNAL", 2, PipelineState::kDecoding, Kind::kStream, StatusCode::kInternal, 1,
       StatusCode::kInternal, "decode failed"},
      {"decode worker refuses the Admit", 2, PipelineState::kAdmitting, Kind::kAdmit, StatusCode::kInvalidArgument, 1,
       StatusCode::kInvalidArgument, "the decode worker refused"},
      {"prefill worker refuses", 2, PipelineState::kPrefilling, Kind::kPrefill, StatusCode::kFailedPrecondition, 1,
       StatusCode::kFailedPrecondition, "prefill failed"},
      {"prefill worker fails, no failover left", 0, PipelineState::kPrefilling, Kind::kPrefill, StatusCode::kDataLoss,
       1, StatusCode::kUnavailable, "the prefill worker"},
  };
  std::mt19937 rng(test_seed("pipeline client text"));
  const std::string label = "client-req-" + std::to_string(rng() % 1000);
  const std::regex attempt_id_like("[0-9a-f]{32}");
  for (const Case& c : cases) {
    INFO(c.name);
    World w(2, 2, c.max_failovers, {}, /*ip_addresses=*/true);
    auto sink = std::make_shared<RecordingSink>();
    const auto prompt = prompt_without_eos(rng, 30);
    auto p = w.start(sink, prompt, 30, false, label);
    std::vector<std::string> ids;
    for (int fault = 0; fault < c.n_faults; ++fault) {
      // Step until a new attempt is in the state, then fail its call.
      for (int guard = 0; guard < 1000; ++guard) {
        if (p->state() == c.at && (ids.empty() || p->attempt_id() != ids.back())) break;
        const auto ready = w.workers.ready();
        if (ready.empty()) {
          w.poll();
          continue;
        }
        w.workers.step(ready.front());
      }
      REQUIRE(p->state() == c.at);
      const std::string id = p->attempt_id();
      ids.push_back(id);
      FakeWorkers::Call* call = nullptr;
      for (auto& [n, open] : w.workers.calls) {
        if (open->request_id == id && open->kind == c.kind) call = open.get();
      }
      REQUIRE(call != nullptr);
      call->inject = Status(c.code, "request " + id + " on worker " + call->address +
                                        ": connection to ipv4:10.0.2.9:41234 lost (peer ipv6:[fd00::2]:50051, " +
                                        "ipv6:%5Bfd00::3%5D:50051, 10.0.1.7)");
    }
    w.run(&rng);
    REQUIRE(sink->n_end == 1);
    CHECK(sink->status.code() == c.ends);
    std::string text = sink->status.message();
    for (const auto& h : sink->outcome.failover_history) text += "\n" + h;
    INFO("the client reads: " << text);
    CHECK(contains(text, label));  // where the worker named the attempt
    CHECK(contains(text, c.role));
    for (const auto& id : ids) CHECK_FALSE(contains(text, id));
    CHECK_FALSE(std::regex_search(text, attempt_id_like));
    for (const char* address : {"10.0.", "fd00", "41234", "%5B"}) CHECK_FALSE(contains(text, address));
    CHECK(sink->outcome.failovers == static_cast<int32_t>(sink->outcome.failover_history.size()));
    w.check_clean();
  }
}

TEST_CASE("pipeline: log-probabilities go with their own tokens through failovers, and a worker that drops them is failed over",
          "[pipeline]") {
  std::mt19937 rng(test_seed("pipeline logprobs"));
  auto check_aligned = [](const RecordingSink& sink) {
    REQUIRE(sink.logprobs.size() == sink.tokens.size());
    for (size_t i = 0; i < sink.tokens.size(); ++i) {
      CHECK(sink.logprobs[i].logprob == FakeWorkers::fake_logprob(sink.tokens[i]).logprob);
      CHECK(sink.logprobs[i].top_ids[0] == sink.tokens[i]);
    }
  };
  int broken_failovers = 0;
  for (int round = 0; round < 6; ++round) {
    INFO("round " << round);
    World w(2, 2);
    w.sampling.top_logprobs = 1;
    const bool broken = round % 2 == 1;
    // A broken worker of each role: the pipeline must leave it and finish on the other.
    if (broken) w.workers.no_logprobs = {w.decode_addrs[rng() % 2], w.prefill_addrs[rng() % 2]};
    auto sink = std::make_shared<RecordingSink>();
    const auto prompt = prompt_without_eos(rng, 20);
    auto p = w.start(sink, prompt, 24);
    // Kill the decode worker of the attempt once some tokens are out (and a failover follows).
    for (int guard = 0; guard < 1000 && p->state() != PipelineState::kEnded; ++guard) {
      if (!broken && sink->tokens.size() >= 5) {
        for (const auto& [id, c] : w.workers.calls) {
          if (c->request_id == p->attempt_id() && c->kind == FakeWorkers::Call::Kind::kStream) {
            w.workers.kill(c->address);
            break;
          }
        }
        break;
      }
      const auto ready = w.workers.ready();
      if (ready.empty()) break;
      w.workers.step(ready[rng() % ready.size()]);
    }
    w.run(&rng);
    REQUIRE(sink->n_end == 1);
    if (!sink->status.ok()) {
      // Both broken workers drawn where the attempts went, past max_failovers: it says why.
      CHECK_THAT(sink->status.message(), Catch::Contains("log-probabilities"));
      continue;
    }
    CHECK(sink->tokens == reference(prompt, 24, false));
    check_aligned(*sink);
    if (broken) broken_failovers += sink->outcome.failovers;
    if (!broken) CHECK(sink->outcome.failovers >= 1);
  }
  CHECK(broken_failovers > 0);  // some attempt met a broken worker and left it
}
