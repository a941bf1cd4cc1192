#include "kv/prefix_cache.h"

#include <algorithm>

#include "common/check.h"

namespace baton {

PrefixCache::PrefixCache(int n_blocks, int block_size, int max_cached)
    : n_total_(n_blocks), block_size_(block_size), max_cached_(max_cached) {
  BATON_CHECK(n_blocks > 0 && block_size > 0 && max_cached >= 0, "prefix cache of %d blocks of %d, %d cached", n_blocks,
              block_size, max_cached);
  blocks_.resize(n_blocks);
  if (max_cached_ > 0) tokens_.assign(static_cast<size_t>(n_blocks) * block_size, 0);
  empty_.reserve(n_blocks);
  for (int b = n_blocks - 1; b >= 0; --b) empty_.push_back(b);
}

bool PrefixCache::verifies(int32_t b, int32_t parent, std::span<const int32_t> block_tokens) const {
  const Block& k = blocks_[b];
  return k.cached && k.parent == parent && std::equal(block_tokens.begin(), block_tokens.end(), tokens_of(b));
}

int PrefixCache::match(std::span<const uint64_t> hashes, std::span<const int32_t> tokens, int max_blocks,
                       std::vector<int32_t>* blocks) const {
  if (!enabled()) return 0;
  const int n = std::min<int>(max_blocks, static_cast<int>(hashes.size()));
  BATON_CHECK(tokens.size() >= static_cast<size_t>(n) * block_size_, "%d block hashes for %zu tokens", n,
              tokens.size());
  int32_t parent = -1;
  int i = 0;
  for (; i < n; ++i) {
    const auto it = index_.find(hashes[i]);
    if (it == index_.end() || !verifies(it->second, parent, tokens.subspan(size_t(i) * block_size_, block_size_))) {
      break;
    }
    parent = it->second;
    if (blocks != nullptr) blocks->push_back(parent);
  }
  return i;
}

bool PrefixCache::can_allocate(std::span<const uint64_t> hashes, std::span<const int32_t> tokens, int max_match,
                               int n_blocks) const {
  std::vector<int32_t> matched;
  const int m = match(hashes, tokens, std::min(max_match, n_blocks), &matched);
  const int idle_reused =
      static_cast<int>(std::count_if(matched.begin(), matched.end(), [&](int32_t b) { return blocks_[b].refs == 0; }));
  return n_blocks - m <= n_free() - idle_reused;
}

int PrefixCache::allocate(std::span<const uint64_t> hashes, std::span<const int32_t> tokens, int max_match,
                          int n_blocks, PrefixCacheSeq* seq) {
  BATON_CHECK(seq->table.empty() && seq->pins.empty(), "allocate() of a sequence that holds blocks");
  BATON_CHECK(max_match <= n_blocks, "max_match %d > n_blocks %d", max_match, n_blocks);
  if (!can_allocate(hashes, tokens, max_match, n_blocks)) return -1;
  *seq = PrefixCacheSeq{};
  const int m = match(hashes, tokens, max_match, &seq->table);
  for (int32_t b : seq->table) hold(b);  // before taking fresh ones: a reused idle block is not evicted
  while (static_cast<int>(seq->table.size()) < n_blocks) seq->table.push_back(take_fresh());
  seq->n_reused = seq->n_offered = m;
  seq->last = m > 0 ? seq->table[m - 1] : -1;
  return m;
}

void PrefixCache::insert(PrefixCacheSeq* seq, std::span<const uint64_t> hashes, std::span<const int32_t> tokens,
                         int n_full) {
  if (!enabled()) return;
  n_full = std::min({n_full, static_cast<int>(seq->table.size()), static_cast<int>(hashes.size())});
  BATON_CHECK(tokens.size() >= static_cast<size_t>(n_full) * block_size_, "%d full blocks of %zu tokens", n_full,
              tokens.size());
  while (!seq->chain_ended && seq->n_offered < n_full) {
    const int i = seq->n_offered;
    const int32_t parent = i == 0 ? -1 : seq->last;
    const auto block_tokens = tokens.subspan(size_t(i) * block_size_, block_size_);
    const auto it = index_.find(hashes[i]);
    if (it != index_.end()) {
      const int32_t x = it->second;
      if (verifies(x, parent, block_tokens)) {
        // Another sequence cached this prefix first: its block stands for ours from here on.
        // Pinned, so it stays cached while our later blocks hang below it.
        hold(x);
        seq->pins.emplace_back(i, x);
        seq->last = x;
        ++seq->n_offered;
        continue;
      }
      // A block of another prefix with the same hash (a collision). Idle: it gives way.
      if (blocks_[x].refs > 0) {
        seq->chain_ended = true;
        break;
      }
      evict(x);
    }
    if (n_cached_ >= max_cached_) {
      if (lru_oldest_ < 0) break;  // full of held blocks: tried again at the next insert
      evict(lru_oldest_);
    }
    const int32_t b = seq->table[i];
    Block& k = blocks_[b];
    BATON_CHECK(!k.cached && k.refs == 1, "insert of block %d (cached %d, refs %d)", b, int(k.cached), k.refs);
    k.cached = true;
    k.hash = hashes[i];
    k.parent = parent;
    k.children.clear();
    if (parent >= 0) blocks_[parent].children.push_back(b);
    std::copy(block_tokens.begin(), block_tokens.end(), tokens_.begin() + static_cast<size_t>(b) * block_size_);
    index_[k.hash] = b;
    ++n_cached_;
    ++n_inserted_;
    seq->last = b;
    ++seq->n_offered;
  }
}

void PrefixCache::release(PrefixCacheSeq* seq) {
  // Deepest first: each block becomes more recently used than every block below it.
  std::vector<std::pair<int, int32_t>> held = seq->pins;
  for (size_t i = 0; i < seq->table.size(); ++i) held.emplace_back(static_cast<int>(i), seq->table[i]);
  std::stable_sort(held.begin(), held.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (const auto& [position, b] : held) unhold(b);
  *seq = PrefixCacheSeq{};
}

std::vector<uint64_t> PrefixCache::cached_hashes(size_t max) const {
  std::vector<uint64_t> out;
  for (int32_t b = 0; b < n_total_ && out.size() < max; ++b) {
    if (blocks_[b].cached && blocks_[b].refs > 0) out.push_back(blocks_[b].hash);
  }
  for (int32_t b = lru_newest_; b >= 0 && out.size() < max; b = blocks_[b].prev) out.push_back(blocks_[b].hash);
  return out;
}

void PrefixCache::hold(int32_t b) {
  Block& k = blocks_[b];
  if (k.refs == 0) {
    BATON_CHECK(k.cached, "hold of block %d, which is empty", b);
    lru_unlink(b);
    --n_idle_;
  }
  ++k.refs;
}

void PrefixCache::unhold(int32_t b) {
  Block& k = blocks_[b];
  BATON_CHECK(b >= 0 && b < n_total_ && k.refs > 0, "release of block %d that is not held", b);
  if (--k.refs > 0) return;
  if (k.cached) {
    lru_push_newest(b);
    ++n_idle_;
  } else {
    empty_.push_back(b);
  }
}

int32_t PrefixCache::take_fresh() {
  if (empty_.empty()) {
    BATON_CHECK(lru_oldest_ >= 0, "no block left to take (the caller checks can_allocate)");
    evict(lru_oldest_);
  }
  const int32_t b = empty_.back();
  empty_.pop_back();
  blocks_[b].refs = 1;
  return b;
}

void PrefixCache::evict(int32_t b) {
  Block& k = blocks_[b];
  BATON_CHECK(k.cached && k.refs == 0, "evict of block %d (cached %d, refs %d)", b, int(k.cached), k.refs);
  // Blocks below it are idle too (a held block's parent is held) and unreachable once it goes.
  const std::vector<int32_t> children = std::move(k.children);
  k.children.clear();
  for (int32_t c : children) evict(c);
  if (k.parent >= 0) {
    auto& siblings = blocks_[k.parent].children;
    siblings.erase(std::remove(siblings.begin(), siblings.end(), b), siblings.end());
  }
  lru_unlink(b);
  --n_idle_;
  const auto it = index_.find(k.hash);
  if (it != index_.end() && it->second == b) index_.erase(it);
  k.cached = false;
  k.parent = -1;
  --n_cached_;
  ++n_evicted_;
  empty_.push_back(b);
}

void PrefixCache::lru_unlink(int32_t b) {
  Block& k = blocks_[b];
  (k.prev >= 0 ? blocks_[k.prev].next : lru_oldest_) = k.next;
  (k.next >= 0 ? blocks_[k.next].prev : lru_newest_) = k.prev;
  k.prev = k.next = -1;
}

void PrefixCache::lru_push_newest(int32_t b) {
  Block& k = blocks_[b];
  k.prev = lru_newest_;
  k.next = -1;
  (lru_newest_ >= 0 ? blocks_[lru_newest_].next : lru_oldest_) = b;
  lru_newest_ = b;
}

}  // namespace baton
