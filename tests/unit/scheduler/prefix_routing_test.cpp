// Prefix-aware prefill routing (scheduler/placement.h PrefillPlacement, the registry's map of the
// prefixes it sent): hand-made snapshots against a naive reference that compares token prefixes
// directly (no hashing); a hot prefix spreads over the workers as its queue grows; the frontend's
// own map lives from placement to the first report after the prefill; the scheduler sends a
// repeated prefix to the worker that has it while queues are short.
#include <algorithm>
#include <catch2/catch.hpp>
#include <memory>
#include <random>
#include <unordered_set>

#include "kv/prefix_hash.h"
#include "scheduler/placement.h"
#include "tests/unit/scheduler/scheduler_harness.h"

using namespace baton;
using namespace baton::scheduler_test;

namespace {

using Tokens = std::vector<int32_t>;

// A prefill worker with a prefix cache of root `seed` whose report lists every full block of
// `cached` prompts, and this frontend's map holding `sent` prompts.
struct FakeWorker {
  std::string address;
  int32_t block_size = 16;
  uint64_t seed = 0;
  std::vector<Tokens> cached, sent;
  int64_t queued = 0, unreported = 0;

  WorkerSnapshot snapshot() const {
    WorkerSnapshot w;
    w.address = address;
    w.role = WorkerRole::kPrefill;
    w.has_report = w.healthy = true;
    w.load.block_size = block_size;
    w.load.prefix_cache_blocks = 1000;
    w.load.prefix_hash_seed = seed;
    w.load.queued_prompt_tokens = queued;
    w.unreported_prompt_tokens = unreported;
    auto set = std::make_shared<std::unordered_set<uint64_t>>();
    for (const Tokens& p : cached) {
      for (uint64_t h : prefix_block_hashes(seed, block_size, p)) set->insert(h);
    }
    w.load.cached_blocks = set;
    for (const Tokens& p : sent) {
      const size_t reusable = (p.size() - 1) / block_size;  // as the scheduler records them
      w.sent_prefixes.push_back(
          std::make_shared<const std::vector<uint64_t>>(prefix_block_hashes(seed, block_size, p, reusable)));
    }
    return w;
  }
};

size_t lcp(const Tokens& a, const Tokens& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}

// Naive: the whole blocks `q` shares with a prompt the worker holds, at most all but q's last.
int64_t naive_cached(const FakeWorker& w, const Tokens& q) {
  const size_t bs = w.block_size;
  size_t best = 0;
  for (const Tokens& p : w.cached) best = std::max(best, std::min(lcp(p, q) / bs, p.size() / bs));
  for (const Tokens& p : w.sent) best = std::max(best, std::min(lcp(p, q) / bs, (p.size() - 1) / bs));
  return static_cast<int64_t>(std::min(best, (q.size() - 1) / bs) * bs);
}

Tokens random_tokens(std::mt19937& rng, size_t n) {
  Tokens t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % 5000);
  return t;
}

// `base` cut at `keep`, then `extra` fresh tokens.
Tokens extend(std::mt19937& rng, const Tokens& base, size_t keep, size_t extra) {
  Tokens t(base.begin(), base.begin() + std::min(keep, base.size()));
  const Tokens tail = random_tokens(rng, extra);
  t.insert(t.end(), tail.begin(), tail.end());
  return t;
}

PlacementRequest request_of(const Tokens& t) {
  return {static_cast<int64_t>(t.size()), static_cast<int64_t>(t.size()) + 16, t};
}

}  // namespace

TEST_CASE("prefix routing: the expected cached tokens are the leading whole blocks a worker holds",
          "[scheduler][prefix]") {
  std::mt19937 rng(test_seed("prefix routing expected"));
  FakeWorker w{"p:1", 16, prefix_hash_seed("fp", "f32", 16), {}, {}, 0, 0};
  const Tokens p = random_tokens(rng, 16 * (3 + rng() % 5) + rng() % 16);
  w.cached = {p};
  const WorkerSnapshot s = w.snapshot();
  CHECK(expected_cached_tokens(s, p) == static_cast<int64_t>((p.size() - 1) / 16 * 16));
  for (int i = 0; i < 50; ++i) {
    const Tokens q = extend(rng, p, rng() % (p.size() + 1), 1 + rng() % 40);
    INFO("q shares " << lcp(p, q) << " of " << q.size());
    CHECK(expected_cached_tokens(s, q) == naive_cached(w, q));
  }
  CHECK(expected_cached_tokens(s, {}) == 0);
  // Another root (model, KV dtype or block size), no cache, or a gap at block 0: nothing.
  WorkerSnapshot other = s;
  other.load.prefix_hash_seed ^= 1;
  CHECK(expected_cached_tokens(other, p) == 0);
  other = s;
  other.load.prefix_cache_blocks = 0;
  CHECK(expected_cached_tokens(other, p) == 0);
  other = s;
  auto without_first = std::make_shared<std::unordered_set<uint64_t>>(*s.load.cached_blocks);
  without_first->erase(prefix_block_hashes(w.seed, 16, p).front());
  other.load.cached_blocks = without_first;
  CHECK(expected_cached_tokens(other, p) == 0);
}

