// sum16: sixteen AVX-512 vectors summed across their lanes at once, for kernels that end with
// many short dot products (decode attention's scores: 16 keys per tile).
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

namespace baton::cpu {

// [x.L0+x.L1, x.L2+x.L3, y.L0+y.L1, y.L2+y.L3] of 128-bit lanes L. A function of its own, not a
// lambda in sum16: a lambda does not take its enclosing function's target attribute, and the
// intrinsics then fail to inline in a build without -march (-DBATON_NATIVE=OFF).
__attribute__((target("avx512f,avx512dq"))) inline __m512 sum16_lanes(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Lane j of the result is the sum of v[j]'s 16 lanes: 8 + 4 + 2 + 1 vector additions and
// twice as many shuffles, about 3 instructions a sum instead of a horizontal reduction each.
__attribute__((target("avx512f,avx512dq"))) inline __m512 sum16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i) {  // [x0+x2, y0+y2, x1+x3, y1+y3] per 128-bit lane
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: partial sums of v[4i .. 4i+3]
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  return sum16_lanes(sum16_lanes(b[0], b[1]), sum16_lanes(b[2], b[3]));
}

}  // namespace baton::cpu
#endif
