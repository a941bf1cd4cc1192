// The bounds on JSON that comes with a request: the HTTP body, and the JSON a request carries as
// text (a response_format schema, tool definitions, a tool call's arguments, over HTTP or gRPC).
// Checked in one pass over the text, without recursion, before anything parses it:
// - depth: nlohmann parses any depth without recursing, but its copies, dump() and ==, the schema
//   compiler and the chat template's values all recurse once per level (250,000 levels in a tool
//   call's arguments overflowed the frontend's stack);
// - members of one object: ordered_json's own parser (which keeps a schema's property order)
//   finds each new key by a linear search, O(n^2) in an object's keys (a 1 MiB body of 95,000
//   keys: seconds of CPU); request JSON is parsed by common/json_parse.h in linear time now, and
//   this bound keeps what walks an object afterwards (the schema compiler, the template) in
//   proportion.
// Both defaults are about 10x the largest of 430 real-world schemas (bench/RESULTS.md, "Schema
// budget": JSON depth 27 in a schema, 31 inside a request body; 836 properties in one object),
// and 256 levels are a few dozen KiB of stack for any of the recursive walkers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/status.h"

namespace baton {

inline constexpr int kMaxJsonDepth = 256;
inline constexpr int64_t kMaxJsonObjectMembers = 10'000;

struct JsonShape {
  int depth = 0;                // the deepest nesting of arrays and objects
  int64_t widest_object = 0;    // the most members of one object
};

// The shape of `text`, in one pass. Brackets and colons inside strings (escapes understood) do not
// count; the text need not be valid JSON (an unclosed string ends the scan). The scan stops once
// the depth passes `stop_depth` (depth is then stop_depth + 1).
JsonShape json_shape(std::string_view text, int stop_depth = kMaxJsonDepth);

// Where the JSON array or object that opens `text` ends (one past its closing bracket), or npos
// when it does not close. Brackets inside strings do not count.
size_t json_value_end(std::string_view text);

// INVALID_ARGUMENT naming `field` and the bound when `text` nests deeper than `max_depth` or has
// an object of more than `max_members` members.
Status check_json_bounds(std::string_view text, std::string_view field, int max_depth = kMaxJsonDepth,
                         int64_t max_members = kMaxJsonObjectMembers);

}  // namespace baton
