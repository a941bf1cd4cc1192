#include "kernels/cpu/cpu_backend.h"

#include <omp.h>
#include <sys/mman.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "common/check.h"
#include "common/cpu_set.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/half.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/quant_gemm.h"

namespace baton {
namespace {

// Flush denormals to zero (FTZ) and read them as zero (DAZ), on every OpenMP thread. An operation
// that produces or consumes a denormal takes a microcode assist (~100 cycles); vectorised
// kernels compute both sides of a select, so one such lane slows every element (measured: SiLU
// went from 3.7 to 0.35 ns per element). Values below 1.2e-38 do not matter for inference.
void flush_denormals_on_this_thread() {
#if defined(__x86_64__)
  _mm_setcsr(_mm_getcsr() | 0x8040);  // FTZ (bit 15) | DAZ (bit 6)
#endif
}

using dt = dnnl::memory::data_type;
using tag = dnnl::memory::format_tag;

// A cached matmul primitive is specific to M and the strides; a serving process sees a bounded
// set of step sizes, but to be safe the cache is dropped whole when it grows past this.
constexpr size_t kMaxCachedPrimitives = 64;

void f32_to_bf16_rows(const Tensor& x, uint16_t* out) {
  const int64_t k = x.cols;
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(x.rows * k))
  for (int64_t r = 0; r < x.rows; ++r) {
    const uint32_t* src = reinterpret_cast<const uint32_t*>(x.f32() + r * x.ld);
    uint16_t* dst = out + r * k;
#pragma omp simd
    for (int64_t c = 0; c < k; ++c) {
      uint32_t v = src[c];  // round to nearest even; activations are finite
      dst[c] = static_cast<uint16_t>((v + 0x7FFFu + ((v >> 16) & 1u)) >> 16);
    }
  }
}

class CpuVector final : public Matrix {
 public:
  CpuVector(const float* host, int64_t rows, int64_t cols)
      : Matrix(rows, cols), data(host, host + rows * cols) {}
  std::vector<float> data;
};

// An embedding table held in bf16 under bf16 compute: half the bytes of f32 (a 128K-token
// vocabulary at width 2048 is 1 GiB in f32); a gathered row widens to f32 exactly.
class CpuBf16Table final : public Matrix {
 public:
  CpuBf16Table(const float* host, int64_t rows, int64_t cols)
      : Matrix(rows, cols), data(static_cast<size_t>(rows * cols)) {
    for (size_t i = 0; i < data.size(); ++i) data[i] = fp32_to_bf16(host[i]);
  }
  std::vector<uint16_t> data;
};

// A gemm weight [N, K] packed by oneDNN into the layout its matmul prefers for the dtype.
class CpuGemmMatrix final : public Matrix {
 public:
  CpuGemmMatrix(int64_t rows, int64_t cols) : Matrix(rows, cols) {}
  dt dtype = dt::f32;
  dnnl::memory weights;  // packed
  dnnl::memory::desc weights_desc;
  std::mutex mu;
  // (M, ld of x, ld of y, accumulate, bias) -> primitive
  std::map<std::tuple<int64_t, int64_t, int64_t, bool, bool>, dnnl::matmul> primitives;
};

// A gemm weight in the model file's quantised blocks, repacked (kernels/cpu/quant_gemm.h): one
// QuantWeights per stacked part, its outputs the next columns of y.
class CpuQuantMatrix final : public Matrix {
 public:
  CpuQuantMatrix(std::vector<cpu::QuantWeights> w, int64_t rows, int64_t cols)
      : Matrix(rows, cols), parts(std::move(w)) {}
  std::vector<cpu::QuantWeights> parts;
  std::unique_ptr<Matrix> dense;  // for steps of more than kNativeMaxRows rows; may be null
};

class CpuKvCache final : public KvCache {
 public:
  explicit CpuKvCache(const KvCacheConfig& c) : KvCache(c) {
    layer_elems = static_cast<size_t>(c.n_blocks) * c.block_size * c.n_kv_heads * c.head_dim;
    bytes = 2 * layer_elems * dtype_size(c.dtype) * static_cast<size_t>(c.n_layers);
    // Anonymous pages: zero, and resident only once a block is written (the pool hands out the
    // lowest free blocks first), so the process holds the KV it uses, not the pool's bound.
    void* p = mmap(nullptr, std::max<size_t>(bytes, 1), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    BATON_CHECK(p != MAP_FAILED, "cannot map %zu bytes of KV cache", bytes);
    memory = static_cast<char*>(p);
  }
  ~CpuKvCache() override { munmap(memory, std::max<size_t>(bytes, 1)); }
  CpuKvCache(const CpuKvCache&) = delete;
  CpuKvCache& operator=(const CpuKvCache&) = delete;
  cpu::KvLayerView layer(int l) const {
    const KvCacheConfig& c = config();
    char* base = memory + 2 * layer_elems * dtype_size(c.dtype) * static_cast<size_t>(l);
    return {base, base + layer_elems * dtype_size(c.dtype), c.dtype, c.block_size, c.n_kv_heads, c.head_dim};
  }
  char* memory = nullptr;
  size_t bytes = 0;
  size_t layer_elems = 0;
};

class CpuBackend final : public Backend {
 public:
  CpuBackend(DType dtype, int n_threads, std::vector<int> cpus, int nice, DType kv_default = DType::kF32,
             std::string dtype_reason = "")
      : dtype_(dtype),
        kv_default_(dtype == DType::kBF16 ? DType::kBF16 : kv_default),
        dtype_reason_(std::move(dtype_reason)),
        n_threads_(n_threads),
        cpus_(std::move(cpus)),
        nice_(nice),
        engine_(dnnl::engine::kind::cpu, 0),
        stream_(engine_) {}

