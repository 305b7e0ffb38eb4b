// The sm90 wgmma kernel (src/attn/sm90) emulated step by step: per tile of block_q rows, softmax
// blocks of softmax_block_k keys (one or several 64-key K scale blocks) in order. In a block:
// the scores in the kernel's fp32 form, the running max (with its slack), P~·224 as one 2^x (the
// polynomial 2^x on its share of the scores where the block is whole for the tile), P^·V^ in the
// wgmma E4M3 accumulator (each k32 step aligned to its largest addend), the row sum l of the
// weights O takes, P^ (each step's sum in that accumulator from zero, against a column of ones:
// the kernel's m64n8 wgmma beside P̃·V, in one of four parts per row, added into them in fp32
// one block late, as the kernel does); at the end the kernel's finalize. The configs of
// sm90_softmax_form come here; the ones no kernel runs (other accumulators, formats, Q smoothing)
// are this algorithm with one step changed. Host code.
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "attn/sm90/split.h"
#include "common/exp2_poly.h"
#include "ref/emulate.h"

namespace sage::ref {

double exp2_poly(double x) {
  // The same approximation with ideal arithmetic around it (the double emulation).
  x = std::max(x, -125.0);
  const double n = std::nearbyint(x);  // round to nearest even, as the float add of 1.5·2^23
  const double r = x - n;
  const double q =
      ((double(kExp2PolyC3) * r + double(kExp2PolyC2)) * r + double(kExp2PolyC1)) * r + 1.0;
  return std::ldexp(q, int(n));
}

bool exp2_poly_at(int64_t row, int64_t key, int every) {
  if (every <= 0) return false;
  // Register i of the m64n128 accumulator of the thread holding (row, key): 8-key tile
  // (key mod 128) / 8 gives i / 4, the row half (row mod 16) / 8 gives bit 1, the key's parity
  // bit 0 (sage.h, exp2_poly_every).
  const int64_t i = 4 * ((key % 128) / 8) + 2 * ((row % 16) / 8) + key % 2;
  return i % every == every - 1;
}

namespace emu {

template <typename Real>
void emulate_sm90(const Problem& p, const sage_quant_config& cfg, const TensorView& q,
                  const TensorView& k, const TensorView& v, Real* out, Real* lse, int threads) {
  const int64_t D = p.head_dim, Nq = p.seq_q, bq = cfg.block_q;
  const int64_t sbk = cfg.softmax_block_k > 0 ? cfg.softmax_block_k : cfg.block_k;
  const PvFormat pv = pv_format_of(cfg.pv_format);  // V scales per channel (quant_config_error)
  const Real scale_log2 = Real(p.scale * kLog2e);
  // The scores in fp32 as the kernel forms them where that form exists (integer Q·K, no ΔS: the
  // kernel has no Q smoothing): f = (q_scale · scale·log2 e) · k_scale, the max over Q^K^·f,
  // and, in a block every row sees all of, the exponent of P~·448 as one FFMA on the seeded
  // accumulator 1.5·2^23 + Q^K^ (attn/sm90/softmax.cuh). The double emulation keeps ideal
  // arithmetic.
  const bool kernel_scores = std::is_same_v<Real, float> && !(cfg.smooth & SAGE_SMOOTH_Q) &&
                             (cfg.qk_format == SAGE_QK_INT8 || cfg.qk_format == SAGE_QK_INT4);
  // 2^x gives P~·p_unit directly: x = s - m + log2 p_unit, p_unit = p_scale / 2^kMaxSlack (the
  // running max m moves only when a block's row max passes it by more than kMaxSlack, so a score
  // may exceed m by that much: attn/sm90/softmax.cuh).
  const double p_unit = double(pv.p_scale) / double(1 << kMaxSlack);
  const Real log2_p_unit = Real(std::log2(p_unit));
  const bool aligned = cfg.pv_accum == SAGE_PV_ACCUM_ALIGNED;
  const int bits = cfg.accum_mantissa_bits;

  // 1. The pre-pass: Q, K, V smoothed and quantized.
  const Prepass<Real> pre = prepass<Real>(p, cfg, q, k, v, threads);

  // 2. The attention kernel: one item per (batch, q head, tile of block_q rows). The split tail
  // (cfg.split_tiles > 0, attn/sm90/split.h): the last split_tiles tiles run their key blocks in
  // parts, each from a fresh softmax state, merged in order at the end.
  const int64_t q_blocks = (Nq + bq - 1) / bq, tiles = p.batch * p.heads_q * q_blocks;
  const sm90::SplitTail split{std::min<int64_t>(cfg.split_tiles, tiles),
                              (p.seq_kv + sbk - 1) / sbk, cfg.split_ctas};
  const std::vector<Real> ones(size_t(p.seq_kv), Real(1));  // the row sums' column of V
  parallel_for(tiles, threads, [&](int64_t item) {
    const Tile<Real> t = pre.tile(p, bq, item);
    const std::vector<Real> ds = delta_s(p, cfg, t);
    // Per row: running max m (base 2), the row's four parts of its sum (thread t of the quad:
    // the P̃·V steps t, t + 4, ... of every block) l4 and a block's parts not yet added into
    // them (pend4), in units of P~·p_unit, and the P·V state (R: the wgmma accumulator).
    struct State {
      std::vector<Real> m, l4, pend4;
      RowAccumulators<Real> ra;
      State(int64_t rows, int64_t D, int chunk)
          : m(size_t(rows), neg_inf<Real>()), l4(size_t(rows * 4), Real(0)),
            pend4(size_t(rows * 4), Real(0)), ra(rows, D, chunk) {}
      // Row r's P·V sum as the kernel's accumulator register holds it at the end.
      Real o(int64_t r, int64_t d) const {
        const size_t at = size_t(r * ra.D + d);
        return ra.O[at] + Real(ra.R[at]);
      }
      // Part th of row r's sum at the end (the last block's added: the kernel's last_pv).
      Real l_end(int64_t r, int th) const {
        return l4[size_t(r * 4 + th)] + pend4[size_t(r * 4 + th)];
      }
      // Block b's rescale of l by its alpha, then block b - 1's parts added (the kernel adds
      // them once that P̃·V has landed, after the softmax of b), and block b's parts held.
      void next_block(int64_t r, Real alpha, const double (&parts)[4]) {
        for (int th = 0; th < 4; ++th) {
          Real& lt = l4[size_t(r * 4 + th)];
          Real& pt = pend4[size_t(r * 4 + th)];
          lt *= alpha;
          lt = std::fma(pt, alpha, lt);
          pt = Real(parts[th]);
        }
      }
    };
    std::vector<Real> s(static_cast<size_t>(sbk)), phat(s.size()), qk(s.size()), fk(s.size());
    // A cut of the accumulator without products: a wgmma step whose keys the row does not see
    // still aligns the held value to its own grid.
    auto idle_step = [&](double* acc, int64_t channels) {
      for (int64_t d = 0; d < channels; ++d) acc[d] = mma_aligned_step(acc[d], nullptr, 0, bits);
    };
    // The fast path: a softmax block whose every key the tile's first row sees (so every row
    // does; the kernel's kb < first_masked_block) skips the mask, takes the FFMA form and the
    // polynomial 2^x.
    const int64_t tile_visible = p.visible_keys(t.r0);

    // The softmax blocks of keys [k0, k1) into st.
    auto run_blocks = [&](State& st, int64_t k0, int64_t k1) {
      std::vector<Real>& m = st.m;
      RowAccumulators<Real>& ra = st.ra;
      for (int64_t j0 = k0; j0 < k1; j0 += sbk) {
        const int64_t j1 = std::min(p.seq_kv, j0 + sbk);
        const bool full_block = j0 + sbk <= tile_visible;
        for (int64_t r = 0; r < t.rows; ++r) {
          const int64_t i = t.r0 + r, n = p.visible_keys(i);
          double* acc = ra.acc(r);
          if (j0 >= n) {
            // Fully masked for this row: the wgmma still adds its zero products (alpha = 1, a
            // zero sum).
            if (aligned) idle_step(acc, D);
            st.next_block(r, Real(1), {0, 0, 0, 0});
            continue;
          }
          // S in base 2: Q^K^ · f in the kernel's form, else as the mma kernel forms it.
          Real row_max = neg_inf<Real>();
          if (kernel_scores) {
            const Real* qi = &t.q.q.values[size_t(i * D)];
            const Real q_scale_log2 = t.q.q.scale[size_t(i)] * scale_log2;
            for (int64_t j = j0; j < j1; ++j) {
              if (j >= n) {
                s[size_t(j - j0)] = neg_inf<Real>();
                continue;
              }
              const Real a = Real(dot<float>(qi, &t.kv.k.values[size_t(j * D)], D));
              const Real f = q_scale_log2 * t.kv.k.scale[size_t(j)];
              qk[size_t(j - j0)] = a;
              fk[size_t(j - j0)] = f;
              s[size_t(j - j0)] = a * f;
              row_max = std::max(row_max, s[size_t(j - j0)]);
            }
          } else {
            row_max =
                row_scores(cfg, t, ds.data(), D, i, n, j0, j1, scale_log2, Real(0), s.data());
          }
          const bool move = row_max > m[size_t(r)] + Real(kMaxSlack);
          const Real m_new = move ? row_max : m[size_t(r)];
          const Real alpha = move ? std::exp2(m[size_t(r)] - m_new) : Real(1);  // 0: first block
          // e = P~·p_unit = 2^(s - m + log2 p_unit), and P^ its E4M3 value.
          const Real m_shift = m_new - log2_p_unit;
          for (int64_t j = j0; j < j1; ++j) {
            Real e = 0;
            if (j < n) {
              Real x = s[size_t(j - j0)] - m_shift;
              if constexpr (std::is_same_v<Real, float>) {
                if (full_block && kernel_scores) {
                  const float f = fk[size_t(j - j0)];
                  x = std::fmaf(kMagicF + qk[size_t(j - j0)], f, -std::fmaf(kMagicF, f, m_shift));
                }
              }
              e = full_block && exp2_poly_at(i, j, cfg.exp2_poly_every) ? exp2_poly(x)
                                                                        : std::exp2(x);
            }
            phat[size_t(j - j0)] = pv.quantize(e);  // P^
          }
          m[size_t(r)] = m_new;
          ra.rescale(r, alpha);
          // P^·V^ into the accumulator. The kernel runs all sbk / accum_chunk steps of a
          // block; those past Nk add zero products (the held value cut to its own grid).
          accumulate_pv(cfg, phat.data(), t.kv.v.data(), j0, j1, D, acc, ra.scratch);
          const int64_t steps = (sbk + cfg.accum_chunk - 1) / cfg.accum_chunk;
          const int64_t steps_run = (j1 - j0 + cfg.accum_chunk - 1) / cfg.accum_chunk;
          if (aligned && steps_run < steps) idle_step(acc, D);
          ra.flush_if_due(cfg, r, [](int64_t, Real a) { return a; });
          // P^·1 by step: step s against a column of ones from zero (the kernel's channels 2s,
          // 2s + 1), the block's later steps adding zero products to it (aligned: cut to its own
          // grid), into part s mod 4.
          double parts[4] = {0, 0, 0, 0};
          for (int64_t s = 0; s < steps_run; ++s) {
            const int64_t c0 = j0 + s * cfg.accum_chunk;
            const int64_t c1 = std::min(j1, c0 + int64_t(cfg.accum_chunk));
            double sum = 0;
            accumulate_pv(cfg, phat.data() + (c0 - j0), ones.data(), c0, c1, 1, &sum, ra.scratch);
            if (aligned && s + 1 < steps) idle_step(&sum, 1);
            parts[s % 4] += sum;
          }
          st.next_block(r, alpha, parts);
        }
      }
    };

    // The tile's parts: key blocks [cut[i], cut[i + 1]) (one part unless the tile is split).
    std::vector<int64_t> cut{0};
    const int64_t tail = item - (tiles - split.tiles);
    if (split.tiles > 0 && tail >= 0) {
      const int64_t first = tail * split.blocks, last = first + split.blocks - 1;
      for (int64_t c = split.owner(first) + 1; c <= split.owner(last); ++c)
        cut.push_back(split.begin(c) - first);
    }
    cut.push_back(split.tiles > 0 && tail >= 0 ? split.blocks : (t.visible_max + sbk - 1) / sbk);
    State st(t.rows, D, cfg.accum_chunk);
    run_blocks(st, 0, std::min(t.visible_max, cut[1] * sbk));
    std::vector<Real> o(size_t(t.rows * D)), l4(size_t(t.rows * 4));
    for (int64_t r = 0; r < t.rows; ++r) {
      for (int64_t d = 0; d < D; ++d) o[size_t(r * D + d)] = st.o(r, d);
      for (int th = 0; th < 4; ++th) l4[size_t(r * 4 + th)] = st.l_end(r, th);
    }
    // Each later part merged into the first, in order (the merger's arithmetic, attn/sm90
    // mainloop.cuh): m = max, each side scaled by 2^(its m - m), l and O as a·x + (b·y).
    for (size_t c = 1; c + 1 < cut.size(); ++c) {
      State pt(t.rows, D, cfg.accum_chunk);
      run_blocks(pt, cut[c] * sbk, std::min(t.visible_max, cut[c + 1] * sbk));
      for (int64_t r = 0; r < t.rows; ++r) {
        const Real mn = std::max(st.m[size_t(r)], pt.m[size_t(r)]);
        const Real mu = mn == neg_inf<Real>() ? Real(0) : mn;
        const Real a = std::exp2(st.m[size_t(r)] - mu), b = std::exp2(pt.m[size_t(r)] - mu);
        for (int th = 0; th < 4; ++th) {
          Real& lt = l4[size_t(r * 4 + th)];
          lt = std::fma(lt, a, pt.l_end(r, th) * b);
        }
        for (int64_t d = 0; d < D; ++d) {
          Real& x = o[size_t(r * D + d)];
          x = std::fma(x, a, pt.o(r, d) * b);
        }
        st.m[size_t(r)] = mn;
      }
    }

    // 3. The kernel's finalize (attn/epilogue.cuh, kLUnit = kOUnit = p_unit): the parts added
    // (l0 + l1) + (l2 + l3), O · (v_scale · (1 / l)) + v_mean, and the LSE from l / p_unit.
    for (int64_t r = 0; r < t.rows; ++r) {
      const int64_t i = t.r0 + r;
      if (special_row(p, t, i, out, lse)) continue;
      Real* dst = out + (t.bh * Nq + i) * D;
      const Real* lt = &l4[size_t(r * 4)];
      const Real lsum = (lt[0] + lt[1]) + (lt[2] + lt[3]);
      const Real inv = Real(1) / lsum;
      for (int64_t d = 0; d < D; ++d)
        dst[d] = o[size_t(r * D + d)] * (t.kv.v_scale[size_t(d)] * inv) + t.kv.v_mean[size_t(d)];
      if (lse)
        lse[t.bh * Nq + i] =
            (st.m[size_t(r)] + std::log2(lsum * (Real(1) / Real(p_unit)))) * Real(kLn2) +
            t.q.lse_shift[size_t(i)];
    }
  });
}

template void emulate_sm90(const Problem&, const sage_quant_config&, const TensorView&,
                           const TensorView&, const TensorView&, float*, float*, int);
template void emulate_sm90(const Problem&, const sage_quant_config&, const TensorView&,
                           const TensorView&, const TensorView&, double*, double*, int);

}  // namespace emu
}  // namespace sage::ref
