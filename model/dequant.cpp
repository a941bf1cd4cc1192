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

// ---- K-quants: super-blocks of 256 (ggml's block_q4_K, block_q5_K, block_q6_K) ---------------

// Sub-block j's (0..7) 6-bit scale and minimum, packed in 12 bytes: j < 4 in the low six bits of
// bytes j and j + 4; j >= 4 split between the low or high nibble of byte j + 4 and the top two
// bits of bytes j - 4 and j.
void k_scale_min(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// Q4_K (144 bytes): d, dmin (fp16), 12 bytes of scales, 128 bytes of 4-bit values. Per 64
// elements, 32 bytes: low nibbles are the first 32 (sub-block 2i), high nibbles the next 32.
// value = d·sc·q − dmin·m.
void dequant_q4_k(const uint8_t* b, float* y) {
  const float d = load_fp16(b), dmin = load_fp16(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  for (int i = 0; i < 4; ++i) {
    uint8_t sc, m;
    k_scale_min(2 * i, scales, &sc, &m);
    const float d1 = d * sc, m1 = dmin * m;
    k_scale_min(2 * i + 1, scales, &sc, &m);
    const float d2 = d * sc, m2 = dmin * m;
    for (int l = 0; l < 32; ++l) y[64 * i + l] = d1 * static_cast<float>(q[32 * i + l] & 0xF) - m1;
    for (int l = 0; l < 32; ++l) y[64 * i + 32 + l] = d2 * static_cast<float>(q[32 * i + l] >> 4) - m2;
  }
}

// Q5_K (176 bytes): as Q4_K plus a fifth bit per value in 32 bytes qh (bit 2i for the low-nibble
// half of the i-th 64, bit 2i + 1 for the high one).
void dequant_q5_k(const uint8_t* b, float* y) {
  const float d = load_fp16(b), dmin = load_fp16(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* q = b + 48;
  for (int i = 0; i < 4; ++i) {
    uint8_t sc, m;
    k_scale_min(2 * i, scales, &sc, &m);
    const float d1 = d * sc, m1 = dmin * m;
    k_scale_min(2 * i + 1, scales, &sc, &m);
    const float d2 = d * sc, m2 = dmin * m;
    const uint8_t u1 = static_cast<uint8_t>(1u << (2 * i)), u2 = static_cast<uint8_t>(2u << (2 * i));
    for (int l = 0; l < 32; ++l) {
      y[64 * i + l] = d1 * static_cast<float>((q[32 * i + l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
    }
    for (int l = 0; l < 32; ++l) {
      y[64 * i + 32 + l] = d2 * static_cast<float>((q[32 * i + l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
    }
  }
}

// Q6_K (210 bytes): 128 bytes of low nibbles ql, 64 bytes of high bit pairs qh, 16 int8 scales
// (one per 16 elements), d (fp16). value = d·sc[e / 16]·(q − 32), q in 0..63.
void dequant_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = load_fp16(b + 208);
  for (int half = 0; half < 2; ++half) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * static_cast<float>(sc[is]) * static_cast<float>(q1);
      y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
      y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
      y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

// Q2_K (84 bytes): 16 bytes of sub-block scales (low nibble: scale, high: minimum, one per 16
// elements), 64 bytes of 2-bit quants, d and dmin (fp16). Each 128 elements read 32 quant bytes
// four times, two bits further each time: value = d·(sc & 15)·q − dmin·(sc >> 4).
void dequant_q2_k(const uint8_t* b, float* y) {
  const uint8_t* scales = b;
  const uint8_t* q = b + 16;
  const float d = load_fp16(b + 80), dmin = load_fp16(b + 82);
  int is = 0;
  for (int n = 0; n < 256; n += 128, q += 32) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int half = 0; half < 2; ++half) {
        const uint8_t sc = scales[is++];
        const float dl = d * static_cast<float>(sc & 0xF), ml = dmin * static_cast<float>(sc >> 4);
        for (int l = 0; l < 16; ++l) *y++ = dl * static_cast<float>((q[16 * half + l] >> shift) & 3) - ml;
      }
    }
  }
}

// Q3_K (110 bytes): 32 bytes hmask (the third bit), 64 bytes of 2-bit quants, 12 bytes of 6-bit
// scales (16 of them, offset 32), d (fp16). value = d·(sc − 32)·(q − (high bit set ? 0 : 4)).
void dequant_q3_k(const uint8_t* b, float* y) {
  const uint8_t* hm = b;
  const uint8_t* q = b + 32;
  const float d = load_fp16(b + 108);
  // The 16 scales: low 4 bits from the first 8 bytes' nibbles, high 2 bits from the last 4.
  const uint8_t* s = b + 96;
  int8_t sc[16];
  for (int i = 0; i < 16; ++i) {
    const int low = i < 8 ? (s[i] & 0xF) : (s[i - 8] >> 4);
    const int high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    sc[i] = static_cast<int8_t>((low | (high << 4)) - 32);
  }
  int is = 0;
  uint8_t m = 1;
  for (int n = 0; n < 256; n += 128, q += 32) {
    for (int shift = 0; shift < 8; shift += 2, m = static_cast<uint8_t>(m << 1)) {
      for (int half = 0; half < 2; ++half) {
        const float dl = d * static_cast<float>(sc[is++]);
        for (int l = 0; l < 16; ++l) {
          const int k = 16 * half + l;
          const int v = ((q[k] >> shift) & 3) - ((hm[k] & m) ? 0 : 4);
          *y++ = dl * static_cast<float>(v);
        }
      }
    }
  }
}

// IQ4_NL and IQ4_XS map each 4-bit index through one non-linear table.
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// 16 bytes of indices for 32 elements (low nibbles first), each times dl.
void iq4_32(const uint8_t* qs, float dl, float* y) {
  for (int j = 0; j < 16; ++j) {
    y[j] = dl * static_cast<float>(kIq4Values[qs[j] & 0xF]);
    y[j + 16] = dl * static_cast<float>(kIq4Values[qs[j] >> 4]);
  }
}

// IQ4_NL (18 bytes per 32): d (fp16), 16 bytes of indices.
void dequant_iq4_nl(const uint8_t* b, float* y) { iq4_32(b + 2, load_fp16(b), y); }

// IQ4_XS (136 bytes per 256): d (fp16), scales_h (u16: 2 high bits per 32), scales_l (4 bytes:
// a low nibble per 32), 128 bytes of indices; sub-block scale = d·(6-bit value − 32).
void dequant_iq4_xs(const uint8_t* b, float* y) {
  const float d = load_fp16(b);
  uint16_t scales_h;
  std::memcpy(&scales_h, b + 2, 2);
  const uint8_t* scales_l = b + 4;
  const uint8_t* qs = b + 8;
  for (int ib = 0; ib < 8; ++ib) {
    const int ls = ((scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF) | (((scales_h >> (2 * ib)) & 3) << 4);
    iq4_32(qs + 16 * ib, d * static_cast<float>(ls - 32), y + 32 * ib);
  }
}

}  // namespace

bool ggml_type_supported(GgmlType type) {
  switch (type) {
    case GgmlType::kF32: case GgmlType::kF16: case GgmlType::kBF16: case GgmlType::kQ4_0:
    case GgmlType::kQ4_1: case GgmlType::kQ5_0: case GgmlType::kQ5_1: case GgmlType::kQ8_0:
    case GgmlType::kQ2_K: case GgmlType::kQ3_K: case GgmlType::kQ4_K: case GgmlType::kQ5_K:
    case GgmlType::kQ6_K: case GgmlType::kIQ4_NL: case GgmlType::kIQ4_XS:
      return true;
    default:
      return false;
  }
}

Status dequantize(GgmlType type, std::span<const uint8_t> src, float* dst, int64_t n) {
  if (!ggml_type_supported(type)) {
    return unimplemented(std::string("tensor type ") + ggml_type_name(type) +
                         " is not supported (baton reads F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, "
                         "Q5_K, Q6_K, IQ4_NL, IQ4_XS)");
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
      if (type == GgmlType::kQ4_K) fn = dequant_q4_k;
      if (type == GgmlType::kQ5_K) fn = dequant_q5_k;
      if (type == GgmlType::kQ6_K) fn = dequant_q6_k;
      if (type == GgmlType::kQ2_K) fn = dequant_q2_k;
      if (type == GgmlType::kQ3_K) fn = dequant_q3_k;
      if (type == GgmlType::kIQ4_NL) fn = dequant_iq4_nl;
      if (type == GgmlType::kIQ4_XS) fn = dequant_iq4_xs;
      const int64_t elems = t.block_elems;
#pragma omp parallel for schedule(static)
      for (int64_t b = 0; b < static_cast<int64_t>(n_blocks); ++b) fn(s + b * t.block_bytes, dst + b * elems);
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
