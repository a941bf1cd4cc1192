#include "kv/kv_transfer.h"

#include <cstring>

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
  const int64_t elem = h.dtype == "f32" ? 4 : 2;
  return static_cast<int64_t>(n_tokens) * h.n_kv_heads * h.head_dim * elem;
}

}  // namespace baton
