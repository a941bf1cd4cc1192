// How much memory this process may use: a container's memory limit (the cgroup's), and what the
// process holds now. A role whose KV pool lives in host memory sizes it from these, so that a
// pool the limit cannot hold is an error at start instead of an OOM kill (which says nothing).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "common/status.h"

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

// How much memory an operator gives a KV pool (--kv-memory): bytes ("1073741824", "512MiB",
// "1.5G"; K/M/G/T are powers of 1024, with or without "iB"/"B"), or a share of what the process
// can still use ("30%": of the memory limit or, without one, of MemAvailable, less what it holds).
struct MemoryAmount {
  int64_t bytes = 0;      // > 0 for an absolute amount
  double fraction = 0.0;  // in (0, 1] for a share
};
// Invalid input names the text and the accepted forms; 0, negative, non-finite and more than
// 100 % are errors.
Result<MemoryAmount> parse_memory_amount(const std::string& text);

// Bytes this process can still take: the memory limit less what it holds, else /proc/meminfo's
// MemAvailable (`meminfo` for tests); 0 when neither can be read.
int64_t available_memory(const std::string& cgroup_root = "/sys/fs/cgroup", const std::string& meminfo = "/proc/meminfo");

// The bytes an amount stands for, given what is available now.
int64_t memory_amount_bytes(const MemoryAmount& amount, int64_t available);

}  // namespace baton
