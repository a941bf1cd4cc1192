// Writes GGUF v3 files: metadata and F32 tensors. Used by `baton tools make-test-model`, by
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
  // A tensor of `dims` (ggml order: dims[0] fastest) holding `data` (product of dims floats).
  void add_tensor_f32(const std::string& name, const std::vector<uint64_t>& dims, std::vector<float> data);

  std::vector<uint8_t> to_bytes() const;
  Status write(const std::string& path) const;

 private:
  struct TensorEntry {
    std::string name;
    std::vector<uint64_t> dims;
    std::vector<float> data;
  };
  void key(const std::string& k, GgufType type);

  std::vector<uint8_t> meta_;  // serialised key/value pairs
  uint64_t n_kv_ = 0;
  std::vector<TensorEntry> tensors_;
};

}  // namespace baton
