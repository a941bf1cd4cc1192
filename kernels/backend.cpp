#include "kernels/backend.h"

#include "common/check.h"
#include "kernels/cpu/cpu_backend.h"

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

Tensor Tensor::row_slice(int64_t r0, int64_t n) const {
  BATON_CHECK(r0 >= 0 && n >= 0 && r0 + n <= rows, "row slice [%ld, %ld) of %ld rows", static_cast<long>(r0),
              static_cast<long>(r0 + n), static_cast<long>(rows));
  Tensor t = *this;
  t.data = static_cast<char*>(data) + r0 * ld * static_cast<int64_t>(dtype_size(dtype));
  t.rows = n;
  return t;
}

Tensor Backend::alloc_tensor(int64_t rows, int64_t cols, DType dtype, Buffer* holder) {
  size_t bytes = static_cast<size_t>(std::max<int64_t>(rows * cols, 1)) * dtype_size(dtype);
  *holder = alloc(bytes);
  return Tensor{holder->get(), dtype, rows, cols, cols};
}

std::unique_ptr<Backend> make_backend(const BackendOptions& options, std::string* error) {
  if (options.device == "cpu") return make_cpu_backend(options, error);
  if (options.device.rfind("cuda", 0) == 0) {
    *error = "device '" + options.device + "' is not available: this build of baton has no CUDA backend";
    return nullptr;
  }
  *error = "unknown device '" + options.device + "' (expected cpu or cuda[:N])";
  return nullptr;
}

}  // namespace baton
