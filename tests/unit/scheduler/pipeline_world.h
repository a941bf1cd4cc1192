// The request pipeline's test world: a toy deterministic "model", fake workers that can be killed,
// revived and hung, calls that can be failed one at a time, and every event delivered in an order
// the test chooses (deterministic, or drawn at random). The scheduler and the worker registry are
// the real ones, on fake time.
#pragma once

#include <catch2/catch.hpp>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <span>

#include "scheduler/request_pipeline.h"
#include "tests/unit/scheduler/scheduler_harness.h"

namespace baton::pipeline_test {

using namespace baton::scheduler_test;

constexpr int32_t kVocab = 1000;
constexpr int32_t kEos = 0;

// The toy model: the greedy next token of a sequence (end-of-sequence now and then).
inline int32_t next_token(const std::vector<int32_t>& seq) {
  uint64_t h = 1469598103934665603ULL;
  for (int32_t t : seq) h = (h ^ static_cast<uint64_t>(t)) * 1099511628211ULL;
  h ^= h >> 29;
  return (h % 61 == 0) ? kEos : 1 + static_cast<int32_t>(h % (kVocab - 1));
}

// What an uninterrupted run streams.
inline std::vector<int32_t> reference(std::vector<int32_t> seq, int32_t max_tokens, bool ignore_eos) {
  std::vector<int32_t> out;
  while (static_cast<int32_t>(out.size()) < max_tokens) {
    const int32_t t = next_token(seq);
    seq.push_back(t);
    out.push_back(t);
    if (t == kEos && !ignore_eos) break;
  }
  return out;
}

// Decode and prefill workers in one object: what each holds, and every call in flight.
class FakeWorkers final : public WorkerClient {
 public:
  struct Call final : public WorkerCall {
    enum class Kind { kAdmit, kPrefill, kStream, kRelease } kind;
    int id = 0;
    std::string address, request_id;
    AdmitCall admit;
    PrefillCall prefill;
    int prefill_step = 0;  // 0: first token next, 1: KV hand-off next, 2: done next
    bool cancelled = false;
    std::optional<Status> inject;  // fail at the next step with this
    std::function<void(const PrefillUpdate&)> on_prefill;
    std::function<void(const DecodeUpdate&)> on_decode;
    Done done;
    void cancel() override { cancelled = true; }
  };
  // A decode worker's sequence.
  struct Seq {
    int32_t max_tokens = 0;  // counting the first
    bool ignore_eos = false;
    bool kv = false;                // the KV arrived (or, local, the prompt is here to prefill)
    bool local = false;             // prefilled here: the stream's first update brings the first token
    std::vector<int32_t> tokens;    // prompt + generated so far (incl. the first token)
    int32_t n_generated = 0;
    bool attached = false;
    bool logprobs = false;  // the sampling asks for log-probabilities
    int32_t n_forks = 0;    // forks of its prompt it announced (held once its KV is here)
    bool fork = false;      // a fork of another's prompt: its stream starts with its first token
  };
  // A prompt held for forks (the real worker's fork hold).
  struct Hold {
    std::vector<int32_t> tokens;
    int32_t n_left = 0;
  };
  std::map<std::string, std::map<std::string, Hold>> holds;  // address → source request id → hold
  int n_prefill_calls = 0;                                   // Prefill calls made
  int n_forks_admitted = 0;                                  // fork Admits that took a hold

  // What the fake workers say a token's log-probability is: a function of the token, so that a
  // test can tell each value went with its own token.
  static TokenLogprobs fake_logprob(int32_t token) {
    TokenLogprobs lp;
    lp.logprob = -0.25f * static_cast<float>(token % 13) - 0.125f;
    lp.n_top = 1;
    lp.top_ids[0] = token;
    lp.top_logprobs[0] = lp.logprob;
    return lp;
  }
  // Workers that send tokens without the log-probabilities asked for (a broken worker).
  std::set<std::string> no_logprobs;

