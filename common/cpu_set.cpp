#include "common/cpu_set.h"

#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <string>

namespace baton {
namespace {

Result<int> parse_cpu(std::string_view s, std::string_view what, std::string_view text) {
  int v = -1;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size() || v < 0 || v >= CPU_SETSIZE) {
    return invalid_argument(std::string(what) + " '" + std::string(text) +
                            "' is not a CPU list (expected e.g. 0-3,6: CPU ids from 0 to " +
                            std::to_string(CPU_SETSIZE - 1) + ")");
  }
  return v;
}

}  // namespace

Result<std::vector<int>> parse_cpu_list(std::string_view text, std::string_view what) {
  std::vector<int> cpus;
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t comma = std::min(text.find(',', pos), text.size());
    const std::string_view part = text.substr(pos, comma - pos);
    const size_t dash = part.find('-');
    BATON_ASSIGN_OR_RETURN(int lo, parse_cpu(part.substr(0, dash), what, text));
    int hi = lo;
    if (dash != std::string_view::npos) {
      BATON_ASSIGN_OR_RETURN(hi, parse_cpu(part.substr(dash + 1), what, text));
    }
    if (hi < lo) {
      return invalid_argument(std::string(what) + " '" + std::string(text) + "': range " + std::string(part) +
                              " ends before it starts");
    }
    for (int c = lo; c <= hi; ++c) cpus.push_back(c);
    pos = comma + 1;
  }
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  const std::vector<int> allowed = allowed_cpus();
  for (int c : cpus) {
    if (!std::binary_search(allowed.begin(), allowed.end(), c)) {
      return invalid_argument(std::string(what) + ": CPU " + std::to_string(c) +
                              " is not one this process may run on (allowed: " + format_cpu_list(allowed) + ")");
    }
  }
  return cpus;
}

std::string format_cpu_list(std::span<const int> cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(cpus[i]);
    if (j > i) out += '-' + std::to_string(cpus[j]);
    i = j + 1;
  }
  return out;
}

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

Status pin_current_thread(std::span<const int> cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  const int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  if (rc != 0) {
    return unavailable("cannot run a thread on CPUs " + format_cpu_list(cpus) + ": " + std::strerror(rc));
  }
  return {};
}

Status set_current_thread_nice(int nice) {
  const auto tid = static_cast<id_t>(syscall(SYS_gettid));
  if (setpriority(PRIO_PROCESS, tid, nice) != 0) {
    return unavailable("cannot set a thread's niceness to " + std::to_string(nice) + ": " + std::strerror(errno));
  }
  return {};
}

CpuSplit split_cpus(std::span<const int> cpus, size_t n_first) {
  CpuSplit s;
  if (cpus.size() < 2) {
    s.first.assign(cpus.begin(), cpus.end());
    s.second = s.first;
    return s;
  }
  n_first = std::clamp<size_t>(n_first, 1, cpus.size() - 1);
  s.first.assign(cpus.begin(), cpus.begin() + static_cast<std::ptrdiff_t>(n_first));
  s.second.assign(cpus.begin() + static_cast<std::ptrdiff_t>(n_first), cpus.end());
  return s;
}

}  // namespace baton
