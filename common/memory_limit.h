// How much memory this process may use: a container's memory limit (the cgroup's), and what the
// process holds now. A role whose KV pool lives in host memory sizes it from these, so that a
// pool the limit cannot hold is an error at start instead of an OOM kill (which says nothing).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace baton {

// The memory limit of this process's cgroup in bytes: cgroup v2 `memory.max`, else cgroup v1
// `memory/memory.limit_in_bytes`, both under `cgroup_root` (a container sees its own cgroup there).
// nullopt when there is none ("max", v1's page-rounded "unlimited", or no such file).
std::optional<int64_t> cgroup_memory_limit(const std::string& cgroup_root = "/sys/fs/cgroup");

// Bytes this process has resident now (/proc/self/statm); 0 when unreadable.
int64_t resident_bytes();

// How many blocks of `block_bytes` fit in what `limit` leaves after `resident` bytes and a
// `reserve` for everything else the process will still allocate; 0 when nothing is left.
int64_t blocks_within(int64_t limit, int64_t resident, int64_t reserve, int64_t block_bytes);

}  // namespace baton
