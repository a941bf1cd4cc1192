#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

namespace baton {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100 << 20;  // the format's own limit

// The ggml type of a safetensors dtype baton reads, and its element size.
bool dtype_of(const std::string& dtype, GgmlType* type, uint64_t* bytes) {
  if (dtype == "F32") {
    *type = GgmlType::kF32;
    *bytes = 4;
  } else if (dtype == "F16" || dtype == "BF16") {
    *type = dtype == "F16" ? GgmlType::kF16 : GgmlType::kBF16;
    *bytes = 2;
  } else {
    return false;
  }
  return true;
}

}  // namespace

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::open(const std::string& path) {
  BATON_ASSIGN_OR_RETURN(auto mapping, FileMapping::open(path, "'" + path + "'"));
  auto file = std::unique_ptr<SafetensorsFile>(new SafetensorsFile());
  file->path_ = path;
  file->data_ = mapping->data();
  file->size_ = mapping->size();
  file->mapping_ = std::move(mapping);
  if (Status s = file->parse_header(); !s.ok()) return Status(s.code(), "'" + path + "': " + s.message());
  return file;
}

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::parse(std::span<const uint8_t> bytes,
                                                                const std::string& name) {
  auto file = std::unique_ptr<SafetensorsFile>(new SafetensorsFile());
  file->path_ = name;
  file->owned_.assign(bytes.begin(), bytes.end());
  file->data_ = file->owned_.data();
  file->size_ = file->owned_.size();
  if (Status s = file->parse_header(); !s.ok()) return Status(s.code(), "'" + name + "': " + s.message());
  return file;
}

Status SafetensorsFile::parse_header() {
  if (size_ < 8) return invalid_argument("too short for a safetensors file (" + std::to_string(size_) + " bytes)");
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = header_bytes << 8 | data_[i];
  if (header_bytes > kMaxHeaderBytes || header_bytes > size_ - 8) {
    return invalid_argument("safetensors header of " + std::to_string(header_bytes) + " bytes does not fit the file");
  }
  const auto* begin = reinterpret_cast<const char*>(data_ + 8);
  const nlohmann::json header = nlohmann::json::parse(begin, begin + header_bytes, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object())
    return invalid_argument("the safetensors header is not a JSON object");
  const uint64_t base = 8 + header_bytes;
  const uint64_t body = size_ - base;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    const std::string& tensor = name;  // (clang 14 cannot capture a structured binding)
    const auto bad = [&](const std::string& why) { return invalid_argument("tensor '" + tensor + "': " + why); };
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") || !entry.contains("data_offsets")) {
      return bad("needs dtype, shape and data_offsets");
    }
    const auto& dtype = entry.at("dtype");
    const auto& shape = entry.at("shape");
    const auto& offsets = entry.at("data_offsets");
    if (!dtype.is_string() || !shape.is_array() || !offsets.is_array() || offsets.size() != 2) {
      return bad("malformed dtype, shape or data_offsets");
    }
    SafetensorInfo info;
    uint64_t elem_bytes = 0;
    if (!dtype_of(dtype.get<std::string>(), &info.type, &elem_bytes)) {
      return unimplemented("tensor '" + name + "' is " + dtype.get<std::string>() +
                           ": baton reads F32, F16 and BF16 safetensors (no integer or 8-bit float weights)");
    }
    uint64_t n = 1;
    for (const auto& d : shape) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > (uint64_t{1} << 40)) return bad("malformed shape");
      info.shape.push_back(d.get<uint64_t>());
      n *= info.shape.back();
      if (n > (uint64_t{1} << 40)) return bad("too many elements");
    }
    if (!offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned()) return bad("malformed data_offsets");
    const uint64_t lo = offsets[0].get<uint64_t>(), hi = offsets[1].get<uint64_t>();
    if (lo > hi || hi > body)
      return bad("data_offsets [" + std::to_string(lo) + ", " + std::to_string(hi) + ") outside the file");
    if (hi - lo != n * elem_bytes) {
      return bad(std::to_string(hi - lo) + " bytes for " + std::to_string(n) + " " + dtype.get<std::string>() +
                 " elements");
    }
    info.data = std::span<const uint8_t>(data_ + base + lo, hi - lo);
    tensors_.emplace(name, std::move(info));
  }
  return Status::ok_status();
}

const SafetensorInfo* SafetensorsFile::tensor(const std::string& name) const {
  const auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

}  // namespace baton
