// kv/prefix_hash.h and kv/prefix_cache.h: the hash against the xxHash specification's values and
// its chaining; the cache on random prompts that share prefixes, step by step against a naive
// model of the same policy (whole token prefixes as keys, LRU by a counter), and with hashes
// made to collide, where every reused block must still hold exactly the prompt's prefix.
#include "kv/prefix_cache.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <string>

#include "kv/prefix_hash.h"

using namespace baton;

namespace {

using Tokens = std::vector<int32_t>;

Tokens prefix_of(const Tokens& t, size_t n) {
  return Tokens(t.begin(), t.begin() + n);
}

// The same policy, written naively: one entry per cached block, keyed by the whole token prefix
// it ends; LRU order by a counter; a sequence's holds by key.
class NaiveCache {
 public:
  NaiveCache(int n_total, int bs, int max_cached) : n_total_(n_total), bs_(bs), max_cached_(max_cached) {}

  struct Seq {
    Tokens prompt;
    int n_blocks = 0, n_reused = 0, n_offered = 0;
    std::vector<std::pair<int, Tokens>> cached_holds;  // (position, key) of cached blocks it holds
    std::vector<int> private_positions;                // its fresh blocks not (yet) cached
  };

  int n_free() const { return n_empty() + n_idle(); }
  int n_cached() const { return static_cast<int>(entries_.size()); }
  int n_idle() const {
    return static_cast<int>(
        std::count_if(entries_.begin(), entries_.end(), [](const auto& e) { return e.second.refs == 0; }));
  }
  int64_t n_evicted = 0, n_inserted = 0;

  int match(const Tokens& prompt, int max_blocks) const {
    if (max_cached_ == 0) return 0;
    int i = 0;
    while (i < max_blocks && static_cast<size_t>(i + 1) * bs_ <= prompt.size() &&
           entries_.count(prefix_of(prompt, size_t(i + 1) * bs_))) {
      ++i;
    }
    return i;
  }

  int allocate(const Tokens& prompt, int max_match, int n_blocks, Seq* seq) {
    const int m = match(prompt, max_match);
    int idle_reused = 0;
    for (int i = 0; i < m; ++i) idle_reused += entries_.at(key(prompt, i)).refs == 0;
    if (n_blocks - m > n_free() - idle_reused) return -1;
    *seq = Seq{prompt, n_blocks, m, m, {}, {}};
    for (int i = 0; i < m; ++i) {
      entries_.at(key(prompt, i)).refs++;
      seq->cached_holds.emplace_back(i, key(prompt, i));
    }
    for (int i = m; i < n_blocks; ++i) {
      if (n_empty() == 0) evict(oldest_idle());
      ++n_private_;
      seq->private_positions.push_back(i);
    }
    return m;
  }

  void insert(Seq* seq, int n_full) {
    if (max_cached_ == 0) return;
    n_full = std::min(n_full, seq->n_blocks);
    n_full = std::min<int>(n_full, static_cast<int>(seq->prompt.size()) / bs_);
    while (seq->n_offered < n_full) {
      const int i = seq->n_offered;
      const Tokens k = key(seq->prompt, i);
      if (entries_.count(k)) {  // cached by another sequence first: pinned
        entries_.at(k).refs++;
        seq->cached_holds.emplace_back(i, k);
        ++seq->n_offered;
        continue;
      }
      if (n_cached() >= max_cached_) {
        if (n_idle() == 0) break;
        evict(oldest_idle());
      }
      entries_[k] = Entry{1, 0};
      ++n_inserted;
      --n_private_;
      auto& p = seq->private_positions;
      p.erase(std::find(p.begin(), p.end(), i));
      seq->cached_holds.emplace_back(i, k);
      ++seq->n_offered;
    }
  }

  void release(Seq* seq) {
    // Deepest first; at equal positions pins before the sequence's own blocks (which are then
    // private: a pin at position i means its own block i stayed out of the cache).
    std::vector<std::pair<int, const Tokens*>> order;
    for (const auto& [pos, k] : seq->cached_holds) order.emplace_back(pos, &k);
    for (int pos : seq->private_positions) order.emplace_back(pos, nullptr);
    std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    for (const auto& [pos, k] : order) {
      if (k == nullptr) {
        --n_private_;
      } else if (--entries_.at(*k).refs == 0) {
        entries_.at(*k).stamp = ++clock_;
      }
    }
    *seq = Seq{};
  }

