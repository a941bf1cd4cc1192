#include "model/dequant.h"

#include <cstring>

namespace baton {
namespace {

inline float load_fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return fp16_to_fp32(h);
}

// Block layouts follow ggml: a 32-element block is a scale d (fp16), an optional minimum m
// (fp16), optional 5th bits qh (32 bits), and packed quants. Element j < 16 is the low nibble of
// qs[j], element j + 16 the high nibble.
void dequant_q4_0(const uint8_t* b, float* y) {
  float d = load_fp16(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>((qs[j] & 0x0F) - 8) * d;
    y[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

void dequant_q4_1(const uint8_t* b, float* y) {
  float d = load_fp16(b), m = load_fp16(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
    y[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

void dequant_q5_0(const uint8_t* b, float* y) {
  float d = load_fp16(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    int hi0 = ((qh >> j) << 4) & 0x10;
    int hi1 = (qh >> (j + 12)) & 0x10;
    y[j] = static_cast<float>(((qs[j] & 0x0F) | hi0) - 16) * d;
    y[j + 16] = static_cast<float>(((qs[j] >> 4) | hi1) - 16) * d;
  }
}

void dequant_q5_1(const uint8_t* b, float* y) {
  float d = load_fp16(b), m = load_fp16(b + 2);
  uint32_t qh;
  std::memcpy(&qh, b + 4, 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    int hi0 = ((qh >> j) << 4) & 0x10;
    int hi1 = (qh >> (j + 12)) & 0x10;
    y[j] = static_cast<float>((qs[j] & 0x0F) | hi0) * d + m;
    y[j + 16] = static_cast<float>((qs[j] >> 4) | hi1) * d + m;
  }
}

void dequant_q8_0(const uint8_t* b, float* y) {
  float d = load_fp16(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(qs[j]) * d;
}

}  // namespace

bool ggml_type_supported(GgmlType type) {
  switch (type) {
    case GgmlType::kF32: case GgmlType::kF16: case GgmlType::kBF16: case GgmlType::kQ4_0:
    case GgmlType::kQ4_1: case GgmlType::kQ5_0: case GgmlType::kQ5_1: case GgmlType::kQ8_0:
      return true;
    default:
      return false;
  }
}

Status dequantize(GgmlType type, std::span<const uint8_t> src, float* dst, int64_t n) {
  if (!ggml_type_supported(type)) {
    return unimplemented(std::string("tensor type ") + ggml_type_name(type) +
                         " is not supported (baton reads F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)");
  }
  GgmlTypeTraits t = ggml_type_traits(type);
  BATON_CHECK(n % t.block_elems == 0, "n=%ld is not a multiple of the block size", static_cast<long>(n));
  const uint64_t n_blocks = static_cast<uint64_t>(n) / t.block_elems;
  BATON_CHECK(src.size() == n_blocks * t.block_bytes, "source holds %zu bytes, expected %lu", src.size(),
              static_cast<unsigned long>(n_blocks * t.block_bytes));
  const uint8_t* s = src.data();
  switch (type) {
    case GgmlType::kF32: std::memcpy(dst, s, static_cast<size_t>(n) * 4); break;
    case GgmlType::kF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = load_fp16(s + 2 * i);
      break;
    case GgmlType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, s + 2 * i, 2);
        dst[i] = bf16_to_fp32(h);
      }
      break;
    default: {
      void (*fn)(const uint8_t*, float*) = nullptr;
      if (type == GgmlType::kQ4_0) fn = dequant_q4_0;
      if (type == GgmlType::kQ4_1) fn = dequant_q4_1;
      if (type == GgmlType::kQ5_0) fn = dequant_q5_0;
      if (type == GgmlType::kQ5_1) fn = dequant_q5_1;
      if (type == GgmlType::kQ8_0) fn = dequant_q8_0;
#pragma omp parallel for schedule(static)
      for (int64_t b = 0; b < static_cast<int64_t>(n_blocks); ++b) fn(s + b * t.block_bytes, dst + b * 32);
    }
  }
  return {};
}

Result<std::vector<float>> dequantize_tensor(const GgufFile& file, const GgufTensorInfo& info) {
  std::vector<float> out(info.n_elements);
  BATON_RETURN_IF_ERROR(dequantize(info.type, file.tensor_data(info), out.data(), static_cast<int64_t>(info.n_elements)));
  return out;
}

}  // namespace baton