  std::set<std::string> dead;
  // Stopped, or cut off by the network: its calls neither progress nor fail, and its load polls
  // time out.
  std::set<std::string> hung;
  std::map<std::string, std::map<std::string, Seq>> decode;  // address → request id → sequence
  std::map<int, std::unique_ptr<Call>> calls;
  int next_call = 0;

  void admit(const std::string& addr, const AdmitCall& c, CallDeadline, Done done) override {
    auto call = add(Call::Kind::kAdmit, addr, c.request_id);
    call->admit = c;
    call->done = std::move(done);
  }
  WorkerCall* prefill(const std::string& addr, const PrefillCall& c, CallDeadline,
                      std::function<void(const PrefillUpdate&)> on_update, Done done) override {
    auto call = add(Call::Kind::kPrefill, addr, c.request_id);
    ++n_prefill_calls;
    call->prefill = c;
    call->on_prefill = std::move(on_update);
    call->done = std::move(done);
    return call;
  }
  WorkerCall* stream(const std::string& addr, const std::string& id, CallDeadline,
                     std::function<void(const DecodeUpdate&)> on_update, Done done) override {
    auto call = add(Call::Kind::kStream, addr, id);
    call->on_decode = std::move(on_update);
    call->done = std::move(done);
    return call;
  }
  void release(const std::string& addr, const std::string& id) override { add(Call::Kind::kRelease, addr, id); }

  // Calls that can make progress now.
  std::vector<int> ready() const {
    std::vector<int> out;
    for (const auto& [id, c] : calls) {
      if (hung.count(c->address) != 0) continue;
      if (c->kind == Call::Kind::kStream && !c->cancelled && !c->inject && !dead.count(c->address)) {
        auto w = decode.find(c->address);
        const Seq* s = nullptr;
        if (w != decode.end()) {
          auto it = w->second.find(c->request_id);
          if (it != w->second.end()) s = &it->second;
        }
        if (s != nullptr && !s->kv) continue;  // waits for its KV
      }
      out.push_back(id);
    }
    return out;
  }