  // The step thread and its OpenMP team run on cpus_ (each team thread may use any of them; with
  // as many threads as cores and nothing else there, none migrates), n_threads_ of them.
  Status bind_thread() override {
    if (!cpus_.empty()) BATON_RETURN_IF_ERROR(pin_current_thread(cpus_));
    if (nice_ > 0) BATON_RETURN_IF_ERROR(set_current_thread_nice(nice_));
    const int n = n_threads_ > 0 ? n_threads_ : cpus_.empty() ? 0 : static_cast<int>(cpus_.size());
    if (n == 0 && nice_ == 0) return {};
    if (n > 0) omp_set_num_threads(n);
    // The team is made on this thread's first parallel region; make it now, on these cores and
    // at this niceness, with denormals flushed as on every other team of the process.
    bool pinned = true, niced = true;
#pragma omp parallel num_threads(n > 0 ? n : omp_get_max_threads()) reduction(&& : pinned, niced)
    {
      if (!cpus_.empty()) pinned = pin_current_thread(cpus_).ok();
      if (nice_ > 0) niced = set_current_thread_nice(nice_).ok();
      flush_denormals_on_this_thread();
    }
    if (!pinned) return unavailable("cannot run the engine's OpenMP threads on CPUs " + format_cpu_list(cpus_));
    if (!niced) return unavailable("cannot run the engine's OpenMP threads at niceness " + std::to_string(nice_));
    return {};
  }

  std::string name() const override { return std::string("cpu (oneDNN, ") + dtype_name(dtype_) + " gemm)"; }
  bool host_memory() const override { return true; }
  DType compute_dtype() const override { return dtype_; }
  DType default_kv_dtype() const override { return kv_default_; }
  std::string dtype_reason() const override { return dtype_reason_; }
  bool synchronous() const override { return true; }

