// TEMPORARY (issue 32, the oracle refactor): a verbatim copy of src/ref/attention_quant.cpp as it
// stood at 3758249, before it was split into one emulation per kernel family, in namespace
// sage::ref::legacy. test_oracle_families.cpp holds the new emulations equal to it bit for bit.
// The CPU emulation of quantized attention (SageAttention2): smoothing, per-group
// Q/K quantization, base-2 online softmax over key blocks, P~ and V quantization, and the P·V
// accumulator as the hardware keeps it (exact sums inside one MMA, truncation to a few mantissa
// bits on each add, flushed into fp32 every few key blocks). Host code; mirrors the GPU kernels.
// softmax_block_k > block_k, exp2_poly_every > 0, or granularity PER_THREAD_WGMMA with pv_accum
// ALIGNED (sm90_softmax_form) selects the sm90 (wgmma) kernel's softmax form: softmax blocks of
// one or several K scale blocks, P~·448 computed as one 2^x (in fp32 with the
// kernel's seeded-accumulator FFMA), the polynomial 2^x on its share of the scores, row sums in
// the kernel's per-thread partial sums, and its finalize (see run()).
//
// `Real` is the arithmetic of everything that is not quantized: float reproduces the GPU's fp32
// registers; double gives the same quantization with ideal arithmetic around it (used to show
// that smoothing is an exact identity, and to separate rounding error from quantization error).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include "common/error.h"
#include "common/exp2_poly.h"
#include "common/formats.h"
#include "ref/reference.h"

namespace sage::ref::legacy {
using sage::exp2_poly;
namespace {

constexpr double kLog2e = 1.4426950408889634;
constexpr double kLn2 = 0.6931471805599453;
template <typename Real>
constexpr Real neg_inf() {
  return -std::numeric_limits<Real>::infinity();
}

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

// ΔS = q_mean·(k - k_mean) of one key (k_smooth: k - k_mean, already rounded to Real) as the
// mma kernel forms it in fp32 (attn/mma/attention.cuh, DeltaS): channel c belongs to part
// (c / 8) % 4, each part is an FMA chain over its channels in increasing order, and the parts
// are added as (p0 + p1) + (p2 + p3). The double emulation takes the exact dot product.
template <typename Real>
Real delta_s_of(const Real* q_mean, const Real* k_smooth, int64_t n) {
  if constexpr (std::is_same_v<Real, float>) {
    float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t c = 0; c < n; ++c) {
      float& acc = part[(c / 8) % 4];
      acc = std::fmaf(q_mean[c], k_smooth[c], acc);
    }
    return (part[0] + part[1]) + (part[2] + part[3]);
  } else {
    return Real(dot<double>(q_mean, k_smooth, n));
  }
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

// Keep `bits` mantissa bits of x, dropping the rest toward zero (the MMA accumulator's add).
double truncate_mantissa(double x, int bits) {
  if (x == 0.0 || !std::isfinite(x)) return x;
  int e = 0;
  const double f = std::frexp(x, &e);  // |f| in [0.5, 1)
  return std::ldexp(std::trunc(std::ldexp(f, bits + 1)), e - (bits + 1));
}

}  // namespace

int v_block_exponent(float amax) {
  // From the float's exponent field E, as the kernel computes it: amax is in [2^(E-127),
  // 2^(E-126)), so amax / 2^(E-134) is in [128, 256). The clamp keeps 2^-e a normal float.
  uint32_t bits = 0;
  std::memcpy(&bits, &amax, sizeof bits);
  const int biased = int((bits >> 23) & 0xFF);
  if (biased == 0 || biased == 255) return 0;
  return std::clamp(biased - 134, -120, 120);
}

double mma_aligned_step(double acc, const double* products, int n, int bits) {
  // The largest exponent among the addends is the exponent of the largest magnitude (frexp's
  // exponent is monotone in |x|): one frexp per step instead of one per addend (the emulation
  // calls this for every (row, channel, 32 keys) of the sm90 configuration).
  double amax = std::fabs(acc);
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(products[i]));
  if (amax == 0.0) return 0.0;
  if (!std::isfinite(amax)) {  // inf or NaN: whatever the grid, the sum is not finite
    double sum = acc;
    for (int i = 0; i < n; ++i) sum += products[i];
    return double(float(sum));
  }
  int e_max = 0;
  std::frexp(amax, &e_max);
  // The largest addend keeps its leading bit and `bits` more; the others are cut to that grid.
  // Scaling by the power of two 2^(bits + 1 - e_max) is exact, so trunc cuts at the grid.
  const double quantum = std::ldexp(1.0, e_max - 1 - bits), inv = std::ldexp(1.0, bits + 1 - e_max);
  double sum = std::trunc(acc * inv) * quantum;  // exact: multiples of quantum, few bits
  for (int i = 0; i < n; ++i) sum += std::trunc(products[i] * inv) * quantum;
  return double(float(sum));  // the accumulator register is fp32
}

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

