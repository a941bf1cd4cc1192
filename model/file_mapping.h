// A regular file mapped read-only (MAP_PRIVATE): how GgufFile and SafetensorsFile hold a model's
// bytes without copying them. Unmapped when destroyed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"

namespace baton {

class FileMapping {
 public:
  // `label` names the file in errors ("model file 'x.gguf'"): NOT_FOUND when it cannot be
  // opened, INVALID_ARGUMENT when it is no regular file or cannot be mapped.
  static Result<std::unique_ptr<FileMapping>> open(const std::string& path, const std::string& label);
  ~FileMapping();
  FileMapping(const FileMapping&) = delete;
  FileMapping& operator=(const FileMapping&) = delete;

  const uint8_t* data() const { return static_cast<const uint8_t*>(mapping_); }
  size_t size() const { return size_; }

 private:
  FileMapping() = default;
  void* mapping_ = nullptr;  // null for an empty file
  size_t size_ = 0;
};

}  // namespace baton
