// The GGUF reader on valid files written by GgufWriter and on crafted bad ones: every bad file
// must give an error that names the problem, never a crash.
#include "model/gguf.h"

#include <catch2/catch.hpp>
#include <cstring>
#include <random>

#include "model/dequant.h"
#include "model/gguf_writer.h"
#include "model/test_model.h"

using namespace baton;

namespace {

std::vector<uint8_t> small_file() {
  GgufWriter w;
  w.add_string("general.architecture", "llama");
  w.add_u32("llama.block_count", 3);
  w.add_f32("llama.rope.freq_base", 500000.0f);
  w.add_bool("tokenizer.ggml.add_bos_token", true);
  w.add_string_array("tokenizer.ggml.tokens", {"a", "b", "<s>"});
  w.add_i32_array("tokenizer.ggml.token_type", {1, 1, 3});
  w.add_tensor_f32("t0", {32, 2}, std::vector<float>(64, 1.5f));
  w.add_tensor_f32("t1", {5}, {1, 2, 3, 4, 5});
  return w.to_bytes();
}

template <typename T>
void poke(std::vector<uint8_t>& b, size_t off, T v) {
  REQUIRE(off + sizeof(T) <= b.size());
  std::memcpy(b.data() + off, &v, sizeof(T));
}

std::string error_of(const std::vector<uint8_t>& bytes) {
  auto r = GgufFile::parse(bytes);
  REQUIRE_FALSE(r.ok());
  return r.status().message();
}

// Offset of the first byte after `needle` in the file.
size_t after(const std::vector<uint8_t>& b, const std::string& needle) {
  auto it = std::search(b.begin(), b.end(), needle.begin(), needle.end());
  REQUIRE(it != b.end());
  return static_cast<size_t>(it - b.begin()) + needle.size();
}

}  // namespace

TEST_CASE("gguf reads back what the writer wrote", "[gguf]") {
  auto r = GgufFile::parse(small_file());
  REQUIRE(r.ok());
  const GgufFile& f = **r;
  CHECK(f.version() == 3);
  CHECK(*f.get_string("general.architecture") == "llama");
  CHECK(*f.get_int("llama.block_count") == 3);
  CHECK(*f.get_float("llama.rope.freq_base") == Approx(500000.0));
  CHECK(*f.get_bool("tokenizer.ggml.add_bos_token"));
  CHECK(f.string_array("tokenizer.ggml.tokens")->at(2) == "<s>");
  CHECK(f.int_array("tokenizer.ggml.token_type")->at(2) == 3);
  CHECK(f.get_int("missing").status().code() == StatusCode::kNotFound);
  CHECK(f.get_int("general.architecture").status().code() == StatusCode::kInvalidArgument);
  const GgufTensorInfo* t1 = f.tensor("t1");
  REQUIRE(t1 != nullptr);
  CHECK(t1->n_elements == 5);
  CHECK(t1->offset % 32 == 0);
  auto v = dequantize_tensor(f, *t1);
  REQUIRE(v.ok());
  CHECK((*v)[4] == 5.0f);
}

TEST_CASE("gguf rejects every truncation of a valid file", "[gguf]") {
  const auto bytes = small_file();
  auto full = GgufFile::parse(bytes);
  REQUIRE(full.ok());
  size_t data_end = 0;  // past this only alignment padding follows, which a file may omit
  for (const auto& t : (*full)->tensors()) data_end = std::max<size_t>(data_end, t.offset + t.n_bytes);
  for (size_t n = 0; n < data_end; ++n) {
    std::vector<uint8_t> cut(bytes.begin(), bytes.begin() + n);
    auto r = GgufFile::parse(cut);
    INFO("length " << n);
    REQUIRE_FALSE(r.ok());
    CHECK_FALSE(r.status().message().empty());
  }
}

