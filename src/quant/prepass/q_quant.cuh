// Q quantization (quant_q): INT8/INT4 Q with optional block smoothing, and the LSE correction
// of each row (NaN for a poisoned row). Skipped when the sm90 kernel quantizes Q itself.
// (Included only by quant/prepass.cu, the pre-pass's one translation unit: the code sits in
// that file's anonymous namespace, so the kernels stay internal to it.)
#pragma once

#include "common/grid.h"
#include "quant/elements.cuh"
#include "quant/prepass/common.cuh"
#include "quant/prepass/params.h"

namespace sage::quant {
namespace {

// One CTA (512 threads, 4 a row) per 128-row Q block: optional block mean (kSmooth), the LSE
// correction scale·q·k_mean, then per-thread groups (rows {g, g+8} of each 16-row warp slice).
// A thread's row loads are issued first (in flight during the mean); q·k_mean is summed in double
// in channel order of the part, with each q value from scaled_double (one exact multiply by 2^s)
// and k_mean from a double copy in shared memory. Inf/NaN elements count as zeros (in the mean
// too); a row that holds one, or that sees a key of the head's first bad one (kv_bad) or later,
// gets a NaN LSE shift, which the attention epilogue turns into a NaN row. Without smoothing the
// row's max |q| is taken on the raw bits (|x| orders as its bits do). The quantization skips
// quantize_bits' clamp and NaN test where neither can act: every |x - mean| of the group is at
// most its finite amax, so with a finite inv |y| <= qmax·(1+2^-24)^2 rounds into [-qmax, qmax],
// and no operand is NaN.
// (Its __global__, kernels.cuh, only enters the PDL chain and calls it.)
template <typename T, int D, int kBits, bool kVec, bool kSmooth>
__device__ __forceinline__ void quant_q(const QuantQParams& p) {
  constexpr float qmax = kBits == 8 ? float(kInt8Max) : float(kInt4Max);
  constexpr int kChunks = D / 32;
  __shared__ float mean[kSmooth ? D : 1];
  __shared__ __align__(16) double km_d[D];
  __shared__ float row_max[kBlockQ];
  const T* q = static_cast<const T*>(p.q);
  const sage_strides& qs = p.qs;
  const SeqRows& q_rows = p.q_rows;
  const int dim = p.dim, group_ratio = p.group_ratio;
  const int64_t bh = cta_outer_index();
  if (bh >= p.bq) return;
  const BatchHead bhd = batch_head(bh, int64_t(p.heads_kv) * group_ratio);
  const int b = int(bhd.b), h = int(bhd.h);
  const int64_t qb = blockIdx.x;
  const int64_t r0 = qb * kBlockQ;
  // This sequence's query rows (a packed batch's sequence b: the grid covers the longest) and,
  // for a packed batch, the keys its rows see (its own length and causal alignment).
  const SeqSpan sq = q_rows.span(b);
  const int64_t seq_q = sq.len;
  if (r0 >= seq_q) return;
  RowSight sight = p.sight;
  if (q_rows.packed()) {
    const int64_t nk = p.kv_rows.span(b).len;
    sight.seq_kv = nk;
    sight.causal_offset = p.bottom_right ? nk - seq_q : 0;
  }
  const int64_t qrow0 = q_rows.row0(b, h, sq), srow0 = p.shift_rows.row0(b, h, sq);
  const int64_t bhk = int64_t(b) * p.heads_kv + h / group_ratio;
  const float* km = p.k_mean + bhk * D;
  const int r = threadIdx.x / 4, part = threadIdx.x % 4;
  const int64_t row = r0 + r;
  const bool valid = row < seq_q;
  uint4 raw[kChunks];
  for (int ci = 0; ci < kChunks; ++ci) {  // channels from dim to D: zeros (whole chunks)
    const int d0 = (ci * 4 + part) * 8;
    raw[ci] = make_uint4(0u, 0u, 0u, 0u);
    if (valid && d0 < dim) raw[ci] = load_raw8<kVec>(row_ptr(q, qs, b, h, sq.tok0 + row) + d0);
  }
  if (threadIdx.x < D) {
    const int c = threadIdx.x;
    km_d[c] = double(km[c]);
    if constexpr (kSmooth) {
      const int64_t r1 = min(seq_q, r0 + kBlockQ);
      double s = 0;
      for (int64_t rr = r0; rr < r1 && c < dim; ++rr) {  // a padded channel's mean is 0
        const float x = to_float(row_ptr(q, qs, b, h, sq.tok0 + rr)[c]);
        s += isfinite(x) ? double(x) : 0.0;
      }
      const float m = float(s / double(r1 - r0));
      p.q_mean[(qrow0 / kBlockQ + qb) * D + c] = m;
      mean[c] = m;
    }
  }
  __syncthreads();
  // x - mean, or x itself without smoothing (x - 0 is x, -0 included).
  auto centered = [&](float x, int c) { return kSmooth ? __fsub_rn(x, mean[c]) : x; };

  int row_bad = zero_special<T>(raw) != 0u;
  float amax = 0.0f;
  if constexpr (!kSmooth) {
    // max |x| on the bits: both halves of a word at once (unsigned 16-bit lanes).
    uint32_t m2 = 0u;
    for (int ci = 0; ci < kChunks; ++ci) {
      m2 = __vmaxu2(m2, raw[ci].x & 0x7FFF7FFFu);
      m2 = __vmaxu2(m2, raw[ci].y & 0x7FFF7FFFu);
      m2 = __vmaxu2(m2, raw[ci].z & 0x7FFF7FFFu);
      m2 = __vmaxu2(m2, raw[ci].w & 0x7FFF7FFFu);
    }
    amax = Bits<T>::to_float(max(m2 & 0xFFFFu, m2 >> 16));
  } else if (valid) {
    // Rows past seq_q stay out of the group max: their zeroed raw words centre to -mean, which
    // would otherwise set the scale of a group {g, g+8} shared with a valid row (the emulation
    // groups only rows < seq_q).
    for (int ci = 0; ci < kChunks; ++ci)
      for (int e = 0; e < 8; ++e) {
        const float x = elem_float<T>(raw[ci], e);
        amax = fmaxf(amax, fabsf(centered(x, (ci * 4 + part) * 8 + e)));
      }
  }
  double shift = 0;
  for (int ci = 0; ci < kChunks; ++ci) {
    const double2* kd = reinterpret_cast<const double2*>(&km_d[(ci * 4 + part) * 8]);
    for (int e2 = 0; e2 < 4; ++e2) {
      const double2 k2 = kd[e2];
      const uint32_t w = e2 == 0 ? raw[ci].x : e2 == 1 ? raw[ci].y : e2 == 2 ? raw[ci].z : raw[ci].w;
      const double lo = __dmul_rn(scaled_double_lo<T>(w), Bits<T>::kUnscale);
      const double hi = __dmul_rn(scaled_double_hi<T>(w), Bits<T>::kUnscale);
      shift = __fma_rn(lo, k2.x, shift);  // x·k_mean is exact
      shift = __fma_rn(hi, k2.y, shift);
    }
  }
  for (int m : {1, 2}) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
    shift += __shfl_xor_sync(0xffffffffu, shift, m);
    row_bad |= __shfl_xor_sync(0xffffffffu, row_bad, m);
  }
  if (part == 0) {
    row_max[r] = amax;
    if (valid)
      p.lse_shift[srow0 + row] =
          sight.poisoned(row, row_bad != 0, p.kv_bad[bhk]) ? __int_as_float(0x7FC00000)
                                                           : float(double(p.scale) * shift);
  }
  __syncthreads();
  amax = fmaxf(row_max[r], row_max[r ^ 8]);  // the group: rows {g, g+8} of a 16-row slice
  const QuantScale s = make_quant_scale(amax, qmax);
  if (part == 0 && r % 16 < 8)
    p.q_scale[(qrow0 / kBlockQ + qb) * kQGroups + (r / 16) * 8 + r % 8] = s.scale;
  const bool fast = finite_scale(amax, s.inv);
  const uint32_t keep = valid ? 0xFFFFFFFFu : 0u;
  quantize_store_row_part<T, D, kBits>(p.qq + (qrow0 + row) * (D * kBits / 8), raw,
                                       centered, part, s.inv, qmax, fast, keep);
}

}  // namespace
}  // namespace sage::quant
