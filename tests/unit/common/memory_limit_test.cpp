#include "common/memory_limit.h"

#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <random>
#include <vector>

using namespace baton;
namespace fs = std::filesystem;

namespace {

// A fresh cgroup root with the given files (path relative to the root → contents).
fs::path fake_cgroup(const std::vector<std::pair<std::string, std::string>>& files) {
  static int n = 0;
  const fs::path root =
      fs::temp_directory_path() / ("baton-cgroup-" + std::to_string(getpid()) + "-" + std::to_string(n++));
  fs::remove_all(root);
  for (const auto& [path, contents] : files) {
    fs::create_directories((root / path).parent_path());
    std::ofstream(root / path) << contents;
  }
  return root;
}

}  // namespace

TEST_CASE("memory limit: cgroup v2's memory.max, else v1's limit_in_bytes, none when unlimited", "[common]") {
  std::mt19937_64 rng(std::random_device{}());
  const int64_t limit = std::uniform_int_distribution<int64_t>(1 << 20, int64_t{1} << 40)(rng);
  const std::string text = std::to_string(limit);
  CHECK(cgroup_memory_limit(fake_cgroup({{"memory.max", text + "\n"}}).string()) == limit);
  CHECK(cgroup_memory_limit(fake_cgroup({{"memory/memory.limit_in_bytes", text + "\n"}}).string()) == limit);
  // v2 wins where both are there (a hybrid hierarchy's unified mount may carry it).
  CHECK(cgroup_memory_limit(fake_cgroup({{"memory.max", text}, {"memory/memory.limit_in_bytes", "4096"}}).string()) ==
        limit);
  // Unlimited, in each version's words; a v2 "max" falls through to v1.
  CHECK_FALSE(cgroup_memory_limit(fake_cgroup({{"memory.max", "max\n"}}).string()).has_value());
  CHECK_FALSE(cgroup_memory_limit(fake_cgroup({{"memory/memory.limit_in_bytes", "9223372036854771712\n"}}).string())
                  .has_value());
  CHECK(cgroup_memory_limit(fake_cgroup({{"memory.max", "max"}, {"memory/memory.limit_in_bytes", text}}).string()) ==
        limit);
  // Nothing readable, or nonsense: no limit known.
  CHECK_FALSE(cgroup_memory_limit(fake_cgroup({}).string()).has_value());
  CHECK_FALSE(cgroup_memory_limit(fake_cgroup({{"memory.max", "12abc"}}).string()).has_value());
  CHECK_FALSE(cgroup_memory_limit(fake_cgroup({{"memory.max", "-5"}}).string()).has_value());
}

TEST_CASE("memory limit: blocks within what the limit leaves, never negative", "[common]") {
  std::mt19937_64 rng(std::random_device{}());
  for (int i = 0; i < 1000; ++i) {
    const int64_t block = std::uniform_int_distribution<int64_t>(1, 1 << 22)(rng);
    const int64_t limit = std::uniform_int_distribution<int64_t>(0, int64_t{1} << 36)(rng);
    const int64_t resident = std::uniform_int_distribution<int64_t>(0, int64_t{1} << 34)(rng);
    const int64_t reserve = std::uniform_int_distribution<int64_t>(0, int64_t{1} << 30)(rng);
    const int64_t n = blocks_within(limit, resident, reserve, block);
    const int64_t room = limit - resident - reserve;
    if (room < block) {
      CHECK(n == 0);
    } else {
      CHECK(n * block <= room);       // they fit
      CHECK((n + 1) * block > room);  // and one more would not
    }
  }
  CHECK(blocks_within(1 << 30, 0, 0, 0) == 0);
}

TEST_CASE("memory limit: this process's resident bytes grow with what it touches", "[common]") {
  const int64_t before = resident_bytes();
  REQUIRE(before > 0);
  std::vector<char> touched(64 << 20, 1);  // 64 MiB, written
  const int64_t after = resident_bytes();
  CHECK(after - before >= (48 << 20));
  CHECK(touched[touched.size() / 2] == 1);
}

TEST_CASE("KV memory amounts (--kv-memory): bytes with a unit, or a share of what is available", "[common]") {
  std::mt19937_64 rng(std::random_device{}());
  const int64_t n = std::uniform_int_distribution<int64_t>(1, 4000)(rng);
  const auto bytes = [](const std::string& text) { return parse_memory_amount(text).value().bytes; };
  CHECK(bytes(std::to_string(n)) == n);
  CHECK(bytes(std::to_string(n) + "B") == n);
  for (const char* unit : {"K", "k", "KiB", "KB"}) CHECK(bytes(std::to_string(n) + unit) == n * 1024);
  for (const char* unit : {"M", "MiB", "mb"}) CHECK(bytes(std::to_string(n) + unit) == n << 20);
  for (const char* unit : {"G", "GiB"}) CHECK(bytes(std::to_string(n) + unit) == n << 30);
  CHECK(bytes("1.5G") == (int64_t{3} << 29));
  CHECK(bytes("2T") == int64_t{2} << 40);

  const MemoryAmount share = parse_memory_amount(std::to_string(n % 100 + 1) + "%").value();
  CHECK(share.bytes == 0);
  CHECK(share.fraction == Approx((n % 100 + 1) / 100.0));
  const int64_t available = std::uniform_int_distribution<int64_t>(1 << 20, int64_t{1} << 36)(rng);
  CHECK(memory_amount_bytes(share, available) == static_cast<int64_t>(share.fraction * static_cast<double>(available)));
  CHECK(memory_amount_bytes(MemoryAmount{n, 0}, available) == n);  // bytes are bytes, whatever is free

  for (const char* bad : {"", "lots", "0", "-5M", "0%", "101%", "12Q", "1MiBs", "nan", "inf", "1e30", "%", "M"}) {
    const Result<MemoryAmount> r = parse_memory_amount(bad);
    INFO(bad);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(r.status().message(), Catch::Matchers::Contains("512MiB"));  // says what it takes
  }
}

TEST_CASE("available memory: the limit less what is resident, else MemAvailable", "[common]") {
  std::mt19937_64 rng(std::random_device{}());
  const int64_t kib = std::uniform_int_distribution<int64_t>(1, int64_t{1} << 30)(rng);
  const fs::path none = fake_cgroup({{"memory.max", "max\n"}});
  const fs::path meminfo = none / "meminfo";
  std::ofstream(meminfo) << "MemTotal:       99999999 kB\nMemFree:          12345 kB\nMemAvailable:   " << kib
                         << " kB\nBuffers:            1 kB\n";
  CHECK(available_memory(none.string(), meminfo.string()) == kib * 1024);
  CHECK(available_memory(none.string(), (none / "missing").string()) == 0);
  const int64_t limit = resident_bytes() + (int64_t{1} << 30);
  const int64_t got = available_memory(fake_cgroup({{"memory.max", std::to_string(limit)}}).string(), meminfo.string());
  CHECK(got > (int64_t{1} << 30) - (int64_t{64} << 20));  // the limit wins over MemAvailable
  CHECK(got <= int64_t{1} << 30);
}