  std::set<Tokens> keys() const {
    std::set<Tokens> out;
    for (const auto& [k, e] : entries_) out.insert(k);
    return out;
  }

 private:
  struct Entry {
    int refs = 0;
    uint64_t stamp = 0;
  };
  Tokens key(const Tokens& prompt, int i) const { return prefix_of(prompt, size_t(i + 1) * bs_); }
  int n_empty() const { return n_total_ - n_cached() - n_private_; }
  Tokens oldest_idle() const {
    const Tokens* best = nullptr;
    uint64_t stamp = 0;
    for (const auto& [k, e] : entries_) {
      if (e.refs == 0 && (best == nullptr || e.stamp < stamp)) {
        best = &k;
        stamp = e.stamp;
      }
    }
    REQUIRE(best != nullptr);
    return *best;
  }
  // The entry and every entry below it (they are idle too).
  void evict(const Tokens& k) {
    std::vector<Tokens> gone;
    for (const auto& [other, e] : entries_) {
      if (other.size() >= k.size() && std::equal(k.begin(), k.end(), other.begin())) {
        REQUIRE(e.refs == 0);
        gone.push_back(other);
      }
    }
    for (const auto& g : gone) entries_.erase(g);
    n_evicted += static_cast<int64_t>(gone.size());
  }

  int n_total_, bs_, max_cached_;
  std::map<Tokens, Entry> entries_;
  int n_private_ = 0;
  uint64_t clock_ = 0;
};

// Prompts that share prefixes: one of a few roots cut at a random length, then fresh tokens, over
// a small vocabulary (equal blocks under different prefixes are common).
struct PromptSource {
  std::mt19937& rng;
  int vocab;
  std::vector<Tokens> roots;
  PromptSource(std::mt19937& r, int vocab_size, int n_roots, int root_len) : rng(r), vocab(vocab_size) {
    for (int i = 0; i < n_roots; ++i) roots.push_back(random(root_len));
  }
  Tokens random(int n) {
    Tokens t(n);
    for (auto& x : t) x = static_cast<int32_t>(rng() % vocab);
    return t;
  }
  Tokens next(int max_len) {
    const Tokens& root = roots[rng() % roots.size()];
    Tokens p = prefix_of(root, rng() % (root.size() + 1));
    const Tokens tail = random(1 + static_cast<int>(rng() % 24));
    p.insert(p.end(), tail.begin(), tail.end());
    if (static_cast<int>(p.size()) > max_len) p.resize(max_len);
    return p;
  }
};

// What the test believes each block holds: the token prefix written into it (empty: unknown).
struct Contents {
  std::vector<Tokens> of;
  explicit Contents(int n) : of(n) {}
};

}  // namespace

TEST_CASE("xxh64 gives the xxHash specification's values", "[kv][prefix]") {
  // Reference values from the xxHash project (XXH64, the canonical test strings).
  const auto h = [](const std::string& s, uint64_t seed) { return xxh64(s.data(), s.size(), seed); };
  CHECK(h("", 0) == 0xEF46DB3751D8E999ULL);
  CHECK(h("a", 0) == 0xD24EC4F1A98C6E5BULL);
  CHECK(h("abc", 0) == 0x44BC2CF5AD770999ULL);
  CHECK(h("Nobody inspects the spammish repetition", 0) == 0xFBCEA83C8A378BF1ULL);
  CHECK(h("", 12345) == 0x95584AF7701F808DULL);
  CHECK(h("Nobody inspects the spammish repetition", 12345) == 0x081A876428A9313BULL);
  std::string bytes(100, '\0');
  for (int i = 0; i < 100; ++i) bytes[i] = static_cast<char>(i);
  CHECK(h(bytes, 0) == 0x6AC1E58032166597ULL);  // the 32-byte stripes, then the tail
  CHECK(h(bytes, 12345) == 0x028BA1AE2DE4DE27ULL);
}

