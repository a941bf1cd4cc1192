#include "scheduler/placement.h"

namespace baton {

int64_t blocks_for(int64_t n_tokens, int32_t block_size) {
  BATON_CHECK(block_size > 0, "blocks_for with block_size %d", block_size);
  BATON_CHECK(n_tokens >= 0, "blocks_for with %lld tokens", static_cast<long long>(n_tokens));
  return (n_tokens + block_size - 1) / block_size;
}

std::optional<std::string> DecodePlacement::pick(std::span<const WorkerSnapshot> workers,
                                                 const PlacementRequest& request) const {
  const WorkerSnapshot* best = nullptr;
  int64_t best_free_tokens = 0;
  int64_t best_n_sequences = 0;
  for (const WorkerSnapshot& w : workers) {
    if (!w.can_place() || w.load.block_size <= 0) continue;
    const int64_t available = w.available_blocks();
    if (available < blocks_for(request.n_total_tokens, w.load.block_size)) continue;
    const int64_t free_tokens = available * w.load.block_size;
    const int64_t n_sequences = int64_t{w.load.n_running} + w.n_unreported_requests;
    if (best == nullptr || free_tokens > best_free_tokens ||
        (free_tokens == best_free_tokens && n_sequences < best_n_sequences)) {
      best = &w;
      best_free_tokens = free_tokens;
      best_n_sequences = n_sequences;
    }
  }
  if (best == nullptr) return std::nullopt;
  return best->address;
}

std::optional<std::string> PrefillPlacement::pick(std::span<const WorkerSnapshot> workers,
                                                  const PlacementRequest& request) const {
  const WorkerSnapshot* best = nullptr;
  for (const WorkerSnapshot& w : workers) {
    if (!w.can_place()) continue;
    if (best == nullptr || w.outstanding_prompt_tokens() < best->outstanding_prompt_tokens()) best = &w;
  }
  if (best == nullptr) return std::nullopt;
  return best->address;
}

}  // namespace baton
