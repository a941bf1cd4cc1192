#include "common/npy.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace baton {

Status write_npy_f32(const std::string& path, std::span<const float> data, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  std::string dims;
  for (int64_t d : shape) {
    n *= d;
    dims += std::to_string(d) + ",";
  }
  BATON_CHECK(n == static_cast<int64_t>(data.size()), "npy shape holds %ld values, data %zu", static_cast<long>(n),
              data.size());
  if (shape.size() > 1) dims.pop_back();  // (n,) keeps its comma; (a, b) does not need one
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + dims + "), }";
  // Magic (6) + version (2) + header length (2) + header, padded with spaces to a multiple of 64
  // and ended by a newline.
  const size_t total = (10 + header.size() + 1 + 63) / 64 * 64;
  header.append(total - 10 - header.size() - 1, ' ');
  header += '\n';
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return invalid_argument("cannot write '" + path + "': " + std::strerror(errno));
  const uint8_t magic[8] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
  const uint16_t hlen = static_cast<uint16_t>(header.size());
  bool ok = std::fwrite(magic, 1, 8, f) == 8 && std::fwrite(&hlen, 2, 1, f) == 1 &&
            std::fwrite(header.data(), 1, header.size(), f) == header.size() &&
            std::fwrite(data.data(), sizeof(float), data.size(), f) == data.size();
  ok = std::fclose(f) == 0 && ok;
  if (!ok) return invalid_argument("cannot write '" + path + "': " + std::strerror(errno));
  return {};
}

}  // namespace baton
