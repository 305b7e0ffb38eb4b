// What the kernel-family emulations of quantized attention share (internal to src/ref): the
// pre-pass that smooths and quantizes Q, K and V (prepass.cpp), the scores as the Q·K MMA forms
// them, the P·V accumulator models (pv_accumulator.cpp), and the epilogue's special rows. The
// families themselves, each the algorithm of one kernel read top to bottom:
//   emulate_mma.cpp   the mma.sync kernel (SageAttention2; also every ablation knob of that form),
//   emulate_sm90.cpp  the sm90 wgmma kernel (sm90_softmax_form),
//   emulate_fp4.cpp   the FP4 kernel (SageAttention3: an FP4 P·V format);
// attention_quant.cpp picks one. The backward is backward.cpp.
//
// `Real` is the arithmetic of everything that is not quantized: float reproduces the GPU's fp32
// registers; double gives the same quantization with ideal arithmetic around it (used to show
// that smoothing is an exact identity, and to separate rounding error from quantization error).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/formats.h"
#include "ref/reference.h"

namespace sage::ref::emu {

constexpr double kLog2e = 1.4426950408889634;
constexpr double kLn2 = 0.6931471805599453;
template <typename Real>
constexpr Real neg_inf() {
  return -std::numeric_limits<Real>::infinity();
}

// A row's LSE (natural log) from its running max m (log2 units) and sum l, in double as the
// mma.sync and FP4 kernels' epilogues form it, plus the row's smoothing shift.
template <typename Real>
Real row_lse(Real m, Real l, Real shift) {
  return Real((double(m) + std::log2(double(l))) * kLn2) + shift;
}

// Dot product with independent partial sums (vectorizes without reassociation flags). With
// Acc = float it is exact for INT8/INT4 operands (every partial sum < 2^24 for head_dim <= 256),
// which is what the integer MMA computes.
template <typename Acc, typename T>
Acc dot(const T* a, const T* b, int64_t n) {
  Acc acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += Acc(a[i + l]) * Acc(b[i + l]);
  for (; i < n; ++i) acc[0] += Acc(a[i]) * Acc(b[i]);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// A block-scaled FP4 MMA's dot product: each k_step-long slice (one m16n8k64) summed exactly (in
// double) and added to the fp32 (Real) accumulator, as D = A·B + C. The operands are the
// dequantized values (E2M1 x scale), so their products are exact.
template <typename Real>
Real mma_dot(const Real* a, const Real* b, int64_t n, int64_t k_step) {
  Real acc = 0;
  for (int64_t c0 = 0; c0 < n; c0 += k_step) {
    const int64_t c1 = std::min(n, c0 + k_step);
    double slice = 0;
    for (int64_t i = c0; i < c1; ++i) slice += double(a[i]) * double(b[i]);
    acc = Real(double(acc) + slice);
  }
  return acc;
}
constexpr int64_t kFp4MmaK = 64;  // K of mma.sync m16n8k64 / tcgen05.mma kind::mxf4nvf4

// Q^·K^ of one query and one key as the Q·K MMA of `format` sums it: integer operands exactly
// (a float dot product is exact, as the integer MMA is), FP4 ones k64 slice by slice into fp32,
// others (FP8, unquantized) in double, rounded to Real.
template <typename Real>
Real qk_dot(const Real* q, const Real* k, int64_t n, sage_qk_format format) {
  if (qk_microscale(format)) return mma_dot(q, k, n, kFp4MmaK);
  if (std::is_same_v<Real, float> && (format == SAGE_QK_INT8 || format == SAGE_QK_INT4))
    return Real(dot<float>(q, k, n));
  return Real(dot<double>(q, k, n));
}

// How P~ and V are stored for the P·V product.
struct PvFormat {
  sage_pv_format format;
  float p_scale;  // P^ = quantize(P~ * p_scale)
  float v_max;    // V^ = quantize(V / v_scale), v_scale = amax / v_max (0: no scale)
  const MicroscaleFormat* fp4 = nullptr;  // FP4 runs (quantize() is then the identity)
  bool two_level = false;                 // P~ scaled per row to [0, 448·6] first (SAGE_PV_NVFP4)

  template <typename Real>
  Real quantize(Real x) const {
    switch (format) {
      case SAGE_PV_FP16: return Real(round_fp16(float(x)));
      case SAGE_PV_FP8_E4M3: return Real(round_float(kE4M3, float(x)));
      case SAGE_PV_FP8_E5M2: return Real(round_float(kE5M2, float(x)));
      case SAGE_PV_INT8: return Real(quantize_int(float(x), 1.0f, kInt8Max));
      default: return x;
    }
  }
};
PvFormat pv_format_of(sage_pv_format f);

// ---- The pre-pass (prepass.cpp): Q, K, V smoothed and quantized as the kernels' pre-pass does.

// K, V of one (batch, kv head).
template <typename Real>
struct KvPrep {
  std::vector<Real> k_mean;       // [D], zeros without K smoothing
  std::vector<Real> k_smooth;     // K - k_mean, [Nk][D] (for ΔS)
  QuantizedGroups<Real> k;        // quantized K - k_mean
  std::vector<Real> v_mean;       // [D], zeros without V smoothing
  std::vector<Real> v;            // quantized V - v_mean, [Nk][D]
  std::vector<Real> v_scale;      // [scale rows][D]: one row (per channel) or one per key block
  std::vector<int> v_exponent;    // [key blocks]: V^ = V / 2^e (SAGE_V_SCALE_PER_BLOCK), else 0
  int64_t first_bad = 0;          // the first key whose K or V row holds Inf/NaN, else Nk
};

// Q of one (batch, q head).
template <typename Real>
struct QPrep {
  std::vector<Real> q_mean;       // [Q blocks][D], zeros without Q smoothing
  QuantizedGroups<Real> q;        // quantized Q - q_mean of its block
  std::vector<Real> lse_shift;    // [Nq]: scale * q_i·k_mean, added back to the LSE
  std::vector<char> bad;          // [Nq]: the row of Q holds Inf/NaN
};

// One item of the attention kernel: a Q block of one (batch, q head), rows r0 .. r0 + rows - 1.
template <typename Real>
struct Tile {
  int64_t bh, qb, r0, rows;
  int64_t visible_max;  // the most keys any of its rows sees
  const QPrep<Real>& q;
  const KvPrep<Real>& kv;
};

template <typename Real>
struct Prepass {
  std::vector<KvPrep<Real>> kv;  // [B][Hkv]
  std::vector<QPrep<Real>> q;    // [B][Hq]
  // Item `item` of B·Hq·ceil(Nq / block_q) (Q blocks innermost).
  Tile<Real> tile(const Problem& p, int64_t block_q, int64_t item) const {
    const int64_t q_blocks = (p.seq_q + block_q - 1) / block_q;
    const int64_t qb = item % q_blocks, bh = item / q_blocks;
    const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
    const int64_t r0 = qb * block_q, rows = std::min(p.seq_q, r0 + block_q) - r0;
    int64_t visible_max = 0;
    for (int64_t r = 0; r < rows; ++r) visible_max = std::max(visible_max, p.visible_keys(r0 + r));
    return {bh, qb, r0, rows, visible_max, q[size_t(bh)],
            kv[size_t(b * p.heads_kv + h / p.group_ratio())]};
  }
};

// K then Q of every head: each Inf/NaN element quantized as a zero (and its row remembered), the
// means taken out (K's over every mean_token_stride-th token, V's over all, Q's per Q block), K
// and Q quantized in the config's groups, V in its format with its scales.
template <typename Real>
Prepass<Real> prepass(const Problem& p, const sage_quant_config& cfg, const TensorView& q,
                      const TensorView& k, const TensorView& v, int threads);

// ---- Scores

// ΔS = q_mean · (K - k_mean)ᵀ of the tile's Q block, one value per key (zeros without Q
// smoothing): the part of Q·Kᵀ that quantizing Q - q_mean leaves out, added back to the scores.
// In float as the mma kernel forms it (attn/mma/attention.cuh, DeltaS): channel c belongs to part
// (c / 8) % 4, each part is an FMA chain over its channels in increasing order, and the parts are
// added as (p0 + p1) + (p2 + p3). The double emulation takes the exact dot product.
template <typename Real>
std::vector<Real> delta_s(const Problem& p, const sage_quant_config& cfg, const Tile<Real>& t);

// Row i's scores of keys [j0, j1) in base 2, into s[j - j0]: Q^·K^ (qk_dot) times the two
// groups' scales, ΔS added, times scale·log2 e, plus `shift`; -inf for the keys past the row's n
// visible ones. Returns their max.
template <typename Real>
Real row_scores(const sage_quant_config& cfg, const Tile<Real>& t, const Real* delta_s,
                int64_t D, int64_t i, int64_t n, int64_t j0, int64_t j1, Real scale_log2,
                Real shift, Real* s) {
  const Real* qi = &t.q.q.values[size_t(i * D)];
  const Real qs = t.q.q.scale[size_t(i)];
  Real row_max = neg_inf<Real>();
  for (int64_t j = j0; j < j1; ++j) {
    if (j >= n) {
      s[j - j0] = neg_inf<Real>();
      continue;
    }
    const Real a = qk_dot(qi, &t.kv.k.values[size_t(j * D)], D, cfg.qk_format);
    const Real x = (a * (qs * t.kv.k.scale[size_t(j)]) + delta_s[j]) * scale_log2 + shift;
    s[j - j0] = x;
    row_max = std::max(row_max, x);
  }
  return row_max;
}

// ---- The P·V accumulator (pv_accumulator.cpp)

// Keep `bits` mantissa bits of x, dropping the rest toward zero (the MMA accumulator's add).
double truncate_mantissa(double x, int bits);

// One row's P^·V^ over keys [j0, j1) (p[j - j0]; v the [Nk][D] quantized V) added into acc[D],
// the MMA accumulator (a double holding exactly what the hardware register holds), one MMA of
// accum_chunk keys at a time: the MMA sums its products exactly, then the accumulator takes the
// sum rounded to fp32 (Real: pv_accum FP32), cut to accum_mantissa_bits (HW, TWO_LEVEL), or
// product by product as the wgmma E4M3 accumulator aligns them (ALIGNED, mma_aligned_step).
struct PvScratch {
  std::vector<double> chunk, step;
  PvScratch(int64_t D, int accum_chunk)
      : chunk(size_t(D)), step(size_t(std::max(1, accum_chunk))) {}
};
template <typename Real>
void accumulate_pv(const sage_quant_config& cfg, const Real* p, const Real* v, int64_t j0,
                   int64_t j1, int64_t D, double* acc, PvScratch& scratch);

// Whether the row's accumulator is added into O after this key block: every block (FP32), every
// pv_flush_interval-th one (TWO_LEVEL; `pending` counts them), never (HW, ALIGNED: one level).
inline bool flush_due(const sage_quant_config& cfg, int& pending) {
  if (cfg.pv_accum == SAGE_PV_ACCUM_FP32) return true;
  if (cfg.pv_accum != SAGE_PV_ACCUM_TWO_LEVEL || ++pending != cfg.pv_flush_interval) return false;
  pending = 0;
  return true;
}

// A tile's P·V state per row, as every kernel family keeps it: the fp32 output O, the MMA
// accumulator R (a double holding exactly what the register holds), and the key blocks in R since
// its last flush.
template <typename Real>
struct RowAccumulators {
  int64_t D;
  std::vector<Real> O;
  std::vector<double> R;
  std::vector<int> pending;
  PvScratch scratch;
  RowAccumulators(int64_t rows, int64_t D, int accum_chunk)
      : D(D), O(size_t(rows * D), Real(0)), R(size_t(rows * D), 0.0), pending(size_t(rows), 0),
        scratch(D, accum_chunk) {}
  Real* o(int64_t r) { return &O[size_t(r * D)]; }
  double* acc(int64_t r) { return &R[size_t(r * D)]; }
  // The online softmax's rescale by alpha = 2^(m_old - m): O, and the accumulator as the fp32
  // value its register holds.
  void rescale(int64_t r, Real alpha) {
    Real* out = o(r);
    double* a = acc(r);
    for (int64_t d = 0; d < D; ++d) {
      out[d] *= alpha;
      a[d] = double(Real(a[d]) * alpha);
    }
  }
  // After a key block (flush_due): the accumulator into O, channel d's value mapped by
  // scaled(d, value) (a family's V or P scale), and cleared.
  template <typename Scaled>
  void flush_if_due(const sage_quant_config& cfg, int64_t r, Scaled scaled) {
    if (!flush_due(cfg, pending[size_t(r)])) return;
    Real* out = o(r);
    double* a = acc(r);
    for (int64_t d = 0; d < D; ++d) {
      out[d] += scaled(d, Real(a[d]));
      a[d] = 0.0;
    }
  }
};

// ---- The epilogue

// Writes row i of (batch, q head) bh where it is special and returns true: a row that sees keys
// is poisoned (O and LSE NaN) by an Inf/NaN in its query or in a key or value row it sees (the
// kernels: the pre-pass marks its LSE shift, the epilogue writes NaN); a row that sees none gets
// O = 0, LSE = -inf.
template <typename Real>
bool special_row(const Problem& p, const Tile<Real>& t, int64_t i, Real* out, Real* lse) {
  const int64_t D = p.head_dim, n = p.visible_keys(i);
  Real* dst = out + (t.bh * p.seq_q + i) * D;
  if (n > 0 && (t.q.bad[size_t(i)] || t.kv.first_bad < n)) {
    std::fill(dst, dst + D, std::numeric_limits<Real>::quiet_NaN());
    if (lse) lse[t.bh * p.seq_q + i] = std::numeric_limits<Real>::quiet_NaN();
    return true;
  }
  if (n == 0) {
    std::fill(dst, dst + D, Real(0));
    if (lse) lse[t.bh * p.seq_q + i] = neg_inf<Real>();
    return true;
  }
  return false;
}

// ---- The families (same conventions as attention_quant; the config already validated).
template <typename Real>
void emulate_mma(const Problem& p, const sage_quant_config& cfg, const TensorView& q,
                 const TensorView& k, const TensorView& v, Real* out, Real* lse, int threads);
template <typename Real>
void emulate_sm90(const Problem& p, const sage_quant_config& cfg, const TensorView& q,
                  const TensorView& k, const TensorView& v, Real* out, Real* lse, int threads);
template <typename Real>
void emulate_fp4(const Problem& p, const sage_quant_config& cfg, const TensorView& q,
                 const TensorView& k, const TensorView& v, Real* out, Real* lse, int threads);

}  // namespace sage::ref::emu
