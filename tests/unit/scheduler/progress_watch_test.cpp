// The progress watchdog (scheduler/progress_watch.h): the bound's formula, and the pipeline failing
// over an attempt whose worker goes silent (stopped, or cut off: its calls neither progress nor
// fail) in each phase, after its bound and not before, with the client's stream intact.
#include <catch2/catch.hpp>

#include "scheduler/progress_watch.h"
#include "tests/unit/scheduler/pipeline_world.h"

using namespace baton;
using namespace baton::pipeline_test;
using Phase = ProgressInputs::Phase;

TEST_CASE("progress bound: grace plus slack times what the workers report", "[progress]") {
  ProgressConfig c;
  c.grace_seconds = 1.5;
  c.slack = 3;
  c.min_prefill_tokens_per_second = 100;
  ProgressInputs in;
  in.prefill_step_seconds = 0.4;
  in.decode_step_seconds = 0.05;
  CHECK(progress_bound(c, in) == Approx(1.5));  // admitting: nothing reported bounds an Admit
  in.phase = Phase::kPrefill;  // the worker reports after each step: one step
  in.tokens = 2000;
  in.prefill_tokens_per_second = 1000;
  CHECK(progress_bound(c, in) == Approx(1.5 + 3 * 0.4));
  in.prefill_step_seconds = 0;  // not stepped yet: the prompt and those ahead at the floor rate
  in.prefill_tokens_per_second = 0;
  CHECK(progress_bound(c, in) == Approx(1.5 + 3 * 20.0));
  in.prefill_step_seconds = 0.4;
  in.phase = Phase::kLocalPrefill;
  in.tokens = 300;
  in.prefill_tokens_per_second = 600;
  CHECK(progress_bound(c, in) == Approx(1.5 + 3 * (0.5 + 0.05)));
  in.phase = Phase::kDecoding;
  in.tokens = 0;
  CHECK(progress_bound(c, in) == Approx(1.5 + 3 * 0.05));
  in.tokens = 300;  // the decode worker's local prompts share the steps
  CHECK(progress_bound(c, in) == Approx(1.5 + 3 * (0.05 + 0.5)));
  in.tokens = 0;
  in.handoff_in_flight = true;
  CHECK(progress_bound(c, in) == Approx(1.5 + 3 * (0.05 + 0.4)));
  in.decode_step_seconds = in.prefill_step_seconds = 0;  // cold workers: 64 tokens at the floor rate
  CHECK(progress_bound(c, in) == Approx(1.5 + 3 * (0.64 + 0.64)));

  CHECK(c.validate().ok());
  c.slack = 0.5;
  CHECK(c.validate().code() == StatusCode::kInvalidArgument);
  c.slack = 2;
  c.grace_seconds = std::numeric_limits<double>::quiet_NaN();
  CHECK(c.validate().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("progress watch: holds requests weakly and checks the live ones", "[progress]") {
  struct Counter final : ProgressWatched {
    int n = 0;
    void check_progress(TimePoint) override { ++n; }
  };
  ProgressWatch watch;
  auto a = std::make_shared<Counter>();
  auto b = std::make_shared<Counter>();
  watch.add(a);
  watch.add(b);
  CHECK(watch.check(TimePoint{}) == 2);
  b.reset();
  CHECK(watch.check(TimePoint{}) == 1);
  CHECK(a->n == 2);
}

namespace {

// Delivers events, oldest call first, until the request ends (a hung worker's calls wait).
void run_until_end(World& w, const RecordingSink& sink) {
  for (int i = 0; i < 100000 && sink.n_end == 0; ++i) {
    const auto ready = w.workers.ready();
    if (ready.empty()) {
      w.poll();
    } else {
      w.workers.step(ready.front());
    }
  }
  REQUIRE(sink.n_end == 1);
}

// The address of the open call of `kind` (the worker the attempt waits on).
std::string open_call_address(const FakeWorkers& workers, FakeWorkers::Call::Kind kind) {
  for (const auto& [id, c] : workers.calls) {
    if (c->kind == kind && !c->cancelled) return c->address;
  }
  FAIL("no open call of that kind");
  return "";
}

}  // namespace

TEST_CASE("pipeline: a worker that goes silent is failed over after its progress bound, in every phase",
          "[pipeline][progress]") {
  using Kind = FakeWorkers::Call::Kind;
  struct Case {
    const char* name;
    PipelineState at;        // where the worker stops
    Kind waits_on;           // the call that goes quiet
    const char* reason;      // the failover's reason
    double bound;            // what progress_bound gives with the reports below
  };
  // grace 1, slack 2; reports: prefill step 0.25 s at 1000 tokens/s, decode step 2 s.
  const Case cases[] = {
      {"admitting", PipelineState::kAdmitting, Kind::kAdmit, "decode_admit", 1.0},
      {"prefill", PipelineState::kPrefilling, Kind::kPrefill, "prefill", 1.0 + 2 * 0.25},
      {"decoding", PipelineState::kDecoding, Kind::kStream, "decode", 1.0 + 2 * 2.0},
  };
  std::mt19937 rng(test_seed("pipeline progress"));
  for (const Case& c : cases) {
    DYNAMIC_SECTION(c.name) {
      World w(2, 2);
      ProgressWatch watch;
      w.deps.watch = &watch;
      w.deps.config.progress.grace_seconds = 1.0;
      w.deps.config.progress.slack = 2.0;
      w.deps.config.progress.min_prefill_tokens_per_second = 100;
      w.prefill_step_seconds = 0.25;
      w.prefill_rate = 1000;
      w.decode_step_seconds = 2.0;
      w.poll();
      const auto prompt = prompt_without_eos(rng, 12);  // 8 tokens
      const auto ref = reference(prompt, 12, false);
      auto sink = std::make_shared<RecordingSink>();
      auto p = w.start(sink, prompt, 12);
      // Up to the phase, and in decoding a few tokens into the stream.
      for (int i = 0; i < 1000; ++i) {
        if (p->state() == c.at && (c.at != PipelineState::kDecoding || sink->tokens.size() >= 3)) break;
        const auto ready = w.workers.ready();
        REQUIRE(!ready.empty());
        w.workers.step(ready.front());
      }
      REQUIRE(p->state() == c.at);
      const std::string stuck = open_call_address(w.workers, c.waits_on);
      w.workers.hung.insert(stuck);

      w.h.clock.advance(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(0.9 * c.bound)));
      CHECK(watch.check(w.h.clock.now()) == 1);
      CHECK(sink->failovers.empty());  // within the bound: patience
      w.h.clock.advance(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(0.2 * c.bound)));
      watch.check(w.h.clock.now());
      REQUIRE(sink->failovers == std::vector<std::string>{c.reason});

      run_until_end(w, *sink);
      CHECK(sink->status.ok());
      CHECK(sink->tokens == ref);  // nothing lost, nothing twice
      CHECK(sink->outcome.failovers == 1);
      CHECK(sink->outcome.failover_history.at(0).find("no progress for") != std::string::npos);
      CHECK(sink->outcome.decode_address != (c.waits_on == Kind::kPrefill ? "" : stuck));
      CHECK(sink->outcome.prefill_address != (c.waits_on == Kind::kPrefill ? stuck : ""));

      // The worker resumes: what it still held for the abandoned attempt is let go.
      w.workers.hung.erase(stuck);
      w.run();
      w.check_clean();
    }
  }
}

