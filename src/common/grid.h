// Grids with more "outer" indices (batch × heads, sequences × heads) than CUDA's 65535 limit on
// gridDim.y and gridDim.z: a count n is spread over (y, z), and each CTA recovers its linear index
// once, in its prologue (one 64-bit division per CTA for (b, h), none in a loop). The index math
// is plain host+device code, so the CPU tests check it (tests/cpu/test_grid.cpp). Any
// architecture; the launch and blockIdx helpers need nvcc.
#pragma once

#include <cstdint>

#include "common/formats.h"  // SAGE_HOST_DEVICE

namespace sage {

constexpr int64_t kGridYZMax = 65535;                       // gridDim.y and gridDim.z
constexpr int64_t kGridOuterMax = kGridYZMax * kGridYZMax;  // the most (y, z) can carry
constexpr int64_t kGridXMax = (int64_t(1) << 31) - 1;       // gridDim.x

struct OuterGrid {
  uint32_t y, z;
};

// n outer indices (1 <= n <= kGridOuterMax) as gridDim (y, z): z = ⌈n / 65535⌉ rows of
// y = ⌈n / z⌉, so y·z >= n with fewer than z spare slots (their CTAs return at once). n <= 65535
// gives (n, 1): the one-dimensional grid, its CTAs in the same order. (n < 1: (1, 1), a grid whose
// one slot is spare.)
SAGE_HOST_DEVICE constexpr OuterGrid outer_grid(int64_t n) {
  if (n < 1) return {1u, 1u};
  const int64_t z = (n + kGridYZMax - 1) / kGridYZMax;
  return {uint32_t((n + z - 1) / z), uint32_t(z)};
}

// The linear outer index of the CTA at (y, z) in a grid of grid_y columns: z·grid_y + y. A grid
// walks x fastest, then y, then z, so CTAs of the same index are consecutive, and those of a lower
// index come before them. Every CTA of a cluster along x shares it.
SAGE_HOST_DEVICE constexpr int64_t outer_index(uint32_t y, uint32_t z, uint32_t grid_y) {
  return int64_t(z) * grid_y + y;
}

// Outer index i of a (batch, heads) grid, head fastest: b = i / heads, h = i % heads.
struct BatchHead {
  int64_t b, h;
};
SAGE_HOST_DEVICE constexpr BatchHead batch_head(int64_t i, int64_t heads) {
  return {i / heads, i % heads};
}

}  // namespace sage

#if defined(__CUDACC__)
#include <cuda_runtime.h>

namespace sage {

// The grid (x, y, z) for x CTAs along x times n outer indices.
inline dim3 outer_dims(int64_t x, int64_t n) {
  const OuterGrid g = outer_grid(n);
  return dim3(unsigned(x), g.y, g.z);
}

// This CTA's outer index; a kernel returns at once (the whole CTA, before any barrier) when it is
// past its count.
__device__ __forceinline__ int64_t cta_outer_index() {
  return outer_index(blockIdx.y, blockIdx.z, gridDim.y);
}

}  // namespace sage
#endif
