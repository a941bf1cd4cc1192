// Writes GGUF v3 files: metadata and tensors (F32, or blocks of any type already encoded). Used by `baton tools make-test-model`, by
// tests that craft files (good and bad), and for the fuzzer's seed corpus.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/gguf.h"

namespace baton {

class GgufWriter {
 public:
  void add_string(const std::string& key, const std::string& value);
  void add_u32(const std::string& key, uint32_t value);
  void add_i32(const std::string& key, int32_t value);
  void add_f32(const std::string& key, float value);
  void add_bool(const std::string& key, bool value);
  void add_string_array(const std::string& key, const std::vector<std::string>& values);
  void add_i32_array(const std::string& key, const std::vector<int32_t>& values);
  void add_f32_array(const std::string& key, const std::vector<float>& values);
  // A tensor of `dims` (ggml order: dims[0] fastest) holding `data` (product of dims floats).
  void add_tensor_f32(const std::string& name, const std::vector<uint64_t>& dims, std::vector<float> data);
  // A tensor of `dims` stored as `bytes` of ggml `type` (e.g. K-quant blocks): exactly the bytes
  // the type's blocks take for the product of dims elements.
  void add_tensor_raw(const std::string& name, const std::vector<uint64_t>& dims, GgmlType type,
                      std::vector<uint8_t> bytes);

  std::vector<uint8_t> to_bytes() const;
  Status write(const std::string& path) const;

 private:
  struct TensorEntry {
    std::string name;
    std::vector<uint64_t> dims;
    GgmlType type = GgmlType::kF32;
    std::vector<uint8_t> bytes;
  };
  void key(const std::string& k, GgufType type);

  std::vector<uint8_t> meta_;  // serialised key/value pairs
  uint64_t n_kv_ = 0;
  std::vector<TensorEntry> tensors_;
};

}  // namespace baton
