// client/final_fields.h: cached_prompt_tokens is read by name from whatever schema the message
// has — here message types built at run time, with and without the field, as a later
// generate.proto may declare it.
#include "client/final_fields.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/descriptor.pb.h>
#include <google/protobuf/dynamic_message.h>

#include <catch2/catch.hpp>
#include <memory>
#include <random>

namespace baton::ctl {
namespace {

using google::protobuf::FieldDescriptorProto;

// A pool holding one file with message `Timing` and, unless `type` is 0, a field
// cached_prompt_tokens of that type (proto3; `optional` when asked).
struct DynamicTiming {
  DynamicTiming(FieldDescriptorProto::Type type, bool optional, const char* name = kCachedPromptTokensField) {
    google::protobuf::FileDescriptorProto file;
    file.set_name("timing_test.proto");
    file.set_package("test");
    file.set_syntax("proto3");
    auto* m = file.add_message_type();
    m->set_name("Timing");
    auto* q = m->add_field();
    q->set_name("queue_seconds");
    q->set_number(1);
    q->set_type(FieldDescriptorProto::TYPE_DOUBLE);
    q->set_label(FieldDescriptorProto::LABEL_OPTIONAL);
    if (type != 0) {
      auto* f = m->add_field();
      f->set_name(name);
      f->set_number(8);
      f->set_type(type);
      f->set_label(FieldDescriptorProto::LABEL_OPTIONAL);
      if (optional) {
        // proto3 `optional`: a synthetic oneof holding the one field.
        f->set_proto3_optional(true);
        f->set_oneof_index(0);
        m->add_oneof_decl()->set_name(std::string("_") + name);
      }
    }
    const google::protobuf::FileDescriptor* fd = pool.BuildFile(file);
    REQUIRE(fd != nullptr);
    descriptor = fd->FindMessageTypeByName("Timing");
    message.reset(factory.GetPrototype(descriptor)->New());
  }
  void set_int(int64_t v) {
    const auto* f = descriptor->FindFieldByName(kCachedPromptTokensField);
    const auto* r = message->GetReflection();
    switch (f->cpp_type()) {
      case google::protobuf::FieldDescriptor::CPPTYPE_INT32:
        r->SetInt32(message.get(), f, static_cast<int32_t>(v));
        break;
      case google::protobuf::FieldDescriptor::CPPTYPE_INT64: r->SetInt64(message.get(), f, v); break;
      case google::protobuf::FieldDescriptor::CPPTYPE_UINT32:
        r->SetUInt32(message.get(), f, static_cast<uint32_t>(v));
        break;
      default: r->SetUInt64(message.get(), f, static_cast<uint64_t>(v));
    }
  }
  google::protobuf::DescriptorPool pool;
  google::protobuf::DynamicMessageFactory factory;
  const google::protobuf::Descriptor* descriptor = nullptr;
  std::unique_ptr<google::protobuf::Message> message;
};

TEST_CASE("cached_prompt_tokens is read when the schema has it, of any integer type") {
  std::mt19937_64 rng(std::random_device{}());
  for (auto type : {FieldDescriptorProto::TYPE_INT32, FieldDescriptorProto::TYPE_INT64,
                    FieldDescriptorProto::TYPE_UINT32, FieldDescriptorProto::TYPE_UINT64}) {
    for (bool optional : {false, true}) {
      DynamicTiming t(type, optional);
      INFO("type " << type << " optional " << optional);
      if (optional) {
        CHECK(!cached_prompt_tokens(*t.message));  // declared, not set: not reported
      } else {
        CHECK(cached_prompt_tokens(*t.message) == 0);  // proto3 scalar: 0 is a count
      }
      const int64_t v = std::uniform_int_distribution<int64_t>(1, 1 << 30)(rng);
      t.set_int(v);
      CHECK(cached_prompt_tokens(*t.message) == v);
    }
  }
}

TEST_CASE("cached_prompt_tokens is not reported without the field, or with one of another kind") {
  CHECK(!cached_prompt_tokens(*DynamicTiming(static_cast<FieldDescriptorProto::Type>(0), false).message));
  CHECK(!cached_prompt_tokens(*DynamicTiming(FieldDescriptorProto::TYPE_STRING, false).message));
  CHECK(!cached_prompt_tokens(*DynamicTiming(FieldDescriptorProto::TYPE_INT32, false, "cached_tokens").message));
}

}  // namespace
}  // namespace baton::ctl
