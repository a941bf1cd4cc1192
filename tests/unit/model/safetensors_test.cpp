// The safetensors reader on files made here: tensors of each dtype read back at their offsets and
// shapes, and every malformed header refused with a reason instead of read past or misread.
#include "model/safetensors.h"

#include <catch2/catch.hpp>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>

using namespace baton;

namespace {

// header JSON + body -> the file's bytes (8-byte little-endian header length first).
std::vector<uint8_t> file_of(const std::string& header, const std::vector<uint8_t>& body) {
  std::string text;
  for (int i = 0; i < 8; ++i) text += static_cast<char>(static_cast<uint64_t>(header.size()) >> (8 * i));
  text += header;
  text.append(body.begin(), body.end());
  return std::vector<uint8_t>(text.begin(), text.end());
}

Status parse_status(const std::string& header, const std::vector<uint8_t>& body) {
  const auto bytes = file_of(header, body);
  auto f = SafetensorsFile::parse(bytes, "test.safetensors");
  return f.ok() ? Status::ok_status() : f.status();
}

}  // namespace

TEST_CASE("safetensors: tensors of each dtype at their offsets and shapes") {
  std::mt19937 rng(std::random_device{}());
  const int rows = 1 + static_cast<int>(rng() % 5), cols = 1 + static_cast<int>(rng() % 7);
  std::vector<uint8_t> body(rows * cols * (4 + 2 + 2));
  for (auto& b : body) b = static_cast<uint8_t>(rng());
  const size_t f32 = rows * cols * 4, f16 = rows * cols * 2;
  const nlohmann::json h = {
      {"__metadata__", {{"format", "pt"}}},
      {"a", {{"dtype", "F32"}, {"shape", {rows, cols}}, {"data_offsets", {0, f32}}}},
      {"b", {{"dtype", "F16"}, {"shape", {rows, cols}}, {"data_offsets", {f32, f32 + f16}}}},
      {"c", {{"dtype", "BF16"}, {"shape", {rows * cols}}, {"data_offsets", {f32 + f16, f32 + 2 * f16}}}},
  };
  const auto bytes = file_of(h.dump(), body);
  auto f = SafetensorsFile::parse(bytes, "t");
  REQUIRE(f.ok());
  REQUIRE((*f)->tensors().size() == 3);
  const SafetensorInfo* b = (*f)->tensor("b");
  REQUIRE(b != nullptr);
  CHECK(b->type == GgmlType::kF16);
  CHECK(b->shape == std::vector<uint64_t>{static_cast<uint64_t>(rows), static_cast<uint64_t>(cols)});
  CHECK(std::memcmp(b->data.data(), body.data() + f32, f16) == 0);
  CHECK((*f)->tensor("c")->type == GgmlType::kBF16);
  CHECK((*f)->tensor("missing") == nullptr);
}

TEST_CASE("safetensors: malformed files are refused with the reason") {
  const std::vector<uint8_t> body(16);
  const auto entry = [](const char* dtype, nlohmann::json shape, uint64_t lo, uint64_t hi) {
    return nlohmann::json{{"t", {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {lo, hi}}}}}.dump();
  };
  const auto refused = [&](const std::string& header, const char* why, StatusCode code = StatusCode::kInvalidArgument) {
    const Status s = parse_status(header, body);
    CHECK(s.code() == code);
    CHECK_THAT(s.message(), Catch::Contains(why));
  };
  refused("not json", "not a JSON object");
  refused("[1, 2]", "not a JSON object");
  refused(entry("F32", {4}, 0, 20), "outside the file");  // past the end
  refused(entry("F32", {4}, 8, 4), "outside the file");   // reversed
  refused(entry("F32", {3}, 0, 16), "16 bytes for 3");    // size against the shape
  refused(entry("F32", {-1}, 0, 4), "malformed shape");
  refused(entry("I8", {16}, 0, 16), "I8", StatusCode::kUnimplemented);
  refused(entry("F8_E4M3", {16}, 0, 16), "F8_E4M3", StatusCode::kUnimplemented);
  refused(R"({"t": {"dtype": "F32"}})", "needs dtype, shape and data_offsets");
  // A header length larger than the file.
  std::vector<uint8_t> bytes = file_of("{}", body);
  bytes[0] = 0xFF;
  bytes[3] = 0x7F;
  CHECK(SafetensorsFile::parse(bytes, "t").status().code() == StatusCode::kInvalidArgument);
  CHECK(SafetensorsFile::parse(std::vector<uint8_t>(5), "t").status().code() == StatusCode::kInvalidArgument);
  CHECK(SafetensorsFile::open("/nonexistent.safetensors").status().code() == StatusCode::kNotFound);
}
