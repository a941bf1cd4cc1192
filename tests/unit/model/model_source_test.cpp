// release_mapped_pages: the loader's way to keep a file's pages out of the resident set once a
// tensor is converted. The pages go, and the bytes read back unchanged (faulted in from the file).
#include "model/model_source.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <span>
#include <vector>

#include "common/memory_limit.h"

using namespace baton;

TEST_CASE("released pages of a file mapping leave the resident set and read back unchanged") {
  std::mt19937_64 rng(std::random_device{}());
  const size_t size = size_t{96} << 20;
  std::vector<uint8_t> bytes(size);
  for (size_t i = 0; i < size; i += 8) {
    const uint64_t v = rng();
    std::memcpy(bytes.data() + i, &v, 8);
  }
  const auto path = std::filesystem::temp_directory_path() / ("baton_release_" + std::to_string(rng()) + ".bin");
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(size));
  const int fd = ::open(path.c_str(), O_RDONLY);
  REQUIRE(fd >= 0);
  void* m = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  std::filesystem::remove(path);
  REQUIRE(m != MAP_FAILED);
  const std::span<const uint8_t> mapped(static_cast<const uint8_t*>(m), size);

  uint64_t sum = 0;
  for (size_t i = 0; i < size; i += 4096) sum += mapped[i];  // fault every page in
  const int64_t touched = resident_bytes();
  // A range that starts and ends inside pages: only whole pages inside it go.
  release_mapped_pages(mapped.subspan(100, size - 200));
  const int64_t released = resident_bytes();
  INFO("resident " << touched << " -> " << released << " (checksum " << sum << ")");
  CHECK(touched - released >= static_cast<int64_t>(size) * 9 / 10);
  CHECK(std::equal(mapped.begin(), mapped.end(), bytes.begin()));
  ::munmap(m, size);
}