TEST_CASE("prefix routing picks the least cost, prefix saved against queue, as a naive reference",
          "[scheduler][prefix]") {
  std::mt19937 rng(test_seed("prefix routing naive"));
  for (int iter = 0; iter < 1500; ++iter) {
    const double weight = std::vector<double>{0, 0.5, 1, 1, 2, 10}[rng() % 6];
    const PrefillPlacement policy(weight);
    const int32_t bs = rng() % 2 == 0 ? 4 : 16;
    const uint64_t seed = prefix_hash_seed("fp", "f32", bs);
    std::vector<Tokens> roots = {random_tokens(rng, 8 * bs), random_tokens(rng, 8 * bs)};
    const auto prompt = [&] { return extend(rng, roots[rng() % 2], rng() % (8 * bs + 1), 1 + rng() % (3 * bs)); };
    std::vector<FakeWorker> fakes;
    const int n = 1 + static_cast<int>(rng() % 4);
    for (int i = 0; i < n; ++i) {
      FakeWorker f{"p:" + std::to_string(i),
                   bs,
                   seed,
                   {},
                   {},
                   static_cast<int64_t>(rng() % (6 * bs)),
                   static_cast<int64_t>(rng() % (2 * bs))};
      for (int k = static_cast<int>(rng() % 3); k > 0; --k) f.cached.push_back(prompt());
      for (int k = static_cast<int>(rng() % 2); k > 0; --k) f.sent.push_back(prompt());
      fakes.push_back(f);
    }
    std::vector<WorkerSnapshot> ws;
    for (const auto& f : fakes) ws.push_back(f.snapshot());
    for (auto& w : ws) w.healthy = rng() % 8 != 0;
    const Tokens q = prompt();
    // Naive: the documented cost for each placeable worker; ties to fewer outstanding, then order.
    std::optional<std::string> want;
    double best = 0;
    int64_t best_out = 0;
    for (int i = 0; i < n; ++i) {
      if (!ws[i].healthy) continue;
      const int64_t out = fakes[i].queued + fakes[i].unreported;
      const double cost = weight * out + static_cast<double>(q.size()) - naive_cached(fakes[i], q);
      if (!want || cost < best || (cost == best && out < best_out)) {
        want = fakes[i].address;
        best = cost;
        best_out = out;
      }
    }
    INFO("iteration " << iter << ", weight " << weight);
    CHECK(policy.pick(ws, request_of(q)) == want);
    // Without tokens: the fewest outstanding tokens.
    std::optional<std::string> fewest;
    int64_t fewest_out = 0;
    for (int i = 0; i < n; ++i) {
      const int64_t out = fakes[i].queued + fakes[i].unreported;
      if (ws[i].healthy && (!fewest || out < fewest_out)) {
        fewest = fakes[i].address;
        fewest_out = out;
      }
    }
    CHECK(policy.pick(ws, PlacementRequest{static_cast<int64_t>(q.size()), 1000, {}}) == fewest);
  }
}

