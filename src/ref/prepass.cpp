// The pre-pass of the quantized-attention emulation (emulate.h), shared by every kernel family:
// Inf/NaN elements set aside, smoothing (K's and V's channel means per head, Q's per Q block), Q
// and K quantized in the config's groups (groups.cpp, microscale.cpp), V in its P·V format with
// its scales; then ΔS, the scores' share that Q smoothing takes out. Host code; mirrors
// src/quant/prepass.cu.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "ref/emulate.h"

namespace sage::ref {

int v_block_exponent(float amax) {
  // From the float's exponent field E, as the kernel computes it: amax is in [2^(E-127),
  // 2^(E-126)), so amax / 2^(E-134) is in [128, 256). The clamp keeps 2^-e a normal float.
  uint32_t bits = 0;
  std::memcpy(&bits, &amax, sizeof bits);
  const int biased = int((bits >> 23) & 0xFF);
  if (biased == 0 || biased == 255) return 0;
  return std::clamp(biased - 134, -120, 120);
}

namespace emu {

PvFormat pv_format_of(sage_pv_format f) {
  switch (f) {
    case SAGE_PV_FP8_E4M3: return {f, kE4M3Max, kE4M3Max};
    case SAGE_PV_FP8_E5M2: return {f, kE5M2Max, kE5M2Max};
    case SAGE_PV_INT8: return {f, float(kInt8Max), float(kInt8Max)};
    case SAGE_PV_NVFP4:
    case SAGE_PV_NVFP4_DIRECT:
    case SAGE_PV_MXFP4:
      return {f, 1.0f, 0.0f, pv_microscale(f), f == SAGE_PV_NVFP4};
    default: return {f, 1.0f, 0.0f};  // fp16 or full precision: no scales
  }
}

namespace {

// Channel means over rows r0, r0 + step, ... < r1 of a [rows][dim] matrix: summed in double,
// divided once by the number of rows taken, rounded to Real.
template <typename Real>
std::vector<Real> channel_mean(const std::vector<Real>& x, int64_t r0, int64_t r1, int64_t dim,
                               int64_t step = 1) {
  std::vector<double> sum(static_cast<size_t>(dim), 0.0);
  for (int64_t r = r0; r < r1; r += step)
    for (int64_t d = 0; d < dim; ++d) sum[size_t(d)] += double(x[size_t(r * dim + d)]);
  const double count = double((r1 - r0 + step - 1) / step);
  std::vector<Real> mean(static_cast<size_t>(dim));
  for (int64_t d = 0; d < dim; ++d) mean[size_t(d)] = Real(sum[size_t(d)] / count);
  return mean;
}

// x[r][d] -= mean[d] for rows r0 .. r1 - 1.
template <typename Real>
void subtract_mean(std::vector<Real>& x, int64_t r0, int64_t r1, int64_t dim,
                   const std::vector<Real>& mean) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t d = 0; d < dim; ++d) x[size_t(r * dim + d)] -= mean[size_t(d)];
}

// Non-finite inputs (docs/c-api.md, "Non-finite inputs"): every Inf/NaN element is quantized as a zero,
// so it reaches no statistic, scale or score of the other rows, and the rows it touches are
// marked afterwards (poisoned). Returns per row whether it held one.
template <typename Real>
std::vector<char> zero_non_finite(std::vector<Real>& x, int64_t rows, int64_t dim) {
  std::vector<char> bad(size_t(rows), 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < dim; ++d) {
      Real& e = x[size_t(r * dim + d)];
      if (!std::isfinite(e)) e = Real(0), bad[size_t(r)] = 1;
    }
  return bad;
}

template <typename Real>
std::vector<Real> load_rows(const TensorView& t, int64_t b, int64_t h, int64_t rows, int64_t dim) {
  const std::vector<float> f = load_matrix(t, b, h, rows, dim);
  return std::vector<Real>(f.begin(), f.end());
}

// V - v_mean ([Nk][D], in place) to the P·V format: FP4 runs of keys per channel; a power of
// two per key block (SAGE_V_SCALE_PER_BLOCK, kp.v_exponent); or amax / v_max per channel, or per
// (key block, channel) (kp.v_scale); or the format alone where it takes no scale.
// sample > 0 (a per-channel scale without V smoothing): every channel's amax is at least
// v_sample_bound of its max over tokens 0, sample, 2·sample, ... (formats.h).
template <typename Real>
void quantize_v(const sage_quant_config& cfg, int64_t Nk, int64_t D, int64_t sample,
                KvPrep<Real>& kp) {
  const PvFormat pv = pv_format_of(cfg.pv_format);
  const int64_t bk = cfg.block_k, k_blocks = (Nk + bk - 1) / bk;
  const bool block_v_scale = cfg.v_scale == SAGE_V_SCALE_PER_BLOCK_CHANNEL && pv.v_max > 0;
  const bool pow2_v_scale = cfg.v_scale == SAGE_V_SCALE_PER_BLOCK && pv.v_max > 0;
  const int64_t scale_rows = block_v_scale ? k_blocks : 1;
  kp.v_scale.assign(size_t(scale_rows * D), Real(1));
  kp.v_exponent.assign(size_t(k_blocks), 0);
  if (pv.fp4) {
    // Runs of keys per channel, from key 0 (so inside key blocks: block_k is a multiple).
    for (int64_t d = 0; d < D; ++d) round_fp4(&kp.v[size_t(d)], Nk, D, *pv.fp4);
  } else if (pow2_v_scale) {
    for (int64_t kb = 0; kb < k_blocks; ++kb) {
      const int64_t j0 = kb * bk, j1 = std::min(Nk, j0 + bk);
      float amax = 0.0f;
      for (int64_t i = j0 * D; i < j1 * D; ++i)
        amax = std::max(amax, float(std::fabs(kp.v[size_t(i)])));
      const int e = v_block_exponent(amax);
      kp.v_exponent[size_t(kb)] = e;
      const float inv = std::ldexp(1.0f, -e);  // exact: |e| <= 120
      for (int64_t i = j0 * D; i < j1 * D; ++i)
        kp.v[size_t(i)] = pv.quantize(Real(float(kp.v[size_t(i)]) * inv));
    }
  } else if (pv.v_max > 0) {
    std::vector<float> amax(size_t(scale_rows * D), 0.0f);
    for (int64_t j = 0; j < Nk; ++j) {
      const int64_t row = block_v_scale ? j / bk : 0;
      for (int64_t d = 0; d < D; ++d) {
        float& a = amax[size_t(row * D + d)];
        a = std::max(a, float(std::fabs(kp.v[size_t(j * D + d)])));
      }
    }
    if (!block_v_scale && sample > 0)
      for (int64_t d = 0; d < D; ++d) {
        float smax = 0.0f;
        for (int64_t j = 0; j < Nk; j += sample)
          smax = std::max(smax, float(std::fabs(kp.v[size_t(j * D + d)])));
        amax[size_t(d)] = std::max(amax[size_t(d)], v_sample_bound(smax));
      }
    for (int64_t j = 0; j < Nk; ++j) {
      const int64_t row = block_v_scale ? j / bk : 0;
      for (int64_t d = 0; d < D; ++d) {
        const QuantScale s = make_quant_scale(amax[size_t(row * D + d)], pv.v_max);
        kp.v_scale[size_t(row * D + d)] = Real(s.scale);
        Real& x = kp.v[size_t(j * D + d)];
        x = pv.quantize(Real(float(x) * s.inv));
      }
    }
  } else {
    for (Real& x : kp.v) x = pv.quantize(x);
  }
}

// K and V of (batch b, kv head h).
template <typename Real>
KvPrep<Real> prepare_kv(const Problem& p, const sage_quant_config& cfg, const TensorView& k,
                        const TensorView& v, int64_t b, int64_t h) {
  const int64_t D = p.head_dim, Nk = p.seq_kv;
  KvPrep<Real> kp;
  kp.k_smooth = load_rows<Real>(k, b, h, Nk, D);
  const std::vector<char> k_bad = zero_non_finite(kp.k_smooth, Nk, D);
  // K's smoothing mean over every k_mean_stride-th token (any k_mean is exact: a constant per row).
  kp.k_mean = cfg.smooth & SAGE_SMOOTH_K
                  ? channel_mean(kp.k_smooth, 0, Nk, D, mean_token_stride(Nk, cfg.k_mean_tokens))
                  : std::vector<Real>(size_t(D), Real(0));
  subtract_mean(kp.k_smooth, 0, Nk, D, kp.k_mean);
  kp.k = quantize_groups(kp.k_smooth, Nk, D, k_group_layout(cfg), cfg.qk_format);

  kp.v = load_rows<Real>(v, b, h, Nk, D);
  const std::vector<char> v_bad = zero_non_finite(kp.v, Nk, D);
  kp.first_bad = Nk;
  for (int64_t j = Nk - 1; j >= 0; --j)
    if (k_bad[size_t(j)] || v_bad[size_t(j)]) kp.first_bad = j;
  kp.v_mean = cfg.smooth & SAGE_SMOOTH_V ? channel_mean(kp.v, 0, Nk, D)
                                         : std::vector<Real>(size_t(D), Real(0));
  subtract_mean(kp.v, 0, Nk, D, kp.v_mean);
  // Without V smoothing V's scale is bounded from K's mean sample (v_sample_bound); with it the
  // exact channel range, which the pass for V's exact mean gives anyway.
  quantize_v(cfg, Nk, D,
             cfg.smooth & SAGE_SMOOTH_V ? 0 : mean_token_stride(Nk, cfg.k_mean_tokens), kp);
  return kp;
}

// Q of (batch b, q head h), whose kv head's pre-pass is kp (its k_mean gives the LSE shift).
template <typename Real>
QPrep<Real> prepare_q(const Problem& p, const sage_quant_config& cfg, const TensorView& q,
                      const KvPrep<Real>& kp, int64_t b, int64_t h) {
  const int64_t D = p.head_dim, Nq = p.seq_q, bq = cfg.block_q;
  QPrep<Real> pr;
  std::vector<Real> x = load_rows<Real>(q, b, h, Nq, D);
  pr.bad = zero_non_finite(x, Nq, D);
  pr.lse_shift.resize(size_t(Nq));
  for (int64_t r = 0; r < Nq; ++r)
    pr.lse_shift[size_t(r)] = Real(p.scale * dot<double>(&x[size_t(r * D)], kp.k_mean.data(), D));
  const int64_t q_blocks = (Nq + bq - 1) / bq;
  pr.q_mean.assign(size_t(q_blocks * D), Real(0));
  for (int64_t qb = 0; qb < q_blocks && (cfg.smooth & SAGE_SMOOTH_Q); ++qb) {
    const int64_t r0 = qb * bq, r1 = std::min(Nq, r0 + bq);
    const std::vector<Real> mean = channel_mean(x, r0, r1, D);
    std::copy(mean.begin(), mean.end(), pr.q_mean.begin() + qb * D);
    subtract_mean(x, r0, r1, D, mean);
  }
  pr.q = quantize_groups(x, Nq, D, q_group_layout(cfg), cfg.qk_format);
  return pr;
}

}  // namespace

