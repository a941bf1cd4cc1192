// Routing policies: given the workers of one role (WorkerRegistry::snapshot) and one request,
// which worker should take it now. Pure functions of their inputs (no clock, no locks), so the
// scheduler can swap them and tests can drive them with hand-made snapshots.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "scheduler/worker_registry.h"

namespace baton {

// KV blocks that hold n_tokens positions at block_size positions per block (block_size > 0).
int64_t blocks_for(int64_t n_tokens, int32_t block_size);

// What a policy may look at in a request.
struct PlacementRequest {
  int64_t n_prompt_tokens = 0;  // tokens to prefill
  int64_t n_total_tokens = 0;   // prompt + max new tokens: the KV positions decode must hold
};

class PlacementPolicy {
 public:
  virtual ~PlacementPolicy() = default;
  // The address of the worker in `workers` that should take `request`, or nullopt when none can
  // take it now (the request waits). Only workers with can_place() are ever chosen.
  virtual std::optional<std::string> pick(std::span<const WorkerSnapshot> workers,
                                          const PlacementRequest& request) const = 0;
};

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

// Prefill: among placeable workers, the one with the fewest outstanding prompt tokens (reported
// queue plus this frontend's unreported ones): its queue drains first, so TTFT is lowest.
// Ties: the earlier in `workers`.
class PrefillPlacement final : public PlacementPolicy {
 public:
  std::optional<std::string> pick(std::span<const WorkerSnapshot> workers,
                                  const PlacementRequest& request) const override;
};

}  // namespace baton
