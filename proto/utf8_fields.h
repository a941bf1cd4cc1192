// Which string field of a serialized message is not UTF-8. Protobuf refuses to parse such a
// message without saying where; the frontend parses requests itself (server/generate_call.cpp) and
// uses this to name the field in its INVALID_ARGUMENT.
#pragma once

#include <google/protobuf/descriptor.h>

#include <optional>
#include <string>
#include <string_view>

namespace baton {

// The path of the first `string` field in `bytes` (a serialized `type`) whose value is not valid
// UTF-8: "prompt", "messages[1].content", "stop[0]". nullopt when every string field is valid, or
// when the bytes are malformed before such a field is reached.
std::optional<std::string> first_non_utf8_field(const google::protobuf::Descriptor& type, std::string_view bytes);

}  // namespace baton
