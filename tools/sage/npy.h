// Minimal .npy reader for the `sage` tool: little-endian float16 / float32, C order.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sage::tool {

struct NpyArray {
  std::vector<int64_t> shape;
  bool is_fp16 = false;           // else float32
  std::vector<uint8_t> bytes;     // raw element data
};

// Reads `path`; on failure returns false and explains in *error.
bool read_npy(const std::string& path, NpyArray* out, std::string* error);

}  // namespace sage::tool