  Buffer alloc(size_t bytes) override {
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    BATON_CHECK(p != nullptr, "cannot allocate %zu bytes", bytes);
    return Buffer(p, [](void* q) { std::free(q); });
  }
  void upload(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void download(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void download_f32(const Tensor& t, float* host) override {
    BATON_CHECK(t.dtype == DType::kF32, "download_f32 of a %s tensor", dtype_name(t.dtype));
    for (int64_t r = 0; r < t.rows; ++r) std::memcpy(host + r * t.cols, t.f32() + r * t.ld, t.cols * sizeof(float));
  }
  void synchronize() override {}

  std::unique_ptr<Matrix> make_matrix(const float* host, int64_t rows, int64_t cols, MatrixUse use) override {
    if (use == MatrixUse::kTable && dtype_ == DType::kBF16) return std::make_unique<CpuBf16Table>(host, rows, cols);
    if (use != MatrixUse::kGemm) return std::make_unique<CpuVector>(host, rows, cols);
    auto m = std::make_unique<CpuGemmMatrix>(rows, cols);
    m->dtype = dtype_ == DType::kBF16 ? dt::bf16 : dt::f32;
    // Logical weights are [K, N]; the host rows are [N][K], i.e. format `ba`.
    dnnl::memory::desc plain_f32({cols, rows}, dt::f32, tag::ba);
    dnnl::memory plain(plain_f32, engine_, const_cast<float*>(host));
    // Let matmul choose the packed layout (for AMX/avx512 brgemm); it accepts that layout for every M.
    dnnl::memory::desc src({256, cols}, m->dtype, tag::ab), dst({256, rows}, dt::f32, tag::ab);
    dnnl::memory::desc any({cols, rows}, m->dtype, tag::any);
    auto pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, any, dst), engine_);
    m->weights_desc = pd.weights_desc();
    m->weights = dnnl::memory(m->weights_desc, engine_);
    dnnl::reorder(plain, m->weights).execute(stream_, plain, m->weights);
    stream_.wait();
    return m;
  }

  std::unique_ptr<Matrix> make_quantized_matrix(std::span<const QuantizedPart> parts, int64_t cols,
                                                const float* dense) override {
    // Consecutive parts of one type become one repacked weight: each part is a quant_gemm call
    // (an OpenMP region and the activations quantised again), which a decode step pays per layer.
    std::vector<cpu::QuantWeights> repacked;
    int64_t rows = 0;
    for (size_t i = 0; i < parts.size();) {
      size_t j = i;
      int64_t run_rows = 0;
      std::vector<uint8_t> run;
      for (; j < parts.size() && parts[j].ggml_type == parts[i].ggml_type; ++j) {
        run.insert(run.end(), parts[j].blocks.begin(), parts[j].blocks.end());
        run_rows += parts[j].rows;
      }
      if (!cpu::quant_type_supported(parts[i].ggml_type)) return nullptr;
      auto w = cpu::repack_quant(parts[i].ggml_type, run, run_rows, cols);
      if (!w.ok()) return nullptr;
      repacked.push_back(std::move(*w));
      rows += run_rows;
      i = j;
    }
    if (repacked.empty()) return nullptr;
    // BF16 weights under bf16 compute keep no dense copy for long prompts: the native kernel
    // computes the same products (bf16 × bf16, f32 sums) as the dense GEMM, at 0.9× its prefill
    // speed on the 1B model (bench/RESULTS.md), in half the memory of two copies.
    const bool all_bf16 = std::all_of(repacked.begin(), repacked.end(),
                                      [](const cpu::QuantWeights& w) { return w.kind == cpu::QuantKind::kBF16; });
    auto m = std::make_unique<CpuQuantMatrix>(std::move(repacked), rows, cols);
    if (dense != nullptr && !(all_bf16 && compute_dtype() == DType::kBF16)) {
      m->dense = make_matrix(dense, rows, cols, MatrixUse::kGemm);
    }
    return m;
  }
  bool native_weights_fast() const override { return cpu::quant_gemm_fast(); }

  std::unique_ptr<KvCache> make_kv_cache(const KvCacheConfig& config) override {
    return std::make_unique<CpuKvCache>(config);
  }

