// The CUDA backend's memory-bound kernels (see elementwise.h). Each has a CPU twin in
// kernels/cpu/elementwise.cpp that tests/gpu/ops_test.cpp compares it with. Rows are handled by
// one block each with a grid-stride loop over columns: coalesced, and every op here moves a few
// bytes per flop, so the width of a step (tokens) gives the parallelism.
#include <cuda_bf16.h>

#include "common/check.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/elementwise.h"

namespace baton::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// Calls fn(T*) with the tensor's element type.
template <typename F>
void with_type(DType dtype, F&& fn) {
  switch (dtype) {
    case DType::kF32: fn(static_cast<float*>(nullptr)); return;
    case DType::kBF16: fn(static_cast<__nv_bfloat16*>(nullptr)); return;
    case DType::kF16: break;
  }
  BATON_CHECK(false, "CUDA elementwise kernels take f32 or bf16 tensors, not %s", dtype_name(dtype));
}

// Calls fn(Tin*, Tout*) with both tensors' element types.
template <typename F>
void with_types(DType in, DType out, F&& fn) {
  with_type(in, [&](auto* tin) { with_type(out, [&](auto* tout) { fn(tin, tout); }); });
}

unsigned grid_rows(int64_t rows) {
  BATON_CHECK(rows < (int64_t{1} << 31), "%ld rows in one launch", static_cast<long>(rows));
  return static_cast<unsigned>(rows);
}

__device__ float block_sum(float v) {
  __shared__ float partial[32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / 32) ? partial[lane] : 0.0f;
  if (warp == 0) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) partial[0] = v;
  }
  __syncthreads();
  v = partial[0];
  __syncthreads();  // partial[] is reused by the next call
  return v;
}

// Eight consecutive elements through 16-byte accesses (two for f32): the wide loads a
// memory-bound kernel needs. The caller checks alignment (vec8_ok).
__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&v)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x, v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void store8(float* p, const float (&v)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void store8(__nv_bfloat16* p, const float (&v)[8]) {
  uint4 u;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = u;
}

// True when every row of `t` starts 16-byte aligned and holds whole groups of eight.
bool vec8_ok(const Tensor& t) {
  const size_t row_bytes = static_cast<size_t>(t.ld) * dtype_size(t.dtype);
  return reinterpret_cast<uintptr_t>(t.data) % 16 == 0 && row_bytes % 16 == 0 && t.cols % 8 == 0;
}

template <typename Tin, typename Tout>
__global__ void rms_norm_vec8_kernel(const Tin* x, int64_t ld_x, const float* w, float eps, Tout* out, int64_t ld_out,
                                     int64_t cols, int64_t segs) {
  // One block per row segment: `segs` segments of `cols` per row (1 for a whole-row norm).
  const int64_t row = blockIdx.x / segs, seg = blockIdx.x % segs;
  const Tin* xr = x + row * ld_x + seg * cols;
  Tout* yr = out + row * ld_out + seg * cols;
  float ss = 0.0f;
  float v[8];
  for (int64_t i = 8 * threadIdx.x; i < cols; i += 8 * blockDim.x) {
    load8(xr + i, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) ss += v[j] * v[j];
  }
  const float inv = rsqrtf(block_sum(ss) / static_cast<float>(cols) + eps);
  float wv[8];
  for (int64_t i = 8 * threadIdx.x; i < cols; i += 8 * blockDim.x) {
    load8(xr + i, v);  // the row is still in L1/L2
    load8(w + i, wv);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = v[j] * inv * wv[j];
    store8(yr + i, v);
  }
}

template <typename Tin, typename Tout>
__global__ void silu_mul_vec8_kernel(const Tin* gu, int64_t ld_gu, Tout* out, int64_t ld_out, int64_t f) {
  const Tin* g = gu + blockIdx.x * ld_gu;
  Tout* y = out + blockIdx.x * ld_out;
  float a[8], u[8];
  for (int64_t i = 8 * threadIdx.x; i < f; i += 8 * blockDim.x) {
    load8(g + i, a);
    load8(g + f + i, u);
#pragma unroll
    for (int j = 0; j < 8; ++j) a[j] = a[j] / (1.0f + __expf(-a[j])) * u[j];
    store8(y + i, a);
  }
}

template <typename Tin, typename Tout>
__global__ void rms_norm_kernel(const Tin* x, int64_t ld_x, const float* w, float eps, Tout* out, int64_t ld_out,
                                int64_t cols, int64_t segs) {
  const int64_t row = blockIdx.x / segs, seg = blockIdx.x % segs;
  const Tin* xr = x + row * ld_x + seg * cols;
  Tout* yr = out + row * ld_out + seg * cols;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
    const float v = load(xr + i);
    ss += v * v;
  }
  const float inv = rsqrtf(block_sum(ss) / static_cast<float>(cols) + eps);
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) store(yr + i, load(xr + i) * inv * w[i]);
}

