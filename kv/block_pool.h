// KV block bookkeeping (metadata only; the memory lives in the backend's KvCache). A block id
// indexes the same block in every layer. Contract: a block is owned by at most one sequence;
// can_allocate() before allocate(); every allocated block is returned with release().
#pragma once

#include <cstdint>
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
  // Returns every block of `table` to the pool and clears it.
  void release(std::vector<int32_t>& table);

 private:
  int n_total_;
  int block_size_;
  std::vector<int32_t> free_;     // LIFO: recently freed blocks are warm in cache
  std::vector<uint8_t> in_use_;   // guards against double release
};

}  // namespace baton
