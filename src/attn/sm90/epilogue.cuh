// The Hopper kernel's epilogue (sm_90a): each consumer warpgroup stores its 64 rows of a tile,
// O / l · v_scale + v_mean in the output dtype, and the LSE.
#pragma once

#include <cstdint>

#include "attn/epilogue.cuh"
#include "attn/sm90/params.h"
#include "ptx/async.cuh"
#include "ptx/barrier.cuh"

namespace sage::sm90 {

// The tile's V scales and means, copied into this warpgroup's shared copy when the tile starts
// (cp.async: nothing waits until the epilogue; the copy alternates with the tile's parity, so the
// previous tile's epilogue may still read the other). Read from global memory in the epilogue,
// their load latency sat exposed in every tile's epilogue: 25-30 % of the stall samples at
// N = 1k.
template <int D>
__device__ __forceinline__ void load_v_stats(const Params& p, float (&vst)[2][D], int64_t bhk) {
  for (int j = threadIdx.x % 128; j < 2 * D; j += 128)
    ptx::cp_async_4(&vst[j / D][j % D], (j < D ? p.v_scale : p.v_mean) + bhk * D + j % D);
  ptx::cp_async_commit();
}

// Rows row_a and row_a + 8 of this thread: o[D/2] the wgmma accumulator (P~ · 448 · V^), m and l
// the rows' softmax state. Waits for the V statistics and syncs the warpgroup (named barrier
// `bar`) first: the copy was issued by other threads of it.
template <int D, typename OutT>
__device__ __forceinline__ void store_tile(const Params& p, const float (&o)[D / 2],
                                           const float (&m)[2], float (&l)[2],
                                           const float (&vst)[2][D], int bar, int64_t b, int64_t h,
                                           int64_t bh, int64_t row_a, int t) {
  ptx::cp_async_wait<0>();
  ptx::named_bar_sync(bar, 128);
  attn::finalize<D, OutT, 448>(
      p, [&](int i, int e) { return o[4 * i + e]; }, m, l, b, h, bh, row_a, t, vst[0], vst[1]);
}

}  // namespace sage::sm90
