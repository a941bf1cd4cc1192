// The backend interface: the few ops the transformer needs, implemented once per device
// (kernels/cpu/, kernels/cuda/). The model (model/) is written against this interface only.
//
// Conventions:
// - A Tensor is a row-major 2-D view of backend memory: `rows` x `cols`, row stride `ld`
//   elements. Views never own memory; buffers come from Backend::alloc and are freed by the
//   returned handle.
// - T is the number of tokens in the step (all sequences' new tokens, concatenated).
// - Weights are Matrix objects the backend owns in its preferred layout and compute dtype.
// - Host arrays (token ids, positions, block tables) are passed as host pointers; a device
//   backend copies what it needs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "kernels/sampling.h"

namespace baton {

enum class DType { kF32, kBF16, kF16 };
const char* dtype_name(DType dtype);
// The inverse of dtype_name ("f32", "bf16", "f16"); nullopt for anything else.
std::optional<DType> dtype_from_name(std::string_view name);
size_t dtype_size(DType dtype);

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t ld = 0;  // row stride in elements (>= cols)

  // Columns [c0, c0 + n) of every row (a strided view).
  Tensor col_slice(int64_t c0, int64_t n) const;
  // Rows [r0, r0 + n).
  Tensor row_slice(int64_t r0, int64_t n) const;
  float* f32() const { return static_cast<float*>(data); }
};

// Backend memory; freed when the handle goes away.
using Buffer = std::shared_ptr<void>;

// A weight the backend owns: a matrix [rows, cols] used as `y = x W^T` (rows = outputs), or a
// vector (rows == 1) used by norms and biases, or an embedding table gathered by row.
class Matrix {
 public:
  virtual ~Matrix() = default;
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }

 protected:
  Matrix(int64_t rows, int64_t cols) : rows_(rows), cols_(cols) {}

 private:
  int64_t rows_;
  int64_t cols_;
};

enum class MatrixUse {
  kGemm,    // right-hand side of gemm (may be packed/converted to the compute dtype)
  kVector,  // norm weight or bias, kept in f32
  kTable,   // embedding table, gathered by row
};

// Rotary position embedding as the model file defines it.
struct RopeConfig {
  float theta = 10000.0f;          // base
  int n_rot = 0;                   // leading dims of each head that rotate (= head_dim usually)
  bool neox = false;               // true: pairs (i, i + n_rot/2) (qwen2); false: adjacent pairs (llama)
  float freq_scale = 1.0f;         // linear scaling: position * freq_scale
  std::vector<float> freq_factors; // optional per-pair divisors (Llama 3.1 rope_freqs), n_rot/2 entries
};

// inv_freq[i] = theta^(-2i/n_rot) / factor_i for the n_rot/2 pairs, in double so long positions
// stay exact (pair i of position p turns by p · freq_scale · inv_freq[i]). Checks the config.
std::vector<double> rope_inv_freq(const RopeConfig& rope, int n_rot);

struct KvCacheConfig {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int block_size = 16;  // tokens per block
  int n_blocks = 0;     // blocks per layer (a block id indexes every layer)
  DType dtype = DType::kF32;
};

// Paged KV memory: for each layer, K and V of shape [n_blocks, block_size, n_kv_heads, head_dim].
// Which blocks belong to which sequence is the caller's business (kv/block_pool.h).
class KvCache {
 public:
  virtual ~KvCache() = default;
  const KvCacheConfig& config() const { return config_; }
  // Unique among every cache this process makes (a new cache at a freed one's address differs).
  uint64_t uid() const { return uid_; }

 protected:
  explicit KvCache(KvCacheConfig config);

 private:
  KvCacheConfig config_;
  uint64_t uid_;
};

// One sequence's part of a step. Its new tokens are batch rows [row0, row0 + n_new), at positions
// [kv_offset, kv_offset + n_new); keys [0, kv_offset) are already in the cache.
struct SeqView {
  int32_t row0 = 0;
  int32_t n_new = 0;
  int32_t kv_offset = 0;
  const int32_t* block_table = nullptr;  // host; block ids covering positions [0, kv_offset + n_new)
  int32_t n_blocks = 0;
};

// A bug unless `s`'s block table covers every position the step touches, [0, kv_offset + n_new),
// with blocks of `block_size` tokens: a short table would read or write another sequence's KV.
void check_block_table(const SeqView& s, int block_size);

