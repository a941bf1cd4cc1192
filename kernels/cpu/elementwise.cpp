// CPU elementwise ops: RMSNorm, embedding gather, RoPE, SiLU·mul, row gather. All f32, OpenMP
// over rows; inner loops are written to vectorise.
#include <cmath>
#include <cstring>
#include <vector>

#include "common/check.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/parallel.h"

namespace baton::cpu {

namespace {

// y = x / sqrt(mean(x²) + eps) * w over n values (y may be x).
inline void rms_normalise(const float* x, float* y, int64_t n, const float* w, float eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inv * w[i];
}

}  // namespace

void rms_norm(const Tensor& x, const float* w, float eps, const Tensor& out) {
  const int64_t d = x.cols;
  BATON_CHECK(out.rows == x.rows && out.cols == d, "rms_norm shape mismatch");
#pragma omp parallel for schedule(static) if (worth_parallel(x.rows * d))
  for (int64_t r = 0; r < x.rows; ++r) rms_normalise(x.f32() + r * x.ld, out.f32() + r * out.ld, d, w, eps);
}

void head_rms_norm(const Tensor& x, int head_dim, const float* w, float eps) {
  BATON_CHECK(head_dim > 0 && x.cols % head_dim == 0, "head_rms_norm: %ld columns are not heads of %d",
              static_cast<long>(x.cols), head_dim);
  const int64_t heads = x.cols / head_dim;
#pragma omp parallel for schedule(static) if (worth_parallel(x.rows * x.cols))
  for (int64_t i = 0; i < x.rows * heads; ++i) {
    float* v = x.f32() + (i / heads) * x.ld + (i % heads) * head_dim;
    rms_normalise(v, v, head_dim, w, eps);
  }
}

void embed(const float* table, int64_t dim, const int32_t* ids, int64_t n, const Tensor& out) {
  BATON_CHECK(out.rows == n && out.cols == dim, "embed shape mismatch");
#pragma omp parallel for schedule(static) if (worth_parallel(n * dim))
  for (int64_t r = 0; r < n; ++r) std::memcpy(out.f32() + r * out.ld, table + ids[r] * dim, dim * sizeof(float));
}

namespace {

// Rotates every head of row `x` (n_heads heads of head_dim) with the row's cos/sin tables.
void rope_row(float* x, int n_heads, int head_dim, int n_rot, bool neox, const float* cs, const float* sn) {
  const int half = n_rot / 2;
  for (int h = 0; h < n_heads; ++h) {
    float* v = x + h * head_dim;
    if (neox) {
#pragma omp simd
      for (int i = 0; i < half; ++i) {
        float a = v[i], b = v[i + half];
        v[i] = a * cs[i] - b * sn[i];
        v[i + half] = a * sn[i] + b * cs[i];
      }
    } else {
      for (int i = 0; i < half; ++i) {
        float a = v[2 * i], b = v[2 * i + 1];
        v[2 * i] = a * cs[i] - b * sn[i];
        v[2 * i + 1] = a * sn[i] + b * cs[i];
      }
    }
  }
}

}  // namespace

void rope(const Tensor& q, const Tensor& k, const int32_t* positions, int head_dim, const RopeConfig& rope) {
  const int n_rot = rope.n_rot > 0 ? rope.n_rot : head_dim;
  const int half = n_rot / 2;
  BATON_CHECK(n_rot % 2 == 0 && n_rot <= head_dim, "n_rot %d, head_dim %d", n_rot, head_dim);
  const std::vector<double> inv_freq = rope_inv_freq(rope, n_rot);
  const int q_heads = static_cast<int>(q.cols / head_dim), k_heads = static_cast<int>(k.cols / head_dim);
#pragma omp parallel for schedule(static) if (worth_parallel(q.rows * (q.cols + k.cols)))
  for (int64_t t = 0; t < q.rows; ++t) {
    float cs[256], sn[256];
    BATON_CHECK(half <= 256, "head_dim too large for rope");
    const double p = static_cast<double>(positions[t]) * rope.freq_scale;
    for (int i = 0; i < half; ++i) {
      double a = p * inv_freq[i];
      cs[i] = static_cast<float>(std::cos(a));
      sn[i] = static_cast<float>(std::sin(a));
    }
    rope_row(q.f32() + t * q.ld, q_heads, head_dim, n_rot, rope.neox, cs, sn);
    rope_row(k.f32() + t * k.ld, k_heads, head_dim, n_rot, rope.neox, cs, sn);
  }
}

void silu_mul(const Tensor& gate_up, const Tensor& out) {
  const int64_t f = out.cols;
  BATON_CHECK(gate_up.cols == 2 * f && gate_up.rows == out.rows, "silu_mul shape mismatch");
#pragma omp parallel for schedule(static) if (worth_parallel(out.rows * f))
  for (int64_t r = 0; r < out.rows; ++r) {
    const float* g = gate_up.f32() + r * gate_up.ld;
    const float* u = g + f;
    float* y = out.f32() + r * out.ld;
#pragma omp simd
    for (int64_t i = 0; i < f; ++i) y[i] = g[i] / (1.0f + exp_fast(-g[i])) * u[i];
  }
}

void gather_rows(const Tensor& x, const int32_t* rows, int64_t n, const Tensor& out) {
  BATON_CHECK(out.rows == n && out.cols == x.cols, "gather_rows shape mismatch");
  for (int64_t i = 0; i < n; ++i) {
    BATON_CHECK(rows[i] >= 0 && rows[i] < x.rows, "gather row %d of %ld", rows[i], static_cast<long>(x.rows));
    std::memcpy(out.f32() + i * out.ld, x.f32() + rows[i] * x.ld, x.cols * sizeof(float));
  }
}

}  // namespace baton::cpu