TEST_CASE("pipeline: a silent worker with no other of its role to move to is waited for, not failed over onto",
          "[pipeline][progress]") {
  using Kind = FakeWorkers::Call::Kind;
  std::mt19937 rng(test_seed("pipeline progress, one decode worker"));
  World w(1, 1);
  ProgressWatch watch;
  w.deps.watch = &watch;
  w.deps.config.progress.grace_seconds = 1.0;
  w.deps.config.progress.slack = 2.0;
  w.decode_step_seconds = 0.1;
  w.poll();
  const auto prompt = prompt_without_eos(rng, 12);
  auto sink = std::make_shared<RecordingSink>();
  auto p = w.start(sink, prompt, 12);
  for (int i = 0; i < 1000 && sink->tokens.size() < 3; ++i) w.workers.step(w.workers.ready().at(0));
  REQUIRE(p->state() == PipelineState::kDecoding);
  const std::string stuck = open_call_address(w.workers, Kind::kStream);
  w.workers.hung.insert(stuck);
  for (int i = 0; i < 10; ++i) {  // 10 s: five times the bound
    w.h.clock.advance(std::chrono::seconds(1));
    watch.check(w.h.clock.now());
  }
  CHECK(sink->failovers.empty());
  CHECK(sink->n_end == 0);
  w.workers.hung.erase(stuck);  // it moves again: the stream goes on where it was
  w.run();
  REQUIRE(sink->n_end == 1);
  CHECK(sink->status.ok());
  CHECK(sink->tokens == reference(prompt, 12, false));
  CHECK(sink->outcome.failovers == 0);
  w.check_clean();
}