  // One step of call `id`.
  void step(int id) {
    Call& c = *calls.at(id);
    const bool down = dead.count(c.address) != 0;
    // The handle stays valid until its done has returned (worker_client.h).
    auto finish = [this, id](Status s) {
      auto node = calls.extract(id);
      if (node.mapped()->done) node.mapped()->done(s);
    };
    if (c.kind == Call::Kind::kRelease) {
      if (!down) decode[c.address].erase(c.request_id);
      calls.erase(id);
      return;
    }
    if (down) {
      finish(unavailable("connection reset by peer"));
      return;
    }
    if (c.inject) {
      if (c.kind == Call::Kind::kStream) decode[c.address].erase(c.request_id);
      finish(*c.inject);
      return;
    }
    if (c.cancelled) {
      if (c.kind == Call::Kind::kStream) decode[c.address].erase(c.request_id);
      finish(cancelled("cancelled by the client"));
      return;
    }
    switch (c.kind) {
      case Call::Kind::kAdmit: {
        Seq s;
        s.max_tokens = c.admit.max_tokens;
        s.ignore_eos = c.admit.ignore_eos;
        s.logprobs = c.admit.sampling.top_logprobs >= 0 && no_logprobs.count(c.address) == 0;
        s.n_forks = c.admit.n_forks;
        if (!c.admit.fork_of.empty()) {  // a fork: the prompt is here already, held for it
          auto& held = holds[c.address];
          auto h = held.find(c.admit.fork_of);
          if (h == held.end()) {
            finish(failed_precondition("request " + c.admit.fork_of + " holds no prompt for forks here"));
            return;
          }
          REQUIRE(static_cast<int32_t>(h->second.tokens.size()) == c.admit.n_prompt_tokens);
          REQUIRE(c.admit.prefill_ids.empty());
          REQUIRE(c.admit.n_forks == 0);
          s.local = s.fork = s.kv = true;
          s.tokens = h->second.tokens;
          if (--h->second.n_left == 0) held.erase(h);
          ++n_forks_admitted;
        }
        if (!c.admit.prefill_ids.empty()) {  // local prefill: nothing else will come
          REQUIRE(static_cast<int32_t>(c.admit.prefill_ids.size()) == c.admit.n_prompt_tokens);
          s.local = true;
          s.kv = true;
          s.tokens = c.admit.prefill_ids;
        }
        REQUIRE(decode[c.address].count(c.request_id) == 0);
        decode[c.address][c.request_id] = s;
        finish(Status());
        return;
      }
      case Call::Kind::kPrefill: {
        std::vector<int32_t> seq = c.prefill.prompt_ids;
        seq.insert(seq.end(), c.prefill.generated_ids.begin(), c.prefill.generated_ids.end());
        if (c.prefill_step == 0) {
          PrefillUpdate u;
          u.token_id = next_token(seq);
          if (c.prefill.sampling.top_logprobs >= 0 && no_logprobs.count(c.address) == 0) {
            u.logprobs = fake_logprob(u.token_id);
          }
          u.cached_tokens = static_cast<int32_t>(seq.size() / 2);  // what a prefix cache might hold
          ++c.prefill_step;
          c.on_prefill(u);
        } else if (c.prefill_step == 1) {
          const std::string& d = c.prefill.decode_address;
          auto w = decode.find(d);
          if (dead.count(d) || w == decode.end() || w->second.count(c.request_id) == 0) {
            finish(unavailable("KV hand-off to " + d + ": the decode worker refused or is gone"));
            return;
          }
          Seq& s = w->second.at(c.request_id);
          if (s.n_forks > 0) holds[d][c.request_id] = Hold{seq, s.n_forks};
          s.tokens = seq;
          s.tokens.push_back(next_token(seq));
          s.n_generated = 1;
          s.kv = true;
          PrefillUpdate u;
          u.kind = PrefillUpdate::Kind::kKvSent;
          u.transfer_seconds = 0.001;
          ++c.prefill_step;
          c.on_prefill(u);
        } else {
          finish(Status());
        }
        return;
      }
      case Call::Kind::kStream: {
        auto& seqs = decode[c.address];
        auto it = seqs.find(c.request_id);
        if (it == seqs.end()) {
          finish(not_found("request " + c.request_id + " is not admitted here"));
          return;
        }
        Seq& s = it->second;
        DecodeUpdate u;
        if (s.local && s.n_generated == 0) {  // the first token, prefilled here
          if (s.n_forks > 0) holds[c.address][c.request_id] = Hold{s.tokens, s.n_forks};
          if (s.fork) u.cached_tokens = static_cast<int32_t>(s.tokens.size()) - 1;
          const int32_t t = next_token(s.tokens);
          s.tokens.push_back(t);
          s.n_generated = 1;
          u.token_ids.push_back(t);
          if (s.logprobs) u.logprobs.push_back(fake_logprob(t));
          u.first_token_included = true;
        }
        const bool stopped_at_first = !s.ignore_eos && s.tokens.back() == kEos;
        for (int i = 0; i < 2 && !stopped_at_first && s.n_generated < s.max_tokens; ++i) {
          const int32_t t = next_token(s.tokens);
          s.tokens.push_back(t);
          ++s.n_generated;
          u.token_ids.push_back(t);
          if (s.logprobs) u.logprobs.push_back(fake_logprob(t));
          if (t == kEos && !s.ignore_eos) break;
        }
        const bool eos = !s.ignore_eos && s.tokens.back() == kEos;
        u.done = eos || s.n_generated >= s.max_tokens;
        u.length = !eos;
        c.on_decode(u);
        if (u.done) {
          seqs.erase(c.request_id);
          finish(Status());
        }
        return;
      }
      case Call::Kind::kRelease:
        return;
    }
  }

  // Fails the next step of an open call of `kind` (any, when nullopt) with `status`.
  bool inject(std::mt19937& rng, std::optional<Call::Kind> kind, const Status& status) {
    std::vector<Call*> open;
    for (auto& [id, c] : calls) {
      if (c->kind != Call::Kind::kRelease && (!kind || c->kind == *kind) && !c->inject) open.push_back(c.get());
    }
    if (open.empty()) return false;
    open[rng() % open.size()]->inject = status;
    return true;
  }

