#include "common/memory_limit.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>

namespace baton {
namespace {

// The first word of a file, or "" when it cannot be read.
std::string first_word(const std::string& path) {
  std::ifstream in(path);
  std::string word;
  in >> word;
  return word;
}

std::optional<int64_t> parse_limit(const std::string& text) {
  if (text.empty() || text == "max") return std::nullopt;
  try {
    size_t used = 0;
    const long long v = std::stoll(text, &used);
    // cgroup v1 writes "no limit" as the largest page-aligned int64 (9223372036854771712).
    if (used != text.size() || v <= 0 || v >= (int64_t{1} << 62)) return std::nullopt;
    return v;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

}  // namespace

std::optional<int64_t> cgroup_memory_limit(const std::string& cgroup_root) {
  if (auto v2 = parse_limit(first_word(cgroup_root + "/memory.max"))) return v2;
  return parse_limit(first_word(cgroup_root + "/memory/memory.limit_in_bytes"));
}

int64_t resident_bytes() {
  std::ifstream in("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(in >> size >> resident)) return 0;
  return resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

int64_t blocks_within(int64_t limit, int64_t resident, int64_t reserve, int64_t block_bytes) {
  if (block_bytes <= 0) return 0;
  return std::max<int64_t>(0, (limit - resident - reserve) / block_bytes);
}

}  // namespace baton