TEST_CASE("prefix routing: a hot prefix spreads over the workers as its queue grows", "[scheduler][prefix]") {
  std::mt19937 rng(test_seed("prefix routing hot"));
  const int32_t bs = 16;
  const uint64_t seed = prefix_hash_seed("fp", "f32", bs);
  const Tokens hot = random_tokens(rng, 1000);  // a system prompt
  const size_t tail = 50 + rng() % 100;         // each request's own part
  for (const double weight : {1.0, 0.0}) {
    INFO("weight " << weight);
    const PrefillPlacement policy(weight);
    std::vector<FakeWorker> fakes = {{"p:0", bs, seed, {hot}, {}, 0, 0}, {"p:1", bs, seed, {}, {}, 0, 0}};
    std::vector<int> n_placed(2, 0);
    int first_elsewhere = -1;
    for (int i = 0; i < 40; ++i) {
      std::vector<WorkerSnapshot> ws = {fakes[0].snapshot(), fakes[1].snapshot()};
      const Tokens q = extend(rng, hot, hot.size(), tail);
      const auto pick = policy.pick(ws, request_of(q));
      REQUIRE(pick.has_value());
      const int k = *pick == "p:0" ? 0 : 1;
      // What the scheduler then records: the tokens left to compute there, and the prompt.
      fakes[k].unreported += static_cast<int64_t>(q.size()) - expected_cached_tokens(ws[k], q);
      fakes[k].sent.push_back(q);
      ++n_placed[k];
      if (k == 1 && first_elsewhere < 0) first_elsewhere = i;
    }
    if (weight == 0) {
      CHECK(n_placed[0] == 40);  // the cache alone: everything piles onto the worker that has it
      continue;
    }
    // The holder takes the prompts while its queue is shorter than what the prefix saves
    // elsewhere, then the other worker gets one (and with it the prefix), and both share the rest.
    const int64_t saved = static_cast<int64_t>(hot.size() / bs * bs);             // the hot prefix's whole blocks
    const int64_t per_request = static_cast<int64_t>(hot.size() + tail) - saved;  // computed where it is cached
    CHECK(first_elsewhere == static_cast<int>((saved + per_request - 1) / per_request));
    CHECK(n_placed[1] > 0);
    CHECK(std::abs(n_placed[0] - n_placed[1]) <= first_elsewhere + 1);
    const int64_t gap = std::abs(fakes[0].unreported - fakes[1].unreported);
    CHECK(gap <= static_cast<int64_t>(hot.size() + tail));
  }
}

TEST_CASE("the frontend's map of sent prefixes lives from placement to the first report after the prefill",
          "[scheduler][prefix]") {
  FakeClock clock;
  WorkerRegistry registry({}, clock);
  registry.set_addresses(kPrefill, {"p:1"});
  WorkerLoad l;
  l.prefix_cache_blocks = 100;
  REQUIRE(registry.report_load(kPrefill, "p:1", l, clock.now()).ok());
  const auto hashes = std::make_shared<const std::vector<uint64_t>>(std::vector<uint64_t>{1, 2, 3});
  CHECK_FALSE(registry.add_prefill_prefix("p:9", "r", hashes));
  REQUIRE(registry.add_prefill_prefix("p:1", "r", hashes));
  REQUIRE(registry.add_prefill_prefix("p:1", "gone", hashes));
  CHECK(registry.find(kPrefill, "p:1")->sent_prefixes.size() == 2);
  registry.remove_prefill_prefix("p:1", "gone");  // abandoned before its prefill
  CHECK(registry.find(kPrefill, "p:1")->sent_prefixes.size() == 1);
  clock.advance(1ms);
  REQUIRE(registry.report_load(kPrefill, "p:1", l, clock.now()).ok());  // its prefill has not finished
  CHECK(registry.find(kPrefill, "p:1")->sent_prefixes.size() == 1);
  clock.advance(1ms);
  const TimePoint asked_before = clock.now();
  clock.advance(1ms);
  registry.confirm_prefill_prefix("p:1", "r");
  REQUIRE(registry.report_load(kPrefill, "p:1", l, asked_before).ok());  // asked before the prefill ended
  CHECK(registry.find(kPrefill, "p:1")->sent_prefixes.size() == 1);
  clock.advance(1ms);
  REQUIRE(registry.report_load(kPrefill, "p:1", l, clock.now()).ok());  // includes it
  CHECK(registry.find(kPrefill, "p:1")->sent_prefixes.empty());
  l.prefix_cache_blocks = -1;
  CHECK(registry.report_load(kPrefill, "p:1", l, clock.now()).code() == StatusCode::kInvalidArgument);
}