struct BatchView {
  int64_t n_tokens = 0;
  const int32_t* tokens = nullptr;     // host [n_tokens]
  const int32_t* positions = nullptr;  // host [n_tokens]
  std::span<const SeqView> seqs;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // The dtype gemm computes in (f32 or bf16).
  virtual DType compute_dtype() const = 0;
  // The dtype of the activations the model passes between ops (normed inputs, q/k/v, attention
  // output, FFN): f32 on CPU, bf16 on CUDA. The residual stream and logits stay f32 everywhere.
  // Every op accepts f32 and this dtype for its tensors.
  virtual DType activation_dtype() const { return DType::kF32; }
  // True when every op has finished its writes when it returns (the CPU): another thread may read
  // what an op wrote right after. False for a device that queues work (CUDA).
  virtual bool synchronous() const { return false; }
  // False for KV cache dtypes this backend's attention cannot read.
  virtual bool supports_kv_dtype(DType dtype) const { return true; }
  // The KV cache dtype when --kv-dtype is not given (resolve_kv_dtype).
  virtual DType default_kv_dtype() const {
    return compute_dtype() == DType::kBF16 || activation_dtype() == DType::kBF16 ? DType::kBF16 : DType::kF32;
  }
  // Why compute_dtype() is what it is, for the log ("" when it is simply what was asked for).
  virtual std::string dtype_reason() const { return ""; }

  // ---- threads ----
  // Called once by the thread that will run this backend's steps (an engine's loop), before its
  // first step: gives that thread, and the team it parallelises over, the backend's cores and
  // thread count (BackendOptions::cpus, n_threads). OpenMP's thread count is a per-thread
  // setting, so a thread that never calls this runs with the process default. UNAVAILABLE when
  // the cores cannot be had. With BackendOptions::nice > 0 they also run at that niceness. A
  // device backend has nothing to bind.
  virtual Status bind_thread() { return {}; }

  // ---- memory ----
  // True when alloc() takes this process's host memory, which a container's memory limit bounds
  // (the CPU); false for device memory.
  virtual bool host_memory() const { return false; }
  virtual Buffer alloc(size_t bytes) = 0;
  // A fresh tensor [rows, cols] in `dtype` with its own buffer (kept alive by `*holder`).
  Tensor alloc_tensor(int64_t rows, int64_t cols, DType dtype, Buffer* holder);
  virtual void upload(void* dst, const void* src, size_t bytes) = 0;
  virtual void download(void* dst, const void* src, size_t bytes) = 0;
  // Host copy of a (possibly strided) f32 tensor, rows packed.
  virtual void download_f32(const Tensor& t, float* host) = 0;
  virtual void synchronize() = 0;

  // ---- weights ----
  // `host` is f32 [rows, cols], row-major.
  virtual std::unique_ptr<Matrix> make_matrix(const float* host, int64_t rows, int64_t cols, MatrixUse use) = 0;
  // A gemm weight kept in the model file's quantised blocks ("native" weights), stacked by rows
  // from `parts` (q, k and v, say, which a file may hold in different types): each is `rows` rows
  // of GGUF blocks of type `ggml_type` (model/gguf.h's GgmlType), `cols` per row. With `dense`
  // (the whole weight as f32 [Σ rows, cols]), a dense copy is kept too and serves steps of more
  // than kNativeMaxRows tokens (prefill), where dense GEMMs are faster. nullptr when this backend
  // has no kernel for some part's type or shape (then use make_matrix).
  struct QuantizedPart {
    uint32_t ggml_type = 0;
    std::span<const uint8_t> blocks;
    int64_t rows = 0;
  };
  static constexpr int64_t kNativeMaxRows = 32;
  virtual std::unique_ptr<Matrix> make_quantized_matrix(std::span<const QuantizedPart> parts, int64_t cols,
                                                        const float* dense = nullptr) {
    return nullptr;
  }
  // True when gemm on make_quantized_matrix weights is faster than on dense ones for decode-sized
  // steps on this machine (what `--weights auto` asks).
  virtual bool native_weights_fast() const { return false; }
  virtual std::unique_ptr<KvCache> make_kv_cache(const KvCacheConfig& config) = 0;

