// The CUDA backend (see cuda_backend.h). Host-side orchestration: device memory, weights in
// bf16, the step's metadata copied to the device once per step, op launches on one stream, and
// CUDA graphs for decode steps. Kernels live beside this file: gemm (cuBLASLt), elementwise,
// attention_prefill / attention_decode, sampling.
#include "kernels/cuda/cuda_backend.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/check.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/sampling.h"
#include "kernels/half.h"

namespace baton {
namespace {

using cuda::AttnSeq;

// cuBLASLt's workspace: enough for its split-K and stream-K kernels on large shapes.
constexpr size_t kGemmWorkspaceBytes = size_t{64} << 20;
// Decode steps with at most this many sequences are recorded as CUDA graphs.
constexpr int64_t kMaxGraphBatch = 256;
// Recorded graphs kept at most (keyed by batch size, context bound and buffers).
constexpr size_t kMaxGraphs = 1024;

Buffer device_alloc(size_t bytes) {
  void* p = nullptr;
  CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 256)));
  return Buffer(p, [](void* q) { cudaFree(q); });
}

struct PinnedFree {
  void operator()(void* p) const { cudaFreeHost(p); }
};
using PinnedPtr = std::unique_ptr<void, PinnedFree>;

PinnedPtr pinned_alloc(size_t bytes) {
  void* p = nullptr;
  CUDA_CHECK(cudaMallocHost(&p, std::max<size_t>(bytes, 256)));
  return PinnedPtr(p);
}

class CudaMatrix final : public Matrix {
 public:
  CudaMatrix(int64_t rows, int64_t cols, DType dtype, Buffer data) : Matrix(rows, cols), dtype(dtype), data(std::move(data)) {}
  DType dtype;  // bf16 for gemm weights and tables, f32 for vectors
  Buffer data;
};

class CudaKvCache final : public KvCache {
 public:
  CudaKvCache(const KvCacheConfig& c, Buffer memory) : KvCache(c), memory(std::move(memory)) {
    layer_bytes = static_cast<size_t>(c.n_blocks) * c.block_size * c.n_kv_heads * c.head_dim * dtype_size(c.dtype);
  }
  void* k(int layer) const { return static_cast<char*>(memory.get()) + 2 * layer_bytes * static_cast<size_t>(layer); }
  void* v(int layer) const { return static_cast<char*>(k(layer)) + layer_bytes; }
  int64_t row_bytes() const {
    return static_cast<int64_t>(config().n_kv_heads) * config().head_dim * static_cast<int64_t>(dtype_size(config().dtype));
  }
  Buffer memory;  // per layer: K then V, each [n_blocks, block_size, n_kv_heads, head_dim]
  size_t layer_bytes = 0;
};

// A growable device buffer paired with a pinned host buffer of the same size, for copies that
// must not block on pageable memory.
struct Staging {
  Buffer device;
  PinnedPtr host;
  size_t bytes = 0;
  // Grows to at least `need` bytes; true when the device address changed.
  bool reserve(size_t need, bool with_host = true) {
    if (need <= bytes) return false;
    bytes = std::max(need, bytes * 2);
    device = device_alloc(bytes);
    if (with_host) host = pinned_alloc(bytes);
    return true;
  }
};

// The step's metadata on the device (begin_step): offsets into one staging buffer.
struct StepMeta {
  bool active = false;
  // The host arrays these copies came from (ops compare their pointers with these).
  const int32_t* tokens_host = nullptr;
  const int32_t* positions_host = nullptr;
  const int32_t* rows_host = nullptr;
  const SeqView* seqs_host = nullptr;
  int64_t n_tokens = 0;
  int64_t n_rows = 0;
  size_t n_seqs = 0;
  // Device pointers.
  const int32_t* tokens = nullptr;     // [n_tokens]
  const int32_t* positions = nullptr;  // [n_tokens]
  const int32_t* token_seq = nullptr;  // [n_tokens] index of each token's sequence
  const int32_t* rows = nullptr;       // [n_rows] logits rows
  const AttnSeq* seqs = nullptr;       // [n_seqs]
  const int32_t* tables = nullptr;     // block tables, concatenated
  int max_n_new = 0;
  int max_kv_len = 0;
  bool decode_only = false;  // every sequence has one new token
};

