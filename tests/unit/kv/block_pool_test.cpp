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