TEST_CASE("prefix block hashes chain: each names its whole prefix and what changes its KV", "[kv][prefix]") {
  std::mt19937 rng(std::random_device{}());
  const uint32_t seed_value = rng();
  INFO("seed " << seed_value);
  rng.seed(seed_value);
  const int bs = 1 + static_cast<int>(rng() % 32);
  Tokens t(static_cast<size_t>(bs) * (2 + rng() % 10) + rng() % bs);
  for (auto& x : t) x = static_cast<int32_t>(rng() % 50000);
  const uint64_t seed = prefix_hash_seed("fp", "f32", bs);
  const auto hashes = prefix_block_hashes(seed, bs, t);
  REQUIRE(hashes.size() == t.size() / bs);
  uint64_t parent = seed;
  for (size_t i = 0; i < hashes.size(); ++i) {
    CHECK(hashes[i] == prefix_block_hash(parent, std::span<const int32_t>(t).subspan(i * bs, bs)));
    parent = hashes[i];
  }
  CHECK(prefix_block_hashes(seed, bs, t, 1).size() == 1);
  CHECK(prefix_block_hashes(seed, bs, t, 1)[0] == hashes[0]);
  // Another model, KV type or block size starts another chain.
  CHECK(prefix_hash_seed("fp2", "f32", bs) != seed);
  CHECK(prefix_hash_seed("fp", "bf16", bs) != seed);
  CHECK(prefix_hash_seed("fp", "f32", bs + 1) != seed);
  CHECK(prefix_hash_seed("f", "pf32", bs) != seed);  // the fields do not run together
  // A change in block 0 changes every later hash; a change in the last block only its own.
  Tokens u = t;
  u[rng() % bs] ^= 1;
  const auto hu = prefix_block_hashes(seed, bs, u);
  for (size_t i = 0; i < hashes.size(); ++i) CHECK(hu[i] != hashes[i]);
  Tokens w = t;
  const size_t last = hashes.size() - 1;
  w[last * bs + rng() % bs] ^= 1;
  const auto hw = prefix_block_hashes(seed, bs, w);
  for (size_t i = 0; i < last; ++i) CHECK(hw[i] == hashes[i]);
  CHECK(hw[last] != hashes[last]);
}

TEST_CASE("prefix cache: reuse, sharing, LRU eviction and the deepest block first", "[kv][prefix]") {
  const int bs = 4;
  PrefixCache cache(8, bs, 8);
  const uint64_t seed = prefix_hash_seed("fp", "f32", bs);
  const Tokens a = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13};  // 3 full blocks + 1 token
  const auto ha = prefix_block_hashes(seed, bs, a);
  PrefixCacheSeq s1;
  REQUIRE(cache.allocate(ha, a, 3, 4, &s1) == 0);
  CHECK(cache.n_free() == 4);
  cache.insert(&s1, ha, a, 3);
  CHECK(cache.n_cached() == 3);
  // A second prompt sharing two blocks reuses them while the first still holds them.
  Tokens b = prefix_of(a, 8);
  b.insert(b.end(), {20, 21, 22});
  const auto hb = prefix_block_hashes(seed, bs, b);
  PrefixCacheSeq s2;
  REQUIRE(cache.allocate(hb, b, 2, 3, &s2) == 2);
  CHECK(s2.table[0] == s1.table[0]);
  CHECK(s2.table[1] == s1.table[1]);
  CHECK(cache.ref_count(s1.table[0]) == 2);
  CHECK(cache.n_free() == 3);
  cache.release(&s1);
  CHECK(cache.ref_count(s2.table[0]) == 1);
  CHECK(cache.n_idle() == 1);  // a's third block
  CHECK(cache.n_free() == 5);  // 4 empty + 1 idle
  cache.release(&s2);
  CHECK(cache.n_free() == 8);
  CHECK(cache.n_cached() == 3);
  // Every empty block gone, the least recently used idle one is taken: a's third block (released
  // before the two it hangs on).
  PrefixCacheSeq s3;
  const Tokens c = {40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60};
  const auto hc = prefix_block_hashes(seed, bs, c);
  REQUIRE(cache.allocate(hc, c, 5, 6, &s3) == 0);
  CHECK(cache.n_evicted() == 1);
  CHECK(cache.match(ha, a, 3) == 2);
  CHECK(cache.n_free() == 2);
  CHECK_FALSE(cache.can_allocate(hc, c, 0, 3));
  CHECK(cache.allocate(hc, c, 0, 3, &s2) == -1);
  CHECK(s2.table.empty());
  cache.release(&s3);
  CHECK(cache.n_free() == 8);
}