// The context bound a decode step's attention is sized for: the longest context rounded up to a
// power of two (at least 256), so a recorded decode graph serves every length up to it.
int decode_kv_bound(int max_kv_len) {
  int b = 256;
  while (b < max_kv_len && b < (1 << 30)) b *= 2;
  return std::max(b, max_kv_len);
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, const cudaDeviceProp& prop) : device_(device), prop_(prop) {
    CUDA_CHECK(cudaSetDevice(device_));
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&meta_copied_, cudaEventDisableTiming));
    gemm_ = std::make_unique<cuda::LtGemm>(stream_, kGemmWorkspaceBytes);
    graphs_enabled_ = std::getenv("BATON_CUDA_GRAPHS") == nullptr || std::string(std::getenv("BATON_CUDA_GRAPHS")) != "0";
  }
  // Teardown ignores errors: a failing device at exit has already been reported by the call
  // that met it, and aborting here would hide that report.
  ~CudaBackend() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    cudaStreamSynchronize(copy_stream_);
    clear_graphs();
    gemm_.reset();
    cudaEventDestroy(meta_copied_);
    cudaStreamDestroy(copy_stream_);
    cudaStreamDestroy(stream_);
  }

  std::string name() const override {
    return std::string("cuda:") + std::to_string(device_) + " (" + prop_.name + ", bf16, cuBLASLt)";
  }
  DType compute_dtype() const override { return DType::kBF16; }
  DType activation_dtype() const override { return DType::kBF16; }
  bool supports_kv_dtype(DType dtype) const override { return dtype == DType::kBF16; }

  // ---- memory ----
  Buffer alloc(size_t bytes) override {
    bind();
    return device_alloc(bytes);
  }
  void upload(void* dst, const void* src, size_t bytes) override {
    bind();
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void download(void* dst, const void* src, size_t bytes) override {
    bind();
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void download_f32(const Tensor& t, float* host) override {
    BATON_CHECK(t.dtype == DType::kF32, "download_f32 of a %s tensor", dtype_name(t.dtype));
    bind();
    CUDA_CHECK(cudaMemcpy2DAsync(host, t.cols * sizeof(float), t.data, t.ld * sizeof(float), t.cols * sizeof(float),
                                 t.rows, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void synchronize() override {
    bind();
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  // ---- weights ----
  std::unique_ptr<Matrix> make_matrix(const float* host, int64_t rows, int64_t cols, MatrixUse use) override {
    bind();
    const size_t n = static_cast<size_t>(rows * cols);
    if (use == MatrixUse::kVector) {
      Buffer b = device_alloc(n * sizeof(float));
      CUDA_CHECK(cudaMemcpyAsync(b.get(), host, n * sizeof(float), cudaMemcpyHostToDevice, stream_));
      CUDA_CHECK(cudaStreamSynchronize(stream_));
      return std::make_unique<CudaMatrix>(rows, cols, DType::kF32, std::move(b));
    }
    std::vector<uint16_t> bf(n);
    for (size_t i = 0; i < n; ++i) bf[i] = fp32_to_bf16(host[i]);
    Buffer b = device_alloc(n * sizeof(uint16_t));
    // On the op stream (non-blocking: the legacy stream would not order it before the ops).
    CUDA_CHECK(cudaMemcpyAsync(b.get(), bf.data(), n * sizeof(uint16_t), cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    return std::make_unique<CudaMatrix>(rows, cols, DType::kBF16, std::move(b));
  }

  std::unique_ptr<KvCache> make_kv_cache(const KvCacheConfig& c) override {
    BATON_CHECK(supports_kv_dtype(c.dtype), "the CUDA backend keeps its KV cache in bf16, not %s", dtype_name(c.dtype));
    BATON_CHECK(cuda::attention_supports_head_dim(c.head_dim), "the CUDA attention kernels do not support head_dim %d",
                c.head_dim);
    // The decode kernel indexes token slots with int32.
    BATON_CHECK(static_cast<int64_t>(c.n_blocks) * c.block_size < (int64_t{1} << 31), "%d blocks of %d tokens",
                c.n_blocks, c.block_size);
    bind();
    const size_t bytes =
        2 * static_cast<size_t>(c.n_layers) * c.n_blocks * c.block_size * c.n_kv_heads * c.head_dim * dtype_size(c.dtype);
    Buffer memory = device_alloc(bytes);
    CUDA_CHECK(cudaMemsetAsync(memory.get(), 0, bytes, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    return std::make_unique<CudaKvCache>(c, std::move(memory));
  }

  // ---- ops ----
  void gemm(const Tensor& x, const Matrix& w_base, const Matrix* bias, const Tensor& y, bool accumulate) override {
    const auto& w = static_cast<const CudaMatrix&>(w_base);
    const int64_t m = x.rows, k = x.cols, n = w.rows();
    BATON_CHECK(w.dtype == DType::kBF16 && k == w.cols() && y.rows == m && y.cols == n,
                "gemm shapes: x [%ld, %ld], w [%ld, %ld], y [%ld, %ld]", static_cast<long>(m), static_cast<long>(k),
                static_cast<long>(w.rows()), static_cast<long>(w.cols()), static_cast<long>(y.rows),
                static_cast<long>(y.cols));
    if (m == 0) return;
    bind();
    Tensor xb = x;
    if (x.dtype != DType::kBF16) {  // f32 inputs (tests, tools) are rounded to bf16 first
      BATON_CHECK(!capturing_, "gemm of f32 input inside a recorded step");
      scratch_.reserve(static_cast<size_t>(m * k) * sizeof(uint16_t), /*with_host=*/false);
      xb = Tensor{scratch_.device.get(), DType::kBF16, m, k, k};
      cuda::convert(x, xb, stream_);
    }
    gemm_->run(xb.data, xb.ld, w.data.get(), k, y.data, y.ld, y.dtype, m, n, k, accumulate);
    if (bias != nullptr) {
      const auto& b = static_cast<const CudaMatrix&>(*bias);
      BATON_CHECK(b.rows() * b.cols() == n, "bias of %ld elements for %ld outputs", static_cast<long>(b.rows() * b.cols()),
                  static_cast<long>(n));
      cuda::add_bias(y, static_cast<const float*>(b.data.get()), stream_);
    }
  }

  void rms_norm(const Tensor& x, const Matrix& w, float eps, const Tensor& out) override {
    bind();
    cuda::rms_norm(x, vec(w), eps, out, stream_);
  }
  void head_rms_norm(const Tensor& x, int head_dim, const Matrix& w, float eps) override {
    bind();
    cuda::head_rms_norm(x, head_dim, vec(w), eps, stream_);
  }
  void embed(const Matrix& table_base, const int32_t* ids, int64_t n, const Tensor& out) override {
    const auto& table = static_cast<const CudaMatrix&>(table_base);
    BATON_CHECK(out.rows == n, "embed of %ld ids into %ld rows", static_cast<long>(n), static_cast<long>(out.rows));
    for (int64_t i = 0; i < n; ++i) {
      BATON_CHECK(ids[i] >= 0 && ids[i] < table.rows(), "token id %d outside the table's %ld rows", ids[i],
                  static_cast<long>(table.rows()));
    }
    bind();
    cuda::embed(static_cast<const uint16_t*>(table.data.get()), table.cols(), device_ints(ids, n), out, stream_);
  }
  void rope(const Tensor& q, const Tensor& k, const int32_t* positions, int head_dim, const RopeConfig& r) override {
    bind();
    const int n_rot = r.n_rot > 0 ? r.n_rot : head_dim;
    cuda::rope(q, k, device_ints(positions, q.rows), head_dim, n_rot, r.neox, r.freq_scale, inv_freq(r, n_rot), stream_);
  }
  void silu_mul(const Tensor& gate_up, const Tensor& out) override {
    bind();
    cuda::silu_mul(gate_up, out, stream_);
  }
  void gather_rows(const Tensor& x, const int32_t* rows, int64_t n, const Tensor& out) override {
    BATON_CHECK(out.rows == n, "gather of %ld rows into %ld", static_cast<long>(n), static_cast<long>(out.rows));
    for (int64_t i = 0; i < n; ++i) {
      BATON_CHECK(rows[i] >= 0 && rows[i] < x.rows, "row %d of %ld", rows[i], static_cast<long>(x.rows));
    }
    bind();
    cuda::gather_rows(x, device_ints(rows, n), out, stream_);
  }
  void kv_write(KvCache& cache_base, int layer, const Tensor& k, const Tensor& v, const BatchView& batch) override {
    auto& cache = static_cast<CudaKvCache&>(cache_base);
    const KvCacheConfig& c = cache.config();
    BATON_CHECK(k.cols == static_cast<int64_t>(c.n_kv_heads) * c.head_dim && k.rows == batch.n_tokens,
                "kv_write of [%ld, %ld] into a cache of %d KV heads of %d", static_cast<long>(k.rows),
                static_cast<long>(k.cols), c.n_kv_heads, c.head_dim);
    for (const SeqView& s : batch.seqs) check_block_table(s, c.block_size);
    bind();
    const StepMeta& m = step_meta(batch);
    cuda::kv_write(k, v, m.positions, m.token_seq, m.seqs, m.tables, cache.k(layer), cache.v(layer), cache.config().dtype,
                   cache.config().block_size, stream_);
  }
  void kv_export(const KvCache& cache, int layer, const int32_t* block_table, int32_t start, int32_t n, void* k_host,
                 void* v_host) override {
    kv_transfer(const_cast<KvCache&>(cache), layer, block_table, start, n, k_host, v_host, /*to_host=*/true);
  }
  void kv_import(KvCache& cache, int layer, const int32_t* block_table, int32_t start, int32_t n, const void* k_host,
                 const void* v_host) override {
    kv_transfer(cache, layer, block_table, start, n, const_cast<void*>(k_host), const_cast<void*>(v_host), false);
  }

  void attention(const Tensor& q, const KvCache& cache_base, int layer, const BatchView& batch, int n_head, float scale,
                 const Tensor& out) override {
    const auto& cache = static_cast<const CudaKvCache&>(cache_base);
    const KvCacheConfig& c = cache.config();
    BATON_CHECK(q.dtype == DType::kBF16 && out.dtype == DType::kBF16, "CUDA attention takes bf16 q and out");
    BATON_CHECK(q.cols == static_cast<int64_t>(n_head) * c.head_dim && out.cols == q.cols && n_head % c.n_kv_heads == 0,
                "attention shapes: q [%ld, %ld], %d heads of %d, %d KV heads", static_cast<long>(q.rows),
                static_cast<long>(q.cols), n_head, c.head_dim, c.n_kv_heads);
    for (const SeqView& s : batch.seqs) check_block_table(s, c.block_size);
    bind();
    const StepMeta& m = step_meta(batch);
    cuda::AttnParams p{};
    p.q = static_cast<const __nv_bfloat16*>(q.data);
    p.ld_q = q.ld;
    p.out = static_cast<__nv_bfloat16*>(out.data);
    p.ld_out = out.ld;
    p.k_cache = static_cast<const __nv_bfloat16*>(cache.k(layer));
    p.v_cache = static_cast<const __nv_bfloat16*>(cache.v(layer));
    p.seqs = m.seqs;
    p.block_tables = m.tables;
    p.n_seqs = static_cast<int>(m.n_seqs);
    p.n_head = n_head;
    p.n_kv_heads = c.n_kv_heads;
    p.head_dim = c.head_dim;
    p.block_size = c.block_size;
    p.scale = scale;
    p.max_n_new = m.max_n_new;
    if (m.decode_only) {
      p.max_kv_len = decode_kv_bound(m.max_kv_len);
      const size_t need = cuda::attention_decode_workspace_bytes(p.n_seqs, n_head, c.head_dim, p.max_kv_len);
      if (need > decode_ws_bytes_) {
        BATON_CHECK(!capturing_, "decode attention workspace grew inside a recorded step");
        clear_graphs();  // recorded decode steps point at the old workspace
        decode_ws_ = device_alloc(need);
        decode_ws_bytes_ = need;
      }
      cuda::attention_decode(p, decode_ws_.get(), decode_ws_bytes_, stream_);
    } else {
      p.max_kv_len = m.max_kv_len;
      cuda::attention_prefill(p, stream_);
    }
  }

  // ---- steps ----
  void begin_step(const BatchView& batch, std::span<const int32_t> logit_rows) override {
    bind();
    stage(batch, logit_rows.data(), static_cast<int64_t>(logit_rows.size()), meta_staging_, &meta_);
    meta_.active = true;
  }
  void end_step() override { meta_.active = false; }

  void run_step(const BatchView& batch, uint64_t key, const std::function<void()>& body) override {
    bind();
    if (!graphs_enabled_ || !meta_.active || !meta_.decode_only || batch.n_tokens > kMaxGraphBatch) {
      body();
      return;
    }
    const int bound = decode_kv_bound(meta_.max_kv_len);
    const uint64_t graph_key = (key ^ static_cast<uint64_t>(bound)) * 1099511628211ull;
    if (auto it = graphs_.find(graph_key); it != graphs_.end()) {
      CUDA_CHECK(cudaGraphLaunch(it->second, stream_));
      ++n_graph_replays_;
      return;
    }
    // The first step with a key runs eagerly: it loads modules, makes GEMM plans and sizes
    // workspaces, none of which may happen while recording. The second records.
    if (warmed_.insert(graph_key).second) {
      body();
      return;
    }
    if (graphs_.size() >= kMaxGraphs) clear_graphs();
    cudaGraph_t graph = nullptr;
    {
      // ThreadLocal mode leaves other threads free to call CUDA; the KV copies of this backend
      // still keep their (device-synchronising) buffer growth out of the recording window.
      std::lock_guard<std::mutex> lock(capture_mu_);
      CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
      capturing_ = true;
      body();
      capturing_ = false;
      CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    }
    cudaGraphExec_t exec = nullptr;
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_CHECK(cudaGraphDestroy(graph));
    graphs_.emplace(graph_key, exec);
    ++n_graphs_recorded_;
    CUDA_CHECK(cudaGraphLaunch(exec, stream_));
  }

  std::string stats() const override {
    return "graphs_recorded=" + std::to_string(n_graphs_recorded_) + " graph_replays=" + std::to_string(n_graph_replays_);
  }

  // ---- sampling ----
  void sample(const Tensor& logits, std::span<const SampleSpec> specs, std::span<const LogitAdjust> adjust,
              int32_t* tokens, TokenLogprobs* logprobs) override {
    BATON_CHECK(logits.dtype == DType::kF32 && logits.rows == static_cast<int64_t>(specs.size()),
                "sample: %ld rows of %s logits for %zu specs", static_cast<long>(logits.rows), dtype_name(logits.dtype),
                specs.size());
    const int rows = static_cast<int>(specs.size());
    const int vocab = static_cast<int>(logits.cols);
    // The kernels index by these without bounds: an entry outside the logits would write anywhere.
    BATON_CHECK(adjust.size() <= static_cast<size_t>(INT32_MAX), "%zu logit adjustments", adjust.size());
    for (size_t e = 0; e < adjust.size(); ++e) {
      const LogitAdjust& a = adjust[e];
      BATON_CHECK(a.row >= 0 && a.row < rows && a.token >= 0 && a.token < vocab,
                  "logit adjustment (%d, %d) outside %d rows of %d logits", a.row, a.token, rows, vocab);
      BATON_CHECK(e == 0 || adjust[e - 1].row <= a.row, "logit adjustments not ordered by row");
    }
    if (specs.empty()) return;
    bind();
    const bool any_random = std::any_of(specs.begin(), specs.end(), [](const SampleSpec& s) { return s.temperature != 0.0f; });
    const bool any_logprobs =
        std::any_of(specs.begin(), specs.end(), [](const SampleSpec& s) { return s.top_logprobs >= 0; });
    BATON_CHECK(!any_logprobs || logprobs != nullptr, "sample: rows ask for log-probabilities, none to write");
    const int n_adjust = static_cast<int>(adjust.size());
    const int n_words = (vocab + 31) / 32;
    const int n_masked =
        static_cast<int>(std::count_if(specs.begin(), specs.end(), [](const SampleSpec& s) { return s.allowed != nullptr; }));

    // sample_io_ holds, each part 256-byte aligned and absent when empty: what is copied in (specs,
    // adjust entries, each row's first entry), what is copied out (token ids, log-probabilities),
    // then device scratch (the penalised logits' raw values, each row's log-sum-exp). Without
    // penalties or log-probabilities it is the specs and the ids alone, as plain sampling needs.
    size_t end = 0;
    auto place = [&end](size_t bytes) {
      if (bytes == 0) return end;
      const size_t at = (end + 255) / 256 * 256;
      end = at + bytes;
      return at;
    };
    const size_t specs_at = place(specs.size() * sizeof(SampleSpec));
    const size_t adjust_at = place(adjust.size() * sizeof(LogitAdjust));
    const size_t first_at = place(any_logprobs ? (specs.size() + 1) * sizeof(int32_t) : 0);
    const size_t slot_at = place(n_masked > 0 ? specs.size() * sizeof(int32_t) : 0);
    const size_t masks_at = place(static_cast<size_t>(n_masked) * n_words * sizeof(uint32_t));
    const size_t in_bytes = end;
    const size_t ids_at = place(specs.size() * sizeof(int32_t));
    const size_t logprobs_at = place(any_logprobs ? specs.size() * sizeof(TokenLogprobs) : 0);
    const size_t out_bytes = end - ids_at;
    const size_t raw_at = place(adjust.size() * sizeof(float));
    const size_t lse_at = place(any_logprobs ? specs.size() * sizeof(double) : 0);
    sample_io_.reserve(end);
    if (any_random) {
      const size_t need = cuda::sample_workspace_bytes(rows, vocab);
      if (need > sample_ws_bytes_) {
        sample_ws_ = device_alloc(need);
        sample_ws_bytes_ = need;
      }
    }
    char* host = static_cast<char*>(sample_io_.host.get());
    char* dev = static_cast<char*>(sample_io_.device.get());
    std::memcpy(host + specs_at, specs.data(), specs.size() * sizeof(SampleSpec));
    if (n_masked > 0) {
      // Each masked row's bits, and its top_k capped to the tokens allowed, as sample_row does.
      auto* staged = reinterpret_cast<SampleSpec*>(host + specs_at);
      auto* slot = reinterpret_cast<int32_t*>(host + slot_at);
      auto* masks = reinterpret_cast<uint32_t*>(host + masks_at);
      int next = 0;
      for (int r = 0; r < rows; ++r) {
        slot[r] = -1;
        if (specs[r].allowed == nullptr) continue;
        slot[r] = next;
        uint32_t* dst = masks + static_cast<size_t>(next++) * n_words;
        std::memcpy(dst, specs[r].allowed, static_cast<size_t>(n_words) * sizeof(uint32_t));
        if (vocab % 32 != 0) dst[n_words - 1] &= (1u << (vocab % 32)) - 1u;
        int32_t n_allowed = 0;
        for (int w = 0; w < n_words; ++w) n_allowed += __builtin_popcount(dst[w]);
        const int32_t cap = std::max(n_allowed, 1);
        staged[r].top_k = staged[r].top_k > 0 ? std::min(staged[r].top_k, cap) : cap;
        staged[r].allowed = nullptr;  // a host address: the device reads the slot instead
      }
    }
    std::copy(adjust.begin(), adjust.end(), reinterpret_cast<LogitAdjust*>(host + adjust_at));
    if (any_logprobs) {
      auto* first = reinterpret_cast<int32_t*>(host + first_at);
      int e = 0;
      for (int r = 0; r <= rows; ++r) {
        while (e < n_adjust && adjust[e].row < r) ++e;
        first[r] = e;
      }
    }
    CUDA_CHECK(cudaMemcpyAsync(dev, host, in_bytes, cudaMemcpyHostToDevice, stream_));
    const auto* specs_d = reinterpret_cast<const SampleSpec*>(dev + specs_at);
    const auto* adjust_d = reinterpret_cast<const LogitAdjust*>(dev + adjust_at);
    auto* ids_d = reinterpret_cast<int32_t*>(dev + ids_at);
    auto* logprobs_d = reinterpret_cast<TokenLogprobs*>(dev + logprobs_at);
    auto* raw_d = reinterpret_cast<float*>(dev + raw_at);
    auto* lse_d = reinterpret_cast<double*>(dev + lse_at);
    // Log-probabilities are of the raw logits, so they come before the penalties change them.
    if (any_logprobs) cuda::row_logprobs(logits.f32(), logits.ld, rows, vocab, specs_d, logprobs_d, lse_d, stream_);
    // A penalty keeps a NaN or an infinity non-finite, so sample_rows' check of the adjusted row
    // also catches what sample_row's check of the raw one does.
    cuda::adjust_logits(logits.f32(), logits.ld, adjust_d, n_adjust, raw_d, stream_);
    if (n_masked > 0) {
      cuda::mask_logits(logits.f32(), logits.ld, rows, vocab, reinterpret_cast<const int32_t*>(dev + slot_at),
                        reinterpret_cast<const uint32_t*>(dev + masks_at), n_words, stream_);
    }
    cuda::sample_rows(logits.f32(), logits.ld, rows, vocab, specs_d, any_random, ids_d, sample_ws_.get(),
                      sample_ws_bytes_, stream_);
    if (any_logprobs) {
      cuda::sampled_logprobs(logits.f32(), logits.ld, rows, specs_d, ids_d, adjust_d,
                             reinterpret_cast<const int32_t*>(dev + first_at), raw_d, lse_d, logprobs_d, stream_);
    }
    CUDA_CHECK(cudaMemcpyAsync(host + ids_at, ids_d, out_bytes, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::memcpy(tokens, host + ids_at, specs.size() * sizeof(int32_t));
    if (!any_logprobs) return;
    // As sample_row: a row that did not ask, or whose logits are not finite, keeps what it held.
    const auto* got = reinterpret_cast<const TokenLogprobs*>(host + logprobs_at);
    for (int r = 0; r < rows; ++r) {
      if (specs[r].top_logprobs >= 0 && tokens[r] != kNonFiniteLogits) logprobs[r] = got[r];
    }
  }

 private:
  // Every entry point binds the backend's device to the calling thread (serving calls come from
  // several threads).
  void bind() const { CUDA_CHECK(cudaSetDevice(device_)); }

  static const float* vec(const Matrix& m) {
    const auto& v = static_cast<const CudaMatrix&>(m);
    BATON_CHECK(v.dtype == DType::kF32, "a vector weight must be f32");
    return static_cast<const float*>(v.data.get());
  }

  void clear_graphs() {
    for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
    graphs_.clear();
    warmed_.clear();
  }

  // Copies `batch` (and the logits rows) to the device: one pinned buffer, one copy.
  void stage(const BatchView& batch, const int32_t* rows, int64_t n_rows, Staging& staging, StepMeta* m) {
    const int64_t n = batch.n_tokens;
    const size_t n_seqs = batch.seqs.size();
    size_t n_table = 0;
    for (const SeqView& s : batch.seqs) n_table += static_cast<size_t>(s.n_blocks);
    auto round = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
    const size_t off_tokens = 0;
    const size_t off_positions = off_tokens + round(n * sizeof(int32_t));
    const size_t off_token_seq = off_positions + round(n * sizeof(int32_t));
    const size_t off_rows = off_token_seq + round(n * sizeof(int32_t));
    const size_t off_seqs = off_rows + round(n_rows * sizeof(int32_t));
    const size_t off_tables = off_seqs + round(n_seqs * sizeof(AttnSeq));
    const size_t total = off_tables + round(n_table * sizeof(int32_t));
    // The previous copy must be done (and, for a reused device buffer, read) before the pinned
    // source is rewritten: steps end by reading results back, so this rarely waits.
    CUDA_CHECK(cudaEventSynchronize(meta_copied_));
    if (&staging != &meta_staging_) CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (staging.reserve(total) && &staging == &meta_staging_) clear_graphs();  // graphs point into the old buffer

    char* h = static_cast<char*>(staging.host.get());
    if (n > 0) {
      std::memcpy(h + off_tokens, batch.tokens, n * sizeof(int32_t));
      std::memcpy(h + off_positions, batch.positions, n * sizeof(int32_t));
    }
    if (n_rows > 0) std::memcpy(h + off_rows, rows, n_rows * sizeof(int32_t));
    auto* token_seq = reinterpret_cast<int32_t*>(h + off_token_seq);
    auto* seqs = reinterpret_cast<AttnSeq*>(h + off_seqs);
    auto* tables = reinterpret_cast<int32_t*>(h + off_tables);
    int32_t table0 = 0;
    m->max_n_new = 0;
    m->max_kv_len = 0;
    m->decode_only = n_seqs > 0;
    for (size_t i = 0; i < n_seqs; ++i) {
      const SeqView& s = batch.seqs[i];
      BATON_CHECK(s.row0 >= 0 && s.row0 + s.n_new <= n, "sequence rows [%d, %d) outside the step's %ld tokens", s.row0,
                  s.row0 + s.n_new, static_cast<long>(n));
      seqs[i] = AttnSeq{s.row0, s.n_new, s.kv_offset, table0};
      if (s.n_blocks > 0) std::memcpy(tables + table0, s.block_table, s.n_blocks * sizeof(int32_t));
      table0 += s.n_blocks;
      for (int32_t r = s.row0; r < s.row0 + s.n_new; ++r) token_seq[r] = static_cast<int32_t>(i);
      m->max_n_new = std::max(m->max_n_new, s.n_new);
      m->max_kv_len = std::max(m->max_kv_len, s.kv_offset + s.n_new);
      if (s.n_new != 1) m->decode_only = false;
    }
    CUDA_CHECK(cudaMemcpyAsync(staging.device.get(), h, total, cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaEventRecord(meta_copied_, stream_));

    const char* d = static_cast<const char*>(staging.device.get());
    m->tokens_host = batch.tokens;
    m->positions_host = batch.positions;
    m->rows_host = rows;
    m->seqs_host = batch.seqs.data();
    m->n_tokens = n;
    m->n_rows = n_rows;
    m->n_seqs = n_seqs;
    m->tokens = reinterpret_cast<const int32_t*>(d + off_tokens);
    m->positions = reinterpret_cast<const int32_t*>(d + off_positions);
    m->token_seq = reinterpret_cast<const int32_t*>(d + off_token_seq);
    m->rows = reinterpret_cast<const int32_t*>(d + off_rows);
    m->seqs = reinterpret_cast<const AttnSeq*>(d + off_seqs);
    m->tables = reinterpret_cast<const int32_t*>(d + off_tables);
  }

  // The device copy of the step's metadata for `batch`: begin_step's when this is that step's
  // batch, else a fresh copy (ops called outside a model step, as tests do).
  const StepMeta& step_meta(const BatchView& batch) {
    if (meta_.active && batch.seqs.data() == meta_.seqs_host && batch.seqs.size() == meta_.n_seqs &&
        batch.n_tokens == meta_.n_tokens && batch.tokens == meta_.tokens_host) {
      return meta_;
    }
    BATON_CHECK(!capturing_, "an op's batch is not the recorded step's batch");
    stage(batch, nullptr, 0, loose_staging_, &loose_meta_);
    return loose_meta_;
  }

  // A device copy of host ints: the step's own arrays when `host` is one of them, else a copy.
  const int32_t* device_ints(const int32_t* host, int64_t n) {
    if (meta_.active) {
      if (host == meta_.tokens_host && n <= meta_.n_tokens) return meta_.tokens;
      if (host == meta_.positions_host && n <= meta_.n_tokens) return meta_.positions;
      if (host == meta_.rows_host && n <= meta_.n_rows) return meta_.rows;
    }
    BATON_CHECK(!capturing_, "an op's host array is not part of the recorded step");
    CUDA_CHECK(cudaStreamSynchronize(stream_));  // the previous user of the buffer is done
    loose_ints_.reserve(static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(int32_t));
    std::memcpy(loose_ints_.host.get(), host, n * sizeof(int32_t));
    CUDA_CHECK(cudaMemcpyAsync(loose_ints_.device.get(), loose_ints_.host.get(), n * sizeof(int32_t),
                               cudaMemcpyHostToDevice, stream_));
    return static_cast<const int32_t*>(loose_ints_.device.get());
  }

  // rope_inv_freq on the device, one table per distinct config.
  const double* inv_freq(const RopeConfig& r, int n_rot) {
    const std::vector<double> f = rope_inv_freq(r, n_rot);
    std::string key(reinterpret_cast<const char*>(f.data()), f.size() * sizeof(double));
    auto it = rope_tables_.find(key);
    if (it == rope_tables_.end()) {
      BATON_CHECK(!capturing_, "a new rope table inside a recorded step");
      Buffer b = device_alloc(f.size() * sizeof(double));
      CUDA_CHECK(cudaMemcpyAsync(b.get(), f.data(), f.size() * sizeof(double), cudaMemcpyHostToDevice, stream_));
      CUDA_CHECK(cudaStreamSynchronize(stream_));
      it = rope_tables_.emplace(std::move(key), std::move(b)).first;
    }
    return static_cast<const double*>(it->second.get());
  }

  // KV hand-off copies run on their own stream under their own lock: a prefill worker's sender
  // threads export finished prompts while its engine thread runs the next step. The blocks read
  // or written here belong to no running step (the caller's contract), and the forward that
  // wrote them finished before its logits came back, so no cross-stream ordering is needed.
  void kv_transfer(KvCache& cache_base, int layer, const int32_t* block_table, int32_t start, int32_t n, void* k_host,
                   void* v_host, bool to_host) {
    auto& cache = static_cast<CudaKvCache&>(cache_base);
    const KvCacheConfig& c = cache.config();
    if (n == 0) return;
    bind();
    std::lock_guard<std::mutex> lock(kv_mu_);
    const int32_t n_blocks = (start + n + c.block_size - 1) / c.block_size;
    const int64_t row = cache.row_bytes();
    const size_t table_bytes = (static_cast<size_t>(n_blocks) * sizeof(int32_t) + 255) / 256 * 256;
    const size_t packed = static_cast<size_t>(n) * row;
    if (table_bytes + 2 * packed > kv_staging_.bytes) {
      std::lock_guard<std::mutex> capture_lock(capture_mu_);  // growth frees and allocates
      kv_staging_.reserve(table_bytes + 2 * packed);
    }
    char* h = static_cast<char*>(kv_staging_.host.get());
    char* d = static_cast<char*>(kv_staging_.device.get());
    std::memcpy(h, block_table, n_blocks * sizeof(int32_t));
    if (!to_host) {
      std::memcpy(h + table_bytes, k_host, packed);
      std::memcpy(h + table_bytes + packed, v_host, packed);
    }
    CUDA_CHECK(cudaMemcpyAsync(d, h, to_host ? table_bytes : table_bytes + 2 * packed, cudaMemcpyHostToDevice, copy_stream_));
    cuda::kv_copy_packed(cache.k(layer), cache.v(layer), row, reinterpret_cast<const int32_t*>(d), start, n, c.block_size,
                         d + table_bytes, d + table_bytes + packed, to_host, copy_stream_);
    if (to_host) {
      CUDA_CHECK(cudaMemcpyAsync(h + table_bytes, d + table_bytes, 2 * packed, cudaMemcpyDeviceToHost, copy_stream_));
    }
    CUDA_CHECK(cudaStreamSynchronize(copy_stream_));
    if (to_host) {
      std::memcpy(k_host, h + table_bytes, packed);
      std::memcpy(v_host, h + table_bytes + packed, packed);
    }
  }

  int device_;
  cudaDeviceProp prop_;
  cudaStream_t stream_ = nullptr;       // every op
  cudaStream_t copy_stream_ = nullptr;  // KV hand-off copies
  std::unique_ptr<cuda::LtGemm> gemm_;

  StepMeta meta_;        // begin_step .. end_step
  StepMeta loose_meta_;  // ops called outside a step
  Staging meta_staging_;   // meta_'s arrays (recorded graphs read them in place)
  Staging loose_staging_;  // loose_meta_'s arrays
  Staging loose_ints_;     // host ints of ops called outside a step
  Staging scratch_;        // bf16 copies of f32 gemm inputs
  Staging sample_io_;      // sampling specs and penalties in, token ids and log-probabilities out
  cudaEvent_t meta_copied_ = nullptr;
  Buffer decode_ws_;
  size_t decode_ws_bytes_ = 0;
  Buffer sample_ws_;
  size_t sample_ws_bytes_ = 0;
  std::unordered_map<std::string, Buffer> rope_tables_;

  bool graphs_enabled_ = true;  // BATON_CUDA_GRAPHS=0 turns recording off
  bool capturing_ = false;
  std::unordered_map<uint64_t, cudaGraphExec_t> graphs_;
  std::unordered_set<uint64_t> warmed_;
  int64_t n_graphs_recorded_ = 0;
  int64_t n_graph_replays_ = 0;
  std::mutex capture_mu_;  // held while recording; taken by other threads' buffer growth

  std::mutex kv_mu_;
  Staging kv_staging_;  // guarded by kv_mu_
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& options, std::string* error) {
  const std::string& d = options.device;
  const std::optional<int> ordinal = cuda_device_ordinal(d);
  if (!ordinal) {
    *error = "bad device '" + d + "' (expected cuda or cuda:N with N a device index)";
    return nullptr;
  }
  const int device = *ordinal;
  if (options.dtype != DType::kBF16) {
    *error = std::string("the CUDA backend computes in bf16 (fp32 accumulation); --dtype ") + dtype_name(options.dtype) +
             " is CPU-only";
    return nullptr;
  }
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess || n == 0) {
    *error = "device '" + d + "': no CUDA device is usable here (no NVIDIA GPU, or no driver for this CUDA " +
             std::to_string(CUDART_VERSION / 1000) + " build: " +
             (err != cudaSuccess ? std::string(cudaGetErrorString(err)) : std::string("no devices")) + ")";
    return nullptr;
  }
  if (device >= n) {
    *error = "device '" + d + "': this machine has " + std::to_string(n) + " CUDA device(s), numbered from 0";
    return nullptr;
  }
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::string lt_error;
  if (cuda::cublaslt_load(&lt_error) == nullptr) {
    *error = "device '" + d + "': " + lt_error;
    return nullptr;
  }
  if (prop.major < 8) {
    *error = "device '" + d + "' (" + prop.name + ", sm_" + std::to_string(prop.major) + std::to_string(prop.minor) +
             ") is too old: baton's CUDA kernels need bf16 tensor cores (sm_80 or newer)";
    return nullptr;
  }
  return std::make_unique<CudaBackend>(device, prop);
}

}  // namespace baton
