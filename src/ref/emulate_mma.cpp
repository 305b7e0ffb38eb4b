// The mma.sync kernel (SageAttention2, src/attn/mma) emulated step by step: per Q block of
// block_q rows, the key blocks of block_k keys in order, each one online-softmax step in base 2
// (std::exp2), P~ quantized to the P·V format, P^·V^ into the MMA accumulator, flushed into the
// fp32 O every pv_flush_interval blocks; O / l · v_scale + v_mean at the end. The knobs of this
// form that no kernel runs (the paper's ablations: other groups and formats, per-block V scales,
// other accumulators) are the same algorithm with one step changed. Host code.
#include <algorithm>
#include <cmath>
#include <vector>

#include "ref/emulate.h"

namespace sage::ref::emu {

template <typename Real>
void emulate_mma(const Problem& p, const sage_quant_config& cfg, const TensorView& q,
                 const TensorView& k, const TensorView& v, Real* out, Real* lse, int threads) {
  const int64_t D = p.head_dim, Nq = p.seq_q, bq = cfg.block_q, bk = cfg.block_k;
  const PvFormat pv = pv_format_of(cfg.pv_format);
  // V's scale per (key block, channel): applied to the accumulator at each flush.
  const bool block_v_scale = cfg.v_scale == SAGE_V_SCALE_PER_BLOCK_CHANNEL && pv.v_max > 0;
  // A power of two per key block moves into the softmax (scores + e, row sum / 2^e): P^·V^
  // then needs no scale at all, so no flush of the accumulator either.
  const bool pow2_v_scale = cfg.v_scale == SAGE_V_SCALE_PER_BLOCK && pv.v_max > 0;
  const Real scale_log2 = Real(p.scale * kLog2e);

  // 1. The pre-pass: Q, K, V smoothed and quantized.
  const Prepass<Real> pre = prepass<Real>(p, cfg, q, k, v, threads);

  // 2. The attention kernel: one item per (batch, q head, Q block).
  const int64_t q_blocks = (Nq + bq - 1) / bq;
  parallel_for(p.batch * p.heads_q * q_blocks, threads, [&](int64_t item) {
    const Tile<Real> t = pre.tile(p, bq, item);
    const KvPrep<Real>& kp = t.kv;
    const std::vector<Real> ds = delta_s(p, cfg, t);
    // Per row: running max m (base 2), sum l, and the P·V state.
    std::vector<Real> m(size_t(t.rows), neg_inf<Real>()), l(size_t(t.rows), Real(0));
    RowAccumulators<Real> ra(t.rows, D, cfg.accum_chunk);
    std::vector<Real> s(static_cast<size_t>(bk)), phat(static_cast<size_t>(bk));

    for (int64_t j0 = 0; j0 < t.visible_max; j0 += bk) {
      const int64_t j1 = std::min(p.seq_kv, j0 + bk);
      const Real* flush_scale = block_v_scale ? &kp.v_scale[size_t(j0 / bk * D)] : nullptr;
      // SAGE_V_SCALE_PER_BLOCK: P~ = 2^(x + e - m) carries the block's 2^e, and the row sum is
      // taken back down by 2^-e, so m + log2 l is still log2 Σ 2^x.
      const int v_exp = kp.v_exponent[size_t(j0 / bk)];
      const Real score_shift = Real(v_exp), sum_scale = std::ldexp(Real(1), -v_exp);
      for (int64_t r = 0; r < t.rows; ++r) {
        const int64_t i = t.r0 + r, n = p.visible_keys(i);
        if (j0 >= n) continue;  // fully masked for this row: skipped
        // S = Q^K^ · δq δk + ΔS, in base 2.
        const Real row_max =
            row_scores(cfg, t, ds.data(), D, i, n, j0, j1, scale_log2, score_shift, s.data());
        // Online softmax: P~ = 2^(S - m), rescale by alpha = 2^(m_old - m).
        const Real m_new = std::max(m[size_t(r)], row_max);
        const Real alpha = std::exp2(m[size_t(r)] - m_new);  // 0 on the first block
        Real row_sum = 0;
        for (int64_t j = j0; j < j1; ++j) {
          const Real pt = j < n ? std::exp2(s[size_t(j - j0)] - m_new) : Real(0);
          row_sum += pt;
          phat[size_t(j - j0)] = pv.quantize(pt * Real(pv.p_scale));  // P^
        }
        l[size_t(r)] = l[size_t(r)] * alpha + row_sum * sum_scale;
        m[size_t(r)] = m_new;
        ra.rescale(r, alpha);
        // P^·V^ into the accumulator, flushed into O (with the block's V scales).
        accumulate_pv(cfg, phat.data(), kp.v.data(), j0, j1, D, ra.acc(r), ra.scratch);
        ra.flush_if_due(cfg, r, [&](int64_t d, Real a) {
          return flush_scale ? a * flush_scale[d] : a;
        });
      }
    }

    // 3. The epilogue: flush what is left, O / (l · p_scale) · v_scale + v_mean; the LSE.
    for (int64_t r = 0; r < t.rows; ++r) {
      const int64_t i = t.r0 + r, n = p.visible_keys(i);
      if (special_row(p, t, i, out, lse)) continue;
      Real* dst = out + (t.bh * Nq + i) * D;
      const Real* flush_scale = block_v_scale ? &kp.v_scale[size_t((n - 1) / bk * D)] : nullptr;
      const Real denom = l[size_t(r)] * Real(pv.p_scale);
      for (int64_t d = 0; d < D; ++d) {
        const Real acc = Real(ra.R[size_t(r * D + d)]);
        const Real o = ra.O[size_t(r * D + d)] + (flush_scale ? acc * flush_scale[d] : acc);
        const Real vs = block_v_scale || pow2_v_scale ? Real(1) : kp.v_scale[size_t(d)];
        dst[d] = o * (vs / denom) + kp.v_mean[size_t(d)];
      }
      if (lse)
        lse[t.bh * Nq + i] = row_lse(m[size_t(r)], l[size_t(r)], t.q.lse_shift[size_t(i)]);
    }
  });
}

template void emulate_mma(const Problem&, const sage_quant_config&, const TensorView&,
                          const TensorView&, const TensorView&, float*, float*, int);
template void emulate_mma(const Problem&, const sage_quant_config&, const TensorView&,
                          const TensorView&, const TensorView&, double*, double*, int);

}  // namespace sage::ref::emu
