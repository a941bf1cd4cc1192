// The prefix cache's block identity (DESIGN.md "Prefix cache"), shared by the prefill workers,
// which key their cached KV blocks by it, and the frontend, which hashes a prompt the same way
// to find the worker holding its prefix. Pure functions; no dependencies.
//
// Block i of a prompt (tokens [i·B, (i+1)·B), B = block size; only full blocks have one) is
//   h(i) = XXH64(le64(h(i-1)) ‖ le32(token) for each of its B tokens, seed 0)
//   h(-1) = prefix_hash_seed(model fingerprint, KV dtype, B), scoped to the tenant
//           (prefix_hash_scoped_seed) when the request has one
// so h(i) names the whole prefix [0, (i+1)·B) and everything that changes its KV: the model
// (its fingerprint covers the weights and the KV layout), the KV element type and the block
// size. Two prefixes with equal h(i) are taken to be equal only where a mistake costs nothing
// (routing); a prefill worker verifies every hit exactly (kv/prefix_cache.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace baton {

// XXH64 (the xxHash specification, 64-bit variant) of n bytes at `data`.
uint64_t xxh64(const void* data, size_t n, uint64_t seed);

// h(-1): the chain's root for one model, KV dtype name ("f32", "bf16", "f16") and block size.
uint64_t prefix_hash_seed(std::string_view model_fingerprint, std::string_view kv_dtype, int32_t block_size);

// The root for one tenant scope (SamplingParams::cache_scope, which the frontend derives from the
// API key and the request's cache_salt): blocks of different scopes never share a hash, so no
// tenant's prompt hits, or learns through cached_tokens of, another's cached prefix. The empty
// scope (no key, no salt) is `seed` itself.
uint64_t prefix_hash_scoped_seed(uint64_t seed, std::string_view scope);

// h(i) from h(i-1) and block i's tokens.
uint64_t prefix_block_hash(uint64_t parent, std::span<const int32_t> block_tokens);

// h(0) … h(n-1) for the first n = min(max_blocks, tokens.size() / block_size) full blocks.
std::vector<uint64_t> prefix_block_hashes(uint64_t seed, int32_t block_size, std::span<const int32_t> tokens,
                                          size_t max_blocks = SIZE_MAX);

}  // namespace baton
