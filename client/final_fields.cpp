#include "client/final_fields.h"

#include <google/protobuf/descriptor.h>

namespace baton::ctl {

std::optional<int64_t> cached_prompt_tokens(const google::protobuf::Message& message) {
  using google::protobuf::FieldDescriptor;
  const FieldDescriptor* f = message.GetDescriptor()->FindFieldByName(kCachedPromptTokensField);
  if (f == nullptr || f->is_repeated()) return std::nullopt;
  const google::protobuf::Reflection* r = message.GetReflection();
  if (f->has_presence() && !r->HasField(message, f)) return std::nullopt;
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32: return r->GetInt32(message, f);
    case FieldDescriptor::CPPTYPE_INT64: return r->GetInt64(message, f);
    case FieldDescriptor::CPPTYPE_UINT32: return r->GetUInt32(message, f);
    case FieldDescriptor::CPPTYPE_UINT64: return static_cast<int64_t>(r->GetUInt64(message, f));
    default: return std::nullopt;
  }
}

}  // namespace baton::ctl