TEST_CASE("the scheduler sends a repeated prefix to the worker that has it while queues are short",
          "[scheduler][prefix]") {
  std::mt19937 rng(test_seed("prefix routing scheduler"));
  Harness h;
  h.decode_worker("d:1", 10000, 10000);
  const uint64_t seed = prefix_hash_seed("fp", "f32", kBlockSize);
  // A prefill worker's report: its queue, and the prompts whose blocks its cache holds.
  const auto report = [&](const std::string& address, int64_t queued, const std::vector<Tokens>& cached) {
    if (std::find(h.prefill_addresses.begin(), h.prefill_addresses.end(), address) == h.prefill_addresses.end()) {
      h.prefill_addresses.push_back(address);
      h.registry.set_addresses(kPrefill, h.prefill_addresses);
    }
    h.clock.advance(1ms);
    WorkerLoad l;
    l.queued_prompt_tokens = queued;
    l.block_size = kBlockSize;
    l.prefix_cache_blocks = 1000;
    l.prefix_hash_seed = seed;
    auto set = std::make_shared<std::unordered_set<uint64_t>>();
    for (const Tokens& p : cached) {
      for (uint64_t x : prefix_block_hashes(seed, kBlockSize, p)) set->insert(x);
    }
    l.cached_blocks = set;
    REQUIRE(h.registry.report_load(kPrefill, address, l, h.clock.now()).ok());
  };
  report("p:0", 0, {});
  report("p:1", 0, {});
  const Tokens system = random_tokens(rng, 10 * kBlockSize + rng() % kBlockSize);
  const auto submit = [&](const std::string& id, const Tokens& tokens) {
    PendingRequest r;
    r.id = id;
    r.n_prompt_tokens = static_cast<int64_t>(tokens.size());
    r.n_total_tokens = r.n_prompt_tokens + 16;
    r.arrival = h.clock.now();
    r.tokens = std::make_shared<const Tokens>(tokens);
    REQUIRE(h.sched
                .submit(
                    std::move(r), [&h, id](const Placement& p) { h.placed[id] = p; },
                    [&h, id](const Status& s) { h.failed[id] = s; })
                .ok());
    REQUIRE(h.is_placed(id));
    return h.placed.at(id).prefill_address;
  };
  const int64_t cached = static_cast<int64_t>(system.size() / kBlockSize * kBlockSize);
  // The first goes where queues are equal (the first worker); each after it, once the one before
  // has its first token, follows it there before any report shows the blocks, and counts there as
  // the tokens it leaves to compute.
  const std::string home = submit("a", extend(rng, system, system.size(), 20));
  const std::string away = home == "p:0" ? "p:1" : "p:0";
  // A report from before its prefill finished: a short queue there, no cached blocks yet.
  const int64_t queued = 1 + static_cast<int64_t>(rng() % (cached - 1));
  report(home, queued, {});
  h.sched.prefill_done("a");
  for (int i = 0; i < 3; ++i) {
    const std::string id = "b" + std::to_string(i);
    const Tokens q = extend(rng, system, system.size(), 1 + rng() % 40);
    CHECK(submit(id, q) == home);  // by queue alone it would go away
    CHECK(h.worker(kPrefill, home).unreported_prompt_tokens == static_cast<int64_t>(q.size()) - cached);
    h.sched.prefill_done(id);
  }
  CHECK(h.worker(kPrefill, home).sent_prefixes.size() == 4);
  // The worker's report shows the blocks (and the frontend's map gives way to it); a long queue
  // there sends the next prompt elsewhere, however much it shares.
  report(home, 10 * static_cast<int64_t>(system.size()), {system});
  CHECK(h.worker(kPrefill, home).sent_prefixes.empty());
  CHECK(submit("c", extend(rng, system, system.size(), 20)) == away);
  h.sched.prefill_done("c");
  // A prompt that shares nothing goes by queue alone; one that shares the prefix goes to a holder.
  report(home, 0, {system});
  report(away, 500, {});
  CHECK(submit("d", random_tokens(rng, 50)) == home);
  h.sched.prefill_done("d");
  report(home, 500, {system});
  report(away, 0, {});
  CHECK(submit("e", random_tokens(rng, 50)) == away);
  h.sched.finished("a");
}

TEST_CASE("a tenant scope keys the prefix hashes: blocks cached in one scope are no hit in another", "[scheduler][limits]") {
  std::mt19937 rng(std::random_device{}());
  const uint64_t seed = (static_cast<uint64_t>(rng()) << 32) | rng();
  Tokens prompt(70);
  for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % 50000);
  const std::string scope_a = "0123456789abcdef0123456789abcdef:", scope_b = "fedcba9876543210fedcba9876543210:";
  // The worker caches the prompt's blocks as the prefill engine hashes them: in scope a.
  WorkerSnapshot w = FakeWorker{"p:1", 16, seed, {}, {}}.snapshot();
  auto set = std::make_shared<std::unordered_set<uint64_t>>();
  for (uint64_t h : prefix_block_hashes(prefix_hash_scoped_seed(seed, scope_a), 16, prompt)) set->insert(h);
  w.load.cached_blocks = set;
  CHECK(expected_cached_tokens(w, prompt, nullptr, scope_a) == 64);
  CHECK(expected_cached_tokens(w, prompt, nullptr, scope_b) == 0);
  CHECK(expected_cached_tokens(w, prompt, nullptr, "") == 0);
  CHECK(expected_cached_tokens(w, prompt, nullptr, scope_a + "salt") == 0);
  // The empty scope is the unscoped root: requests with neither a key nor a salt share as before.
  CHECK(prefix_hash_scoped_seed(seed, "") == seed);
  CHECK(prefix_hash_scoped_seed(seed, scope_a) != prefix_hash_scoped_seed(seed, scope_b));
}
