#include "model/utf8.h"

#include <cstdint>

namespace baton {

Utf8Step utf8_step(std::string_view s, size_t pos) {
  const auto b0 = static_cast<uint8_t>(s[pos]);
  if (b0 < 0x80) return {Utf8Step::kValid, 1};
  // Continuation bytes needed, and the range of the first of them (Unicode Table 3-7).
  const size_t need = b0 >= 0xC2 && b0 <= 0xDF ? 1 : b0 >= 0xE0 && b0 <= 0xEF ? 2 : b0 >= 0xF0 && b0 <= 0xF4 ? 3 : 0;
  if (need == 0) return {Utf8Step::kInvalid, 1};
  const uint8_t lo = b0 == 0xE0 ? 0xA0 : b0 == 0xF0 ? 0x90 : 0x80;
  const uint8_t hi = b0 == 0xED ? 0x9F : b0 == 0xF4 ? 0x8F : 0xBF;
  for (size_t k = 1; k <= need; ++k) {
    if (pos + k >= s.size()) return {Utf8Step::kIncomplete, k};
    const auto b = static_cast<uint8_t>(s[pos + k]);
    if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) return {Utf8Step::kInvalid, k};
  }
  return {Utf8Step::kValid, need + 1};
}

size_t utf8_invalid_offset(std::string_view s) {
  for (size_t pos = 0; pos < s.size();) {
    const Utf8Step step = utf8_step(s, pos);
    if (step.kind != Utf8Step::kValid) return pos;
    pos += step.len;
  }
  return std::string_view::npos;
}

}  // namespace baton
