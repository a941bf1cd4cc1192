#include "kv/prefix_hash.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace baton {
namespace {

constexpr uint64_t kP1 = 0x9E3779B185EBCA87ULL;
constexpr uint64_t kP2 = 0xC2B2AE3D27D4EB4FULL;
constexpr uint64_t kP3 = 0x165667B19E3779F9ULL;
constexpr uint64_t kP4 = 0x85EBCA77C2B2AE63ULL;
constexpr uint64_t kP5 = 0x27D4EB2F165667C5ULL;

uint64_t rotl(uint64_t x, int r) {
  return (x << r) | (x >> (64 - r));
}

// Little-endian loads, whatever the host's byte order.
uint64_t read64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint32_t read32(const unsigned char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
void put64(unsigned char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
void put32(unsigned char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}

uint64_t round(uint64_t acc, uint64_t input) {
  acc += input * kP2;
  acc = rotl(acc, 31);
  return acc * kP1;
}
uint64_t merge_round(uint64_t acc, uint64_t val) {
  acc ^= round(0, val);
  return acc * kP1 + kP4;
}

}  // namespace

uint64_t xxh64(const void* data, size_t n, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  const unsigned char* const end = p + n;
  uint64_t h;
  if (n >= 32) {
    uint64_t v1 = seed + kP1 + kP2, v2 = seed + kP2, v3 = seed, v4 = seed - kP1;
    const unsigned char* const limit = end - 32;
    do {
      v1 = round(v1, read64(p));
      v2 = round(v2, read64(p + 8));
      v3 = round(v3, read64(p + 16));
      v4 = round(v4, read64(p + 24));
      p += 32;
    } while (p <= limit);
    h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
    h = merge_round(h, v1);
    h = merge_round(h, v2);
    h = merge_round(h, v3);
    h = merge_round(h, v4);
  } else {
    h = seed + kP5;
  }
  h += static_cast<uint64_t>(n);
  while (p + 8 <= end) {
    h ^= round(0, read64(p));
    h = rotl(h, 27) * kP1 + kP4;
    p += 8;
  }
  if (p + 4 <= end) {
    h ^= static_cast<uint64_t>(read32(p)) * kP1;
    h = rotl(h, 23) * kP2 + kP3;
    p += 4;
  }
  while (p < end) {
    h ^= static_cast<uint64_t>(*p) * kP5;
    h = rotl(h, 11) * kP1;
    ++p;
  }
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

uint64_t prefix_hash_seed(std::string_view model_fingerprint, std::string_view kv_dtype, int32_t block_size) {
  // Fields separated by NUL (neither name holds one), so ("ab", "c") and ("a", "bc") differ.
  std::string s = "baton prefix v1";
  s.push_back('\0');
  s.append(model_fingerprint);
  s.push_back('\0');
  s.append(kv_dtype);
  s.push_back('\0');
  unsigned char b[4];
  put32(b, static_cast<uint32_t>(block_size));
  s.append(reinterpret_cast<const char*>(b), 4);
  return xxh64(s.data(), s.size(), 0);
}

uint64_t prefix_hash_scoped_seed(uint64_t seed, std::string_view scope) {
  if (scope.empty()) return seed;
  std::string s = "baton scope v1";
  s.push_back('\0');
  s.append(scope);
  return xxh64(s.data(), s.size(), seed);
}

uint64_t prefix_block_hash(uint64_t parent, std::span<const int32_t> block_tokens) {
  // Block sizes are small (16 by default): one buffer on the stack for the common ones.
  unsigned char stack[8 + 4 * 64];
  std::vector<unsigned char> heap;
  const size_t n = 8 + 4 * block_tokens.size();
  unsigned char* buf = stack;
  if (n > sizeof(stack)) {
    heap.resize(n);
    buf = heap.data();
  }
  put64(buf, parent);
  for (size_t i = 0; i < block_tokens.size(); ++i) put32(buf + 8 + 4 * i, static_cast<uint32_t>(block_tokens[i]));
  return xxh64(buf, n, 0);
}

std::vector<uint64_t> prefix_block_hashes(uint64_t seed, int32_t block_size, std::span<const int32_t> tokens,
                                          size_t max_blocks) {
  std::vector<uint64_t> out;
  if (block_size <= 0) return out;
  const size_t n = std::min(max_blocks, tokens.size() / static_cast<size_t>(block_size));
  out.reserve(n);
  uint64_t h = seed;
  for (size_t i = 0; i < n; ++i) {
    h = prefix_block_hash(h, tokens.subspan(i * block_size, block_size));
    out.push_back(h);
  }
  return out;
}

}  // namespace baton