template <typename Tout>
__global__ void embed_kernel(const __nv_bfloat16* table, int64_t dim, const int32_t* ids, Tout* out, int64_t ld) {
  const __nv_bfloat16* src = table + static_cast<int64_t>(ids[blockIdx.x]) * dim;
  Tout* dst = out + blockIdx.x * ld;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) store(dst + i, __bfloat162float(src[i]));
}

// One block per token; threads over (head, pair) of q then k.
template <typename T>
__global__ void rope_kernel(T* q, int64_t ld_q, int q_heads, T* k, int64_t ld_k, int k_heads, const int32_t* positions,
                            int head_dim, int n_rot, bool neox, float freq_scale, const double* inv_freq) {
  const int half = n_rot / 2;
  const double p = static_cast<double>(positions[blockIdx.x]) * freq_scale;
  const int n_q = q_heads * half, n_all = (q_heads + k_heads) * half;
  for (int j = threadIdx.x; j < n_all; j += blockDim.x) {
    const bool is_q = j < n_q;
    const int jj = is_q ? j : j - n_q;
    const int h = jj / half, i = jj % half;
    T* v = (is_q ? q + blockIdx.x * ld_q : k + blockIdx.x * ld_k) + h * head_dim;
    double s, c;
    sincos(p * inv_freq[i], &s, &c);
    const float cs = static_cast<float>(c), sn = static_cast<float>(s);
    const int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
    const float a = load(v + i0), b = load(v + i1);
    store(v + i0, a * cs - b * sn);
    store(v + i1, a * sn + b * cs);
  }
}

template <typename Tin, typename Tout>
__global__ void silu_mul_kernel(const Tin* gu, int64_t ld_gu, Tout* out, int64_t ld_out, int64_t f) {
  const Tin* g = gu + blockIdx.x * ld_gu;
  Tout* y = out + blockIdx.x * ld_out;
  for (int64_t i = threadIdx.x; i < f; i += blockDim.x) {
    const float a = load(g + i), u = load(g + f + i);
    store(y + i, a / (1.0f + __expf(-a)) * u);
  }
}

template <typename Tin, typename Tout>
__global__ void copy_rows_kernel(const Tin* x, int64_t ld_x, const int32_t* rows, Tout* out, int64_t ld_out, int64_t cols) {
  const int64_t r = rows != nullptr ? rows[blockIdx.x] : blockIdx.x;
  const Tin* src = x + r * ld_x;
  Tout* dst = out + blockIdx.x * ld_out;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) store(dst + i, load(src + i));
}

template <typename T>
__global__ void add_bias_kernel(T* y, int64_t ld, const float* bias, int64_t cols) {
  T* row = y + blockIdx.x * ld;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) store(row + i, load(row + i) + bias[i]);
}

