#include "model/gguf_writer.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace baton {
namespace {

constexpr uint64_t kAlignment = 32;

template <typename T>
void put(std::vector<uint8_t>& out, T v) {
  const size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &v, sizeof(T));
}

void put_string(std::vector<uint8_t>& out, const std::string& s) {
  put<uint64_t>(out, s.size());
  const size_t at = out.size();
  out.resize(at + s.size());
  if (!s.empty()) std::memcpy(out.data() + at, s.data(), s.size());
}

}  // namespace

void GgufWriter::key(const std::string& k, GgufType type) {
  put_string(meta_, k);
  put<uint32_t>(meta_, static_cast<uint32_t>(type));
  ++n_kv_;
}

void GgufWriter::add_string(const std::string& k, const std::string& v) {
  key(k, GgufType::kString);
  put_string(meta_, v);
}
void GgufWriter::add_u32(const std::string& k, uint32_t v) {
  key(k, GgufType::kU32);
  put(meta_, v);
}
void GgufWriter::add_i32(const std::string& k, int32_t v) {
  key(k, GgufType::kI32);
  put(meta_, v);
}
void GgufWriter::add_f32(const std::string& k, float v) {
  key(k, GgufType::kF32);
  put(meta_, v);
}
void GgufWriter::add_bool(const std::string& k, bool v) {
  key(k, GgufType::kBool);
  put<uint8_t>(meta_, v ? 1 : 0);
}
void GgufWriter::add_string_array(const std::string& k, const std::vector<std::string>& values) {
  key(k, GgufType::kArray);
  put<uint32_t>(meta_, static_cast<uint32_t>(GgufType::kString));
  put<uint64_t>(meta_, values.size());
  for (const std::string& s : values) put_string(meta_, s);
}
void GgufWriter::add_i32_array(const std::string& k, const std::vector<int32_t>& values) {
  key(k, GgufType::kArray);
  put<uint32_t>(meta_, static_cast<uint32_t>(GgufType::kI32));
  put<uint64_t>(meta_, values.size());
  for (int32_t v : values) put(meta_, v);
}

void GgufWriter::add_f32_array(const std::string& k, const std::vector<float>& values) {
  key(k, GgufType::kArray);
  put<uint32_t>(meta_, static_cast<uint32_t>(GgufType::kF32));
  put<uint64_t>(meta_, values.size());
  for (float v : values) put(meta_, v);
}

void GgufWriter::add_tensor_f32(const std::string& name, const std::vector<uint64_t>& dims, std::vector<float> data) {
  uint64_t n = 1;
  for (uint64_t d : dims) n *= d;
  BATON_CHECK(n == data.size(), "tensor '%s' has %zu values for %lu elements", name.c_str(), data.size(),
              static_cast<unsigned long>(n));
  std::vector<uint8_t> bytes(data.size() * 4);
  std::memcpy(bytes.data(), data.data(), bytes.size());
  tensors_.push_back({name, dims, GgmlType::kF32, std::move(bytes)});
}

void GgufWriter::add_tensor_raw(const std::string& name, const std::vector<uint64_t>& dims, GgmlType type,
                                std::vector<uint8_t> bytes) {
  uint64_t n = 1;
  for (uint64_t d : dims) n *= d;
  const GgmlTypeTraits t = ggml_type_traits(type);
  BATON_CHECK(t.block_elems > 0 && n % t.block_elems == 0 && bytes.size() == n / t.block_elems * t.block_bytes,
              "tensor '%s': %zu bytes do not hold %lu elements of %s", name.c_str(), bytes.size(),
              static_cast<unsigned long>(n), ggml_type_name(type));
  tensors_.push_back({name, dims, type, std::move(bytes)});
}

std::vector<uint8_t> GgufWriter::to_bytes() const {
  std::vector<uint8_t> out;
  put<uint32_t>(out, 0x46554747);  // "GGUF"
  put<uint32_t>(out, 3);
  put<uint64_t>(out, tensors_.size());
  put<uint64_t>(out, n_kv_);
  out.insert(out.end(), meta_.begin(), meta_.end());
  uint64_t offset = 0;
  for (const TensorEntry& t : tensors_) {
    put_string(out, t.name);
    put<uint32_t>(out, static_cast<uint32_t>(t.dims.size()));
    for (uint64_t d : t.dims) put(out, d);
    put<uint32_t>(out, static_cast<uint32_t>(t.type));
    put<uint64_t>(out, offset);
    offset += (t.bytes.size() + kAlignment - 1) / kAlignment * kAlignment;
  }
  out.resize((out.size() + kAlignment - 1) / kAlignment * kAlignment, 0);
  for (const TensorEntry& t : tensors_) {
    out.insert(out.end(), t.bytes.begin(), t.bytes.end());
    out.resize((out.size() + kAlignment - 1) / kAlignment * kAlignment, 0);
  }
  return out;
}

Status GgufWriter::write(const std::string& path) const {
  std::vector<uint8_t> bytes = to_bytes();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return invalid_argument("cannot write '" + path + "': " + std::strerror(errno));
  const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  const bool closed = std::fclose(f) == 0;
  if (!ok || !closed) return invalid_argument("cannot write '" + path + "': " + std::strerror(errno));
  return {};
}

}  // namespace baton
