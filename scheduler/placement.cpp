#include "scheduler/placement.h"

#include <algorithm>

#include "kv/prefix_hash.h"

namespace baton {

int64_t blocks_for(int64_t n_tokens, int32_t block_size) {
  BATON_CHECK(block_size > 0, "blocks_for with block_size %d", block_size);
  BATON_CHECK(n_tokens >= 0, "blocks_for with %lld tokens", static_cast<long long>(n_tokens));
  return (n_tokens + block_size - 1) / block_size;
}

namespace {

// `workers` without those in `avoid`.
std::vector<WorkerSnapshot> without(const std::vector<WorkerSnapshot>& workers, const std::vector<std::string>& avoid) {
  std::vector<WorkerSnapshot> out;
  for (const auto& w : workers) {
    if (std::find(avoid.begin(), avoid.end(), w.address) == avoid.end()) out.push_back(w);
  }
  return out;
}

}  // namespace

std::optional<std::string> pick_avoiding(const PlacementPolicy& policy, const std::vector<WorkerSnapshot>& workers,
                                         const std::vector<std::string>& avoid, const PlacementRequest& q) {
  if (!avoid.empty()) {
    if (auto other = policy.pick(without(workers, avoid), q)) return other;
  }
  return policy.pick(workers, q);
}

const WorkerSnapshot* find_worker(const std::vector<WorkerSnapshot>& workers, const std::string& address) {
  const auto it =
      std::find_if(workers.begin(), workers.end(), [&](const WorkerSnapshot& w) { return w.address == address; });
  return it == workers.end() ? nullptr : &*it;
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

std::vector<uint64_t> prefix_routing_hashes(const WorkerSnapshot& w, std::span<const int32_t> tokens,
                                            std::string_view scope) {
  if (w.load.prefix_cache_blocks <= 0 || w.load.block_size <= 0 || tokens.empty()) return {};
  const size_t reusable = (tokens.size() - 1) / static_cast<size_t>(w.load.block_size);
  return prefix_block_hashes(prefix_hash_scoped_seed(w.load.prefix_hash_seed, scope), w.load.block_size, tokens,
                             reusable);
}

int64_t expected_cached_tokens(const WorkerSnapshot& w, std::span<const int32_t> tokens,
                               const std::vector<uint64_t>* hashes, std::string_view scope) {
  std::vector<uint64_t> own;
  if (hashes == nullptr) {
    own = prefix_routing_hashes(w, tokens, scope);
    hashes = &own;
  }
  if (hashes->empty()) return 0;
  size_t n = 0;
  if (w.load.cached_blocks) {
    while (n < hashes->size() && w.load.cached_blocks->count((*hashes)[n]) != 0) ++n;
  }
  // Chained hashes: two prompts share their first k blocks exactly when their first k hashes agree.
  for (const auto& sent : w.sent_prefixes) {
    const size_t limit = std::min(sent->size(), hashes->size());
    size_t k = 0;
    while (k < limit && (*sent)[k] == (*hashes)[k]) ++k;
    n = std::max(n, k);
  }
  return static_cast<int64_t>(n) * w.load.block_size;
}

PrefillPlacement::PrefillPlacement(double queue_weight) : queue_weight_(queue_weight) {
  BATON_CHECK(queue_weight >= 0, "prefill queue weight %g < 0", queue_weight);
}

std::optional<std::string> PrefillPlacement::pick(std::span<const WorkerSnapshot> workers,
                                                  const PlacementRequest& request) const {
  // Workers of one deployment share a hash root and block size: hash the prompt once per pair.
  struct Hashed {
    uint64_t seed;
    int32_t block_size;
    std::vector<uint64_t> hashes;
  };
  std::vector<Hashed> hashed;
  const WorkerSnapshot* best = nullptr;
  double best_cost = 0;
  for (const WorkerSnapshot& w : workers) {
    if (!w.can_place()) continue;
    int64_t cached = 0;
    if (!request.tokens.empty() && w.load.prefix_cache_blocks > 0) {
      auto it = std::find_if(hashed.begin(), hashed.end(), [&](const Hashed& h) {
        return h.seed == w.load.prefix_hash_seed && h.block_size == w.load.block_size;
      });
      if (it == hashed.end()) {
        hashed.push_back(
            {w.load.prefix_hash_seed, w.load.block_size, prefix_routing_hashes(w, request.tokens, request.cache_scope)});
        it = std::prev(hashed.end());
      }
      cached = expected_cached_tokens(w, request.tokens, &it->hashes);
    }
    const double cost = queue_weight_ * static_cast<double>(w.outstanding_prompt_tokens()) +
                        static_cast<double>(request.n_prompt_tokens - cached);
    if (best == nullptr || cost < best_cost ||
        (cost == best_cost && w.outstanding_prompt_tokens() < best->outstanding_prompt_tokens())) {
      best = &w;
      best_cost = cost;
    }
  }
  if (best == nullptr) return std::nullopt;
  return best->address;
}

}  // namespace baton
