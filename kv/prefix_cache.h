// The prefill worker's KV blocks and the prefix cache over them (DESIGN.md "Prefix cache";
// metadata only: the KV itself lives in the backend's KvCache, a block id names the same block in
// every layer). Replaces a plain BlockPool where prompts may share prefixes.
//
// A block is in one of three states:
//   empty  on the free list; its content is worth nothing
//   held   in a sequence's table, or pinned by one (refs > 0). A held block may also be *cached*:
//          indexed by its chained hash (kv/prefix_hash.h), so other sequences may hold it too
//   idle   cached, refs == 0: kept for later prompts on an LRU list, and taken back (evicted),
//          least recently used first, when the pool has no empty block left
// Blocks free for new work = empty + idle (n_free()).
//
// Contract (the prefill engine's, under its lock; not thread-safe):
// - allocate() starts a sequence: it reuses the longest cached prefix of the prompt (those blocks
//   are shared: the sequence must never write them) and takes fresh blocks for the rest.
// - insert() once the forward has written every layer of a sequence's leading full blocks: they
//   join the cache (or, where an equal block is cached already, the sequence pins that one, so its
//   later blocks can hang below it). A cached block is never written again: its sequence writes
//   only positions after it.
// - release() once nothing reads the sequence's blocks any more (the engine and the KV transfer
//   are done). Its blocks are released deepest first, so a prefix's first block is always more
//   recently used than the blocks below it: eviction takes leaves before the prefixes they hang on.
// Exactness: hashes index the cache, but every hit is verified: the block's tokens are compared,
// and its parent must be the block matched just before it. Every cached block's parent is cached
// (evicting a block evicts the idle blocks below it; a held block's parent is held by the same
// sequence), so a match is exactly the KV of the same token prefix: a 64-bit hash collision costs
// a miss, never wrong KV.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

namespace baton {

// One sequence's hold on the pool. Owned by the caller, changed only by PrefixCache.
struct PrefixCacheSeq {
  std::vector<int32_t> table;                 // its blocks in position order (the forward's block table)
  int n_reused = 0;                           // leading blocks of `table` that came from the cache: never written
  int n_offered = 0;                          // leading blocks already in the cache (reused, or through insert)
  int32_t last = -1;                          // the cached block standing for block n_offered - 1
  bool chain_ended = false;                   // no later block of it can be cached (a cached block of another
                                              // prefix, held, has the same hash)
  std::vector<std::pair<int, int32_t>> pins;  // (position, block): cached blocks held beyond `table`
};

class PrefixCache {
 public:
  // n_blocks blocks of block_size tokens, of which at most max_cached may be cached at once
  // (held or idle). max_cached == 0: no caching at all, a plain pool. All > 0 but max_cached.
  PrefixCache(int n_blocks, int block_size, int max_cached);

  int block_size() const { return block_size_; }
  int n_total() const { return n_total_; }
  int max_cached() const { return max_cached_; }
  bool enabled() const { return max_cached_ > 0; }
  // Blocks needed to hold n_tokens positions.
  int blocks_for(int64_t n_tokens) const { return static_cast<int>((n_tokens + block_size_ - 1) / block_size_); }

  int n_free() const { return static_cast<int>(empty_.size()) + n_idle_; }  // empty + idle
  int n_cached() const { return n_cached_; }                                // held or idle
  int n_idle() const { return n_idle_; }
  int64_t n_inserted() const { return n_inserted_; }  // blocks that joined the cache so far
  int64_t n_evicted() const { return n_evicted_; }    // cached blocks that left it so far

  // The longest cached prefix of a prompt: its blocks (appended to `blocks`, when given), at most
  // max_blocks. `hashes` are the prompt's full blocks' chained hashes, `tokens` the prompt.
  int match(std::span<const uint64_t> hashes, std::span<const int32_t> tokens, int max_blocks,
            std::vector<int32_t>* blocks = nullptr) const;
  // Whether allocate() with these arguments would succeed now.
  bool can_allocate(std::span<const uint64_t> hashes, std::span<const int32_t> tokens, int max_match,
                    int n_blocks) const;
  // Starts `seq` (empty) with n_blocks blocks: its longest cached prefix, at most max_match blocks
  // (max_match <= n_blocks), held, then fresh ones, evicting idle blocks when no empty one is
  // left. Returns the number of blocks reused, or -1 (and changes nothing) when even evicting
  // every idle block would not give enough.
  int allocate(std::span<const uint64_t> hashes, std::span<const int32_t> tokens, int max_match, int n_blocks,
               PrefixCacheSeq* seq);
  // `seq`'s blocks [0, n_full) are written (every layer): those not in the cache yet join it, in
  // order, while it has room (max_cached; idle blocks are evicted for it, held ones never).
  void insert(PrefixCacheSeq* seq, std::span<const uint64_t> hashes, std::span<const int32_t> tokens, int n_full);
  // Ends `seq`: its blocks go back (cached ones idle, the rest empty) and it is cleared.
  void release(PrefixCacheSeq* seq);

  // Hashes of up to `max` cached blocks, held ones first, then idle ones most recently used first.
  std::vector<uint64_t> cached_hashes(size_t max) const;

  // For tests.
  int ref_count(int32_t block) const { return blocks_.at(block).refs; }
  bool is_cached(int32_t block) const { return blocks_.at(block).cached; }

 private:
  struct Block {
    int32_t refs = 0;
    bool cached = false;
    uint64_t hash = 0;
    int32_t parent = -1;            // the cached block before it in its prefix (-1: a prompt's first)
    std::vector<int32_t> children;  // cached blocks whose parent it is
    int32_t prev = -1, next = -1;   // LRU neighbours while idle (prev: older)
  };

  // Whether block b is cached holding `block_tokens` right after `parent` (-1: as a prompt's first).
  bool verifies(int32_t b, int32_t parent, std::span<const int32_t> block_tokens) const;
  const int32_t* tokens_of(int32_t b) const { return &tokens_[static_cast<size_t>(b) * block_size_]; }
  void hold(int32_t b);    // refs++, off the LRU list if idle
  void unhold(int32_t b);  // refs--; at 0: idle (cached) or empty
  int32_t take_fresh();    // an empty block (evicting the least recently used idle one if need be), held
  void evict(int32_t b);   // an idle block and every idle block below it leave the cache: empty
  void lru_unlink(int32_t b);
  void lru_push_newest(int32_t b);

  const int n_total_;
  const int block_size_;
  const int max_cached_;
  std::vector<Block> blocks_;
  std::vector<int32_t> tokens_;                  // block_size tokens per block: a cached block's, for verification
  std::vector<int32_t> empty_;                   // LIFO: recently freed blocks are warm in cache
  std::unordered_map<uint64_t, int32_t> index_;  // hash → cached block
  int32_t lru_oldest_ = -1, lru_newest_ = -1;
  int n_cached_ = 0;
  int n_idle_ = 0;
  int64_t n_inserted_ = 0;
  int64_t n_evicted_ = 0;
};

}  // namespace baton