  void gemm(const Tensor& x, const Matrix& w_base, const Matrix* bias, const Tensor& y, bool accumulate) override {
    if (const auto* q = dynamic_cast<const CpuQuantMatrix*>(&w_base)) {
      if (q->dense && x.rows > kNativeMaxRows) {
        gemm(x, *q->dense, bias, y, accumulate);
        return;
      }
      const float* b = bias ? static_cast<const CpuVector*>(bias)->data.data() : nullptr;
      int64_t col = 0;
      for (const cpu::QuantWeights& part : q->parts) {
        cpu::quant_gemm(x, part, b ? b + col : nullptr, y.col_slice(col, part.n), accumulate);
        col += part.n;
      }
      return;
    }
    auto& w = const_cast<CpuGemmMatrix&>(dynamic_cast<const CpuGemmMatrix&>(w_base));
    const int64_t m = x.rows, k = x.cols, n = w.rows();
    BATON_CHECK(k == w.cols() && y.rows == m && y.cols == n, "gemm shapes: x [%ld, %ld], w [%ld, %ld], y [%ld, %ld]",
                static_cast<long>(m), static_cast<long>(k), static_cast<long>(w.rows()), static_cast<long>(w.cols()),
                static_cast<long>(y.rows), static_cast<long>(y.cols));
    if (m == 0) return;
    void* src_ptr = x.data;
    int64_t src_ld = x.ld;
    if (w.dtype == dt::bf16) {
      if (bf16_scratch_.size() < static_cast<size_t>(m * k)) bf16_scratch_.resize(static_cast<size_t>(m * k));
      f32_to_bf16_rows(x, bf16_scratch_.data());
      src_ptr = bf16_scratch_.data();
      src_ld = k;
    }
    dnnl::memory::desc src_md({m, k}, w.dtype, {src_ld, 1});
    dnnl::memory::desc dst_md({m, n}, dt::f32, {y.ld, 1});
    dnnl::memory::desc bias_md({1, n}, dt::f32, tag::ab);
    dnnl::matmul prim;
    {
      std::lock_guard<std::mutex> lock(w.mu);
      auto key = std::make_tuple(m, src_ld, y.ld, accumulate, bias != nullptr);
      auto it = w.primitives.find(key);
      if (it == w.primitives.end()) {
        if (w.primitives.size() >= kMaxCachedPrimitives) w.primitives.clear();
        dnnl::primitive_attr attr;
        if (accumulate) {
          dnnl::post_ops po;
          po.append_sum(1.0f);
          attr.set_post_ops(po);
        }
        auto desc = bias != nullptr ? dnnl::matmul::desc(src_md, w.weights_desc, bias_md, dst_md)
                                    : dnnl::matmul::desc(src_md, w.weights_desc, dst_md);
        it = w.primitives.emplace(key, dnnl::matmul(dnnl::matmul::primitive_desc(desc, attr, engine_))).first;
      }
      prim = it->second;
    }
    std::unordered_map<int, dnnl::memory> args = {
        {DNNL_ARG_SRC, dnnl::memory(src_md, engine_, src_ptr)},
        {DNNL_ARG_WEIGHTS, w.weights},
        {DNNL_ARG_DST, dnnl::memory(dst_md, engine_, y.data)},
    };
    if (bias != nullptr) {
      auto& b = dynamic_cast<const CpuVector&>(*bias);
      BATON_CHECK(b.rows() * b.cols() == n, "bias of %ld elements for %ld outputs", static_cast<long>(b.rows() * b.cols()),
                  static_cast<long>(n));
      args.emplace(DNNL_ARG_BIAS, dnnl::memory(bias_md, engine_, const_cast<float*>(b.data.data())));
    }
    prim.execute(stream_, args);
    stream_.wait();
  }

