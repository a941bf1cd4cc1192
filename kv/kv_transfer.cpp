#include "kv/kv_transfer.h"

#include <cstring>
#include <limits>

namespace baton {

uint64_t kv_checksum(const std::string& k, const std::string& v) {
  // FNV-1a 64 over 8-byte little-endian words (then the tail bytes): one multiply per word keeps
  // it far below the cost of moving the bytes.
  uint64_t h = 1469598103934665603ull;
  for (const std::string* s : {&k, &v}) {
    const size_t n_words = s->size() / 8;
    for (size_t i = 0; i < n_words; ++i) {
      uint64_t w;
      std::memcpy(&w, s->data() + 8 * i, 8);
      h = (h ^ w) * 1099511628211ull;
    }
    for (size_t i = n_words * 8; i < s->size(); ++i) h = (h ^ static_cast<unsigned char>((*s)[i])) * 1099511628211ull;
  }
  return h;
}

int64_t kv_chunk_bytes(const KvTransferHeader& h, int32_t n_tokens) {
  // Saturating: the header's fields come off the wire, and a product that wrapped could pass the
  // size checks it is compared with.
  int64_t bytes = h.dtype == "f32" ? 4 : 2;
  for (const int64_t f : {static_cast<int64_t>(n_tokens), static_cast<int64_t>(h.n_kv_heads), static_cast<int64_t>(h.head_dim)}) {
    if (f < 0) return -1;
    if (__builtin_mul_overflow(bytes, f, &bytes)) return std::numeric_limits<int64_t>::max();
  }
  return bytes;
}

}  // namespace baton
