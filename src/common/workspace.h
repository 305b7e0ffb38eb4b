// Carving a caller's workspace into 256-byte-aligned regions, in order: the one rule every
// workspace layout (quant/layout.h, bwd/params.h, fp4/layout.h) follows. Plain C++.
#pragma once

#include <cstddef>

namespace sage {

struct WorkspaceCarver {
  size_t total = 0;  // bytes taken so far (the layout's size once every region is taken)
  // The offset of a new region of `bytes` (0 bytes: an empty region at the current end).
  size_t take(size_t bytes) {
    const size_t at = total;
    total += (bytes + 255) / 256 * 256;
    return at;
  }
};

}  // namespace sage
