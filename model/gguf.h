// GGUF reader (versions 2 and 3): metadata, tensor infos and tensor bytes of a memory-mapped file.
//
// Contract: parsing never trusts the file. Every count, length, offset and size is checked against
// the bytes that are really there (and against fixed caps) before it is used, so a truncated,
// oversized or lying file yields a Status naming the problem, never UB. A GgufFile owns its
// mapping; spans it hands out live as long as it does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "model/file_mapping.h"

namespace baton {

// Metadata value types, as numbered by the GGUF spec.
enum class GgufType : uint32_t {
  kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7,
  kString = 8, kArray = 9, kU64 = 10, kI64 = 11, kF64 = 12,
};

// One metadata value. Integers (and bools) are widened to `i` (or `u` for unsigned), floats to
// `f`; arrays keep their elements in `ints`, `floats` or `strings` by element kind.
struct GgufValue {
  GgufType type = GgufType::kU8;
  GgufType elem_type = GgufType::kU8;  // arrays only
  int64_t i = 0;
  uint64_t u = 0;
  double f = 0;
  std::string s;
  std::vector<int64_t> ints;
  std::vector<double> floats;
  std::vector<std::string> strings;

  bool is_array() const { return type == GgufType::kArray; }
  bool is_integer() const;
  bool is_float() const { return type == GgufType::kF32 || type == GgufType::kF64; }
  size_t array_size() const { return ints.size() + floats.size() + strings.size(); }
};

// ggml tensor types (the ones baton dequantises are listed in model/dequant.h).
enum class GgmlType : uint32_t {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ8_1 = 9,
  kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kQ8_K = 15, kIQ4_NL = 20, kIQ4_XS = 23, kBF16 = 30,
};

const char* ggml_type_name(GgmlType type);
// Elements per block and bytes per block; {0, 0} for a type baton does not know.
struct GgmlTypeTraits {
  uint32_t block_elems = 0;
  uint32_t block_bytes = 0;
};
GgmlTypeTraits ggml_type_traits(GgmlType type);

struct GgufTensorInfo {
  std::string name;
  std::vector<uint64_t> dims;  // ggml order: dims[0] is the fastest-varying (row width)
  GgmlType type = GgmlType::kF32;
  uint64_t offset = 0;         // absolute offset of the data in the file
  uint64_t n_elements = 0;
  uint64_t n_bytes = 0;

  uint64_t n_rows() const { return dims.empty() ? 0 : n_elements / dims[0]; }
};

class GgufFile {
 public:
  // Maps `path` read-only and parses it.
  static Result<std::unique_ptr<GgufFile>> open(const std::string& path);
  // Parses an in-memory copy of a file (tests, fuzzing). `bytes` is copied.
  static Result<std::unique_ptr<GgufFile>> parse(std::span<const uint8_t> bytes);
  // Whether the bytes are a file mapping (open), not a copy in memory (parse).
  bool mapped() const { return mapping_ != nullptr; }

  ~GgufFile() = default;
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  uint32_t version() const { return version_; }
  const std::string& path() const { return path_; }

  const GgufValue* find(std::string_view key) const;
  const std::vector<std::string>& keys() const { return key_order_; }

  // Typed getters: NOT_FOUND when missing, INVALID_ARGUMENT when of another type.
  Result<std::string> get_string(std::string_view key) const;
  Result<int64_t> get_int(std::string_view key) const;    // any integer type, or bool
  Result<double> get_float(std::string_view key) const;   // f32/f64 (integers accepted too)
  Result<bool> get_bool(std::string_view key) const;
  Result<std::vector<std::string>> get_string_array(std::string_view key) const;
  // The referenced array, or nullptr when missing or not an array of that kind.
  const std::vector<std::string>* string_array(std::string_view key) const;
  const std::vector<int64_t>* int_array(std::string_view key) const;
  const std::vector<double>* float_array(std::string_view key) const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* tensor(std::string_view name) const;
  // The tensor's bytes inside the mapping (bounds were checked at parse time).
  std::span<const uint8_t> tensor_data(const GgufTensorInfo& info) const;

 private:
  GgufFile() = default;
  Status parse_all();

  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::unique_ptr<FileMapping> mapping_;  // the mapped file (open), or null (parse)
  std::vector<uint8_t> owned_;       // copied bytes (parse)
  uint32_t version_ = 0;
  std::unordered_map<std::string, GgufValue> kv_;
  std::vector<std::string> key_order_;
  std::vector<GgufTensorInfo> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
};

}  // namespace baton
