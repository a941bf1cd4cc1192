// Writes float32 arrays as NumPy .npy files (format 1.0, little-endian, C order).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"

namespace baton {

Status write_npy_f32(const std::string& path, std::span<const float> data, const std::vector<int64_t>& shape);

}  // namespace baton
