#include "kernels/backend.h"

#include <atomic>
#include <cmath>

#include "common/check.h"
#include "kernels/cpu/cpu_backend.h"
#if BATON_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace baton {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
  }
  return "?";
}

std::optional<DType> dtype_from_name(std::string_view name) {
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    if (name == dtype_name(d)) return d;
  }
  return std::nullopt;
}

size_t dtype_size(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

Tensor Tensor::col_slice(int64_t c0, int64_t n) const {
  BATON_CHECK(c0 >= 0 && n >= 0 && c0 + n <= cols, "column slice [%ld, %ld) of %ld columns", static_cast<long>(c0),
              static_cast<long>(c0 + n), static_cast<long>(cols));
  Tensor t = *this;
  t.data = static_cast<char*>(data) + c0 * static_cast<int64_t>(dtype_size(dtype));
  t.cols = n;
  return t;
}

void Backend::head_rms_norm(const Tensor& x, int head_dim, const Matrix& w, float eps) {
  BATON_CHECK(head_dim > 0 && x.cols % head_dim == 0, "head_rms_norm: %ld columns are not heads of %d",
              static_cast<long>(x.cols), head_dim);
  for (int64_t t = 0; t < x.rows; ++t) {
    const Tensor row = x.row_slice(t, 1);
    const Tensor heads{row.data, x.dtype, x.cols / head_dim, head_dim, head_dim};
    rms_norm(heads, w, eps, heads);
  }
}

Tensor Tensor::row_slice(int64_t r0, int64_t n) const {
  BATON_CHECK(r0 >= 0 && n >= 0 && r0 + n <= rows, "row slice [%ld, %ld) of %ld rows", static_cast<long>(r0),
              static_cast<long>(r0 + n), static_cast<long>(rows));
  Tensor t = *this;
  t.data = static_cast<char*>(data) + r0 * ld * static_cast<int64_t>(dtype_size(dtype));
  t.rows = n;
  return t;
}

std::vector<double> rope_inv_freq(const RopeConfig& rope, int n_rot) {
  const int half = n_rot / 2;
  BATON_CHECK(rope.freq_factors.empty() || static_cast<int>(rope.freq_factors.size()) == half,
              "%zu rope freq factors for %d pairs", rope.freq_factors.size(), half);
  std::vector<double> inv_freq(half);
  for (int i = 0; i < half; ++i) {
    inv_freq[i] = std::pow(static_cast<double>(rope.theta), -2.0 * i / n_rot);
    if (!rope.freq_factors.empty()) inv_freq[i] /= rope.freq_factors[i];
  }
  return inv_freq;
}

void check_block_table(const SeqView& s, int block_size) {
  BATON_CHECK(s.kv_offset >= 0 && s.n_new >= 0 &&
                  static_cast<int64_t>(s.kv_offset) + s.n_new <= static_cast<int64_t>(s.n_blocks) * block_size,
              "sequence needs %d positions but has %d blocks of %d", s.kv_offset + s.n_new, s.n_blocks, block_size);
}

KvCache::KvCache(KvCacheConfig config) : config_(config) {
  static std::atomic<uint64_t> next{1};
  uid_ = next.fetch_add(1);
}

Tensor Backend::alloc_tensor(int64_t rows, int64_t cols, DType dtype, Buffer* holder) {
  size_t bytes = static_cast<size_t>(std::max<int64_t>(rows * cols, 1)) * dtype_size(dtype);
  *holder = alloc(bytes);
  return Tensor{holder->get(), dtype, rows, cols, cols};
}

void Backend::sample(const Tensor& logits, std::span<const SampleSpec> specs, std::span<const LogitAdjust> adjust,
                     int32_t* tokens, TokenLogprobs* logprobs) {
  BATON_CHECK(logits.rows == static_cast<int64_t>(specs.size()), "%ld logit rows for %zu sampling specs",
              static_cast<long>(logits.rows), specs.size());
  std::vector<float> host(static_cast<size_t>(logits.rows * logits.cols));
  download_f32(logits, host.data());
  size_t a = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const size_t first = a;
    while (a < adjust.size() && adjust[a].row == static_cast<int32_t>(i)) ++a;
    BATON_CHECK(a == adjust.size() || adjust[a].row > static_cast<int32_t>(i), "logit adjustments not ordered by row");
    BATON_CHECK(specs[i].top_logprobs < 0 || logprobs != nullptr, "row %zu asks for log-probabilities: none to write", i);
    tokens[i] = sample_row(std::span<float>(host).subspan(i * logits.cols, logits.cols), specs[i],
                           adjust.subspan(first, a - first), logprobs != nullptr ? logprobs + i : nullptr);
  }
  BATON_CHECK(a == adjust.size(), "logit adjustments for rows beyond the %zu sampled", specs.size());
}

std::optional<int> cuda_device_ordinal(std::string_view device) {
  if (device == "cuda") return 0;
  if (device.substr(0, 5) != "cuda:") return std::nullopt;
  const std::string_view idx = device.substr(5);
  if (idx.empty() || idx.size() > 4 || idx.find_first_not_of("0123456789") != std::string_view::npos) return std::nullopt;
  return std::stoi(std::string(idx));
}

Result<DType> resolve_kv_dtype(const Backend& backend, std::string_view name) {
  // bf16 halves the KV pool and the bytes a hand-off moves, and on the CPU a bf16 cache under bf16
  // compute takes the bf16 dot-product decode attention, the faster one (bench/RESULTS.md).
  DType dtype = backend.default_kv_dtype();
  if (!name.empty()) {
    std::optional<DType> d = dtype_from_name(name);
    if (!d) return invalid_argument("--kv-dtype must be f32, bf16 or f16, got '" + std::string(name) + "'");
    dtype = *d;
  }
  if (!backend.supports_kv_dtype(dtype)) {
    return invalid_argument(std::string("--kv-dtype ") + dtype_name(dtype) + " is not supported on " + backend.name() +
                            " (the CUDA backend keeps its KV cache in bf16)");
  }
  return dtype;
}

std::unique_ptr<Backend> make_backend(const BackendOptions& options, std::string* error) {
  if (options.device == "cpu") return make_cpu_backend(options, error);
  if (options.device.rfind("cuda", 0) == 0) {
#if BATON_WITH_CUDA
    return make_cuda_backend(options, error);
#else
    *error = "device '" + options.device + "' is not available: this build of baton has no CUDA backend (rebuild with the CUDA toolkit and -DBATON_CUDA=ON)";
    return nullptr;
#endif
  }
  *error = "unknown device '" + options.device + "' (expected cpu or cuda[:N])";
  return nullptr;
}

}  // namespace baton