  void kill(const std::string& addr) {
    dead.insert(addr);
    decode.erase(addr);  // the process and everything it held are gone
    holds.erase(addr);
    for (auto& [id, c] : calls) {  // and every connection to it breaks, even if it restarts
      if (c->address == addr && c->kind != Call::Kind::kRelease) c->inject = unavailable("connection reset by peer");
    }
  }

 private:
  Call* add(Call::Kind kind, const std::string& addr, const std::string& request_id) {
    auto c = std::make_unique<Call>();
    c->kind = kind;
    c->id = next_call++;
    c->address = addr;
    c->request_id = request_id;
    Call* raw = c.get();
    calls.emplace(raw->id, std::move(c));
    return raw;
  }
};

struct RecordingSink final : public ResponseSink {
  std::vector<int32_t> tokens;
  std::vector<TokenLogprobs> logprobs;
  int n_end = 0;
  Status status;
  PipelineOutcome outcome;
  std::vector<std::string> failovers;
  Accepted on_tokens(std::span<const int32_t> ids, std::span<const TokenLogprobs> lps) override {
    CHECK(n_end == 0);
    tokens.insert(tokens.end(), ids.begin(), ids.end());
    logprobs.insert(logprobs.end(), lps.begin(), lps.end());
    return {ids.size(), false};
  }
  void on_failover(const std::string& reason, const Status&) override { failovers.push_back(reason); }
  void on_end(const Status& s, const PipelineOutcome& o) override {
    ++n_end;
    status = s;
    outcome = o;
  }
};

// The real scheduler and registry over fake workers and fake time.
struct World {
  Harness h;
  FakeWorkers workers;
  PipelineDeps deps;
  std::vector<std::string> prefill_addrs, decode_addrs;
  SamplingParams sampling;  // every request's that start() makes

  // `ip_addresses`: workers at 10.0.1.i:50051 (prefill) and 10.0.2.i:50051 (decode), else p:i, d:i.
  // local_prefill: decode workers prefill prompts of up to this many tokens themselves (and the
  // scheduler sends them there).
  World(int n_prefill, int n_decode, int32_t max_failovers = 2, SchedulerConfig sc = {}, bool ip_addresses = false,
        int32_t local_prefill = 0)
      : h(with_local(sc, local_prefill)), local_prefill_(local_prefill) {
    for (int i = 0; i < n_prefill; ++i) {
      prefill_addrs.push_back(ip_addresses ? "10.0.1." + std::to_string(i) + ":50051" : "p:" + std::to_string(i));
    }
    for (int i = 0; i < n_decode; ++i) {
      decode_addrs.push_back(ip_addresses ? "10.0.2." + std::to_string(i) + ":50051" : "d:" + std::to_string(i));
    }
    deps.scheduler = &h.sched;
    deps.registry = &h.registry;
    deps.client = &workers;
    deps.clock = &h.clock;
    deps.config.max_failovers = max_failovers;
    poll();
  }

  // What WorkerPool does every period: load reports from the live, failures from the dead.
  void poll() {
    h.clock.advance(std::chrono::milliseconds(1));
    for (const auto& a : prefill_addrs) {
      if (workers.dead.count(a) || workers.hung.count(a)) {
        h.registry.report_failure(kPrefill, a);
      } else {
        h.prefill_worker(a, 0, false, prefill_step_seconds, prefill_rate);
      }
    }
    for (const auto& a : decode_addrs) {
      if (workers.dead.count(a) || workers.hung.count(a)) {
        h.registry.report_failure(kDecode, a);
      } else {
        const auto held = static_cast<int64_t>(workers.decode[a].size());
        h.decode_worker(a, 1000 - 4 * held, 1000, false, local_prefill_, decode_step_seconds);
      }
    }
    h.sched.poll();
  }