namespace {

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

// K, V of one (batch, kv head) after the pre-pass.
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

// Q of one (batch, q head) after the pre-pass.
template <typename Real>
struct QPrep {
  std::vector<Real> q_mean;       // [Q blocks][D], zeros without Q smoothing
  QuantizedGroups<Real> q;        // quantized Q - q_mean of its block
  std::vector<Real> lse_shift;    // [Nq]: scale * q_i·k_mean, added back to the LSE
  std::vector<char> bad;          // [Nq]: the row of Q holds Inf/NaN
};

// Non-finite inputs (README, "Non-finite inputs"): every Inf/NaN element is quantized as a zero,
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

// P~ of one row of a key block (n keys, masked ones 0) to FP4 in place; returns the factor s_P1
// the block's P·V product is multiplied by. Two-level (SageAttention3 paper, Algorithm 1, line 10):
// s_P1 = rowmax(P~) / (448·6) in fp32, P~ / s_P1 in [0, 2688] (its runs' E4M3 scales then use
// E4M3's range up to 448), then NVFP4. rowmax(P~) = 2^(rowmax(S) - m), the online softmax's own
// max, as the kernel reuses it. Direct: P~ in [0, 1] straight into FP4, s_P1 = 1.
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

template <typename Real>
std::vector<Real> load_rows(const TensorView& t, int64_t b, int64_t h, int64_t rows, int64_t dim) {
  const std::vector<float> f = load_matrix(t, b, h, rows, dim);
  return std::vector<Real>(f.begin(), f.end());
}

template <typename Real>
void run(const Problem& p, const sage_quant_config& cfg, const TensorView& q, const TensorView& k,
         const TensorView& v, Real* out, Real* lse, int threads) {
  if (const std::string e = quant_config_error(cfg); !e.empty())
    throw Error{SAGE_ERROR_INVALID_ARGUMENT, e};
  const int64_t D = p.head_dim, Nq = p.seq_q, Nk = p.seq_kv;
  const int64_t bq = cfg.block_q, bk = cfg.block_k;
  const int64_t q_blocks = (Nq + bq - 1) / bq, k_blocks = (Nk + bk - 1) / bk;
  const bool smooth_q = cfg.smooth & SAGE_SMOOTH_Q, smooth_k = cfg.smooth & SAGE_SMOOTH_K,
             smooth_v = cfg.smooth & SAGE_SMOOTH_V;
  // Integer operands: a float dot product is exact, as the integer MMA is.
  const bool exact_qk_in_float = cfg.qk_format == SAGE_QK_INT8 || cfg.qk_format == SAGE_QK_INT4;
  const bool fp4_qk = qk_microscale(cfg.qk_format) != nullptr;
  const PvFormat pv = pv_format_of(cfg.pv_format);
  const bool block_v_scale = cfg.v_scale == SAGE_V_SCALE_PER_BLOCK_CHANNEL && pv.v_max > 0;
  // A power of two per key block moves into the softmax (scores + e, row sum / 2^e): P^·V^
  // then needs no scale at all, so no flush of the accumulator either.
  const bool pow2_v_scale = cfg.v_scale == SAGE_V_SCALE_PER_BLOCK && pv.v_max > 0;
  // K's smoothing mean over every k_mean_stride-th token (any k_mean is exact: a constant per row).
  const int64_t k_mean_stride = mean_token_stride(Nk, cfg.k_mean_tokens);
  const GroupLayout q_layout = q_group_layout(cfg), k_layout = k_group_layout(cfg);
  const size_t dims = static_cast<size_t>(D);

  // --- Pre-pass over K and V, once per (batch, kv head).
  std::vector<KvPrep<Real>> kv(size_t(p.batch * p.heads_kv));
  parallel_for(int64_t(kv.size()), threads, [&](int64_t i) {
    KvPrep<Real>& kp = kv[size_t(i)];
    const int64_t b = i / p.heads_kv, h = i % p.heads_kv;
    kp.k_smooth = load_rows<Real>(k, b, h, Nk, D);
    const std::vector<char> k_bad = zero_non_finite(kp.k_smooth, Nk, D);
    kp.k_mean = smooth_k ? channel_mean(kp.k_smooth, 0, Nk, D, k_mean_stride)
                         : std::vector<Real>(dims, Real(0));
    for (int64_t j = 0; j < Nk; ++j)
      for (int64_t d = 0; d < D; ++d) kp.k_smooth[size_t(j * D + d)] -= kp.k_mean[size_t(d)];
    kp.k = quantize_groups(kp.k_smooth, Nk, D, k_layout, cfg.qk_format);

    kp.v = load_rows<Real>(v, b, h, Nk, D);
    const std::vector<char> v_bad = zero_non_finite(kp.v, Nk, D);
    kp.first_bad = Nk;
    for (int64_t j = Nk - 1; j >= 0; --j)
      if (k_bad[size_t(j)] || v_bad[size_t(j)]) kp.first_bad = j;
    kp.v_mean = smooth_v ? channel_mean(kp.v, 0, Nk, D) : std::vector<Real>(dims, Real(0));
    for (int64_t j = 0; j < Nk; ++j)
      for (int64_t d = 0; d < D; ++d) kp.v[size_t(j * D + d)] -= kp.v_mean[size_t(d)];
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
  });

  // --- Pre-pass over Q, once per (batch, q head).
  std::vector<QPrep<Real>> qp(size_t(p.batch * p.heads_q));
  parallel_for(int64_t(qp.size()), threads, [&](int64_t i) {
    QPrep<Real>& pr = qp[size_t(i)];
    const int64_t b = i / p.heads_q, h = i % p.heads_q;
    const KvPrep<Real>& kp = kv[size_t(b * p.heads_kv + h / p.group_ratio())];
    std::vector<Real> x = load_rows<Real>(q, b, h, Nq, D);
    pr.bad = zero_non_finite(x, Nq, D);
    pr.lse_shift.resize(size_t(Nq));
    for (int64_t r = 0; r < Nq; ++r)
      pr.lse_shift[size_t(r)] = Real(p.scale * dot<double>(&x[size_t(r * D)], kp.k_mean.data(), D));
    pr.q_mean.assign(size_t(q_blocks * D), Real(0));
    for (int64_t qb = 0; qb < q_blocks && smooth_q; ++qb) {
      const int64_t r0 = qb * bq, r1 = std::min(Nq, r0 + bq);
      const std::vector<Real> mean = channel_mean(x, r0, r1, D);
      std::copy(mean.begin(), mean.end(), pr.q_mean.begin() + qb * D);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t d = 0; d < D; ++d) x[size_t(r * D + d)] -= mean[size_t(d)];
    }
    pr.q = quantize_groups(x, Nq, D, q_layout, cfg.qk_format);
  });

