#include "common/memory_limit.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <cmath>
#include <fstream>
#include <sstream>

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

Result<MemoryAmount> parse_memory_amount(const std::string& text) {
  const auto bad = [&](const std::string& why) -> Status {
    return invalid_argument("memory amount '" + text.substr(0, 64) + "': " + why +
                            " (give bytes such as 536870912, 512MiB or 1.5G, or a share such as 30%)");
  };
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    return bad("not a number");
  }
  if (!std::isfinite(v) || v <= 0) return bad("must be positive");
  std::string unit = text.substr(used);
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (unit == "%") {
    if (v > 100) return bad("a share is at most 100%");
    return MemoryAmount{0, v / 100.0};
  }
  double scale = 1;
  if (!unit.empty() && unit != "B") {
    static constexpr const char* kUnits = "KMGT";
    const char* at = std::strchr(kUnits, unit[0]);
    const std::string rest = unit.substr(1);
    if (at == nullptr || *at == '\0' || !(rest.empty() || rest == "B" || rest == "IB")) return bad("unknown unit");
    scale = std::ldexp(1.0, 10 * static_cast<int>(at - kUnits + 1));
  }
  const double bytes = v * scale;
  if (bytes < 1 || bytes >= std::ldexp(1.0, 62)) return bad("out of range");
  return MemoryAmount{static_cast<int64_t>(bytes), 0.0};
}

int64_t available_memory(const std::string& cgroup_root, const std::string& meminfo) {
  if (const std::optional<int64_t> limit = cgroup_memory_limit(cgroup_root)) {
    return std::max<int64_t>(0, *limit - resident_bytes());
  }
  std::ifstream in(meminfo);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string key;
    int64_t kib = 0;
    if (words >> key >> kib && key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

int64_t memory_amount_bytes(const MemoryAmount& amount, int64_t available) {
  if (amount.bytes > 0) return amount.bytes;
  return static_cast<int64_t>(amount.fraction * static_cast<double>(std::max<int64_t>(0, available)));
}

}  // namespace baton
