#include "proto/utf8_fields.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>

#include <map>

#include "model/utf8.h"

namespace baton {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::io::CodedInputStream;
using google::protobuf::internal::WireFormatLite;

// Walks one message; sets *found and returns true at the first bad string field. Returns true
// also when the bytes are malformed (the walk stops; *found stays empty).
bool walk(const Descriptor& type, std::string_view bytes, const std::string& prefix, int depth,
          std::optional<std::string>* found) {
  if (depth > 32) return true;  // deeper than any baton message: stop looking
  CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()), static_cast<int>(bytes.size()));
  std::map<int, int> seen;  // repeated fields: how many elements so far
  while (const uint32_t tag = in.ReadTag()) {
    const FieldDescriptor* field = type.FindFieldByNumber(WireFormatLite::GetTagFieldNumber(tag));
    if (WireFormatLite::GetTagWireType(tag) != WireFormatLite::WIRETYPE_LENGTH_DELIMITED || field == nullptr) {
      if (!WireFormatLite::SkipField(&in, tag)) return true;
      continue;
    }
    uint32_t length = 0;
    std::string payload;
    if (!in.ReadVarint32(&length) || !in.ReadString(&payload, static_cast<int>(length))) return true;
    std::string name = prefix + field->name();
    if (field->is_repeated()) name += "[" + std::to_string(seen[field->number()]++) + "]";
    if (field->type() == FieldDescriptor::TYPE_STRING && utf8_invalid_offset(payload) != std::string_view::npos) {
      *found = name;
      return true;
    }
    if (field->type() == FieldDescriptor::TYPE_MESSAGE &&
        walk(*field->message_type(), payload, name + ".", depth + 1, found)) {
      return true;
    }
  }
  return !in.ConsumedEntireMessage();
}

}  // namespace

std::optional<std::string> first_non_utf8_field(const Descriptor& type, std::string_view bytes) {
  std::optional<std::string> found;
  walk(type, bytes, "", 0, &found);
  return found;
}

}  // namespace baton
