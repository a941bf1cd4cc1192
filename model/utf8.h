// UTF-8 decoding steps, shared by the tokenizer (prompt text, streamed output) and the
// frontend's request checks.
#pragma once

#include <cstddef>
#include <string_view>

namespace baton {

// One step of UTF-8 decoding at `pos`: a valid character, an invalid sequence (its maximal
// subpart, per Unicode §3.9, so one U+FFFD replaces it) or a valid prefix cut off by the end.
struct Utf8Step {
  enum Kind { kValid, kInvalid, kIncomplete } kind;
  size_t len;
};

Utf8Step utf8_step(std::string_view s, size_t pos);

// The offset of the first byte that is not valid UTF-8 (overlong forms, surrogates and code
// points above U+10FFFF are invalid), or npos.
size_t utf8_invalid_offset(std::string_view s);

}  // namespace baton
