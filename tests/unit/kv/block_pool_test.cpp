#include "kv/block_pool.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <random>
#include <set>

using namespace baton;

TEST_CASE("block pool grows tables, refuses when full, and gets every block back", "[kv]") {
  BlockPool pool(10, 16);
  std::vector<int32_t> a, b;
  REQUIRE(pool.grow_to(a, 1));
  CHECK(a.size() == 1);
  REQUIRE(pool.grow_to(a, 16));
  CHECK(a.size() == 1);
  REQUIRE(pool.grow_to(a, 17));
  CHECK(a.size() == 2);
  CHECK_FALSE(pool.grow_to(b, 16 * 9));  // needs 9, 8 left
  CHECK(b.empty());
  CHECK(pool.n_free() == 8);
  REQUIRE(pool.grow_to(b, 16 * 8));
  CHECK(pool.n_free() == 0);
  std::set<int32_t> all(a.begin(), a.end());
  all.insert(b.begin(), b.end());
  CHECK(all.size() == 10);  // no block handed out twice
  pool.release(a);
  pool.release(b);
  CHECK(pool.n_free() == 10);
  CHECK(a.empty());
}

TEST_CASE("block pool survives random allocate/release sequences", "[kv]") {
  std::mt19937 rng(std::random_device{}());
  BlockPool pool(64, 4);
  std::vector<std::vector<int32_t>> seqs(8);
  for (int step = 0; step < 2000; ++step) {
    auto& t = seqs[rng() % seqs.size()];
    if (rng() % 3 == 0) {
      pool.release(t);
    } else {
      const int before = pool.n_free();
      const int64_t want = static_cast<int64_t>(t.size()) * 4 + rng() % 20;
      const bool ok = pool.grow_to(t, want);
      if (!ok) CHECK(pool.n_free() == before);
    }
    int used = 0;
    for (auto& s : seqs) used += static_cast<int>(s.size());
    REQUIRE(used + pool.n_free() == 64);
  }
}

TEST_CASE("shared blocks are freed by their last holder, against a count kept by hand", "[kv]") {
  std::mt19937 rng(std::random_device{}());
  constexpr int kBlocks = 48;
  BlockPool pool(kBlocks, 4);
  std::vector<std::vector<int32_t>> holds(12);
  std::vector<int> expect(kBlocks, 0);  // the reference: holds of each block over every table
  for (int step = 0; step < 4000; ++step) {
    auto& t = holds[rng() % holds.size()];
    const int op = static_cast<int>(rng() % 4);
    if (op == 0) {
      for (int32_t b : t) --expect[b];
      pool.release(t);
    } else if (op == 1) {
      // Share a prefix of another holder's table into this one (a fork of its prompt).
      const auto& from = holds[rng() % holds.size()];
      if (&from == &t || from.empty() || !t.empty()) continue;
      const size_t n = 1 + rng() % from.size();
      const std::vector<int32_t> prefix(from.begin(), from.begin() + static_cast<std::ptrdiff_t>(n));
      pool.share(prefix);
      t = prefix;
      for (int32_t b : prefix) ++expect[b];
    } else {
      const int before = pool.n_free();
      const size_t had = t.size();
      if (pool.grow_to(t, static_cast<int64_t>(t.size()) * 4 + 1 + rng() % 12)) {
        for (size_t i = had; i < t.size(); ++i) {
          REQUIRE(expect[t[i]] == 0);  // a new block is one nobody holds
          expect[t[i]] = 1;
        }
      } else {
        CHECK(pool.n_free() == before);
      }
    }
    int n_free = 0;
    for (int b = 0; b < kBlocks; ++b) {
      REQUIRE(pool.holders(b) == expect[b]);
      n_free += expect[b] == 0;
    }
    REQUIRE(pool.n_free() == n_free);
  }
}
