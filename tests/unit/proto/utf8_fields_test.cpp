// Naming the string field that is not UTF-8 (proto/utf8_fields.h), on real GenerateRequests
// with bad bytes put where a string field's value is.
#include <google/protobuf/stubs/logging.h>

#include <catch2/catch.hpp>
#include <random>

#include "baton/v1/generate.pb.h"
#include "model/utf8.h"
#include "proto/utf8_fields.h"

namespace baton {
namespace {

// `request` serialized, with the placeholder value `mark` (which it holds once) replaced by
// bytes of the same length that are not UTF-8.
std::string with_bad_bytes(const v1::GenerateRequest& request, const std::string& mark) {
  std::string bytes = request.SerializeAsString();
  const size_t at = bytes.find(mark);
  REQUIRE(at != std::string::npos);
  bytes[at] = '\xff';
  return bytes;
}

TEST_CASE("the first string field that is not UTF-8 is named", "[proto]") {
  const auto& type = *v1::GenerateRequest::descriptor();
  v1::GenerateRequest r;
  r.set_model("smollm2");
  r.set_prompt("hello");
  r.add_stop("END");
  r.add_stop("@@STOP@@");
  r.add_messages()->set_role("system");
  r.mutable_messages(0)->set_content("be brief");
  r.add_messages()->set_role("user");
  r.mutable_messages(1)->set_content("@@CONTENT@@");
  r.set_request_id("@@ID@@");
  r.set_max_tokens(16);

  CHECK_FALSE(first_non_utf8_field(type, r.SerializeAsString()).has_value());
  CHECK(first_non_utf8_field(type, with_bad_bytes(r, "@@CONTENT@@")) == "messages[1].content");
  CHECK(first_non_utf8_field(type, with_bad_bytes(r, "@@STOP@@")) == "stop[1]");
  CHECK(first_non_utf8_field(type, with_bad_bytes(r, "@@ID@@")) == "request_id");
  CHECK(first_non_utf8_field(type, with_bad_bytes(r, "hello")) == "prompt");
  // Protobuf itself refuses these bytes: the name is what the frontend adds.
  v1::GenerateRequest parsed;
  CHECK_FALSE(parsed.ParseFromString(with_bad_bytes(r, "hello")));
  // Bytes cut inside a field name nothing (and do not crash).
  const std::string bad = with_bad_bytes(r, "@@ID@@");
  CHECK_FALSE(first_non_utf8_field(type, bad.substr(0, bad.find("\xff@ID@@") + 3)).has_value());
}

TEST_CASE("random bytes: the walker agrees with protobuf's own check", "[proto]") {
  const auto& type = *v1::GenerateRequest::descriptor();
  std::random_device rd;
  const unsigned seed = rd();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  google::protobuf::LogSilencer quiet;  // protobuf logs every string it refuses
  for (int i = 0; i < 2000; ++i) {
    v1::GenerateRequest r;
    std::string prompt(rng() % 12, ' ');
    for (char& c : prompt) c = static_cast<char>(rng() % 256);
    r.set_model("m");
    r.mutable_prompt()->swap(prompt);
    const std::string bytes = r.SerializeAsString();
    const bool valid = utf8_invalid_offset(r.prompt()) == std::string_view::npos;
    v1::GenerateRequest parsed;
    CHECK(parsed.ParseFromString(bytes) == valid);
    CHECK(first_non_utf8_field(type, bytes).has_value() == !valid);
  }
}

}  // namespace
}  // namespace baton