  // ---- ops ----
  // y[T, N] = x[T, K] · W[N, K]ᵀ (+ bias[N]); with accumulate, y += instead of =.
  virtual void gemm(const Tensor& x, const Matrix& w, const Matrix* bias, const Tensor& y, bool accumulate) = 0;
  // out[t] = x[t] / sqrt(mean(x[t]²) + eps) * w
  virtual void rms_norm(const Tensor& x, const Matrix& w, float eps, const Tensor& out) = 0;
  // Every head_dim-wide segment of every row of x [T, n·head_dim], in place: x[t, h] = x[t, h] /
  // sqrt(mean(x[t, h]²) + eps) * w (head_dim values): Qwen3's q and k norms. The default runs
  // rms_norm on each row's heads.
  virtual void head_rms_norm(const Tensor& x, int head_dim, const Matrix& w, float eps);
  // out[t] = table[ids[t]]
  virtual void embed(const Matrix& table, const int32_t* ids, int64_t n, const Tensor& out) = 0;
  // True when embed() can gather rows of this GEMM weight itself (a tied LM head that is also the
  // embedding table: one copy of it instead of two).
  virtual bool embeds_from(const Matrix& gemm_weight) const { return false; }
  // Rotates q [T, n_head*head_dim] and k [T, n_kv*head_dim] in place at their positions.
  virtual void rope(const Tensor& q, const Tensor& k, const int32_t* positions, int head_dim,
                    const RopeConfig& rope) = 0;
  // out[t, i] = silu(gate_up[t, i]) * gate_up[t, F + i], F = out.cols
  virtual void silu_mul(const Tensor& gate_up, const Tensor& out) = 0;
  // out[i] = x[rows[i]]
  virtual void gather_rows(const Tensor& x, const int32_t* rows, int64_t n, const Tensor& out) = 0;
  // Writes the step's k and v rows [T, n_kv*head_dim] into the paged cache at their positions.
  virtual void kv_write(KvCache& cache, int layer, const Tensor& k, const Tensor& v, const BatchView& batch) = 0;
  // KV hand-off: copies positions [start, start + n) of one sequence (its block table) for
  // `layer` out of / into the paged cache as host arrays [n, n_kv_heads, head_dim] in the cache
  // dtype (K and V separately).
  virtual void kv_export(const KvCache& cache, int layer, const int32_t* block_table, int32_t start, int32_t n,
                         void* k_host, void* v_host) = 0;
  virtual void kv_import(KvCache& cache, int layer, const int32_t* block_table, int32_t start, int32_t n,
                         const void* k_host, const void* v_host) = 0;
  // Causal attention, chunk-aware and GQA: each sequence's queries at positions
  // [kv_offset, kv_offset + n_new) attend to cached keys [0, position]. q, out: [T, n_head*head_dim].
  // Never materialises a T×T matrix (online softmax over key tiles).
  virtual void attention(const Tensor& q, const KvCache& cache, int layer, const BatchView& batch,
                         int n_head, float scale, const Tensor& out) = 0;

  // ---- steps ----
  // A model step brackets its ops with begin_step/end_step. Between them, ops may rely on `batch`
  // and `logit_rows` (host arrays that stay unchanged until end_step) having been copied to the
  // device once, so per-op host pointers equal to these are not copied again.
  virtual void begin_step(const BatchView& batch, std::span<const int32_t> logit_rows) {}
  virtual void end_step() {}
  // Runs a step's ops (`body`). A backend may record them on first use of `key` and replay the
  // recording for later steps with the same key (CUDA graphs for decode steps); `key` must then
  // change whenever anything the body's launches depend on changes apart from the step's
  // metadata copied by begin_step (buffer addresses, shapes). The CPU runs the body.
  virtual void run_step(const BatchView& batch, uint64_t key, const std::function<void()>& body) { body(); }
  // Counters for diagnostics and tests ("graphs_recorded=3 graph_replays=40"); empty when none.
  virtual std::string stats() const { return ""; }

  // ---- sampling ----
  // tokens[i] = a token drawn from logits row i ([specs.size(), n_vocab] f32) as `specs[i]` says,
  // after the row's `adjust` entries (ordered by row); logprobs[i] is written for each row whose
  // spec asks (top_logprobs >= 0; logprobs may be null when none does). sample_row in
  // kernels/sampling.h is the definition. The logits may be changed. The default copies them to
  // the host; a device backend samples where the logits are and copies back only the results.
  virtual void sample(const Tensor& logits, std::span<const SampleSpec> specs, std::span<const LogitAdjust> adjust,
                      int32_t* tokens, TokenLogprobs* logprobs);
};

struct BackendOptions {
  std::string device = "cpu";   // "cpu" or "cuda[:N]"
  DType dtype = DType::kBF16;   // gemm compute dtype; bf16 falls back to f32 where unsupported
  int n_threads = 0;            // CPU threads (0: all cores, or one per entry of `cpus`)
  std::vector<int> cpus;        // the cores bind_thread() restricts the step threads to (empty: any)
  int nice = 0;                 // the step threads' niceness after bind_thread() (common/cpu_set.h)
  // --dtype auto: a CPU backend that only prefills times `dtype` (bf16) against f32 on a
  // prefill-shaped gemm at start and computes in the faster (some CPUs' bf16 gemm is slower than
  // their f32 one); one that decodes keeps `dtype` (its steps read native or bf16 weights and are
  // memory-bound). The KV cache's default stays bf16 either way, so the roles' KV agree.
  bool measure_dtype = false;
};

// The backend for `options.device`; nullptr and a message in `*error` when unavailable.
std::unique_ptr<Backend> make_backend(const BackendOptions& options, std::string* error);

// The CUDA device ordinal `device` names: "cuda" → 0, "cuda:N" → N; nullopt for anything else.
std::optional<int> cuda_device_ordinal(std::string_view device);

// The KV cache dtype --kv-dtype `name` asks for on `backend`: "" is the backend's default, bf16
// where it computes in bf16 (the CPU's default --dtype on CPUs with bf16, CUDA), else f32 (the
// exact mode: --dtype f32, or a CPU without bf16). INVALID_ARGUMENT when its attention cannot read it.
Result<DType> resolve_kv_dtype(const Backend& backend, std::string_view name);

}  // namespace baton