TEST_CASE("prefix cache: random prompts match a naive model of the same policy", "[kv][prefix]") {
  const uint32_t seed_value = std::random_device{}();
  INFO("seed " << seed_value);
  std::mt19937 rng(seed_value);
  for (int trial = 0; trial < 30; ++trial) {
    const int bs = 1 + static_cast<int>(rng() % 6);
    const int n_total = 8 + static_cast<int>(rng() % 40);
    const int max_cached = trial % 5 == 0 ? 0 : 1 + static_cast<int>(rng() % n_total);
    INFO("trial " << trial << ": " << n_total << " blocks of " << bs << ", max cached " << max_cached);
    PrefixCache cache(n_total, bs, max_cached);
    NaiveCache naive(n_total, bs, max_cached);
    Contents contents(n_total);
    const uint64_t seed = prefix_hash_seed("fp", "f32", bs);
    PromptSource source(rng, 2 + static_cast<int>(rng() % 3), 3, 6 * bs);
    struct Live {
      Tokens prompt;
      std::vector<uint64_t> hashes;
      PrefixCacheSeq seq;
      NaiveCache::Seq naive;
      int n_written = 0;  // blocks whose content the "forward" has written
    };
    std::vector<Live> live;
    for (int op = 0; op < 400; ++op) {
      const int what = static_cast<int>(rng() % 10);
      if (what < 4 || live.empty()) {  // a new sequence
        Live l;
        l.prompt = source.next(n_total * bs / 2);
        l.hashes = prefix_block_hashes(seed, bs, l.prompt);
        const int n_blocks = cache.blocks_for(static_cast<int64_t>(l.prompt.size()));
        const int max_match = (static_cast<int>(l.prompt.size()) - 1) / bs;
        const int predicted = naive.match(l.prompt, max_match);
        REQUIRE(cache.match(l.hashes, l.prompt, max_match) == predicted);
        const int got = cache.allocate(l.hashes, l.prompt, max_match, n_blocks, &l.seq);
        REQUIRE(got == naive.allocate(l.prompt, max_match, n_blocks, &l.naive));
        if (got < 0) continue;
        REQUIRE(got == predicted);
        REQUIRE(static_cast<int>(l.seq.table.size()) == n_blocks);
        // Reused blocks hold exactly this prompt's prefix; no fresh block is anyone else's.
        for (int i = 0; i < got; ++i) REQUIRE(contents.of[l.seq.table[i]] == prefix_of(l.prompt, size_t(i + 1) * bs));
        for (int i = got; i < n_blocks; ++i) {
          REQUIRE(cache.ref_count(l.seq.table[i]) == 1);
          REQUIRE_FALSE(cache.is_cached(l.seq.table[i]));
          contents.of[l.seq.table[i]].clear();
        }
        l.n_written = got;
        live.push_back(std::move(l));
      } else if (what < 8) {  // a step wrote some more of one sequence's blocks
        Live& l = live[rng() % live.size()];
        const int n_full = static_cast<int>(l.prompt.size()) / bs;
        const int upto = std::min(n_full, l.n_written + 1 + static_cast<int>(rng() % 3));
        for (int i = l.n_written; i < upto; ++i) contents.of[l.seq.table[i]] = prefix_of(l.prompt, size_t(i + 1) * bs);
        l.n_written = std::max(l.n_written, upto);
        cache.insert(&l.seq, l.hashes, l.prompt, l.n_written);
        naive.insert(&l.naive, l.n_written);
        REQUIRE(l.seq.n_offered == l.naive.n_offered);
      } else {  // one ends
        const size_t i = rng() % live.size();
        cache.release(&live[i].seq);
        naive.release(&live[i].naive);
        live.erase(live.begin() + static_cast<long>(i));
      }
      REQUIRE(cache.n_free() == naive.n_free());
      REQUIRE(cache.n_cached() == naive.n_cached());
      REQUIRE(cache.n_idle() == naive.n_idle());
      REQUIRE(cache.n_evicted() == naive.n_evicted);
      REQUIRE(cache.n_inserted() == naive.n_inserted);
      REQUIRE(cache.n_cached() <= std::max(max_cached, 0));
      // Reference counts are the holds of the live sequences.
      std::map<int32_t, int> holds;
      for (const Live& l : live) {
        for (int32_t b : l.seq.table) ++holds[b];
        for (const auto& [pos, b] : l.seq.pins) ++holds[b];
      }
      for (int32_t b = 0; b < n_total; ++b) REQUIRE(cache.ref_count(b) == holds[b]);
    }
    // The report names exactly the cached prefixes.
    std::set<uint64_t> want;
    for (const Tokens& k : naive.keys()) want.insert(prefix_block_hashes(seed, bs, k).back());
    const auto reported = cache.cached_hashes(static_cast<size_t>(n_total));
    CHECK(std::set<uint64_t>(reported.begin(), reported.end()) == want);
    CHECK(reported.size() == want.size());
    for (Live& l : live) cache.release(&l.seq);
    CHECK(cache.n_free() == n_total);
  }
}