TEST_CASE("gguf names the problem in lying headers", "[gguf]") {
  const auto good = small_file();
  auto b = good;
  b[0] = 'X';
  CHECK_THAT(error_of(b), Catch::Contains("bad magic"));

  b = good;
  poke<uint32_t>(b, 4, 1);
  CHECK_THAT(error_of(b), Catch::Contains("version 1"));

  b = good;
  poke<uint64_t>(b, 16, uint64_t(1) << 40);  // metadata count
  CHECK_THAT(error_of(b), Catch::Contains("metadata keys"));

  b = good;
  poke<uint64_t>(b, 8, uint64_t(1) << 40);  // tensor count
  CHECK_THAT(error_of(b), Catch::Contains("tensors"));

  b = good;  // the first key's length
  poke<uint64_t>(b, 24, uint64_t(1) << 62);
  CHECK_THAT(error_of(b), Catch::Contains("string"));

  b = good;  // the token array's element count: far more than the file holds
  poke<uint64_t>(b, after(b, "tokenizer.ggml.tokens") + 8, uint64_t(1) << 40);
  CHECK_THAT(error_of(b), Catch::Contains("array elements"));

  b = good;  // a metadata value type that does not exist
  poke<uint32_t>(b, after(b, "general.architecture"), 77);
  CHECK_THAT(error_of(b), Catch::Contains("unknown type"));

  b = good;  // tensor t0: 0 dimensions, then 9
  const size_t t0 = after(b, "t0");
  poke<uint32_t>(b, t0, 0);
  CHECK_THAT(error_of(b), Catch::Contains("dimensions"));
  poke<uint32_t>(b, t0, 9);
  CHECK_THAT(error_of(b), Catch::Contains("dimensions"));

  b = good;  // tensor type unknown
  poke<uint32_t>(b, t0 + 4 + 16, 99);
  CHECK_THAT(error_of(b), Catch::Contains("ggml type"));

  b = good;  // a dimension that overflows the element count
  poke<uint64_t>(b, t0 + 4, uint64_t(1) << 63);
  CHECK_THAT(error_of(b), Catch::Contains("shape"));

  b = good;  // data offset misaligned, then past the end of the file
  poke<uint64_t>(b, t0 + 4 + 16 + 4, 3);
  CHECK_THAT(error_of(b), Catch::Contains("aligned"));
  poke<uint64_t>(b, t0 + 4 + 16 + 4, 1u << 20);
  CHECK_THAT(error_of(b), Catch::Contains("truncated"));

  b = good;  // rows not a multiple of the quant block
  poke<uint32_t>(b, t0 + 4 + 16, static_cast<uint32_t>(GgmlType::kQ8_0));
  poke<uint64_t>(b, t0 + 4, 33);
  CHECK_THAT(error_of(b), Catch::Contains("block size"));
}

TEST_CASE("gguf survives random corruption", "[gguf]") {
  // A short in-process fuzz (the libFuzzer target in tests/fuzz runs longer).
  std::mt19937 rng(std::random_device{}());
  const auto good = make_test_model({}).to_bytes();
  for (int i = 0; i < 3000; ++i) {
    auto b = good;
    const int flips = 1 + static_cast<int>(rng() % 8);
    for (int k = 0; k < flips; ++k) {
      // Bias corruption towards the header and metadata, where the interesting parsing is.
      const size_t span = rng() % 2 ? std::min<size_t>(b.size(), 4096) : b.size();
      b[rng() % span] = static_cast<uint8_t>(rng());
    }
    if (rng() % 4 == 0) b.resize(rng() % b.size());
    auto r = GgufFile::parse(b);
    if (r.ok()) {
      for (const auto& t : (*r)->tensors()) CHECK((*r)->tensor_data(t).size() == t.n_bytes);
    } else {
      CHECK_FALSE(r.status().message().empty());
    }
  }
}

