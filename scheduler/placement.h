// Routing policies: given the workers of one role (WorkerRegistry::snapshot) and one request,
// which worker should take it now. Pure functions of their inputs (no clock, no locks), so the
// scheduler can swap them and tests can drive them with hand-made snapshots.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "scheduler/worker_registry.h"

namespace baton {

// KV blocks that hold n_tokens positions at block_size positions per block (block_size > 0).
int64_t blocks_for(int64_t n_tokens, int32_t block_size);

// What a policy may look at in a request.
struct PlacementRequest {
  int64_t n_prompt_tokens = 0;  // tokens to prefill
  int64_t n_total_tokens = 0;   // prompt + max new tokens: the KV positions decode must hold
  std::span<const int32_t> tokens;  // the n_prompt_tokens tokens (empty: unknown, no prefix routing)
  std::string_view cache_scope = {};  // the tenant scope their blocks are hashed in (kv/prefix_hash.h)
};

class PlacementPolicy {
 public:
  virtual ~PlacementPolicy() = default;
  // The address of the worker in `workers` that should take `request`, or nullopt when none can
  // take it now (the request waits). Only workers with can_place() are ever chosen.
  virtual std::optional<std::string> pick(std::span<const WorkerSnapshot> workers,
                                          const PlacementRequest& request) const = 0;
};

// The worker `policy` picks for `q`, passing over those in `avoid` while another fits.
std::optional<std::string> pick_avoiding(const PlacementPolicy& policy, const std::vector<WorkerSnapshot>& workers,
                                         const std::vector<std::string>& avoid, const PlacementRequest& q);
// The worker of `workers` at `address` (null: none).
const WorkerSnapshot* find_worker(const std::vector<WorkerSnapshot>& workers, const std::string& address);

// Decode: among placeable workers whose available blocks (reported free minus this frontend's
// unreported reservations) hold blocks_for(n_total_tokens), the one with the most free KV
// positions (available blocks × block_size; "most free blocks" when block sizes agree), so load
// spreads and large requests keep a home. Ties: fewer sequences (running + unreported), then the
// earlier in `workers` (address order): stable, so tests and logs are reproducible.
class DecodePlacement final : public PlacementPolicy {
 public:
  std::optional<std::string> pick(std::span<const WorkerSnapshot> workers,
                                  const PlacementRequest& request) const override;
};

// The prompt tokens worker `w` should find in its prefix cache for `tokens`: the longest run of
// leading whole blocks whose chained hashes (kv/prefix_hash.h, from the root and block size `w`
// reported) are all among the blocks it reported cached, or that one prompt this frontend sent
// it since shares; never the block holding the last token (a prefill worker always computes it).
// 0 when `w` has no prefix cache or `tokens` is empty. `hashes`, when given, are the prompt's
// block hashes for w's root and block size (prefix_routing_hashes), computed once by the caller.
// `scope`: the request's tenant scope (SamplingParams::cache_scope).
int64_t expected_cached_tokens(const WorkerSnapshot& w, std::span<const int32_t> tokens,
                               const std::vector<uint64_t>* hashes = nullptr, std::string_view scope = {});
// The block hashes expected_cached_tokens looks up on `w`: those of the blocks a prefill worker
// may reuse (all but the one holding the last token), from w's root scoped to `scope`. Empty
// when `w` has no prefix cache.
std::vector<uint64_t> prefix_routing_hashes(const WorkerSnapshot& w, std::span<const int32_t> tokens,
                                            std::string_view scope = {});

// Prefill: among placeable workers, the one where the prompt's first token should come soonest,
// by an estimate in prompt tokens:
//   cost(w) = queue_weight × outstanding(w) + (n_prompt_tokens − expected_cached_tokens(w))
// outstanding: the tokens w still has to prefill (reported queue plus this frontend's unreported
// placements). With queue_weight = 1 (the default) both terms are prefill work ahead of the first
// token: a prompt goes to the worker that holds its prefix unless that worker's queue is longer
// than another's by more than the prefix saves, so one hot prefix spreads over the workers as its
// queue grows (and is cached on each it reaches). Larger weights favour short queues (∞: fewest
// outstanding tokens, the policy without prefix routing); 0 follows the cache alone, whatever the
// queues. Without prefix information the cost is the queue alone. Ties: fewer outstanding tokens,
// then the earlier in `workers`.
class PrefillPlacement final : public PlacementPolicy {
 public:
  explicit PrefillPlacement(double queue_weight = 1.0);  // >= 0
  std::optional<std::string> pick(std::span<const WorkerSnapshot> workers,
                                  const PlacementRequest& request) const override;

 private:
  double queue_weight_;
};

}  // namespace baton
