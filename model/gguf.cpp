#include "model/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>

namespace baton {
namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" little-endian
// Caps that no real model reaches; they bound what a lying header can make us allocate.
constexpr uint64_t kMaxKeys = 1u << 20;
constexpr uint64_t kMaxTensors = 1u << 20;
constexpr uint64_t kMaxStringBytes = 1u << 26;   // 64 MiB (chat templates are a few KiB)
constexpr uint64_t kMaxArrayElems = 1u << 26;
constexpr uint32_t kMaxDims = 4;
constexpr int kMaxNesting = 2;

// A bounds-checked little-endian cursor over the file's bytes.
class Cursor {
 public:
  Cursor(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  size_t pos() const { return pos_; }
  size_t left() const { return size_ - pos_; }

  template <typename T>
  Status read(T* out, const char* what) {
    if (left() < sizeof(T)) return truncated(what, sizeof(T));
    std::memcpy(out, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return {};
  }

  Status read_string(std::string* out, const char* what) {
    uint64_t len = 0;
    BATON_RETURN_IF_ERROR(read(&len, what));
    if (len > kMaxStringBytes) {
      return invalid_argument("GGUF " + std::string(what) + " claims a string of " +
                              std::to_string(len) + " bytes at offset " + std::to_string(pos_ - 8) +
                              " (limit " + std::to_string(kMaxStringBytes) + ")");
    }
    if (left() < len) return truncated(what, len);
    out->assign(reinterpret_cast<const char*>(data_ + pos_), len);
    pos_ += len;
    return {};
  }

 private:
  Status truncated(const char* what, uint64_t need) const {
    return data_loss("GGUF file is truncated: reading " + std::string(what) + " needs " +
                     std::to_string(need) + " bytes at offset " + std::to_string(pos_) + ", only " +
                     std::to_string(left()) + " left");
  }

  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

bool valid_value_type(uint32_t t) { return t <= static_cast<uint32_t>(GgufType::kF64); }

Status read_scalar(Cursor& c, GgufType type, GgufValue* v, const std::string& key) {
  const char* what = "a metadata value";
  switch (type) {
    case GgufType::kU8: { uint8_t x = 0; BATON_RETURN_IF_ERROR(c.read(&x, what)); v->u = x; v->i = x; return {}; }
    case GgufType::kI8: { int8_t x = 0; BATON_RETURN_IF_ERROR(c.read(&x, what)); v->i = x; v->u = static_cast<uint64_t>(x); return {}; }
    case GgufType::kU16: { uint16_t x = 0; BATON_RETURN_IF_ERROR(c.read(&x, what)); v->u = x; v->i = x; return {}; }
    case GgufType::kI16: { int16_t x = 0; BATON_RETURN_IF_ERROR(c.read(&x, what)); v->i = x; v->u = static_cast<uint64_t>(x); return {}; }
    case GgufType::kU32: { uint32_t x = 0; BATON_RETURN_IF_ERROR(c.read(&x, what)); v->u = x; v->i = x; return {}; }
    case GgufType::kI32: { int32_t x = 0; BATON_RETURN_IF_ERROR(c.read(&x, what)); v->i = x; v->u = static_cast<uint64_t>(x); return {}; }
    case GgufType::kU64: { uint64_t x = 0; BATON_RETURN_IF_ERROR(c.read(&x, what)); v->u = x; v->i = static_cast<int64_t>(x); return {}; }
    case GgufType::kI64: { int64_t x = 0; BATON_RETURN_IF_ERROR(c.read(&x, what)); v->i = x; v->u = static_cast<uint64_t>(x); return {}; }
    case GgufType::kF32: { float x = 0; BATON_RETURN_IF_ERROR(c.read(&x, what)); v->f = x; return {}; }
    case GgufType::kF64: { double x = 0; BATON_RETURN_IF_ERROR(c.read(&x, what)); v->f = x; return {}; }
    case GgufType::kBool: {
      uint8_t x = 0;
      BATON_RETURN_IF_ERROR(c.read(&x, what));
      if (x > 1) return invalid_argument("GGUF metadata key '" + key + "' holds a bool of value " + std::to_string(x));
      v->i = x; v->u = x;
      return {};
    }
    case GgufType::kString: return c.read_string(&v->s, "a metadata string");
    case GgufType::kArray: break;
  }
  return invalid_argument("GGUF metadata key '" + key + "' has an invalid scalar type");
}

// Smallest number of bytes one element of `type` takes in the file (strings: their length field).
uint64_t min_elem_bytes(GgufType type) {
  switch (type) {
    case GgufType::kU8: case GgufType::kI8: case GgufType::kBool: return 1;
    case GgufType::kU16: case GgufType::kI16: return 2;
    case GgufType::kU32: case GgufType::kI32: case GgufType::kF32: return 4;
    default: return 8;
  }
}

Status read_value(Cursor& c, GgufType type, GgufValue* v, const std::string& key, int depth) {
  v->type = type;
  if (type != GgufType::kArray) return read_scalar(c, type, v, key);
  if (depth >= kMaxNesting) return invalid_argument("GGUF metadata key '" + key + "' nests arrays too deeply");
  uint32_t elem = 0;
  uint64_t n = 0;
  BATON_RETURN_IF_ERROR(c.read(&elem, "an array element type"));
  if (!valid_value_type(elem)) {
    return invalid_argument("GGUF metadata key '" + key + "' has unknown array element type " + std::to_string(elem));
  }
  BATON_RETURN_IF_ERROR(c.read(&n, "an array length"));
  v->elem_type = static_cast<GgufType>(elem);
  if (v->elem_type == GgufType::kArray) {
    return unimplemented("GGUF metadata key '" + key + "' is an array of arrays, which baton does not read");
  }
  // A length the remaining bytes cannot hold is a lie: refuse before allocating for it.
  if (n > kMaxArrayElems || n > c.left() / min_elem_bytes(v->elem_type)) {
    return invalid_argument("GGUF metadata key '" + key + "' claims " + std::to_string(n) +
                            " array elements, more than the file holds");
  }
  GgufValue item;
  for (uint64_t k = 0; k < n; ++k) {
    BATON_RETURN_IF_ERROR(read_scalar(c, v->elem_type, &item, key));
    item.type = v->elem_type;
    if (v->elem_type == GgufType::kString) {
      v->strings.push_back(std::move(item.s));
    } else if (item.is_float()) {
      v->floats.push_back(item.f);
    } else {
      v->ints.push_back(item.i);
    }
  }
  return {};
}

bool mul_overflows(uint64_t a, uint64_t b, uint64_t* out) { return __builtin_mul_overflow(a, b, out); }

}  // namespace

bool GgufValue::is_integer() const {
  switch (type) {
    case GgufType::kU8: case GgufType::kI8: case GgufType::kU16: case GgufType::kI16:
    case GgufType::kU32: case GgufType::kI32: case GgufType::kU64: case GgufType::kI64:
    case GgufType::kBool:
      return true;
    default:
      return false;
  }
}

const char* ggml_type_name(GgmlType type) {
  switch (type) {
    case GgmlType::kF32: return "F32";
    case GgmlType::kF16: return "F16";
    case GgmlType::kQ4_0: return "Q4_0";
    case GgmlType::kQ4_1: return "Q4_1";
    case GgmlType::kQ5_0: return "Q5_0";
    case GgmlType::kQ5_1: return "Q5_1";
    case GgmlType::kQ8_0: return "Q8_0";
    case GgmlType::kQ8_1: return "Q8_1";
    case GgmlType::kQ2_K: return "Q2_K";
    case GgmlType::kQ3_K: return "Q3_K";
    case GgmlType::kQ4_K: return "Q4_K";
    case GgmlType::kQ5_K: return "Q5_K";
    case GgmlType::kQ6_K: return "Q6_K";
    case GgmlType::kQ8_K: return "Q8_K";
    case GgmlType::kIQ4_NL: return "IQ4_NL";
    case GgmlType::kIQ4_XS: return "IQ4_XS";
    case GgmlType::kBF16: return "BF16";
  }
  return "unknown";
}

GgmlTypeTraits ggml_type_traits(GgmlType type) {
  switch (type) {
    case GgmlType::kF32: return {1, 4};
    case GgmlType::kF16: return {1, 2};
    case GgmlType::kBF16: return {1, 2};
    case GgmlType::kQ4_0: return {32, 18};
    case GgmlType::kQ4_1: return {32, 20};
    case GgmlType::kQ5_0: return {32, 22};
    case GgmlType::kQ5_1: return {32, 24};
    case GgmlType::kQ8_0: return {32, 34};
    case GgmlType::kQ8_1: return {32, 36};
    case GgmlType::kQ2_K: return {256, 84};
    case GgmlType::kQ3_K: return {256, 110};
    case GgmlType::kQ4_K: return {256, 144};
    case GgmlType::kQ5_K: return {256, 176};
    case GgmlType::kQ6_K: return {256, 210};
    case GgmlType::kQ8_K: return {256, 292};
    case GgmlType::kIQ4_NL: return {32, 18};
    case GgmlType::kIQ4_XS: return {256, 136};
  }
  return {};
}

Result<std::unique_ptr<GgufFile>> GgufFile::open(const std::string& path) {
  BATON_ASSIGN_OR_RETURN(auto mapping, FileMapping::open(path, "model file '" + path + "'"));
  auto file = std::unique_ptr<GgufFile>(new GgufFile());
  file->path_ = path;
  file->data_ = mapping->data();
  file->size_ = mapping->size();
  file->mapping_ = std::move(mapping);
  Status s = file->parse_all();
  if (!s.ok()) return Status(s.code(), "'" + path + "': " + s.message());
  return file;
}

Result<std::unique_ptr<GgufFile>> GgufFile::parse(std::span<const uint8_t> bytes) {
  auto file = std::unique_ptr<GgufFile>(new GgufFile());
  file->path_ = "<memory>";
  file->owned_.assign(bytes.begin(), bytes.end());
  file->data_ = file->owned_.data();
  file->size_ = file->owned_.size();
  BATON_RETURN_IF_ERROR(file->parse_all());
  return file;
}

Status GgufFile::parse_all() {
  Cursor c(data_, size_);
  uint32_t magic = 0;
  if (size_ < 4) return data_loss("file is too small to be GGUF (" + std::to_string(size_) + " bytes)");
  BATON_RETURN_IF_ERROR(c.read(&magic, "the magic"));
  if (magic != kMagic) return invalid_argument("not a GGUF file (bad magic)");
  BATON_RETURN_IF_ERROR(c.read(&version_, "the version"));
  if (version_ != 2 && version_ != 3) {
    return unimplemented("GGUF version " + std::to_string(version_) + " is not supported (only 2 and 3)");
  }
  uint64_t n_tensors = 0, n_kv = 0;
  BATON_RETURN_IF_ERROR(c.read(&n_tensors, "the tensor count"));
  BATON_RETURN_IF_ERROR(c.read(&n_kv, "the metadata count"));
  if (n_kv > kMaxKeys) return invalid_argument("GGUF header claims " + std::to_string(n_kv) + " metadata keys");
  if (n_tensors > kMaxTensors) return invalid_argument("GGUF header claims " + std::to_string(n_tensors) + " tensors");

  for (uint64_t k = 0; k < n_kv; ++k) {
    std::string key;
    uint32_t type = 0;
    BATON_RETURN_IF_ERROR(c.read_string(&key, "a metadata key"));
    BATON_RETURN_IF_ERROR(c.read(&type, "a metadata type"));
    if (!valid_value_type(type)) {
      return invalid_argument("GGUF metadata key '" + key + "' has unknown type " + std::to_string(type));
    }
    GgufValue v;
    BATON_RETURN_IF_ERROR(read_value(c, static_cast<GgufType>(type), &v, key, 0));
    if (kv_.count(key) != 0) return invalid_argument("GGUF metadata key '" + key + "' appears twice");
    key_order_.push_back(key);
    kv_.emplace(std::move(key), std::move(v));
  }

  uint64_t alignment = 32;
  if (const GgufValue* a = find("general.alignment")) {
    if (!a->is_integer() || a->u == 0 || a->u > (1u << 20) || (a->u & (a->u - 1)) != 0) {
      return invalid_argument("GGUF general.alignment must be a power of two up to 1 MiB");
    }
    alignment = a->u;
  }

  tensors_.reserve(static_cast<size_t>(std::min<uint64_t>(n_tensors, c.left() / 24)));
  for (uint64_t t = 0; t < n_tensors; ++t) {
    GgufTensorInfo info;
    uint32_t n_dims = 0, type = 0;
    uint64_t rel_offset = 0;
    BATON_RETURN_IF_ERROR(c.read_string(&info.name, "a tensor name"));
    BATON_RETURN_IF_ERROR(c.read(&n_dims, "a tensor's dimension count"));
    if (n_dims == 0 || n_dims > kMaxDims) {
      return invalid_argument("tensor '" + info.name + "' has " + std::to_string(n_dims) + " dimensions (1 to 4 allowed)");
    }
    info.n_elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      uint64_t dim = 0;
      BATON_RETURN_IF_ERROR(c.read(&dim, "a tensor dimension"));
      if (dim == 0 || mul_overflows(info.n_elements, dim, &info.n_elements) || info.n_elements > (1ull << 40)) {
        return invalid_argument("tensor '" + info.name + "' has an invalid shape");
      }
      info.dims.push_back(dim);
    }
    BATON_RETURN_IF_ERROR(c.read(&type, "a tensor type"));
    BATON_RETURN_IF_ERROR(c.read(&rel_offset, "a tensor offset"));
    info.type = static_cast<GgmlType>(type);
    GgmlTypeTraits traits = ggml_type_traits(info.type);
    if (traits.block_elems == 0) {
      return unimplemented("tensor '" + info.name + "' has ggml type " + std::to_string(type) + ", which baton does not know");
    }
    if (info.dims[0] % traits.block_elems != 0) {
      return invalid_argument("tensor '" + info.name + "' has rows of " + std::to_string(info.dims[0]) +
                              " elements, not a multiple of the " + ggml_type_name(info.type) + " block size");
    }
    if (mul_overflows(info.n_elements / traits.block_elems, traits.block_bytes, &info.n_bytes)) {
      return invalid_argument("tensor '" + info.name + "' is too large");
    }
    if (rel_offset % alignment != 0) {
      return invalid_argument("tensor '" + info.name + "' data offset is not aligned to " + std::to_string(alignment));
    }
    info.offset = rel_offset;  // made absolute below, once the data section's start is known
    if (tensor_index_.count(info.name) != 0) return invalid_argument("tensor '" + info.name + "' appears twice");
    tensor_index_.emplace(info.name, tensors_.size());
    tensors_.push_back(std::move(info));
  }

  // The data section starts at the next multiple of the alignment after the tensor infos.
  uint64_t data_start = (c.pos() + alignment - 1) / alignment * alignment;
  for (GgufTensorInfo& info : tensors_) {
    uint64_t begin = 0, end = 0;
    if (__builtin_add_overflow(data_start, info.offset, &begin) ||
        __builtin_add_overflow(begin, info.n_bytes, &end) || end > size_) {
      return data_loss("GGUF file is truncated: tensor '" + info.name + "' needs bytes up to offset " +
                       std::to_string(end) + " but the file has " + std::to_string(size_));
    }
    info.offset = begin;
  }
  return {};
}

const GgufValue* GgufFile::find(std::string_view key) const {
  auto it = kv_.find(std::string(key));
  return it == kv_.end() ? nullptr : &it->second;
}

Result<std::string> GgufFile::get_string(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return not_found("GGUF metadata key '" + std::string(key) + "' is missing");
  if (v->type != GgufType::kString) return invalid_argument("GGUF metadata key '" + std::string(key) + "' is not a string");
  return v->s;
}

Result<int64_t> GgufFile::get_int(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return not_found("GGUF metadata key '" + std::string(key) + "' is missing");
  if (!v->is_integer()) return invalid_argument("GGUF metadata key '" + std::string(key) + "' is not an integer");
  return v->i;
}

Result<double> GgufFile::get_float(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return not_found("GGUF metadata key '" + std::string(key) + "' is missing");
  if (v->is_float()) return v->f;
  if (v->is_integer()) return static_cast<double>(v->i);
  return invalid_argument("GGUF metadata key '" + std::string(key) + "' is not a number");
}

Result<bool> GgufFile::get_bool(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return not_found("GGUF metadata key '" + std::string(key) + "' is missing");
  if (!v->is_integer()) return invalid_argument("GGUF metadata key '" + std::string(key) + "' is not a bool");
  return v->i != 0;
}

Result<std::vector<std::string>> GgufFile::get_string_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return not_found("GGUF metadata key '" + std::string(key) + "' is missing");
  if (!v->is_array() || v->elem_type != GgufType::kString) {
    return invalid_argument("GGUF metadata key '" + std::string(key) + "' is not an array of strings");
  }
  return v->strings;
}

const std::vector<std::string>* GgufFile::string_array(std::string_view key) const {
  const GgufValue* v = find(key);
  return v != nullptr && v->is_array() && v->elem_type == GgufType::kString ? &v->strings : nullptr;
}

const std::vector<int64_t>* GgufFile::int_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr || !v->is_array() || v->elem_type == GgufType::kString) return nullptr;
  if (v->elem_type == GgufType::kF32 || v->elem_type == GgufType::kF64) return nullptr;
  return &v->ints;
}

const std::vector<double>* GgufFile::float_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr || !v->is_array()) return nullptr;
  if (v->elem_type != GgufType::kF32 && v->elem_type != GgufType::kF64) return nullptr;
  return &v->floats;
}

const GgufTensorInfo* GgufFile::tensor(std::string_view name) const {
  auto it = tensor_index_.find(std::string(name));
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

std::span<const uint8_t> GgufFile::tensor_data(const GgufTensorInfo& info) const {
  return {data_ + info.offset, static_cast<size_t>(info.n_bytes)};
}

}  // namespace baton
