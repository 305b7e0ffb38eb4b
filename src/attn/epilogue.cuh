// Pieces both SageAttention2 kernels (attn/mma, attn/sm90) share (each with its own params struct:
// the fields used here have the same names), for the accumulator layout they have in common: a warp owns 16 query rows, a thread rows g and g+8 and, per 8-column tile,
// columns 2t and 2t+1 (element e of a tile: row g + 8·(e/2), column 2t + e%2).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/fragment.cuh"
#include "ptx/cvt.cuh"
#include "ptx/math.cuh"

namespace sage::attn {

template <typename OutT>
__device__ __forceinline__ void store2(OutT* dst, float a, float b);
template <>
__device__ __forceinline__ void store2<__half>(__half* dst, float a, float b) {
  *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(a, b);
}
template <>
__device__ __forceinline__ void store2<__nv_bfloat16>(__nv_bfloat16* dst, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(a, b);
}

// How many keys of the block starting at key j0 (block_k keys) rows row_a and row_a + 8 see: the
// Nk edge and, when causal, the diagonal (query i sees keys j <= i + causal_offset). The mask is
// then a 32-bit compare per score.
template <bool kCausal, int kBlockKeys, typename Params>
__device__ __forceinline__ void visible_keys(const Params& p, int64_t row_a, int64_t j0,
                                             int (&visible)[2]) {
  for (int r = 0; r < 2; ++r) {
    const int64_t row = row_a + 8 * r;
    const int64_t end = kCausal ? min(p.seq_kv, row + p.causal_offset + 1) : p.seq_kv;
    const int64_t n = end - j0;
    visible[r] = n <= 0 ? 0 : (n >= kBlockKeys ? kBlockKeys : int(n));
  }
}

// Online softmax, base 2: the 4 threads of a row agree on its block max; the running max m moves
// up, the running sum l is rescaled by alpha (returned, for O too), and m_use is what to subtract
// from the scores (0 for a row that has seen nothing visible yet). With a slack (the sm90
// kernel's, attn/sm90/softmax.cuh), m moves only when the block max passes it by more than
// kSlack, and then to that max; elsewhere alpha is exactly 1.
template <int kSlack = 0>
__device__ __forceinline__ void online_max(float (&row_max)[2], float (&m)[2], float (&l)[2],
                                           float (&alpha)[2], float (&m_use)[2]) {
  for (int r = 0; r < 2; ++r) {
    row_max[r] = fmaxf(row_max[r], __shfl_xor_sync(0xffffffffu, row_max[r], 1));
    row_max[r] = fmaxf(row_max[r], __shfl_xor_sync(0xffffffffu, row_max[r], 2));
    if constexpr (kSlack == 0) {
      const float m_new = fmaxf(m[r], row_max[r]);
      m_use[r] = m_new == -INFINITY ? 0.0f : m_new;
      alpha[r] = ptx::ex2(m[r] - m_use[r]);
      m[r] = m_new;
    } else {
      const bool move = row_max[r] > m[r] + float(kSlack);
      const float m_new = move ? row_max[r] : m[r];
      m_use[r] = m_new == -INFINITY ? 0.0f : m_new;
      alpha[r] = move ? ptx::ex2(m[r] - m_use[r]) : 1.0f;
      m[r] = m_new;
    }
    l[r] *= alpha[r];
  }
}

// P^ = E4M3(p) as the A operand of kChunks k32 MMA steps (keys 32c..32c+31 in the order the
// pre-pass gives Vᵀ): reg 0/1 of chunk c take 8-key tiles 4c, 4c+1 of rows g / g+8, reg 2/3 tiles
// 4c+2, 4c+3. p_at(tile, e) gives element e of a tile already scaled to E4M3 range (P~ · 448).
template <int kChunks, typename PAt>
__device__ __forceinline__ void pack_p_e4m3(uint32_t (&pf)[kChunks][4], PAt p_at) {
  Frag::to_a8(pf, [&](int n0, int h) {
    return uint32_t(ptx::cvt_e4m3x2(p_at(n0, 2 * h), p_at(n0, 2 * h + 1))) |
           uint32_t(ptx::cvt_e4m3x2(p_at(n0 + 1, 2 * h), p_at(n0 + 1, 2 * h + 1))) << 16;
  });
}

// What a row adds to its running sum l: 0, or NaN for a row that an Inf/NaN input poisons (the
// pre-pass or the sm90 kernel's Q quantization gave it a NaN LSE shift: quant::RowSight). The NaN
// then carries into the row's output and LSE through the finalize, at no cost there.
template <typename Params>
__device__ __forceinline__ float row_poison(const Params& p, int64_t bh, int64_t row) {
  return row < p.seq_q && isnan(p.lse_shift[bh * p.seq_q + row]) ? __int_as_float(0x7FC00000)
                                                                  : 0.0f;
}

// Finalize and store rows row_a, row_a + 8: O / l / 448 · v_scale + v_mean in the output dtype;
// LSE = (m + log2 l)·ln 2 + the smoothing shift. A row with l = 0 saw no key (0, LSE -inf); a
// poisoned row's l is NaN (row_poison), so are its output and LSE. o_at(i, e) reads element e of
// channel tile i. kLUnit is what l holds for a row whose P~ sums to 1: 1 when l sums P~, 448 (224
// on sm90) when it sums the E4M3-range values P~ · 448 the kernel computed directly; kOUnit the
// same for O's P^ (P~ · kOUnit · V^). vsc / vmean: this head's V scales and means (D floats
// each), from global memory or staged in shared memory by the caller.
// Only the caller's p.head_dim channels are stored (a padded head dim's zero channels past it
// would land in memory that is not the output's); a pair never straddles it (an even head_dim).
template <int D, typename OutT, int kLUnit, int kOUnit = 448, typename Params, typename OAt>
__device__ __forceinline__ void finalize(const Params& p, OAt o_at, const float (&m)[2],
                                         float (&l)[2], int64_t b, int64_t h, int64_t bh,
                                         int64_t row_a, int t, const float* vsc,
                                         const float* vmean) {
  for (int r = 0; r < 2; ++r) l[r] = Frag::quad_sum(l[r]);
  auto store_row = [&](int r) {
    const int64_t row = row_a + 8 * r;
    if (row >= p.seq_q) return;
    const bool empty = l[r] == 0.0f;
    const float inv = empty ? 0.0f : 1.0f / (l[r] * (float(kOUnit) / kLUnit));
    OutT* dst = static_cast<OutT*>(p.o) + b * p.o_batch + h * p.o_head + row * p.o_token;
    for (int i = 0; i < D / 8; ++i) {
      const int c = Frag::pair(i, t);
      const float x0 = empty ? 0.0f : o_at(i, 2 * r) * (vsc[c] * inv) + vmean[c];
      const float x1 = empty ? 0.0f : o_at(i, 2 * r + 1) * (vsc[c + 1] * inv) + vmean[c + 1];
      if (c < p.head_dim) store2<OutT>(dst + c, x0, x1);
    }
    if (p.lse && t == 0)
      p.lse[b * p.lse_batch + h * p.lse_head + row * p.lse_token] =
          empty ? -INFINITY
                : (m[r] + log2f(l[r] * (1.0f / kLUnit))) * 0.69314718055994531f +
                      p.lse_shift[bh * p.seq_q + row];
  };
  // At D = 256 ptxas kept this loop rolled, so o_at's register index was dynamic and O went to
  // local memory (512 bytes of stack): the two rows written out. Below, the loop as it was tuned.
  if constexpr (D > 128) {
    store_row(0);
    store_row(1);
  } else {
    for (int r = 0; r < 2; ++r) store_row(r);
  }
}

}  // namespace sage::attn
