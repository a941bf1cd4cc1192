// KV block bookkeeping (metadata only; the memory lives in the backend's KvCache). A block id
// indexes the same block in every layer. Contract: can_allocate() before allocate(); a block is
// held by one owner from grow_to(), by more through share() (the n choices of one prompt hold its
// prompt blocks once: decode_worker/decode_engine.h), and is free again when every holder has
// given it back with release(). Holders of a shared block write none of the positions another
// holder reads: only a prompt's KV is shared, and nobody writes it again.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace baton {

class BlockPool {
 public:
  BlockPool(int n_blocks, int block_size);

  int block_size() const { return block_size_; }
  int n_total() const { return n_total_; }
  int n_free() const { return static_cast<int>(free_.size()); }
  // Blocks needed to hold n_tokens positions.
  int blocks_for(int64_t n_tokens) const { return static_cast<int>((n_tokens + block_size_ - 1) / block_size_); }

  bool can_allocate(int n_blocks) const { return n_blocks <= n_free(); }
  // Appends blocks to `table` until it covers n_tokens positions; false (and no change) when
  // the pool has too few free blocks.
  bool grow_to(std::vector<int32_t>& table, int64_t n_tokens);
  // Adds a holder to each of `blocks` (all in use): each is freed only when released once more.
  void share(std::span<const int32_t> blocks);
  // Gives back `table`'s hold on each of its blocks (freeing those nobody else holds) and clears it.
  void release(std::vector<int32_t>& table);
  // How many hold `block` (0: free).
  int holders(int32_t block) const;

 private:
  int n_total_;
  int block_size_;
  std::vector<int32_t> free_;     // LIFO: recently freed blocks are warm in cache
  std::vector<int32_t> holders_;  // per block; guards against a release with no hold
};

}  // namespace baton
