// The Hopper kernel's epilogue (sm_90a): each consumer warpgroup stores its 64 rows of a tile,
// O / l · v_scale + v_mean in the output dtype, and the LSE.
#pragma once

#include <cstdint>

#include "attn/epilogue.cuh"
#include "attn/sm90/params.h"
#include "attn/sm90/softmax.cuh"
#include "common/fragment.cuh"
#include "ptx/async.cuh"
#include "ptx/barrier.cuh"

namespace sage::sm90 {

// The tile's V scales and means, copied into this warpgroup's shared copy when the tile starts
// (cp.async: nothing waits until the epilogue; the copy alternates with the tile's parity, so the
// previous tile's epilogue may still read the other). Read from global memory in the epilogue,
// their load latency would sit exposed at the end of every tile, with nothing left to hide it
// under (docs/sm90-kernel.md, "Epilogue").
template <int D>
__device__ __forceinline__ void load_v_stats(const Params& p, float (&vst)[2][D], int64_t bhk) {
  for (int j = threadIdx.x % 128; j < 2 * D; j += 128)
    ptx::cp_async_4(&vst[j / D][j % D], (j < D ? p.v_scale : p.v_mean) + bhk * D + j % D);
  ptx::cp_async_commit();
}

// What attn::finalize reads of one tile's sequence: its query rows from row 0 (a dense call's
// batch entry b through the batch strides; a packed batch's sequence from its first token).
struct OutView {
  int64_t seq_q, head_dim;
  void* o;
  int64_t o_batch, o_head, o_token;
  float* lse;
  int64_t lse_batch, lse_head, lse_token;
  const float* lse_shift;
};

// Rows row_a and row_a + 8 of this thread: o[D/2] the wgmma accumulator (P~ · kPUnit · V^), m and
// l the rows' softmax state (l this thread's part of the row's sum of P^, in units of kPUnit too:
// softmax.cuh); seq_q, tok0_q, shift_row0:
// the tile's sequence (TileInfo). Waits for the V statistics and syncs the warpgroup (named
// barrier `bar`) first: the copy was issued by other threads of it.
template <int D, typename OutT>
__device__ __forceinline__ void store_tile(const Params& p, const float (&o)[D / 2],
                                           const float (&m)[2], float (&l)[2],
                                           const float (&vst)[2][D], int bar, int64_t b, int64_t h,
                                           int64_t row_a, int t, int64_t seq_q, int64_t tok0_q,
                                           int64_t shift_row0) {
  ptx::cp_async_wait<0>();
  ptx::named_bar_sync(bar, 128);
  const OutView v{seq_q,
                  p.head_dim,
                  static_cast<OutT*>(p.o) + tok0_q * p.o_token,
                  p.o_batch,
                  p.o_head,
                  p.o_token,
                  p.lse ? p.lse + tok0_q * p.lse_token : nullptr,
                  p.lse_batch,
                  p.lse_head,
                  p.lse_token,
                  p.lse_shift + shift_row0};
  attn::finalize<D, OutT, kPUnit, kPUnit>(
      v, [&](int i, int e) { return o[Frag::reg(i, e)]; }, m, l, b, h, /*bh=*/0, row_a, t, vst[0],
      vst[1]);
}

}  // namespace sage::sm90
