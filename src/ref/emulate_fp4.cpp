// The FP4 kernel (SageAttention3 paper, Algorithm 1; src/fp4) emulated step by step: Q and K
// smoothed and quantized to FP4 runs along their rows, V to FP4 runs of keys per channel (the
// pre-pass); per Q block, the key blocks in order: S from the block-scaled k64 MMA, one
// online-softmax step in base 2, P~ to FP4 (two-level for NVFP4: P~ / s_P1 first, s_P1 =
// rowmax(P~) / (448·6)), P^·V^ in the MMA accumulator, scaled by s_P1 as it joins the fp32 O;
// O / l + v_mean at the end. Configs with an FP4 P·V format come here; the other FP4 formats and
// accumulators of sage_quant_config (the paper's Table 1) are this algorithm with one step
// changed. Host code.
#include <algorithm>
#include <cmath>
#include <vector>

#include "ref/emulate.h"

namespace sage::ref::emu {
namespace {

// P~ of one row of a key block (n keys, masked ones 0) to FP4 in place; returns the factor s_P1
// the block's P·V product is multiplied by. Two-level (Algorithm 1, line 10): s_P1 = rowmax(P~) /
// (448·6) in fp32, P~ / s_P1 in [0, 2688] (its runs' E4M3 scales then use E4M3's range up to
// 448), then NVFP4. rowmax(P~) = 2^(rowmax(S) - m), the online softmax's own max, as the kernel
// reuses it. Direct: P~ in [0, 1] straight into FP4, s_P1 = 1.
template <typename Real>
Real quantize_p_fp4(const PvFormat& pv, Real* p, int64_t n, Real row_max_minus_m) {
  Real level1 = 1;
  if (pv.two_level) {
    level1 = std::exp2(row_max_minus_m) / Real(kE4M3Max * kE2M1Max);
    if (level1 > 0)
      for (int64_t j = 0; j < n; ++j) p[j] /= level1;
  }
  round_fp4(p, n, 1, *pv.fp4);
  return level1;
}

}  // namespace

template <typename Real>
void emulate_fp4(const Problem& p, const sage_quant_config& cfg, const TensorView& q,
                 const TensorView& k, const TensorView& v, Real* out, Real* lse, int threads) {
  const int64_t D = p.head_dim, Nq = p.seq_q, bq = cfg.block_q, bk = cfg.block_k;
  const PvFormat pv = pv_format_of(cfg.pv_format);  // FP4: V's scales live in its runs
  const Real scale_log2 = Real(p.scale * kLog2e);

  // 1. The pre-pass: Q, K, V smoothed and quantized.
  const Prepass<Real> pre = prepass<Real>(p, cfg, q, k, v, threads);

  // 2. The attention kernel: one item per (batch, q head, Q block).
  const int64_t q_blocks = (Nq + bq - 1) / bq;
  parallel_for(p.batch * p.heads_q * q_blocks, threads, [&](int64_t item) {
    const Tile<Real> t = pre.tile(p, bq, item);
    const std::vector<Real> ds = delta_s(p, cfg, t);
    // Per row: running max m (base 2), sum l, and the P·V state.
    std::vector<Real> m(size_t(t.rows), neg_inf<Real>()), l(size_t(t.rows), Real(0));
    RowAccumulators<Real> ra(t.rows, D, cfg.accum_chunk);
    std::vector<Real> s(static_cast<size_t>(bk)), phat(static_cast<size_t>(bk));

    for (int64_t j0 = 0; j0 < t.visible_max; j0 += bk) {
      const int64_t j1 = std::min(p.seq_kv, j0 + bk);
      for (int64_t r = 0; r < t.rows; ++r) {
        const int64_t i = t.r0 + r, n = p.visible_keys(i);
        if (j0 >= n) continue;  // fully masked for this row: skipped
        // S = Q^K^ · δq δk + ΔS, in base 2 (line 8).
        const Real row_max =
            row_scores(cfg, t, ds.data(), D, i, n, j0, j1, scale_log2, Real(0), s.data());
        // Online softmax: P~ = 2^(S - m), rescale by alpha = 2^(m_old - m) (line 9).
        const Real m_new = std::max(m[size_t(r)], row_max);
        const Real alpha = std::exp2(m[size_t(r)] - m_new);  // 0 on the first block
        Real row_sum = 0;
        for (int64_t j = j0; j < j1; ++j) {
          const Real pt = j < n ? std::exp2(s[size_t(j - j0)] - m_new) : Real(0);
          row_sum += pt;
          phat[size_t(j - j0)] = pt;
        }
        l[size_t(r)] = l[size_t(r)] * alpha + row_sum;
        // P^ and s_P1 (line 10).
        const Real s_p1 = quantize_p_fp4(pv, phat.data(), j1 - j0, row_max - m_new);
        m[size_t(r)] = m_new;
        ra.rescale(r, alpha);
        // P^·V^ into the accumulator, times s_P1 into O (line 11).
        accumulate_pv(cfg, phat.data(), t.kv.v.data(), j0, j1, D, ra.acc(r), ra.scratch);
        ra.flush_if_due(cfg, r, [&](int64_t, Real a) { return a * s_p1; });
      }
    }

    // 3. The epilogue: flush what is left, O / l + v_mean; the LSE.
    for (int64_t r = 0; r < t.rows; ++r) {
      const int64_t i = t.r0 + r;
      if (special_row(p, t, i, out, lse)) continue;
      Real* dst = out + (t.bh * Nq + i) * D;
      for (int64_t d = 0; d < D; ++d) {
        const Real o = ra.O[size_t(r * D + d)] + Real(ra.R[size_t(r * D + d)]);
        dst[d] = o * (Real(1) / l[size_t(r)]) + t.kv.v_mean[size_t(d)];
      }
      if (lse)
        lse[t.bh * Nq + i] = row_lse(m[size_t(r)], l[size_t(r)], t.q.lse_shift[size_t(i)]);
    }
  });
}

template void emulate_fp4(const Problem&, const sage_quant_config&, const TensorView&,
                          const TensorView&, const TensorView&, float*, float*, int);
template void emulate_fp4(const Problem&, const sage_quant_config&, const TensorView&,
                          const TensorView&, const TensorView&, double*, double*, int);

}  // namespace sage::ref::emu
