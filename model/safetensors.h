// A safetensors file, mapped read-only: an 8-byte little-endian header length, a JSON header
// naming each tensor's dtype, shape and byte range, then the bytes. Hugging Face model
// directories hold their weights in one or several of these (model.safetensors, or shards listed
// by model.safetensors.index.json).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/file_mapping.h"
#include "model/gguf.h"

namespace baton {

struct SafetensorInfo {
  GgmlType type = GgmlType::kF32;  // F32, F16 or BF16: the dtypes baton reads
  std::vector<uint64_t> shape;     // as stored: row-major, the last dimension fastest
  std::span<const uint8_t> data;   // inside the mapping
};

class SafetensorsFile {
 public:
  // Maps `path` and checks the header: valid JSON, every tensor's byte range inside the file and
  // as long as its dtype and shape say. A dtype other than F32, F16 or BF16 is UNIMPLEMENTED,
  // naming the tensor: an integer or 8-bit float checkpoint is not read as something else.
  static Result<std::unique_ptr<SafetensorsFile>> open(const std::string& path);
  // The same over an in-memory copy (tests, fuzzing); `bytes` is copied.
  static Result<std::unique_ptr<SafetensorsFile>> parse(std::span<const uint8_t> bytes, const std::string& name);

  ~SafetensorsFile() = default;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, SafetensorInfo>& tensors() const { return tensors_; }
  const SafetensorInfo* tensor(const std::string& name) const;

 private:
  SafetensorsFile() = default;
  Status parse_header();

  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::unique_ptr<FileMapping> mapping_;  // the mapped file (open), or null (parse)
  std::vector<uint8_t> owned_;  // copied bytes (parse)
  std::map<std::string, SafetensorInfo> tensors_;
};

}  // namespace baton