  void rms_norm(const Tensor& x, const Matrix& w, float eps, const Tensor& out) override {
    cpu::rms_norm(x, vec(w), eps, out);
  }
  void head_rms_norm(const Tensor& x, int head_dim, const Matrix& w, float eps) override {
    cpu::head_rms_norm(x, head_dim, vec(w), eps);
  }
  bool embeds_from(const Matrix& m) const override {
    const auto* q = dynamic_cast<const CpuQuantMatrix*>(&m);
    return q != nullptr && q->parts.size() == 1;
  }
  void embed(const Matrix& table, const int32_t* ids, int64_t n, const Tensor& out) override {
    if (const auto* q = dynamic_cast<const CpuQuantMatrix*>(&table)) {
      BATON_CHECK(q->parts.size() == 1 && out.rows == n && out.cols == table.cols(), "embed shape mismatch");
      for (int64_t r = 0; r < n; ++r) cpu::dequantize_row(q->parts[0], ids[r], out.f32() + r * out.ld);
      return;
    }
    if (const auto* t = dynamic_cast<const CpuBf16Table*>(&table)) {
      const int64_t dim = table.cols();
      BATON_CHECK(out.rows == n && out.cols == dim, "embed shape mismatch");
      for (int64_t r = 0; r < n; ++r) {
        const uint16_t* row = t->data.data() + static_cast<size_t>(ids[r]) * static_cast<size_t>(dim);
        float* dst = out.f32() + r * out.ld;
        for (int64_t c = 0; c < dim; ++c) dst[c] = bf16_to_fp32(row[c]);
      }
      return;
    }
    cpu::embed(vec(table), table.cols(), ids, n, out);
  }
  void rope(const Tensor& q, const Tensor& k, const int32_t* positions, int head_dim, const RopeConfig& r) override {
    cpu::rope(q, k, positions, head_dim, r);
  }
  void silu_mul(const Tensor& gate_up, const Tensor& out) override { cpu::silu_mul(gate_up, out); }
  void gather_rows(const Tensor& x, const int32_t* rows, int64_t n, const Tensor& out) override {
    cpu::gather_rows(x, rows, n, out);
  }
  void kv_write(KvCache& cache, int layer, const Tensor& k, const Tensor& v, const BatchView& batch) override {
    cpu::kv_write(static_cast<CpuKvCache&>(cache).layer(layer), k, v, batch);
  }
  void kv_export(const KvCache& cache, int layer, const int32_t* block_table, int32_t start, int32_t n, void* k_host,
                 void* v_host) override {
    kv_copy(static_cast<const CpuKvCache&>(cache).layer(layer), block_table, start, n, k_host, v_host, /*to_host=*/true);
  }
  void kv_import(KvCache& cache, int layer, const int32_t* block_table, int32_t start, int32_t n, const void* k_host,
                 const void* v_host) override {
    kv_copy(static_cast<CpuKvCache&>(cache).layer(layer), block_table, start, n, const_cast<void*>(k_host),
            const_cast<void*>(v_host), /*to_host=*/false);
  }
  void attention(const Tensor& q, const KvCache& cache, int layer, const BatchView& batch, int n_head, float scale,
                 const Tensor& out) override {
    cpu::attention(q, static_cast<const CpuKvCache&>(cache).layer(layer), batch, n_head, scale, dtype_, attention_scratch_, out);
  }

 private:
  // One position's K (or V) row is contiguous in a block: [n_kv_heads, head_dim].
  static void kv_copy(const cpu::KvLayerView& kv, const int32_t* block_table, int32_t start, int32_t n, void* k_host,
                      void* v_host, bool to_host) {
    const size_t row = static_cast<size_t>(kv.n_kv_heads) * kv.head_dim * dtype_size(kv.dtype);
    for (int32_t i = 0; i < n; ++i) {
      const int32_t pos = start + i;
      const size_t off = (static_cast<size_t>(block_table[pos / kv.block_size]) * kv.block_size + pos % kv.block_size) * row;
      char* kc = static_cast<char*>(kv.k) + off;
      char* vc = static_cast<char*>(kv.v) + off;
      char* kh = static_cast<char*>(k_host) + i * row;
      char* vh = static_cast<char*>(v_host) + i * row;
      if (to_host) {
        std::memcpy(kh, kc, row);
        std::memcpy(vh, vc, row);
      } else {
        std::memcpy(kc, kh, row);
        std::memcpy(vc, vh, row);
      }
    }
  }

  static const float* vec(const Matrix& m) { return dynamic_cast<const CpuVector&>(m).data.data(); }

