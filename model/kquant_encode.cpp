#include "model/kquant_encode.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/half.h"

namespace baton {
namespace {

constexpr int kSuper = 256;

void put_fp16(uint8_t* p, float v) {
  const uint16_t h = fp32_to_fp16(v);
  std::memcpy(p, &h, 2);
}

float fp16_round(float v) { return fp16_to_fp32(fp32_to_fp16(v)); }

int clamp_round(float v, int lo, int hi) { return std::clamp(static_cast<int>(std::nearbyint(v)), lo, hi); }

// Q4_K / Q5_K: 8 sub-blocks of 32, value = d·sc·q − dmin·m with 6-bit sc, m and q < levels.
// Writes d, dmin and the 12 scale bytes at `b`; returns the quantised values in `q`.
void encode_scaled_min(const float* x, int levels, uint8_t* b, int* q) {
  float scale[8], min[8];
  for (int j = 0; j < 8; ++j) {
    const float* s = x + 32 * j;
    const float lo = std::min(0.0f, *std::min_element(s, s + 32));
    const float hi = std::max(0.0f, *std::max_element(s, s + 32));
    scale[j] = (hi - lo) / static_cast<float>(levels - 1);
    min[j] = -lo;
  }
  const float d = fp16_round(*std::max_element(scale, scale + 8) / 63.0f);
  const float dmin = fp16_round(*std::max_element(min, min + 8) / 63.0f);
  put_fp16(b, d);
  put_fp16(b + 2, dmin);
  uint8_t sc[8], mq[8];
  for (int j = 0; j < 8; ++j) {
    sc[j] = static_cast<uint8_t>(d > 0 ? clamp_round(scale[j] / d, 0, 63) : 0);
    mq[j] = static_cast<uint8_t>(dmin > 0 ? clamp_round(min[j] / dmin, 0, 63) : 0);
  }
  uint8_t* scales = b + 4;
  std::memset(scales, 0, 12);
  for (int j = 0; j < 4; ++j) {
    scales[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
    scales[j + 4] = static_cast<uint8_t>(mq[j] | ((mq[j + 4] >> 4) << 6));
    scales[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0xF) | ((mq[j + 4] & 0xF) << 4));
  }
  for (int j = 0; j < 8; ++j) {
    const float ds = d * sc[j], dm = dmin * mq[j];
    for (int l = 0; l < 32; ++l) q[32 * j + l] = ds > 0 ? clamp_round((x[32 * j + l] + dm) / ds, 0, levels - 1) : 0;
  }
}

void encode_q4_k(const float* x, uint8_t* b) {
  int q[kSuper];
  encode_scaled_min(x, 16, b, q);
  uint8_t* qs = b + 16;
  for (int i = 0; i < 4; ++i) {
    for (int l = 0; l < 32; ++l) qs[32 * i + l] = static_cast<uint8_t>(q[64 * i + l] | (q[64 * i + 32 + l] << 4));
  }
}

void encode_q5_k(const float* x, uint8_t* b) {
  int q[kSuper];
  encode_scaled_min(x, 32, b, q);
  uint8_t* qh = b + 16;
  uint8_t* qs = b + 48;
  std::memset(qh, 0, 32);
  for (int i = 0; i < 4; ++i) {
    for (int l = 0; l < 32; ++l) {
      const int lo = q[64 * i + l], hi = q[64 * i + 32 + l];
      qs[32 * i + l] = static_cast<uint8_t>((lo & 0xF) | ((hi & 0xF) << 4));
      if (lo & 16) qh[l] |= static_cast<uint8_t>(1u << (2 * i));
      if (hi & 16) qh[l] |= static_cast<uint8_t>(2u << (2 * i));
    }
  }
}

// Q6_K: 16 sub-blocks of 16, value = d·sc·(q − 32), int8 sc, q in 0..63.
void encode_q6_k(const float* x, uint8_t* b) {
  float scale[16];
  for (int j = 0; j < 16; ++j) {
    float amax = 0, v = 0;
    for (int l = 0; l < 16; ++l) {
      if (std::fabs(x[16 * j + l]) > amax) {
        amax = std::fabs(x[16 * j + l]);
        v = x[16 * j + l];
      }
    }
    scale[j] = v / -32.0f;  // the largest magnitude maps to q − 32 = −32, as ggml does
  }
  float smax = 0;
  for (float s : scale) smax = std::max(smax, std::fabs(s));
  const float d = fp16_round(smax / 127.0f);
  int8_t sc[16];
  int q[kSuper];
  for (int j = 0; j < 16; ++j) {
    sc[j] = static_cast<int8_t>(d > 0 ? clamp_round(scale[j] / d, -127, 127) : 0);
    const float ds = d * sc[j];
    for (int l = 0; l < 16; ++l) q[16 * j + l] = ds != 0 ? clamp_round(x[16 * j + l] / ds, -32, 31) + 32 : 32;
  }
  uint8_t* ql = b;
  uint8_t* qh = b + 128;
  std::memcpy(b + 192, sc, 16);
  put_fp16(b + 208, d);
  for (int half = 0; half < 2; ++half) {
    const int* qq = q + 128 * half;
    for (int l = 0; l < 32; ++l) {
      ql[l] = static_cast<uint8_t>((qq[l] & 0xF) | ((qq[l + 64] & 0xF) << 4));
      ql[l + 32] = static_cast<uint8_t>((qq[l + 32] & 0xF) | ((qq[l + 96] & 0xF) << 4));
      qh[l] = static_cast<uint8_t>((qq[l] >> 4) | ((qq[l + 32] >> 4) << 2) | ((qq[l + 64] >> 4) << 4) |
                                   ((qq[l + 96] >> 4) << 6));
    }
    ql += 64;
    qh += 32;
  }
}

}  // namespace

Result<std::vector<uint8_t>> encode_kquant(GgmlType type, std::span<const float> x) {
  if (x.size() % kSuper != 0) {
    return invalid_argument("K-quant blocks hold 256 values; " + std::to_string(x.size()) + " is not a multiple");
  }
  void (*encode)(const float*, uint8_t*) = nullptr;
  if (type == GgmlType::kQ4_K) encode = encode_q4_k;
  if (type == GgmlType::kQ5_K) encode = encode_q5_k;
  if (type == GgmlType::kQ6_K) encode = encode_q6_k;
  if (encode == nullptr) return invalid_argument(std::string("no K-quant encoder for ") + ggml_type_name(type));
  const size_t block_bytes = ggml_type_traits(type).block_bytes;
  std::vector<uint8_t> out(x.size() / kSuper * block_bytes);
  for (size_t i = 0; i < x.size() / kSuper; ++i) encode(x.data() + i * kSuper, out.data() + i * block_bytes);
  return out;
}

}  // namespace baton