  std::shared_ptr<RequestPipeline> start(const std::shared_ptr<RecordingSink>& sink, std::vector<int32_t> prompt,
                                         int32_t max_tokens, bool ignore_eos = false, std::string label = "",
                                         std::shared_ptr<ChoiceGroup> group = nullptr, int32_t choice = 0) {
    PipelineRequest r;
    r.label = std::move(label);
    r.prompt_ids = std::move(prompt);
    r.max_tokens = max_tokens;
    r.ignore_eos = ignore_eos;
    r.stop_ids = {kEos};
    r.sampling = sampling;
    r.arrival = h.clock.now();
    r.group = std::move(group);
    r.choice = choice;
    auto p = RequestPipeline::create(deps, std::move(r), sink);
    p->start();
    return p;
  }

  // Delivers events (in `rng`'s order when given, else oldest call first) until nothing moves.
  void run(std::mt19937* rng = nullptr, int max_steps = 100000) {
    for (int i = 0; i < max_steps; ++i) {
      if (i % 7 == 0) poll();
      const auto ready = workers.ready();
      if (ready.empty()) {
        if (workers.calls.empty() && h.sched.n_queued() == 0) return;
        poll();
        continue;
      }
      workers.step(rng != nullptr ? ready[(*rng)() % ready.size()] : ready.front());
    }
    FAIL("the fake workers did not settle");
  }

  // Delivers events in `rng`'s order for up to 20,000 steps while killing and reviving workers,
  // failing calls with one of `errors` and now and then calling `cancel_one` (a client that
  // cancels), until `all_ended` holds and no call is open; then revives every worker and settles.
  void run_with_faults(std::mt19937& rng, std::span<const Status> errors, const std::function<void()>& cancel_one,
                       const std::function<bool()>& all_ended) {
    for (int step = 0; step < 20000; ++step) {
      if (step % 7 == 0) poll();
      const uint32_t dice = rng() % 1000;
      std::vector<std::string> all = prefill_addrs;
      all.insert(all.end(), decode_addrs.begin(), decode_addrs.end());
      if (dice < 6) {
        workers.kill(all[rng() % all.size()]);
      } else if (dice < 30 && !workers.dead.empty()) {
        workers.dead.erase(workers.dead.begin());  // restarted (empty)
      } else if (dice < 36) {
        (void)workers.inject(rng, std::nullopt, errors[rng() % errors.size()]);
      } else if (dice < 38) {
        cancel_one();
      }
      const auto ready = workers.ready();
      if (ready.empty()) {
        if (all_ended() && workers.calls.empty()) break;
        h.clock.advance(std::chrono::milliseconds(50));  // waiting for a worker to come back
        continue;
      }
      workers.step(ready[rng() % ready.size()]);
    }
    workers.dead.clear();  // the rest of the calls finish
    run(&rng);
  }

  static SchedulerConfig with_local(SchedulerConfig sc, int32_t local_prefill) {
    sc.local_prefill_max_tokens = local_prefill;
    return sc;
  }
  int32_t local_prefill_ = 0;
  // What the workers' load reports say of their speed (the progress bounds' inputs).
  double prefill_step_seconds = 0, prefill_rate = 0, decode_step_seconds = 0;

  // Nothing left anywhere.
  void check_clean() {
    CHECK(workers.calls.empty());
    for (const auto& [addr, seqs] : workers.decode) {
      INFO("decode worker " << addr);
      CHECK(seqs.empty());
    }
    CHECK(h.sched.n_admitted() == 0);
    for (const auto& w : h.registry.snapshot(kDecode)) CHECK(w.n_unreported_requests == 0);
    for (const auto& w : h.registry.snapshot(kPrefill)) CHECK(w.n_unreported_requests == 0);
  }
};

inline std::vector<int32_t> random_prompt(std::mt19937& rng, int n) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (auto& t : p) t = 1 + static_cast<int32_t>(rng() % (kVocab - 1));
  return p;
}

// A prompt whose uninterrupted answer runs `n` tokens without an end-of-sequence.
inline std::vector<int32_t> prompt_without_eos(std::mt19937& rng, int n) {
  for (;;) {
    auto p = random_prompt(rng, 8);
    const auto ref = reference(p, n, false);
    if (static_cast<int>(ref.size()) == n) return p;
  }
}

}  // namespace baton::pipeline_test