  // --- The attention kernel: one item per (batch, q head, Q block), streaming softmax blocks of
  // sbk keys (block_k, unless softmax_block_k asks for more: K's scale groups stay per block_k).
  const Real scale_log2 = Real(p.scale * kLog2e);
  const int64_t sbk = cfg.softmax_block_k > 0 ? cfg.softmax_block_k : bk;
  // The sm90 kernel's softmax form (the file comment). Its scores are modelled in fp32 as the
  // kernel forms them where that form exists (integer Q·K, no ΔS: the kernel has no Q smoothing):
  // f = (q_scale · scale·log2 e) · k_scale, the max over Q^K^·f, and in a block every row sees all
  // of, the exponent of P~·448 as one FFMA on the seeded accumulator 1.5·2^23 + Q^K^
  // (attn/sm90/softmax.cuh). The double emulation keeps ideal arithmetic.
  const bool sm90 = sm90_softmax_form(cfg);
  const bool sm90_scores = sm90 && std::is_same_v<Real, float> && exact_qk_in_float && !smooth_q;
  // In the sm90 form 2^x gives P~·p_scale directly: x = s - m + log2 p_scale.
  const Real log2_p_scale = Real(std::log2(double(pv.p_scale)));
  const bool aligned = cfg.pv_accum == SAGE_PV_ACCUM_ALIGNED;
  const int bits = cfg.accum_mantissa_bits;
  parallel_for(p.batch * p.heads_q * q_blocks, threads, [&](int64_t item) {
    const int64_t qb = item % q_blocks, bh = item / q_blocks;
    const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
    const KvPrep<Real>& kp = kv[size_t(b * p.heads_kv + h / p.group_ratio())];
    const QPrep<Real>& pr = qp[size_t(bh)];
    const int64_t r0 = qb * bq, rows = std::min(Nq, r0 + bq) - r0;

    // ΔS = q_mean · (K - k_mean)ᵀ: one value per key for this Q block, the part of Q·Kᵀ that
    // quantizing Q - q_mean leaves out (added back to the scores exactly).
    std::vector<Real> delta_s(size_t(Nk), Real(0));
    if (smooth_q)
      for (int64_t j = 0; j < Nk; ++j)
        delta_s[size_t(j)] =
            delta_s_of(&pr.q_mean[size_t(qb * D)], &kp.k_smooth[size_t(j * D)], D);

    // Online-softmax state per row: running max m (base 2), sum l, output O, and the MMA
    // accumulator R (a double holding exactly what the hardware register holds). The sm90 form
    // keeps each row's sum as the kernel's four threads t of the row do (t holds keys
    // {8a + 2t, 8a + 2t + 1}): l4 [rows][4], in units of P~·p_scale.
    std::vector<Real> m(size_t(rows), neg_inf<Real>()), l(size_t(rows), Real(0));
    std::vector<Real> l4(sm90 ? size_t(rows * 4) : 0, Real(0));
    std::vector<Real> O(size_t(rows * D), Real(0));
    std::vector<double> R(size_t(rows * D), 0.0);
    std::vector<int> pending(size_t(rows), 0);  // softmax blocks in R since the last flush
    std::vector<Real> s(static_cast<size_t>(sbk)), phat(static_cast<size_t>(sbk));
    std::vector<Real> qk(sm90_scores ? size_t(sbk) : 0), fk(sm90_scores ? size_t(sbk) : 0);
    std::vector<double> chunk(dims);
    std::vector<double> step(size_t(std::max(1, cfg.accum_chunk)));  // one MMA step's products
    int64_t visible_max = 0;
    for (int64_t r = 0; r < rows; ++r) visible_max = std::max(visible_max, p.visible_keys(r0 + r));
    // The sm90 kernel's fast path: a softmax block whose every key the tile's first row sees (so
    // every row does; the kernel's kb < first_masked_block) skips the mask, takes the FFMA form
    // and the polynomial 2^x. The tile is this Q block (block_q = the kernel's tile rows).
    const int64_t tile_visible = p.visible_keys(r0);

    for (int64_t kb = 0; kb * sbk < visible_max; ++kb) {
      const int64_t j0 = kb * sbk, j1 = std::min(Nk, j0 + sbk);
      const bool full_block = sm90 && j0 + sbk <= tile_visible;
      // Per-key-block V scales: sbk == bk whenever they are on (quant_config_error).
      const Real* flush_scale = block_v_scale ? &kp.v_scale[size_t(j0 / bk * D)] : nullptr;
      // SAGE_V_SCALE_PER_BLOCK: P~ = 2^(x + e - m) carries the block's 2^e, and the row sum is
      // taken back down by 2^-e, so m + log2 l is still log2 Σ 2^x.
      const int v_exp = kp.v_exponent[size_t(j0 / bk)];
      const Real score_shift = Real(v_exp), sum_scale = std::ldexp(Real(1), -v_exp);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = r0 + r, n = p.visible_keys(i);
        double* acc = &R[size_t(r * D)];
        if (j0 >= n) {
          // Block fully masked for this row: the mma kernel skips it. The sm90 kernel's wgmma
          // still adds the row's zero products, which cuts the held value to its own grid (a
          // step without products); the rest is unchanged (alpha = 1, nothing added to l).
          if (sm90 && aligned)
            for (int64_t d = 0; d < D; ++d) acc[d] = mma_aligned_step(acc[d], nullptr, 0, bits);
          continue;
        }
        const Real* qi = &pr.q.values[size_t(i * D)];
        const Real qs = pr.q.scale[size_t(i)];
        const Real q_scale_log2 = qs * scale_log2;  // sm90_scores: the kernel's q_scale_log2
        Real row_max = neg_inf<Real>();
        for (int64_t j = j0; j < j1; ++j) {
          if (j >= n) {
            s[size_t(j - j0)] = neg_inf<Real>();
            continue;
          }
          const Real* kj = &kp.k.values[size_t(j * D)];
          const Real a = fp4_qk ? mma_dot(qi, kj, D, kFp4MmaK)
                         : (std::is_same_v<Real, float> && exact_qk_in_float)
                             ? Real(dot<float>(qi, kj, D))
                             : Real(dot<double>(qi, kj, D));
          Real x;
          if (sm90_scores) {
            const Real f = q_scale_log2 * kp.k.scale[size_t(j)];
            qk[size_t(j - j0)] = a;
            fk[size_t(j - j0)] = f;
            x = a * f;
          } else {
            x = (a * (qs * kp.k.scale[size_t(j)]) + delta_s[size_t(j)]) * scale_log2 + score_shift;
          }
          s[size_t(j - j0)] = x;
          row_max = std::max(row_max, x);
        }
        const Real m_new = std::max(m[size_t(r)], row_max);
        const Real alpha = std::exp2(m[size_t(r)] - m_new);  // 0 on the first block
        Real p_level1 = 1;  // s_P1 of the two-level P~ (SageAttention3 paper, Algorithm 1, line 10)
        if (!sm90) {
          Real row_sum = 0;
          for (int64_t j = j0; j < j1; ++j) {
            const Real pt = j < n ? std::exp2(s[size_t(j - j0)] - m_new) : Real(0);
            row_sum += pt;
            phat[size_t(j - j0)] = pv.quantize(pt * Real(pv.p_scale));
          }
          l[size_t(r)] = l[size_t(r)] * alpha + row_sum * sum_scale;
          if (pv.fp4) p_level1 = quantize_p_fp4(pv, &phat[0], j1 - j0, row_max - m_new);
        } else {
          // e = P~·p_scale = 2^(s - m + log2 p_scale); summed per thread t and 32-key quarter,
          // in key order, then l_t = l_t·alpha + ((p0 + p1) + (p2 + p3)) (the kernel's part[]).
          Real part[4][4] = {};
          const Real m_shift = m_new - log2_p_scale;
          for (int64_t j = j0; j < j1; ++j) {
            Real e = 0;
            if (j < n) {
              Real x = s[size_t(j - j0)] - m_shift;
              if constexpr (std::is_same_v<Real, float>) {
                if (full_block && sm90_scores) {
                  const float f = fk[size_t(j - j0)];
                  x = std::fmaf(kMagicF + qk[size_t(j - j0)], f, -std::fmaf(kMagicF, f, m_shift));
                }
              }
              e = full_block && exp2_poly_at(i, j, cfg.exp2_poly_every) ? exp2_poly(x)
                                                                        : std::exp2(x);
            }
            part[((j - j0) % 8) / 2][((j - j0) / 32) % 4] += e;
            phat[size_t(j - j0)] = pv.quantize(e);
          }
          Real* lt = &l4[size_t(r * 4)];
          for (int t = 0; t < 4; ++t) {
            lt[t] *= alpha;
            lt[t] += (part[t][0] + part[t][1]) + (part[t][2] + part[t][3]);
          }
        }
        m[size_t(r)] = m_new;
        Real* o = &O[size_t(r * D)];
        for (int64_t d = 0; d < D; ++d) {
          o[d] *= alpha;
          acc[d] = double(Real(acc[d]) * alpha);
        }
        // P^·V^ one MMA at a time: exact sum of accum_chunk products, then one accumulator add.
        for (int64_t c0 = j0; c0 < j1; c0 += cfg.accum_chunk) {
          const int64_t c1 = std::min(j1, c0 + int64_t(cfg.accum_chunk));
          std::fill(chunk.begin(), chunk.end(), 0.0);
          for (int64_t j = c0; j < c1; ++j) {
            const double pj = double(phat[size_t(j - j0)]);
            if (pj == 0.0) continue;
            const Real* vj = &kp.v[size_t(j * D)];
            for (int64_t d = 0; d < D; ++d) chunk[size_t(d)] += pj * double(vj[d]);
          }
          if (cfg.pv_accum == SAGE_PV_ACCUM_FP32) {  // rounded to Real: fp32 for the emulation
            for (int64_t d = 0; d < D; ++d) acc[d] = double(Real(acc[d] + chunk[size_t(d)]));
          } else if (aligned) {  // product by product (wgmma)
            for (int64_t d = 0; d < D; ++d) {
              int64_t n_step = 0;
              for (int64_t j = c0; j < c1; ++j)
                step[size_t(n_step++)] =
                    double(phat[size_t(j - j0)]) * double(kp.v[size_t(j * D + d)]);
              acc[d] = mma_aligned_step(acc[d], step.data(), int(n_step), bits);
            }
          } else {
            for (int64_t d = 0; d < D; ++d)
              acc[d] = truncate_mantissa(acc[d] + chunk[size_t(d)], bits);
          }
        }
        // The sm90 kernel runs all sbk / accum_chunk steps of a block; those past Nk add zero
        // products: the held value is cut to its own grid.
        const int64_t steps_run = (j1 - j0 + cfg.accum_chunk - 1) / cfg.accum_chunk;
        if (sm90 && aligned && steps_run * cfg.accum_chunk < sbk)
          for (int64_t d = 0; d < D; ++d) acc[d] = mma_aligned_step(acc[d], nullptr, 0, bits);
        const bool flush = cfg.pv_accum == SAGE_PV_ACCUM_FP32 ||
                           (cfg.pv_accum == SAGE_PV_ACCUM_TWO_LEVEL &&
                            ++pending[size_t(r)] == cfg.pv_flush_interval);
        if (flush) {
          for (int64_t d = 0; d < D; ++d) {
            // s_P1 (1 unless P~ is two-level): Algorithm 1, line 11.
            const Real a = Real(acc[d]) * p_level1;
            o[d] += flush_scale ? a * flush_scale[d] : a;
            acc[d] = 0.0;
          }
          pending[size_t(r)] = 0;
        }
      }
    }

    // Finalize: flush what is left, O / l / p_scale * v_scale + v_mean.
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r0 + r, n = p.visible_keys(i);
      Real* dst = out + (bh * Nq + i) * D;
      // A row that sees keys is poisoned by an Inf/NaN in its query or in a key or value row it
      // sees (the kernels: the pre-pass marks its LSE shift, the epilogue writes NaN).
      if (n > 0 && (pr.bad[size_t(i)] || kp.first_bad < n)) {
        std::fill(dst, dst + D, std::numeric_limits<Real>::quiet_NaN());
        if (lse) lse[bh * Nq + i] = std::numeric_limits<Real>::quiet_NaN();
        continue;
      }
      if (n == 0) {
        std::fill(dst, dst + D, Real(0));
        if (lse) lse[bh * Nq + i] = neg_inf<Real>();
        continue;
      }
      const Real* flush_scale = block_v_scale ? &kp.v_scale[size_t((n - 1) / bk * D)] : nullptr;
      if (sm90) {
        // The kernel's finalize (attn/epilogue.cuh, kLUnit = 448): the threads' sums added
        // (l0 + l1) + (l2 + l3), O · (v_scale · (1 / l)) + v_mean, and the LSE from l / 448.
        const Real* lt = &l4[size_t(r * 4)];
        const Real lsum = (lt[0] + lt[1]) + (lt[2] + lt[3]);
        const Real inv = Real(1) / lsum;
        for (int64_t d = 0; d < D; ++d) {
          const Real o = O[size_t(r * D + d)] + Real(R[size_t(r * D + d)]);
          dst[d] = o * (kp.v_scale[size_t(d)] * inv) + kp.v_mean[size_t(d)];
        }
        if (lse)
          lse[bh * Nq + i] =
              (m[size_t(r)] + std::log2(lsum * (Real(1) / Real(pv.p_scale)))) * Real(kLn2) +
              pr.lse_shift[size_t(i)];
        continue;
      }
      const Real denom = l[size_t(r)] * Real(pv.p_scale);
      for (int64_t d = 0; d < D; ++d) {
        const Real acc = Real(R[size_t(r * D + d)]);
        const Real o = O[size_t(r * D + d)] + (flush_scale ? acc * flush_scale[d] : acc);
        const Real vs = block_v_scale || pow2_v_scale ? Real(1) : kp.v_scale[size_t(d)];
        dst[d] = o * (vs / denom) + kp.v_mean[size_t(d)];
      }
      if (lse)
        lse[bh * Nq + i] =
            Real((double(m[size_t(r)]) + std::log2(double(l[size_t(r)]))) * kLn2) +
            pr.lse_shift[size_t(i)];
    }
  });
}

}  // namespace

void attention_quant_legacy(const Problem& p, const sage_quant_config& cfg, const TensorView& q,
                     const TensorView& k, const TensorView& v, float* out, float* lse,
                     int threads) {
  run<float>(p, cfg, q, k, v, out, lse, threads);
}

void attention_quant_legacy(const Problem& p, const sage_quant_config& cfg, const TensorView& q,
                     const TensorView& k, const TensorView& v, double* out, double* lse,
                     int threads) {
  run<double>(p, cfg, q, k, v, out, lse, threads);
}

}  // namespace sage::ref::legacy