template <typename Real>
Prepass<Real> prepass(const Problem& p, const sage_quant_config& cfg, const TensorView& q,
                      const TensorView& k, const TensorView& v, int threads) {
  Prepass<Real> pre;
  pre.kv.resize(size_t(p.batch * p.heads_kv));
  parallel_for(int64_t(pre.kv.size()), threads, [&](int64_t i) {
    pre.kv[size_t(i)] = prepare_kv<Real>(p, cfg, k, v, i / p.heads_kv, i % p.heads_kv);
  });
  pre.q.resize(size_t(p.batch * p.heads_q));
  parallel_for(int64_t(pre.q.size()), threads, [&](int64_t i) {
    const int64_t b = i / p.heads_q, h = i % p.heads_q;
    const KvPrep<Real>& kp = pre.kv[size_t(b * p.heads_kv + h / p.group_ratio())];
    pre.q[size_t(i)] = prepare_q<Real>(p, cfg, q, kp, b, h);
  });
  return pre;
}

template <typename Real>
std::vector<Real> delta_s(const Problem& p, const sage_quant_config& cfg, const Tile<Real>& t) {
  const int64_t D = p.head_dim, Nk = p.seq_kv;
  std::vector<Real> ds(size_t(Nk), Real(0));
  if (!(cfg.smooth & SAGE_SMOOTH_Q)) return ds;
  const Real* q_mean = &t.q.q_mean[size_t(t.qb * D)];
  for (int64_t j = 0; j < Nk; ++j) {
    const Real* k_smooth = &t.kv.k_smooth[size_t(j * D)];
    if constexpr (std::is_same_v<Real, float>) {
      float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int64_t c = 0; c < D; ++c) {
        float& acc = part[(c / 8) % 4];
        acc = std::fmaf(q_mean[c], k_smooth[c], acc);
      }
      ds[size_t(j)] = (part[0] + part[1]) + (part[2] + part[3]);
    } else {
      ds[size_t(j)] = Real(dot<double>(q_mean, k_smooth, D));
    }
  }
  return ds;
}

template Prepass<float> prepass(const Problem&, const sage_quant_config&, const TensorView&,
                                const TensorView&, const TensorView&, int);
template Prepass<double> prepass(const Problem&, const sage_quant_config&, const TensorView&,
                                 const TensorView&, const TensorView&, int);
template std::vector<float> delta_s(const Problem&, const sage_quant_config&, const Tile<float>&);
template std::vector<double> delta_s(const Problem&, const sage_quant_config&,
                                     const Tile<double>&);

}  // namespace emu
}  // namespace sage::ref