  DType dtype_;
  DType kv_default_;          // bf16 under bf16 compute, and under a measured f32 one on a bf16 CPU
  std::string dtype_reason_;  // the measurement behind dtype_, when it was measured
  int n_threads_;          // 0: the process default (or one per core of cpus_)
  std::vector<int> cpus_;  // empty: not pinned
  int nice_;               // the step threads' niceness (0: left as it is)
  dnnl::engine engine_;
  dnnl::stream stream_;
  std::vector<uint16_t> bf16_scratch_;
  cpu::AttentionScratch attention_scratch_;
};

}  // namespace

bool cpu_has_bf16() { return __builtin_cpu_supports("avx512bf16"); }

namespace {

void flush_denormals_on_all_threads() {
#pragma omp parallel
  flush_denormals_on_this_thread();
}

// The --dtype auto probe: a prefill step's shape (a 256-token chunk through a 1024 -> 2816
// projection), ~1.5 GFLOP a run, so the probe costs well under a second even at 20 GFLOP/s.
constexpr int64_t kProbeRows = 256, kProbeCols = 1024, kProbeOutputs = 2816;

// The best of five timed runs (after one warm-up) of a `dtype` backend's gemm, in GFLOP/s.
double measure_gemm_gflops(DType dtype, const BackendOptions& options) {
  CpuBackend b(dtype, options.n_threads, options.cpus, options.nice);
  std::vector<float> w(static_cast<size_t>(kProbeOutputs * kProbeCols));
  std::vector<float> x(static_cast<size_t>(kProbeRows * kProbeCols));
  uint32_t state = 12345;  // any values: only the time is used
  for (float& v : w) v = static_cast<float>((state = state * 1664525u + 1013904223u) >> 8) * 0x1p-24f - 0.5f;
  for (float& v : x) v = static_cast<float>((state = state * 1664525u + 1013904223u) >> 8) * 0x1p-24f - 0.5f;
  auto matrix = b.make_matrix(w.data(), kProbeOutputs, kProbeCols, MatrixUse::kGemm);
  Buffer xb, yb;
  const Tensor xt = b.alloc_tensor(kProbeRows, kProbeCols, DType::kF32, &xb);
  const Tensor yt = b.alloc_tensor(kProbeRows, kProbeOutputs, DType::kF32, &yb);
  b.upload(xt.data, x.data(), x.size() * sizeof(float));
  double best = 1e30;
  for (int rep = 0; rep < 6; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    b.gemm(xt, *matrix, nullptr, yt, false);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (rep > 0) best = std::min(best, s);
  }
  return 2.0 * kProbeRows * kProbeCols * kProbeOutputs / best * 1e-9;
}

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(const BackendOptions& options, std::string* error) {
  if (options.n_threads < 0) {
    *error = "--threads must be >= 0 (0 uses every core)";
    return nullptr;
  }
  if (options.n_threads > 0) omp_set_num_threads(options.n_threads);
  DType dtype = options.dtype;
  if (dtype == DType::kF16) {
    *error = "the CPU backend computes in f32 or bf16, not f16";
    return nullptr;
  }
  // Without native bf16 the oneDNN bf16 path is emulated and slower than f32: use f32.
  if (dtype == DType::kBF16 && !cpu_has_bf16()) dtype = DType::kF32;
  flush_denormals_on_all_threads();
  std::string reason;
  if (options.measure_dtype && dtype == DType::kBF16) {
    const double bf16 = measure_gemm_gflops(DType::kBF16, options);
    const double f32 = measure_gemm_gflops(DType::kF32, options);
    if (f32 > bf16) dtype = DType::kF32;
    char buf[200];
    std::snprintf(buf, sizeof buf, "measured a %ldx%ldx%ld gemm: bf16 %.0f GFLOP/s, f32 %.0f GFLOP/s",
                  static_cast<long>(kProbeRows), static_cast<long>(kProbeCols), static_cast<long>(kProbeOutputs), bf16, f32);
    reason = buf;
  }
  return std::make_unique<CpuBackend>(dtype, options.n_threads, options.cpus, options.nice,
                                      options.measure_dtype && cpu_has_bf16() ? DType::kBF16 : DType::kF32, reason);
}

}  // namespace baton