TEST_CASE("dequantisation of ggml blocks", "[gguf]") {
  // Q8_0: d = 0.5 (fp16 0x3800), quants -3..28
  std::vector<uint8_t> q8(34);
  poke<uint16_t>(q8, 0, 0x3800);
  for (int j = 0; j < 32; ++j) q8[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(j - 3));
  std::vector<float> out(32);
  REQUIRE(dequantize(GgmlType::kQ8_0, q8, out.data(), 32).ok());
  for (int j = 0; j < 32; ++j) CHECK(out[j] == 0.5f * (j - 3));

  // Q4_1: d = 2, m = -1; element j < 16 is the low nibble of qs[j], j + 16 the high nibble.
  std::vector<uint8_t> q41(20);
  poke<uint16_t>(q41, 0, fp32_to_fp16(2.0f));
  poke<uint16_t>(q41, 2, fp32_to_fp16(-1.0f));
  for (int j = 0; j < 16; ++j) q41[4 + j] = static_cast<uint8_t>((j & 0xF) | ((15 - j) << 4));
  REQUIRE(dequantize(GgmlType::kQ4_1, q41, out.data(), 32).ok());
  for (int j = 0; j < 16; ++j) {
    CHECK(out[j] == 2.0f * j - 1.0f);
    CHECK(out[j + 16] == 2.0f * (15 - j) - 1.0f);
  }

  // Q5_0: the 5th bit of element j comes from bit j of qh.
  std::vector<uint8_t> q50(22, 0);
  poke<uint16_t>(q50, 0, fp32_to_fp16(1.0f));
  poke<uint32_t>(q50, 2, 0xFFFF0000u);  // high bit set for elements 16..31
  REQUIRE(dequantize(GgmlType::kQ5_0, q50, out.data(), 32).ok());
  CHECK(out[0] == -16.0f);
  CHECK(out[16] == 0.0f);

  // Q4_K: sub-block 1 (elements 32..63, the high nibbles of the first 32 bytes) has scale 3 and
  // minimum 2 (the low six bits of bytes 1 and 5 of the 12 scale bytes); d = 0.5, dmin = 0.25.
  std::vector<uint8_t> q4k(144, 0);
  poke<uint16_t>(q4k, 0, fp32_to_fp16(0.5f));
  poke<uint16_t>(q4k, 2, fp32_to_fp16(0.25f));
  q4k[4 + 1] = 3;
  q4k[4 + 5] = 2;
  for (int l = 0; l < 32; ++l) q4k[16 + l] = static_cast<uint8_t>((l % 16) << 4);
  std::vector<float> out256(256);
  REQUIRE(dequantize(GgmlType::kQ4_K, q4k, out256.data(), 256).ok());
  for (int l = 0; l < 32; ++l) CHECK(out256[32 + l] == 0.5f * 3 * (l % 16) - 0.25f * 2);
  CHECK(out256[0] == 0.0f);  // sub-block 0: scale and minimum 0
  // Q6_K: element e has scale sc[e / 16]; q = low nibble | two high bits << 4, minus 32.
  std::vector<uint8_t> q6k(210, 0);
  poke<uint16_t>(q6k, 208, fp32_to_fp16(0.125f));
  q6k[192 + 1] = static_cast<uint8_t>(static_cast<int8_t>(-4));  // elements 16..31
  q6k[16] = 0x05;   // element 16: low nibble 5
  q6k[128 + 16] = 0x02;  // its high bits: 2 → q = 0x25 = 37
  REQUIRE(dequantize(GgmlType::kQ6_K, q6k, out256.data(), 256).ok());
  CHECK(out256[16] == 0.125f * -4 * (37 - 32));
  CHECK(out256[17] == 0.125f * -4 * -32);

  // A type baton does not read (Q8_K: llama.cpp's intermediate, never in files) is refused by name.
  const Status q8k = dequantize(GgmlType::kQ8_K, std::vector<uint8_t>(292), out256.data(), 256);
  CHECK(q8k.code() == StatusCode::kUnimplemented);
  CHECK_THAT(q8k.message(), Catch::Contains("Q8_K"));

  for (float x : {0.0f, 1.0f, -2.5f, 65504.0f, 6.1e-5f}) CHECK(fp16_to_fp32(fp32_to_fp16(x)) == Approx(x).epsilon(1e-3));
  CHECK(fp16_to_fp32(fp32_to_fp16(3.0e-7f)) == 5 * 0x1.0p-24f);  // subnormal: nearest multiple of 2^-24
  CHECK(bf16_to_fp32(fp32_to_bf16(1.00390625f)) == 1.0f);  // ties round to even
}
