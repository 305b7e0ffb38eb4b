// The accumulator fragment that mma.sync and wgmma share, written once. A warp holds a 16-row x
// N-column tile (mma.sync: N/8 m16n8 tiles side by side; wgmma: the warp's 16 rows of an m64nN),
// and thread (g = lane / 4, t = lane % 4) holds N/2 values. Value (n, e), element e of 8-column
// tile n, is register i = 4n + e (the wgmma's flat accumulator; the mma.sync kernels keep
// [n][e] arrays) and sits at
//   row g + 8·(e / 2)       ("half" e / 2: the thread's first or second row),
//   column 8n + 2t + (e & 1).
// So the four threads of a quad (same g) hold the whole of their two rows: a row's max or sum is
// a reduction over the quad (quad_max, quad_sum). An 8-bit A operand of a k32 MMA step over
// those columns (the E4M3 P̃ of P̃·V, the INT8 P^ᵀ and dS^ᵀ of the backward) is four 32-bit
// registers per 32 columns whose bytes are the same values: to_a8.
#pragma once

#include <cstdint>

#include "ptx/math.cuh"  // max_nan

namespace sage {

struct Frag {
  // Register i's tile, element, half (0: row g, 1: row g + 8) and column.
  __device__ __forceinline__ static constexpr int tile(int i) { return i / 4; }
  __device__ __forceinline__ static constexpr int elem(int i) { return i % 4; }
  __device__ __forceinline__ static constexpr int half(int i) { return (i / 2) & 1; }
  __device__ __forceinline__ static constexpr int col(int i, int t) {
    return (i / 4) * 8 + 2 * t + (i & 1);
  }
  // Value (n, e): its register, and its column.
  __device__ __forceinline__ static constexpr int reg(int n, int e) { return 4 * n + e; }
  __device__ __forceinline__ static constexpr int col(int n, int e, int t) {
    return n * 8 + 2 * t + (e & 1);
  }
  // The first of the thread's two adjacent columns in tile n (a float2 / two-value store), and
  // that element of a row at `row` (added in this order, as address arithmetic is scheduled).
  __device__ __forceinline__ static constexpr int pair(int n, int t) { return n * 8 + 2 * t; }
  template <typename Ptr>
  __device__ __forceinline__ static Ptr at_pair(Ptr row, int n, int t) {
    return row + n * 8 + 2 * t;
  }
  // Value (n, e)'s column counted from `first` (a key or channel index; the same order).
  template <typename Int>
  __device__ __forceinline__ static Int at_col(Int first, int n, int e, int t) {
    return first + n * 8 + 2 * t + (e & 1);
  }
  // The j-th register of half r in column order (j < N/4): tile j / 2, column 2t + (j & 1).
  __device__ __forceinline__ static constexpr int of_half(int r, int j) {
    return 4 * (j / 2) + 2 * r + (j & 1);
  }
  // Which span of kCols columns register i lies in (a K-scale group, a partial-sum group).
  template <int kCols>
  __device__ __forceinline__ static constexpr int span(int i) {
    return i / (kCols / 2);
  }

  // The max (NaN-keeping) and the sum of x over the quad: over a row, from each thread's part.
  __device__ __forceinline__ static float quad_max(float x) {
    x = ptx::max_nan(x, __shfl_xor_sync(0xFFFFFFFFu, x, 1));
    return ptx::max_nan(x, __shfl_xor_sync(0xFFFFFFFFu, x, 2));
  }
  __device__ __forceinline__ static float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
  }

  // The 8-bit A operand of k32 steps from the fragment: register r of step c holds half r % 2
  // of tiles n0 = 4c + 2·(r / 2) and n0 + 1, two values (e & 1 = 0, 1) of each, in byte order
  // (n0, 0), (n0, 1), (n0 + 1, 0), (n0 + 1, 1). quad(n0, h) packs those four bytes of half h.
  template <int kSteps, typename Quad>
  __device__ __forceinline__ static void to_a8(uint32_t (&a)[kSteps][4], Quad quad) {
#pragma unroll
    for (int c = 0; c < kSteps; ++c)
#pragma unroll
      for (int r = 0; r < 4; ++r) a[c][r] = quad(4 * c + 2 * (r / 2), r % 2);
  }
};

}  // namespace sage