__device__ __forceinline__ void store_cache(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_cache(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store_cache(__half* p, float v) { *p = __float2half_rn(v); }

template <typename Tsrc, typename Tc>
__global__ void kv_write_kernel(const Tsrc* k, int64_t ld_k, const Tsrc* v, int64_t ld_v, int64_t row_elems,
                                const int32_t* positions, const int32_t* token_seq, const AttnSeq* seqs,
                                const int32_t* tables, Tc* k_cache, Tc* v_cache, int block_size) {
  const int t = blockIdx.x;
  const int32_t pos = positions[t];
  const int32_t block = tables[seqs[token_seq[t]].table0 + pos / block_size];
  const int64_t slot = static_cast<int64_t>(block) * block_size + pos % block_size;
  Tc* kd = k_cache + slot * row_elems;
  Tc* vd = v_cache + slot * row_elems;
  for (int64_t i = threadIdx.x; i < row_elems; i += blockDim.x) {
    store_cache(kd + i, load(k + t * ld_k + i));
    store_cache(vd + i, load(v + t * ld_v + i));
  }
}

// Rows are whole multiples of 16 bytes for every supported shape (head_dim * dtype size); copied
// as uint4.
__global__ void kv_copy_packed_kernel(uint4* k_cache, uint4* v_cache, int64_t row_vecs, const int32_t* table,
                                      int32_t start, int block_size, uint4* k_packed, uint4* v_packed, bool to_packed) {
  const int32_t i = blockIdx.x;
  const int32_t pos = start + i;
  const int64_t slot = static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size;
  uint4* kc = k_cache + slot * row_vecs;
  uint4* vc = v_cache + slot * row_vecs;
  uint4* kp = k_packed + static_cast<int64_t>(i) * row_vecs;
  uint4* vp = v_packed + static_cast<int64_t>(i) * row_vecs;
  for (int64_t j = threadIdx.x; j < row_vecs; j += blockDim.x) {
    if (to_packed) {
      kp[j] = kc[j];
      vp[j] = vc[j];
    } else {
      kc[j] = kp[j];
      vc[j] = vp[j];
    }
  }
}

}  // namespace

namespace {

// x's rows normalised in `segs` segments of `width` each (whole rows: one of x.cols) into out.
void rms_norm_segments(const Tensor& x, int64_t width, int64_t segs, const float* w, float eps, const Tensor& out,
                       cudaStream_t stream) {
  if (x.rows == 0) return;
  with_types(x.dtype, out.dtype, [&](auto* tin, auto* tout) {
    using Tin = std::remove_pointer_t<decltype(tin)>;
    using Tout = std::remove_pointer_t<decltype(tout)>;
    const size_t elem = dtype_size(x.dtype);
    if (vec8_ok(x) && vec8_ok(out) && (width * elem) % 16 == 0 && width % 8 == 0 &&
        reinterpret_cast<uintptr_t>(w) % 16 == 0) {
      rms_norm_vec8_kernel<<<grid_rows(x.rows * segs), kThreads, 0, stream>>>(
          static_cast<const Tin*>(x.data), x.ld, w, eps, static_cast<Tout*>(out.data), out.ld, width, segs);
    } else {
      rms_norm_kernel<<<grid_rows(x.rows * segs), kThreads, 0, stream>>>(
          static_cast<const Tin*>(x.data), x.ld, w, eps, static_cast<Tout*>(out.data), out.ld, width, segs);
    }
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace

void rms_norm(const Tensor& x, const float* w, float eps, const Tensor& out, cudaStream_t stream) {
  BATON_CHECK(out.rows == x.rows && out.cols == x.cols, "rms_norm shape mismatch");
  rms_norm_segments(x, x.cols, 1, w, eps, out, stream);
}

void head_rms_norm(const Tensor& x, int head_dim, const float* w, float eps, cudaStream_t stream) {
  BATON_CHECK(head_dim > 0 && x.cols % head_dim == 0, "head_rms_norm: %ld columns are not heads of %d",
              static_cast<long>(x.cols), head_dim);
  rms_norm_segments(x, head_dim, x.cols / head_dim, w, eps, x, stream);
}

void embed(const uint16_t* table, int64_t dim, const int32_t* ids_d, const Tensor& out, cudaStream_t stream) {
  BATON_CHECK(out.cols == dim, "embed shape mismatch");
  if (out.rows == 0) return;
  with_type(out.dtype, [&](auto* tout) {
    using Tout = std::remove_pointer_t<decltype(tout)>;
    embed_kernel<<<grid_rows(out.rows), kThreads, 0, stream>>>(reinterpret_cast<const __nv_bfloat16*>(table), dim, ids_d,
                                                               static_cast<Tout*>(out.data), out.ld);
    CUDA_CHECK_LAUNCH();
  });
}

void rope(const Tensor& q, const Tensor& k, const int32_t* positions_d, int head_dim, int n_rot, bool neox,
          float freq_scale, const double* inv_freq_d, cudaStream_t stream) {
  BATON_CHECK(q.rows == k.rows && q.dtype == k.dtype, "rope: q and k differ in rows or dtype");
  BATON_CHECK(n_rot % 2 == 0 && n_rot <= head_dim && q.cols % head_dim == 0 && k.cols % head_dim == 0,
              "rope: n_rot %d, head_dim %d", n_rot, head_dim);
  if (q.rows == 0) return;
  with_type(q.dtype, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    rope_kernel<<<grid_rows(q.rows), kThreads, 0, stream>>>(
        static_cast<T*>(q.data), q.ld, static_cast<int>(q.cols / head_dim), static_cast<T*>(k.data), k.ld,
        static_cast<int>(k.cols / head_dim), positions_d, head_dim, n_rot, neox, freq_scale, inv_freq_d);
    CUDA_CHECK_LAUNCH();
  });
}

void silu_mul(const Tensor& gate_up, const Tensor& out, cudaStream_t stream) {
  BATON_CHECK(gate_up.cols == 2 * out.cols && gate_up.rows == out.rows, "silu_mul shape mismatch");
  if (out.rows == 0) return;
  with_types(gate_up.dtype, out.dtype, [&](auto* tin, auto* tout) {
    using Tin = std::remove_pointer_t<decltype(tin)>;
    using Tout = std::remove_pointer_t<decltype(tout)>;
    // The up half starts out.cols elements in: aligned when out.cols is a multiple of eight.
    if (vec8_ok(gate_up) && vec8_ok(out)) {
      silu_mul_vec8_kernel<<<grid_rows(out.rows), kThreads, 0, stream>>>(
          static_cast<const Tin*>(gate_up.data), gate_up.ld, static_cast<Tout*>(out.data), out.ld, out.cols);
    } else {
      silu_mul_kernel<<<grid_rows(out.rows), kThreads, 0, stream>>>(static_cast<const Tin*>(gate_up.data), gate_up.ld,
                                                                    static_cast<Tout*>(out.data), out.ld, out.cols);
    }
    CUDA_CHECK_LAUNCH();
  });
}

void gather_rows(const Tensor& x, const int32_t* rows_d, const Tensor& out, cudaStream_t stream) {
  BATON_CHECK(out.cols == x.cols, "gather_rows shape mismatch");
  if (out.rows == 0) return;
  with_types(x.dtype, out.dtype, [&](auto* tin, auto* tout) {
    using Tin = std::remove_pointer_t<decltype(tin)>;
    using Tout = std::remove_pointer_t<decltype(tout)>;
    copy_rows_kernel<<<grid_rows(out.rows), kThreads, 0, stream>>>(static_cast<const Tin*>(x.data), x.ld, rows_d,
                                                                   static_cast<Tout*>(out.data), out.ld, x.cols);
    CUDA_CHECK_LAUNCH();
  });
}

void add_bias(const Tensor& y, const float* bias, cudaStream_t stream) {
  if (y.rows == 0) return;
  with_type(y.dtype, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    add_bias_kernel<<<grid_rows(y.rows), kThreads, 0, stream>>>(static_cast<T*>(y.data), y.ld, bias, y.cols);
    CUDA_CHECK_LAUNCH();
  });
}

void convert(const Tensor& src, const Tensor& dst, cudaStream_t stream) {
  BATON_CHECK(src.rows == dst.rows && src.cols == dst.cols, "convert shape mismatch");
  if (src.rows == 0) return;
  with_types(src.dtype, dst.dtype, [&](auto* tin, auto* tout) {
    using Tin = std::remove_pointer_t<decltype(tin)>;
    using Tout = std::remove_pointer_t<decltype(tout)>;
    copy_rows_kernel<<<grid_rows(src.rows), kThreads, 0, stream>>>(static_cast<const Tin*>(src.data), src.ld, nullptr,
                                                                   static_cast<Tout*>(dst.data), dst.ld, src.cols);
    CUDA_CHECK_LAUNCH();
  });
}

void kv_write(const Tensor& k, const Tensor& v, const int32_t* positions_d, const int32_t* token_seq_d,
              const AttnSeq* seqs_d, const int32_t* tables_d, void* k_cache, void* v_cache, DType cache_dtype,
              int block_size, cudaStream_t stream) {
  BATON_CHECK(k.rows == v.rows && k.cols == v.cols && k.dtype == v.dtype, "kv_write: k and v differ");
  if (k.rows == 0) return;
  with_type(k.dtype, [&](auto* tsrc) {
    using Tsrc = std::remove_pointer_t<decltype(tsrc)>;
    auto launch = [&](auto* tc) {
      using Tc = std::remove_pointer_t<decltype(tc)>;
      kv_write_kernel<<<grid_rows(k.rows), 128, 0, stream>>>(
          static_cast<const Tsrc*>(k.data), k.ld, static_cast<const Tsrc*>(v.data), v.ld, k.cols, positions_d,
          token_seq_d, seqs_d, tables_d, static_cast<Tc*>(k_cache), static_cast<Tc*>(v_cache), block_size);
      CUDA_CHECK_LAUNCH();
    };
    switch (cache_dtype) {
      case DType::kF32: launch(static_cast<float*>(nullptr)); break;
      case DType::kBF16: launch(static_cast<__nv_bfloat16*>(nullptr)); break;
      case DType::kF16: launch(static_cast<__half*>(nullptr)); break;
    }
  });
}

void kv_copy_packed(void* k_cache, void* v_cache, int64_t row_bytes, const int32_t* table_d, int32_t start, int32_t n,
                    int block_size, void* k_packed, void* v_packed, bool to_packed, cudaStream_t stream) {
  BATON_CHECK(row_bytes % 16 == 0, "KV rows of %ld bytes are not a multiple of 16", static_cast<long>(row_bytes));
  if (n == 0) return;
  kv_copy_packed_kernel<<<static_cast<unsigned>(n), 128, 0, stream>>>(
      static_cast<uint4*>(k_cache), static_cast<uint4*>(v_cache), row_bytes / 16, table_d, start, block_size,
      static_cast<uint4*>(k_packed), static_cast<uint4*>(v_packed), to_packed);
  CUDA_CHECK_LAUNCH();
}

}  // namespace baton::cuda