TEST_CASE("prefix cache: colliding hashes cost misses, never another prefix's blocks", "[kv][prefix]") {
  const uint32_t seed_value = std::random_device{}();
  INFO("seed " << seed_value);
  std::mt19937 rng(seed_value);
  // Hashes that collide all the time: a block's hash is its position modulo 3, or its tokens alone.
  for (const int kind : {0, 1}) {
    const int bs = 1 + static_cast<int>(rng() % 4);
    const int n_total = 16 + static_cast<int>(rng() % 32);
    PrefixCache cache(n_total, bs, n_total);
    Contents contents(n_total);
    PromptSource source(rng, 2, 3, 5 * bs);
    const auto bad_hashes = [&](const Tokens& p) {
      std::vector<uint64_t> h;
      for (size_t i = 0; (i + 1) * bs <= p.size(); ++i) {
        uint64_t x = i % 3;
        if (kind == 1) x = prefix_block_hash(0, std::span<const int32_t>(p).subspan(i * bs, bs));
        h.push_back(x);
      }
      return h;
    };
    struct Live {
      Tokens prompt;
      std::vector<uint64_t> hashes;
      PrefixCacheSeq seq;
    };
    std::vector<Live> live;
    int64_t reused = 0;
    for (int op = 0; op < 500; ++op) {
      if (rng() % 2 == 0 || live.empty()) {
        Live l;
        l.prompt = source.next(n_total * bs / 3);
        l.hashes = bad_hashes(l.prompt);
        const int n_blocks = cache.blocks_for(static_cast<int64_t>(l.prompt.size()));
        const int m =
            cache.allocate(l.hashes, l.prompt, (static_cast<int>(l.prompt.size()) - 1) / bs, n_blocks, &l.seq);
        if (m < 0) continue;
        for (int i = 0; i < m; ++i) REQUIRE(contents.of[l.seq.table[i]] == prefix_of(l.prompt, size_t(i + 1) * bs));
        reused += m;
        const int n_full = static_cast<int>(l.prompt.size()) / bs;
        for (int i = m; i < n_full; ++i) contents.of[l.seq.table[i]] = prefix_of(l.prompt, size_t(i + 1) * bs);
        cache.insert(&l.seq, l.hashes, l.prompt, n_full);
        live.push_back(std::move(l));
      } else {
        const size_t i = rng() % live.size();
        cache.release(&live[i].seq);
        live.erase(live.begin() + static_cast<long>(i));
      }
      int held = 0;
      for (int32_t b = 0; b < n_total; ++b) held += cache.ref_count(b) > 0;
      REQUIRE(held + cache.n_free() == n_total);
    }
    for (Live& l : live) cache.release(&l.seq);
    CHECK(cache.n_free() == n_total);
    INFO("blocks reused " << reused);
  }
}
