// The Hopper kernel's online softmax of one key block (sm_90a; 128 keys, 64 at D = 256), per
// consumer thread: rows g and g+8 of its warp's 16, 64 scores (2 rows x 32 keys; 32 at D = 256)
// straight from the Q·Kᵀ accumulator.
//
// The S accumulator starts at the bits of 1.5·2^23 (kMagic), so the exact int32 score x
// comes out of the wgmma as the bits of the float 1.5·2^23 + x whenever -2^22 <= x <= 2^22 (the
// float's exponent stays 2^23, or x = 2^22 carries exactly into 2^24): the int8 values are in
// [-127, 127], so |x| <= D·127² = 4 129 024 < 2^22 up to D = 256. The int -> float conversion
// then costs nothing, the max can be taken on the bits, and
// the softmax of a visible score is one FFMA and one 2^x:
//   P~ · kPUnit = 2^(x·f - m + log2 kPUnit) = 2^(y·f - bias),  y = 1.5·2^23 + x,
//   bias = 1.5·2^23·f + m - log2 kPUnit,
// where f = q_scale · k_scale · scale · log2 e. Rounding bias costs at most 0.75·f in the
// exponent, under a unit of the int32 score (int8 rounding moves it by hundreds). What bounds the
// kernel is this softmax's instruction issue (the loop without it runs several times faster:
// docs/sm90-kernel.md, "What limits it"), hence about seven instructions a score.
//
// The running max m moves only when a block's row max passes it by more than kSlack (base 2), so
// that after the first blocks O is rarely rescaled (64 multiplies a thread whenever a row of the
// warp moves its max). A score may then exceed m by up to kSlack, and the softmax writes
// P~ · kPUnit = 2^(x·f - m + log2 kPUnit) with kPUnit = 448 / 2^kSlack: at most 448, the E4M3
// range P^ is packed from, as float bits over the scores. O sums P^ · V^, and l the weights O
// takes, P^ (each P̃·V step's sums from a wgmma against a tile of ones beside it: mainloop.cuh),
// so the softmax adds nothing; both are in units of kPUnit (the epilogue's). The slack costs P^ one
// binade at the bottom of E4M3's range. m is the same in every thread of a row (the quad's max),
// so the rows' results do not depend on the warp.
#pragma once

#include "attn/epilogue.cuh"
#include "common/exp2_poly.h"  // kMagicF, exp2_poly: shared with the CPU emulation
#include "common/fragment.cuh"
#include "ptx/math.cuh"

namespace sage::sm90 {

constexpr int kMagic = 0x4B400000;                    // the bits of kMagicF: the S seed
constexpr int kSlack = kMaxSlack;                     // the running max's slack (base 2)
constexpr int kPUnit = 448 >> kSlack;                 // P~ · kPUnit: at most 448
// log2 kPUnit (log2 448 = 8.807... as a float, less the slack: exact in float)
constexpr float kLog2PUnit = 8.80735492205760410f - float(kSlack);

// Register i of the 64 scores takes the polynomial (one in kPolyEvery; 0: none).
template <int kPolyEvery>
__device__ __forceinline__ constexpr bool poly_at(int i) {
  return kPolyEvery > 0 && i % (kPolyEvery > 0 ? kPolyEvery : 1) == kPolyEvery - 1;
}

// The online softmax of one block over the thread's kN scores sacc (seeded), in place: P~ · kPUnit
// as float bits. f: the scale products of each 64 keys (their K scale groups). m, l: the rows'
// running max and sum (l scaled by alpha, returned for O). unmasked: every key of the block
// is visible to every row of the tile (CTA-uniform), else visible() gives the keys each row sees
// (the diagonal, the Nk edge). at_max() runs once the rows' maxima are known (where a consumer
// may pass the GEMM-issue turn).
template <int kPolyEvery, int kN, typename Visible, typename AtMax>
__device__ __forceinline__ void softmax_block(int (&sacc)[kN], bool unmasked,
                                              const float (&f)[kN / 32], float (&m)[2],
                                              float (&l)[2], float (&alpha)[2], int t,
                                              Visible visible, AtMax at_max) {
  static_assert(kN == 64 || kN == 32, "128- or 64-key blocks");
  constexpr int kHalves = kN / 32;  // 64-key groups (a K scale each)
  float row_max[2], m_use[2];
  if (unmasked) {
    int mx[2][kHalves];
    for (int r = 0; r < 2; ++r)
      for (int h = 0; h < kHalves; ++h) {  // a tree over the 16 scores of (row r, key group h)
        int v[16];
        for (int j = 0; j < 16; ++j) v[j] = sacc[32 * h + Frag::of_half(r, j)];
        for (int w = 16; w > 1; w /= 2)
          for (int j = 0; j < w / 2; ++j) v[j] = max(v[j], v[j + w / 2]);
        mx[r][h] = v[0];
      }
    for (int r = 0; r < 2; ++r) {
      row_max[r] = (__int_as_float(mx[r][0]) - kMagicF) * f[0];
      if constexpr (kHalves == 2)
        row_max[r] = fmaxf(row_max[r], (__int_as_float(mx[r][1]) - kMagicF) * f[1]);
    }
    attn::online_max<kSlack>(row_max, m, l, alpha, m_use);
    at_max();
    float bias[2][kHalves];
    for (int r = 0; r < 2; ++r)
      for (int h = 0; h < kHalves; ++h) bias[r][h] = fmaf(kMagicF, f[h], m_use[r] - kLog2PUnit);
    for (int i = 0; i < kN; ++i) {
      const int k = Frag::span<64>(i);  // the 64 keys of a K scale
      const float x = fmaf(__int_as_float(sacc[i]), f[k], -bias[Frag::half(i)][k]);
      sacc[i] = __float_as_int(poly_at<kPolyEvery>(i) ? exp2_poly(x) : ptx::ex2(x));
    }
  } else {  // scores as floats, hidden ones -inf
    int vis[2];
    visible(vis);
    row_max[0] = row_max[1] = -INFINITY;
    for (int i = 0; i < kN; ++i) {
      const bool hidden = Frag::col(i, t) >= vis[Frag::half(i)];
      const float x =
          hidden ? -INFINITY : (__int_as_float(sacc[i]) - kMagicF) * f[Frag::span<64>(i)];
      row_max[Frag::half(i)] = fmaxf(row_max[Frag::half(i)], x);
      sacc[i] = __float_as_int(x);
    }
    attn::online_max<kSlack>(row_max, m, l, alpha, m_use);
    at_max();
    for (int i = 0; i < kN; ++i)
      sacc[i] = __float_as_int(
          ptx::ex2(__int_as_float(sacc[i]) - (m_use[Frag::half(i)] - kLog2PUnit)));
  }
}

}  // namespace sage::sm90
