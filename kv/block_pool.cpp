#include "kv/block_pool.h"

#include "common/check.h"

namespace baton {

BlockPool::BlockPool(int n_blocks, int block_size) : n_total_(n_blocks), block_size_(block_size) {
  BATON_CHECK(n_blocks > 0 && block_size > 0, "pool of %d blocks of %d", n_blocks, block_size);
  free_.reserve(n_blocks);
  for (int b = n_blocks - 1; b >= 0; --b) free_.push_back(b);
  holders_.assign(n_blocks, 0);
}

bool BlockPool::grow_to(std::vector<int32_t>& table, int64_t n_tokens) {
  const int need = blocks_for(n_tokens) - static_cast<int>(table.size());
  if (need <= 0) return true;
  if (!can_allocate(need)) return false;
  for (int i = 0; i < need; ++i) {
    int32_t b = free_.back();
    free_.pop_back();
    holders_[b] = 1;
    table.push_back(b);
  }
  return true;
}

void BlockPool::share(std::span<const int32_t> blocks) {
  for (int32_t b : blocks) {
    BATON_CHECK(b >= 0 && b < n_total_ && holders_[b] > 0, "share of block %d that is not in use", b);
    ++holders_[b];
  }
}

void BlockPool::release(std::vector<int32_t>& table) {
  for (int32_t b : table) {
    BATON_CHECK(b >= 0 && b < n_total_ && holders_[b] > 0, "release of block %d that is not in use", b);
    if (--holders_[b] == 0) free_.push_back(b);
  }
  table.clear();
}

int BlockPool::holders(int32_t block) const {
  BATON_CHECK(block >= 0 && block < n_total_, "block %d outside the pool of %d", block, n_total_);
  return holders_[block];
}

}  // namespace baton
