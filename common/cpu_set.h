// CPU sets: which cores a thread may run on. An engine of a process that runs several (`baton
// local`: a prefill and a decode engine) owns its own cores, so that one engine's OpenMP team
// never preempts the other's (a preempted team thread stalls every barrier of the step).
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace baton {

// "0-3,6,8-9" → {0, 1, 2, 3, 6, 8, 9} (sorted, no duplicates). INVALID_ARGUMENT naming `what`
// (the flag) for a malformed list, an empty one, or a CPU this process may not run on.
Result<std::vector<int>> parse_cpu_list(std::string_view text, std::string_view what);
// {0, 1, 2, 3, 6} → "0-3,6".
std::string format_cpu_list(std::span<const int> cpus);

// The CPUs this process may run on (sched_getaffinity), ascending.
std::vector<int> allowed_cpus();

// Restricts the calling thread to `cpus` (threads it creates afterwards inherit the set).
// UNAVAILABLE when the kernel refuses (e.g. a CPU outside the container's cpuset).
Status pin_current_thread(std::span<const int> cpus);

// Lowers the calling thread's scheduling priority to niceness `nice` (0..19; Linux schedules
// threads, so this is the thread's alone). An engine whose cores also run latency-critical
// threads (gRPC, KV senders, the frontend relaying tokens) steps at a higher niceness so that
// they preempt it as soon as they wake instead of sharing the core with it. Raising one's own
// niceness needs no privilege; UNAVAILABLE when the kernel refuses anyway.
Status set_current_thread_nice(int nice);

// Splits `cpus` into two parts of sizes n_first and cpus.size() - n_first, in order.
// When cpus.size() < 2 both parts are the whole set (one core cannot be divided).
struct CpuSplit {
  std::vector<int> first, second;
};
CpuSplit split_cpus(std::span<const int> cpus, size_t n_first);

}  // namespace baton
