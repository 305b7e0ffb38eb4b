// The quantized emulation: quantizers, faithfulness of each stage against an independent
// computation from the definitions, the accumulator model, and the paper's orderings (003
// Tables 4, 6, 7) on the built-in outlier problem with fresh seeds.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <tuple>

#include "common/test_util.h"
#include "ref/ablations.h"
#include "ref/emulate.h"
#include "ref/synthetic.h"

namespace sage::ref {
namespace {

using test::Fp16Tensor;

// Index of the first bitwise difference of two equally long float vectors, or -1.
int64_t first_difference(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) return int64_t(i);
  return -1;
}

TEST(Quantizer, RoundTripWithinHalfStepAndRange) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const int64_t rows = 300, dim = 64;
  std::vector<float> x(size_t(rows * dim));
  for (float& v : x) v = normal(rng);
  // Rows 128..191 all zero: one full per-block group with amax 0.
  for (int64_t r = 128; r < 192; ++r)
    for (int64_t d = 0; d < dim; ++d) x[size_t(r * dim + d)] = 0.0f;
  for (sage_qk_format f : {SAGE_QK_INT8, SAGE_QK_INT4}) {
    const int qmax = f == SAGE_QK_INT8 ? 127 : 7;
    for (const GroupLayout& layout : {GroupLayout::per_block(64), GroupLayout::per_token(64),
                                      GroupLayout::thread_q(128, 32), GroupLayout::per_tensor()}) {
      const QuantizedGroups<float> qz = quantize_groups(x, rows, dim, layout, f);
      std::map<int64_t, int> group_max;  // largest |value| per group: must reach qmax
      for (int64_t r = 0; r < rows; ++r) {
        const float scale = qz.scale[size_t(r)];
        for (int64_t d = 0; d < dim; ++d) {
          const float v = qz.values[size_t(r * dim + d)], xi = x[size_t(r * dim + d)];
          ASSERT_EQ(v, std::nearbyint(v)) << "not an integer";
          ASSERT_LE(std::fabs(v), float(qmax));
          // Half a step, plus the float roundings of inv = 1/scale, x·inv and v·scale (a few
          // 2^-24 of |x|: near qmax that exceeds a relative slack on the half step alone).
          ASSERT_LE(std::fabs(xi - v * scale),
                    0.5f * scale * (1 + 1e-5f) + 4e-7f * std::fabs(xi) + 1e-30f)
              << "row " << r << " d " << d;
          int& gm = group_max[layout.group(r)];
          gm = std::max(gm, int(std::fabs(v)));
        }
      }
      for (const auto& [g, m] : group_max) {
        bool all_zero = true;
        for (int64_t r = 0; r < rows; ++r)
          if (layout.group(r) == g)
            for (int64_t d = 0; d < dim; ++d) all_zero &= x[size_t(r * dim + d)] == 0.0f;
        EXPECT_EQ(m, all_zero ? 0 : qmax) << "group " << g;
        if (all_zero)
          for (int64_t r = 0; r < rows; ++r)
            if (layout.group(r) == g) {
              EXPECT_EQ(qz.scale[size_t(r)], 0.0f);
            }
      }
    }
  }
}

TEST(Quantizer, Fp8GroupsKeepRelativeErrorOfE4M3) {
  std::mt19937_64 rng(test::fresh_seed());
  std::normal_distribution<float> normal(0.0f, 5.0f);
  std::vector<float> x(64 * 128);
  for (float& v : x) v = normal(rng);
  const QuantizedGroups<float> qz =
      quantize_groups(x, 64, 128, GroupLayout::per_block(64), SAGE_QK_FP8_E4M3);
  for (size_t i = 0; i < x.size(); ++i) {
    const float back = qz.values[i] * qz.scale[0];
    // Normal E4M3 numbers carry 3 mantissa bits: relative error <= 2^-4; subnormals 2^-10 * amax.
    EXPECT_LE(std::fabs(back - x[i]),
              std::max(std::fabs(x[i]) / 16.0f, qz.scale[0] / 512.0f) * 1.001f);
  }
}

// INT4 per-thread (mma layout) with Q and K smoothing and ΔS, computed here independently from
// the definitions, must equal the emulation when nothing else is quantized (double arithmetic).
TEST(Emulation, QkQuantizationMatchesIndependentComputation) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t Nq = 200, Nk = 150, D = 64;  // neither a multiple of the block
  const Fp16Tensor q = test::random_tensor(rng, 1, 1, Nq, D, 3.0f);
  const Fp16Tensor k = test::random_tensor(rng, 1, 1, Nk, D, 6.0f);
  const Fp16Tensor v = test::random_tensor(rng, 1, 1, Nk, D, 1.0f);
  const Problem p{1, 1, 1, Nq, Nk, D, 0.125, SAGE_MASK_NONE};

  for (sage_qk_format fmt : {SAGE_QK_INT4, SAGE_QK_INT8}) {
    const double qmax = fmt == SAGE_QK_INT4 ? 7 : 127;
    std::vector<double> Q = test::head_matrix(q, 0, Nq, D), K = test::head_matrix(k, 0, Nk, D);
    const std::vector<double> V = test::head_matrix(v, 0, Nk, D);
    // Smooth K over the sequence, Q per 128-row block. A mean is the channel sum divided once
    // by the count, as the kernels' pre-pass and the emulation define it; kept in double here
    // (the double emulation's ideal arithmetic). The sum of fp16 values is exact in double, so
    // this is the correctly rounded mean. Summing x/n term by term instead is off by an ulp or
    // so, and that is not harmless: sum/72 is often exactly representable, putting x - mean on a
    // float rounding tie, so an ulp-off mean flips float(x - mean) and, when that element is
    // its group's amax, the group's δ (seen as a 6e-9 relative output difference).
    std::vector<double> kmean(size_t(D), 0.0), qmean(size_t(2 * D), 0.0);
    for (int64_t j = 0; j < Nk; ++j)
      for (int64_t d = 0; d < D; ++d) kmean[size_t(d)] += K[size_t(j * D + d)];
    for (int64_t i = 0; i < Nq; ++i)
      for (int64_t d = 0; d < D; ++d) qmean[size_t((i / 128) * D + d)] += Q[size_t(i * D + d)];
    for (int64_t d = 0; d < D; ++d) {
      kmean[size_t(d)] /= double(Nk);
      qmean[size_t(d)] /= 128.0;
      qmean[size_t(D + d)] /= double(Nq - 128);
    }
    for (int64_t j = 0; j < Nk; ++j)
      for (int64_t d = 0; d < D; ++d) K[size_t(j * D + d)] -= kmean[size_t(d)];
    for (int64_t i = 0; i < Nq; ++i)
      for (int64_t d = 0; d < D; ++d) Q[size_t(i * D + d)] -= qmean[size_t((i / 128) * D + d)];
    // ΔS from the unquantized smoothed K.
    std::vector<double> bias(size_t(Nq * Nk), 0.0);
    for (int64_t i = 0; i < Nq; ++i)
      for (int64_t j = 0; j < Nk; ++j)
        for (int64_t d = 0; d < D; ++d)
          bias[size_t(i * Nk + j)] += qmean[size_t((i / 128) * D + d)] * K[size_t(j * D + d)];
    // Groups of the kernel (SPEC §4 with 16-row warps): Q rows {g, g+8} of each 16-row warp
    // slice; K keys {8j+2t, 8j+2t+1} of each 64-key block.
    auto quantize = [&](std::vector<double>& M, int64_t N, auto group_of) {
      std::map<int64_t, double> amax;
      for (int64_t n = 0; n < N; ++n)
        for (int64_t d = 0; d < D; ++d)
          amax[group_of(n)] = std::max(amax[group_of(n)], std::fabs(M[size_t(n * D + d)]));
      for (int64_t n = 0; n < N; ++n) {
        const float a = float(amax[group_of(n)]);
        const float scale = a / float(qmax), inv = float(qmax) / a;
        for (int64_t d = 0; d < D; ++d) {
          const double r = std::nearbyint(float(M[size_t(n * D + d)]) * inv);
          M[size_t(n * D + d)] = std::clamp(r, -qmax, qmax) * double(scale);
        }
      }
    };
    quantize(Q, Nq, [](int64_t n) { return (n / 16) * 8 + n % 8; });
    quantize(K, Nk, [](int64_t n) { return (n / 64) * 4 + (n % 8) / 2; });
    const std::vector<double> want = test::dense_attention(Q, K, V, bias, Nq, Nk, D, p.scale);

    sage_quant_config cfg = quant_preset(SAGE_VARIANT_SAGE2_4B);
    cfg.qk_format = fmt;
    cfg.pv_format = SAGE_PV_NONE;
    cfg.pv_accum = SAGE_PV_ACCUM_FP32;
    std::vector<double> got(want.size());
    attention_quant(p, cfg, q.view(), k.view(), v.view(), got.data(), nullptr);
    // Every quantized value and scale is bit-identical to the emulation's; what remains is double
    // rounding (ΔS summation order, online vs dense softmax): at most 6.5e-15 over 200 seeds.
    for (size_t i = 0; i < want.size(); ++i)
      ASSERT_NEAR(got[i], want[i], 1e-12 * (1 + std::fabs(want[i]))) << "element " << i;
  }
}

// P~ and V in E4M3 with one key block covering all keys: O = Σ P^ V^ / (Σ P~ · 448) · δV,
// computed here from the definitions.
TEST(Emulation, PvQuantizationMatchesIndependentComputation) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t Nq = 50, Nk = 300, D = 64;
  const Fp16Tensor q = test::random_tensor(rng, 1, 1, Nq, D, 0.0f, 2.0f);
  const Fp16Tensor k = test::random_tensor(rng, 1, 1, Nk, D);
  const Fp16Tensor v = test::random_tensor(rng, 1, 1, Nk, D, 4.0f);
  const Problem p{1, 1, 1, Nq, Nk, D, 0.125, SAGE_MASK_NONE};
  const std::vector<double> Q = test::head_matrix(q, 0, Nq, D), K = test::head_matrix(k, 0, Nk, D),
                            V = test::head_matrix(v, 0, Nk, D);
  std::vector<double> vscale(static_cast<size_t>(D)), Vq(V.size());
  // V's scale without V smoothing: 4x its max over K's mean sample (here every token: 300 keys
  // under 256 samples' stride of 1), or the exact max where that is larger (v_sample_bound).
  for (int64_t d = 0; d < D; ++d) {
    float amax = 0;
    for (int64_t j = 0; j < Nk; ++j) amax = std::max(amax, float(std::fabs(V[size_t(j * D + d)])));
    amax = std::max(amax, v_sample_bound(amax));
    vscale[size_t(d)] = double(amax / 448.0f);
    const float inv = 448.0f / amax;
    for (int64_t j = 0; j < Nk; ++j)
      Vq[size_t(j * D + d)] = round_float(kE4M3, float(V[size_t(j * D + d)]) * inv);
  }
  const double log2e = 1.4426950408889634;
  std::vector<double> want(size_t(Nq * D), 0.0);
  for (int64_t i = 0; i < Nq; ++i) {
    std::vector<double> s(static_cast<size_t>(Nk));
    double mx = -INFINITY, sum = 0;
    for (int64_t j = 0; j < Nk; ++j) {
      double x = 0;
      for (int64_t d = 0; d < D; ++d) x += Q[size_t(i * D + d)] * K[size_t(j * D + d)];
      s[size_t(j)] = x * p.scale * log2e;
      mx = std::max(mx, s[size_t(j)]);
    }
    for (int64_t j = 0; j < Nk; ++j) {
      const double pt = std::exp2(s[size_t(j)] - mx);
      sum += pt;
      const double ph = round_float(kE4M3, float(pt * 448.0));
      for (int64_t d = 0; d < D; ++d) want[size_t(i * D + d)] += ph * Vq[size_t(j * D + d)];
    }
    for (int64_t d = 0; d < D; ++d) want[size_t(i * D + d)] *= vscale[size_t(d)] / (sum * 448.0);
  }
  sage_quant_config cfg = quant_preset(SAGE_VARIANT_EXACT);
  cfg.pv_format = SAGE_PV_FP8_E4M3;
  cfg.block_k = 512;  // one key block
  std::vector<double> got(want.size());
  attention_quant(p, cfg, q.view(), k.view(), v.view(), got.data(), nullptr);
  for (size_t i = 0; i < want.size(); ++i)
    ASSERT_NEAR(got[i], want[i], 1e-9 * (1 + std::fabs(want[i]))) << "element " << i;
}

// SAGE_V_SCALE_PER_BLOCK's exponent against its definition through ilogb: amax / 2^e lands in
// [128, 256) (inside E4M3's 448, its top octave used) over the whole normal float range.
// Without V smoothing V's per-channel scale comes from v_sample_bound (4x the max of |v| over
// K's mean sample, tokens 0, s, 2s, ...) unless some token's |v| exceeds it, then from that
// channel's exact max; with V smoothing from the exact max of |v - v_mean|. The scales the
// emulation's pre-pass takes, channel by channel, on V with a channel bias and spikes past the
// bound on tokens the sample skips (two channels), and on a sampled token (it sets the bound).
TEST(VScale, PerChannelScaleIsBoundedFromKsMeanSample) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t Nk = 1000, D = 16;
  const Problem p{1, 1, 1, 4, Nk, D, 0.25, SAGE_MASK_NONE};
  const Fp16Tensor q = test::random_tensor(rng, 1, 1, 4, D, 0.0f);
  const Fp16Tensor k = test::random_tensor(rng, 1, 1, Nk, D, 0.0f);
  Fp16Tensor v = test::random_tensor(rng, 1, 1, Nk, D, 2.0f);
  const int64_t stride = mean_token_stride(Nk, 256);
  ASSERT_EQ(stride, 3);
  auto set = [&](int64_t j, int64_t d, float x) {
    v.data[size_t(j * D + d)] = uint16_t(encode_float(kFp16, x, false));
  };
  set(1, 0, 90.0f);     // past the bound, a token the sample skips
  set(500, 1, -100.0f);  // the same, negative
  set(300, 3, 30.0f);    // a sampled token: it sets the bound itself
  const std::vector<double> x = test::head_matrix(v, 0, Nk, D);
  for (const unsigned smooth : {unsigned(SAGE_SMOOTH_K), unsigned(SAGE_SMOOTH_K | SAGE_SMOOTH_V)}) {
    SCOPED_TRACE("smooth " + std::to_string(smooth));
    sage_quant_config cfg = quant_preset(SAGE_VARIANT_SAGE2_8B);
    cfg.smooth = smooth;
    const emu::Prepass<float> pre = emu::prepass<float>(p, cfg, q.view(), k.view(), v.view(), 1);
    const emu::KvPrep<float>& kp = pre.kv[0];
    int past = 0, bounded = 0;
    for (int64_t d = 0; d < D; ++d) {
      float exact = 0.0f, sample = 0.0f;
      for (int64_t j = 0; j < Nk; ++j) {
        const float c = float(x[size_t(j * D + d)]) - kp.v_mean[size_t(d)];
        exact = std::max(exact, std::fabs(c));
        if (j % stride == 0) sample = std::max(sample, std::fabs(c));
      }
      float amax = exact;
      if (!(smooth & SAGE_SMOOTH_V)) {
        amax = std::max(exact, v_sample_bound(sample));
        (exact > v_sample_bound(sample) ? past : bounded) += 1;
      }
      EXPECT_EQ(kp.v_scale[size_t(d)], make_quant_scale(amax, kE4M3Max).scale) << "channel " << d;
    }
    if (!(smooth & SAGE_SMOOTH_V)) {
      EXPECT_GE(past, 2);  // channels 0 and 1
      EXPECT_GE(bounded, D - 4);
    }
  }
  // Exactly at the bound is within it.
  EXPECT_EQ(v_sample_bound(3.0f), 12.0f);
  EXPECT_EQ(v_sample_bound(3.0e38f), 3.402823466e38f);
}

TEST(VScale, BlockExponentPutsTheBlockMaxInTheTopOctave) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> log2_amax(-112.0f, 127.9f);
  for (int t = 0; t < 10000; ++t) {
    const float amax = std::exp2(log2_amax(rng));
    const int e = v_block_exponent(amax);
    ASSERT_EQ(e, std::ilogb(amax) - 7) << amax;
    const float scaled = amax * std::ldexp(1.0f, -e);
    ASSERT_GE(scaled, 128.0f) << amax;
    ASSERT_LT(scaled, 256.0f) << amax;
  }
  EXPECT_EQ(v_block_exponent(std::numeric_limits<float>::max()), 120);
  EXPECT_EQ(v_block_exponent(std::ldexp(1.0f, -113)), -120);  // 2^-113 / 2^-120 = 128
  EXPECT_EQ(v_block_exponent(std::ldexp(1.0f, -120)), -120);  // clamped: 2^-e stays normal
  EXPECT_EQ(v_block_exponent(std::numeric_limits<float>::min()), -120);
  for (float special :
       {0.0f, std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::infinity(),
        std::numeric_limits<float>::quiet_NaN()})
    EXPECT_EQ(v_block_exponent(special), 0) << special;
}

// E4M3 V with one power-of-two scale per key block folded into the softmax (SAGE_V_SCALE_PER_BLOCK)
// and V smoothed (its mean over every token; k_mean_tokens samples K only), computed here from
// the definitions with the online softmax over the same key blocks: scores + e before the row
// max, row sums times 2^-e, no flush scale.
// Blocks of V with very different magnitudes give each block its own exponent; a bottom-right
// causal mask leaves the last block partly visible. Double arithmetic around the quantization.
TEST(Emulation, PerBlockVScaleMatchesIndependentComputation) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t Nq = 40, Nk = 300, D = 64, bk = 64, blocks = 5;
  const Fp16Tensor q = test::random_tensor(rng, 1, 1, Nq, D, 0.0f, 2.0f);
  const Fp16Tensor k = test::random_tensor(rng, 1, 1, Nk, D);
  // V = a channel bias (taken out by smoothing) + noise whose size changes from block to block.
  Fp16Tensor v = test::random_tensor(rng, 1, 1, Nk, D);
  const double block_gain[blocks] = {1.0, 1.0 / 16, 16.0, 1.0 / 4, 4.0};
  std::vector<double> bias(static_cast<size_t>(D));
  std::normal_distribution<double> normal(0.0, 3.0);
  for (double& b : bias) b = normal(rng);
  for (int64_t j = 0; j < Nk; ++j)
    for (int64_t d = 0; d < D; ++d) {
      uint16_t& x = v.data[size_t(j * D + d)];
      const double noise = decode_float(kFp16, x) * block_gain[j / bk];
      x = uint16_t(encode_float(kFp16, noise + bias[size_t(d)], false));
    }
  const Problem p{1, 1, 1, Nq, Nk, D, 0.125, SAGE_MASK_CAUSAL_BOTTOM_RIGHT};
  const std::vector<double> Q = test::head_matrix(q, 0, Nq, D), K = test::head_matrix(k, 0, Nk, D),
                            V = test::head_matrix(v, 0, Nk, D);
  // V's mean takes every token whatever k_mean_tokens says (64 below: K would take every 4th).
  std::vector<double> vmean(static_cast<size_t>(D), 0.0);
  for (int64_t j = 0; j < Nk; ++j)
    for (int64_t d = 0; d < D; ++d) vmean[size_t(d)] += V[size_t(j * D + d)];
  for (double& m : vmean) m /= double(Nk);
  std::vector<double> Vq(V.size());
  std::vector<int> e(static_cast<size_t>(blocks));
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t j0 = b * bk, j1 = std::min(Nk, j0 + bk);
    float amax = 0;
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t d = 0; d < D; ++d)
        amax = std::max(amax, float(std::fabs(V[size_t(j * D + d)] - vmean[size_t(d)])));
    e[size_t(b)] = std::ilogb(amax) - 7;  // amax / 2^e in [128, 256)
    float scaled_max = 0;
    double vq_max = 0;
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t d = 0; d < D; ++d) {
        const float x = float(V[size_t(j * D + d)] - vmean[size_t(d)]);
        const float scaled = x * std::ldexp(1.0f, -e[size_t(b)]);
        Vq[size_t(j * D + d)] = round_float(kE4M3, scaled);
        scaled_max = std::max(scaled_max, std::fabs(scaled));
        vq_max = std::max(vq_max, std::fabs(Vq[size_t(j * D + d)]));
      }
    // The block's largest |V - v̄| / 2^e is in [128, 256): far from E4M3's 448, and rounding to
    // 3 mantissa bits can only take it to 256.
    EXPECT_GE(scaled_max, 128.0f) << "block " << b;
    EXPECT_LT(scaled_max, 256.0f) << "block " << b;
    EXPECT_GE(vq_max, 128.0) << "block " << b;
    EXPECT_LE(vq_max, 256.0) << "block " << b;
  }
  // What the mean leaves of the loud blocks' noise in the quiet ones can merge exponents; three
  // distinct at least.
  ASSERT_GE(std::set<int>(e.begin(), e.end()).size(), 3u) << "blocks should differ in exponent";

  const double log2e = 1.4426950408889634;
  std::vector<double> want(size_t(Nq * D), 0.0), want_lse(static_cast<size_t>(Nq));
  for (int64_t i = 0; i < Nq; ++i) {
    const int64_t n = i + Nk - Nq + 1;  // keys visible to row i
    double m = -INFINITY, l = 0;
    double* o = &want[size_t(i * D)];
    for (int64_t b = 0; b * bk < n; ++b) {
      const int64_t j0 = b * bk, j1 = std::min(n, j0 + bk);
      std::vector<double> x;
      for (int64_t j = j0; j < j1; ++j) {
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += Q[size_t(i * D + d)] * K[size_t(j * D + d)];
        x.push_back(dot * p.scale * log2e + e[size_t(b)]);
      }
      const double m_new = std::max(m, *std::max_element(x.begin(), x.end()));
      const double alpha = std::exp2(m - m_new);
      double sum = 0;
      for (int64_t d = 0; d < D; ++d) o[d] *= alpha;
      for (int64_t j = j0; j < j1; ++j) {
        const double pt = std::exp2(x[size_t(j - j0)] - m_new);
        sum += pt;
        const double ph = round_float(kE4M3, float(pt * 448.0));
        for (int64_t d = 0; d < D; ++d) o[d] += ph * Vq[size_t(j * D + d)];
      }
      l = l * alpha + sum * std::ldexp(1.0, -e[size_t(b)]);
      m = m_new;
    }
    for (int64_t d = 0; d < D; ++d) o[d] = o[d] / (l * 448.0) + vmean[size_t(d)];
    want_lse[size_t(i)] = (m + std::log2(l)) / log2e;
  }

  sage_quant_config cfg = quant_preset(SAGE_VARIANT_EXACT);
  cfg.pv_format = SAGE_PV_FP8_E4M3;
  cfg.v_scale = SAGE_V_SCALE_PER_BLOCK;
  cfg.smooth = SAGE_SMOOTH_V;
  cfg.k_mean_tokens = 64;
  cfg.block_k = int32_t(bk);
  std::vector<double> got(want.size()), lse(want_lse.size());
  attention_quant(p, cfg, q.view(), k.view(), v.view(), got.data(), lse.data());
  for (size_t i = 0; i < want.size(); ++i)
    ASSERT_NEAR(got[i], want[i], 1e-12 * (1 + std::fabs(want[i]))) << "element " << i;
  // The exponents leave the LSE that of the true scores (nothing in Q·Kᵀ is quantized here).
  std::vector<double> exact(want.size()), exact_lse(want_lse.size());
  attention_exact(p, q.view(), k.view(), v.view(), exact.data(), exact_lse.data());
  for (size_t i = 0; i < lse.size(); ++i) {
    ASSERT_NEAR(lse[i], want_lse[i], 1e-12 * (1 + std::fabs(want_lse[i]))) << "row " << i;
    ASSERT_NEAR(lse[i], exact_lse[i], 1e-12 * (1 + std::fabs(exact_lse[i]))) << "row " << i;
  }
  // And the result is attention: E4M3 error only (a few per cent of the mean |O|).
  EXPECT_LT(compare(exact.data(), got.data(), Nq * D).rel_l1, 0.05);
}

// K's smoothing mean from tokens 0, s, 2s, ... (sage_quant_config.k_mean_tokens): the float
// emulation with K smoothing equals, bit for bit, the emulation without smoothing run on K - k̄
// made here (fp32 inputs), where k̄ is the double sum over the sampled tokens divided by their
// count, rounded to float (V unsmoothed on both sides: its scale from the same sample of the same
// values). k_mean_tokens 0 is every token (the behaviour before k_mean_tokens existed); 256 of
// 1000 tokens is stride 3, 334.
TEST(SmoothingMeans, StridedMeansAreTheMeansOfTheSampledTokens) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t Nq = 64, Nk = 1000, D = 64;
  const Fp16Tensor q = test::random_tensor(rng, 1, 1, Nq, D, 1.0f);
  Fp16Tensor k = test::random_tensor(rng, 1, 1, Nk, D, 8.0f);
  Fp16Tensor v = test::random_tensor(rng, 1, 1, Nk, D, 4.0f);
  // A drift along the sequence, so that the sampled mean differs from the full one.
  for (Fp16Tensor* t : {&k, &v})
    for (int64_t j = 0; j < Nk; ++j)
      for (int64_t d = 0; d < D; ++d) {
        uint16_t& x = t->data[size_t(j * D + d)];
        x = uint16_t(encode_float(kFp16, decode_float(kFp16, x) + 2.0 * std::sin(0.01 * j), false));
      }
  const Problem p{1, 1, 1, Nq, Nk, D, 0.125, SAGE_MASK_NONE};
  const sage_strides strides = contiguous_strides(SAGE_LAYOUT_HND, 1, Nk, D);

  std::map<int32_t, std::vector<float>> outputs;
  for (const auto& [k_mean_tokens, stride, count] :
       {std::tuple<int32_t, int64_t, int64_t>{0, 1, 1000}, {256, 3, 334}}) {
    SCOPED_TRACE("k_mean_tokens " + std::to_string(k_mean_tokens));
    ASSERT_EQ(mean_token_stride(Nk, k_mean_tokens), stride);
    std::vector<float> shifted, mean;
    {
      const std::vector<double> X = test::head_matrix(k, 0, Nk, D);
      std::vector<double> sum(static_cast<size_t>(D), 0.0);
      int64_t taken = 0;
      for (int64_t j = 0; j < Nk; j += stride, ++taken)
        for (int64_t d = 0; d < D; ++d) sum[size_t(d)] += X[size_t(j * D + d)];
      ASSERT_EQ(taken, count);
      for (int64_t d = 0; d < D; ++d) mean.push_back(float(sum[size_t(d)] / double(taken)));
      for (int64_t j = 0; j < Nk; ++j)
        for (int64_t d = 0; d < D; ++d)
          shifted.push_back(float(X[size_t(j * D + d)]) - mean[size_t(d)]);
    }
    sage_quant_config cfg = quant_preset(SAGE_VARIANT_SAGE2_8B);
    cfg.k_mean_tokens = k_mean_tokens;
    // V unsmoothed on both sides (its scale then comes from the same sample of the same values).
    cfg.smooth = SAGE_SMOOTH_K;
    std::vector<float> got(size_t(Nq * D)), want(got.size());
    attention_quant(p, cfg, q.view(), k.view(), v.view(), got.data(), nullptr);
    cfg.smooth = 0;
    const TensorView ks{shifted.data(), SAGE_DTYPE_FP32, strides};
    attention_quant(p, cfg, q.view(), ks, v.view(), want.data(), nullptr);
    EXPECT_EQ(first_difference(got, want), -1);
    outputs[k_mean_tokens] = got;
  }
  // Not vacuous: the sample changes the quantized result.
  EXPECT_NE(first_difference(outputs[0], outputs[256]), -1);
  // k_mean_tokens >= N, and N / k_mean_tokens == 1, take every token too.
  for (int32_t k_mean_tokens : {1000, 600, 4096}) {
    sage_quant_config cfg = quant_preset(SAGE_VARIANT_SAGE2_8B);
    cfg.k_mean_tokens = k_mean_tokens, cfg.smooth = SAGE_SMOOTH_K;
    std::vector<float> got(size_t(Nq * D));
    attention_quant(p, cfg, q.view(), k.view(), v.view(), got.data(), nullptr);
    EXPECT_EQ(first_difference(got, outputs[0]), -1) << "k_mean_tokens " << k_mean_tokens;
  }
}

// Online softmax over many small blocks must agree with one big block when nothing is
// quantized in P·V, for every mask and for LSE (with K smoothing's correction).
TEST(Emulation, BlockingDoesNotChangeTheResult) {
  std::mt19937_64 rng(test::fresh_seed());
  const Fp16Tensor q = test::random_tensor(rng, 1, 2, 77, 64, 2.0f);
  const Fp16Tensor k = test::random_tensor(rng, 1, 1, 201, 64, 5.0f);
  const Fp16Tensor v = test::random_tensor(rng, 1, 1, 201, 64, 2.0f);
  for (sage_mask mask :
       {SAGE_MASK_NONE, SAGE_MASK_CAUSAL_TOP_LEFT, SAGE_MASK_CAUSAL_BOTTOM_RIGHT}) {
    const Problem p{1, 2, 1, 77, 201, 64, 0.125, mask};
    std::vector<double> want(size_t(p.out_elems())), want_lse(size_t(p.lse_elems()));
    attention_exact(p, q.view(), k.view(), v.view(), want.data(), want_lse.data());
    sage_quant_config cfg = quant_preset(SAGE_VARIANT_EXACT);
    cfg.smooth = SAGE_SMOOTH_K;
    for (int bk : {8, 64, 1024}) {
      cfg.block_k = bk;
      cfg.block_q = 16;
      cfg.warps = 1;
      std::vector<double> got(want.size()), lse(want_lse.size());
      attention_quant(p, cfg, q.view(), k.view(), v.view(), got.data(), lse.data());
      for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-11);
      for (size_t i = 0; i < lse.size(); ++i) ASSERT_NEAR(lse[i], want_lse[i], 1e-11);
    }
  }
}

// The accumulator model: FP22 over the whole sequence loses precision (adds truncate toward
// zero relative to a large running value); flushing into fp32 every key block confines it.
TEST(Accumulator, TwoLevelBeatsFp22Only) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t N = 4096, D = 64;
  const Fp16Tensor q = test::random_tensor(rng, 1, 1, 256, D);
  const Fp16Tensor k = test::random_tensor(rng, 1, 1, N, D, 4.0f);
  const Fp16Tensor v = test::random_tensor(rng, 1, 1, N, D, 8.0f);  // channel bias: large sums
  const Problem p{1, 1, 1, 256, N, D, 0.125, SAGE_MASK_NONE};
  std::vector<double> exact(size_t(p.out_elems()));
  attention_exact(p, q.view(), k.view(), v.view(), exact.data(), nullptr);
  auto run = [&](sage_pv_accum accum, int flush) {
    sage_quant_config cfg = quant_preset(SAGE_VARIANT_SAGE2_8B);
    cfg.smooth = SAGE_SMOOTH_K;  // V keeps its bias: the accumulator sums are large
    cfg.pv_accum = accum;
    cfg.pv_flush_interval = flush;
    std::vector<float> o(exact.size());
    attention_quant(p, cfg, q.view(), k.view(), v.view(), o.data(), nullptr);
    return o;
  };
  const std::vector<float> fp32 = run(SAGE_PV_ACCUM_FP32, 1), fp22 = run(SAGE_PV_ACCUM_HW, 1),
                           two = run(SAGE_PV_ACCUM_TWO_LEVEL, 1);
  std::vector<double> fp32d(fp32.begin(), fp32.end());
  // Accumulator error alone (against the same config with a true fp32 accumulator).
  const double err22 = compare(fp32d.data(), fp22.data(), p.out_elems()).rel_l1;
  const double err2l = compare(fp32d.data(), two.data(), p.out_elems()).rel_l1;
  EXPECT_GT(err22, 4.0 * err2l) << "FP22-only " << err22 << " two-level " << err2l;
  EXPECT_GT(err22, 1e-4);  // the truncation is visible at this length
  // And against float64 truth.
  EXPECT_LT(compare(exact.data(), two.data(), p.out_elems()).rel_l1,
            compare(exact.data(), fp22.data(), p.out_elems()).rel_l1);
}

// The accumulator's own error: SageAttn2-8b (smooth K only, so V's bias makes the sums large) with
// a given P·V accumulator against the same config with a true fp32 one, on fresh inputs.
class AccumulatorError {
 public:
  AccumulatorError(int64_t rows, int64_t keys, double scale)
      : rng_(test::fresh_seed()),
        q_(test::random_tensor(rng_, 1, 1, rows, 64)),
        k_(test::random_tensor(rng_, 1, 1, keys, 64)),
        v_(test::random_tensor(rng_, 1, 1, keys, 64, 8.0f)),
        p_{1, 1, 1, rows, keys, 64, scale, SAGE_MASK_NONE},
        cfg_(quant_preset(SAGE_VARIANT_SAGE2_8B)) {
    cfg_.smooth = SAGE_SMOOTH_K;
    const std::vector<float> base = run(SAGE_PV_ACCUM_FP32, cfg_.accum_mantissa_bits, 1);
    base_.assign(base.begin(), base.end());
  }
  double operator()(sage_pv_accum accum, int bits, int flush = 1) {
    const std::vector<float> o = run(accum, bits, flush);
    return compare(base_.data(), o.data(), p_.out_elems()).rel_l1;
  }
  sage_quant_config& config() { return cfg_; }

 private:
  std::vector<float> run(sage_pv_accum accum, int bits, int flush) {
    cfg_.pv_accum = accum;
    cfg_.accum_mantissa_bits = bits;
    cfg_.pv_flush_interval = flush;
    std::vector<float> o(size_t(p_.out_elems()));
    attention_quant(p_, cfg_, q_.view(), k_.view(), v_.view(), o.data(), nullptr);
    return o;
  }
  std::mt19937_64 rng_;
  Fp16Tensor q_, k_, v_;
  Problem p_;
  sage_quant_config cfg_;
  std::vector<double> base_;
};

TEST(Accumulator, MantissaBitsAndFlushIntervalAreMonotone) {
  AccumulatorError err(128, 2048, 0.125);
  EXPECT_LT(err(SAGE_PV_ACCUM_HW, 23, 1), 1e-6);  // a 23-bit truncating accumulator ~ fp32
  EXPECT_LT(err(SAGE_PV_ACCUM_HW, 16, 1), err(SAGE_PV_ACCUM_HW, 10, 1));
  EXPECT_LE(err(SAGE_PV_ACCUM_TWO_LEVEL, 13, 1), err(SAGE_PV_ACCUM_TWO_LEVEL, 13, 8));
  EXPECT_LE(err(SAGE_PV_ACCUM_TWO_LEVEL, 13, 8), err(SAGE_PV_ACCUM_HW, 13, 1));
}

// The wgmma accumulator model against what the H100 probe measured
// (bench/results/probes/2026-11-22-h100-wgmma_accum.json): 32 products of 2^-12 per step added to
// c = 2^m survive at m = 0 and are lost from m = 2 on when chained in the accumulator; a fresh
// accumulator per step followed by an fp32 add keeps them up to m = 16 (fp32's limit).
TEST(Accumulator, AlignedStepReproducesTheWgmmaProbe) {
  const std::vector<double> prods(32, std::ldexp(1.0, -12));
  const double step_sum = 32 * std::ldexp(1.0, -12);
  for (int m = 0; m <= 20; m += 2) {
    SCOPED_TRACE("m = " + std::to_string(m));
    const double c = std::ldexp(1.0, m);
    double chained = c, fresh = c;
    for (int s = 0; s < 16; ++s) {
      chained = mma_aligned_step(chained, prods.data(), 32, 13);
      fresh = double(float(fresh + mma_aligned_step(0.0, prods.data(), 32, 13)));
    }
    EXPECT_EQ(chained, m == 0 ? c + 16 * step_sum : c);
    EXPECT_EQ(fresh, m <= 16 ? c + 16 * step_sum : c);
  }
  // Exact when everything fits the window; zero stays zero; signs truncate toward zero.
  const double mixed[3] = {0.75, -0.25, 0.125};
  EXPECT_EQ(mma_aligned_step(1.0, mixed, 3, 13), 1.625);
  EXPECT_EQ(mma_aligned_step(0.0, nullptr, 0, 13), 0.0);
  const double tiny[1] = {-std::ldexp(1.0, -30)};
  EXPECT_EQ(mma_aligned_step(1.0, tiny, 1, 13), 1.0);
}

// Wired into the emulation: against the same config with an fp32 accumulator, the aligned model
// loses more than exact-sum 13-bit truncation over a flat, long row (each small product is cut
// on its own), and a 23-bit window is close to fp32.
TEST(Accumulator, AlignedModelInTheEmulation) {
  AccumulatorError err(64, 2048, 0.02);  // small scale: flat rows
  EXPECT_GT(err(SAGE_PV_ACCUM_ALIGNED, 13), err(SAGE_PV_ACCUM_HW, 13));
  EXPECT_LT(err(SAGE_PV_ACCUM_ALIGNED, 23), 1e-5);
  // Block V scales need a flushed accumulator; ALIGNED is never flushed.
  sage_quant_config cfg = err.config();
  cfg.pv_accum = SAGE_PV_ACCUM_ALIGNED;
  cfg.v_scale = SAGE_V_SCALE_PER_BLOCK_CHANNEL;
  EXPECT_NE(quant_config_error(cfg).find("v_scale"), std::string::npos);
}

// The paper's orderings on the built-in outlier problem (fresh seed each run).
class PaperOrderings : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    SyntheticSpec spec;  // 1 x 2 heads x 2048 x 128, the `sage accuracy` default
    spec.seed = test::fresh_seed();
    seed_ = spec.seed;
    inputs_ = new SyntheticInputs(make_inputs(spec));
    const Problem p = inputs_->problem();
    exact_ = new std::vector<double>(size_t(p.out_elems()));
    attention_exact(p, inputs_->q_view(), inputs_->k_view(), inputs_->v_view(), exact_->data(),
                    nullptr);
    for (const AblationRow& row : paper_ablations()) rows_[row.table + "/" + row.label] = row.cfg;
  }
  static void TearDownTestSuite() {
    delete inputs_;
    delete exact_;
  }
  static Metrics run(const std::string& table_prefix, const std::string& label) {
    for (const auto& [key, cfg] : rows_)
      if (key.rfind(table_prefix, 0) == 0 && key.substr(key.find('/') + 1) == label) {
        const Problem p = inputs_->problem();
        std::vector<float> o(exact_->size());
        attention_quant(p, cfg, inputs_->q_view(), inputs_->k_view(), inputs_->v_view(), o.data(),
                        nullptr);
        return compare(exact_->data(), o.data(), p.out_elems());
      }
    ADD_FAILURE() << "no ablation row " << table_prefix << " / " << label;
    return {};
  }
  static Metrics run(const sage_quant_config& cfg) {
    const Problem p = inputs_->problem();
    std::vector<float> o(exact_->size());
    attention_quant(p, cfg, inputs_->q_view(), inputs_->k_view(), inputs_->v_view(), o.data(),
                    nullptr);
    return compare(exact_->data(), o.data(), p.out_elems());
  }
  static inline uint64_t seed_ = 0;
  static inline SyntheticInputs* inputs_ = nullptr;
  static inline std::vector<double>* exact_ = nullptr;
  static inline std::map<std::string, sage_quant_config> rows_;
};

// Q+K beats either alone, and either beats none. Whether Q alone beats K alone is a property of
// the draw, not of the code: on this problem the two are within a few per cent and K wins for
// some seeds (rel-L1 Q 0.0786 vs K 0.0779 with seed 54922620480129145, 0.0714 vs 0.0700 with
// 1235858262177816418), so that pair is not ordered here.
TEST_F(PaperOrderings, SmoothingQKBeatsQAndKWhichBeatNone) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const Metrics none = run("Smoothing", "none"), k = run("Smoothing", "K"),
                q = run("Smoothing", "Q"), qk = run("Smoothing", "Q+K");
  for (const Metrics& one : {q, k}) {
    EXPECT_LT(qk.rel_l1, one.rel_l1);
    EXPECT_LT(one.rel_l1, none.rel_l1);
    EXPECT_GT(qk.cos, one.cos);
    EXPECT_GT(one.cos, none.cos);
  }
}

TEST_F(PaperOrderings, PerTokenAboutPerThreadBeatsPerBlockBeatsPerTensor) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const Metrics tok = run("Granularity", "per-token"), thr = run("Granularity", "per-thread (mma)"),
                blk = run("Granularity", "per-block"), ten = run("Granularity", "per-tensor");
  EXPECT_LT(thr.rel_l1, blk.rel_l1);
  EXPECT_LT(blk.rel_l1, ten.rel_l1);
  EXPECT_GT(thr.cos, blk.cos);
  EXPECT_GT(blk.cos, ten.cos);
  // "About": per-thread is nearer per-token than per-block is to per-thread.
  EXPECT_LT(std::fabs(thr.rel_l1 - tok.rel_l1), blk.rel_l1 - thr.rel_l1);
}

TEST_F(PaperOrderings, E4M3BeatsE5M2BeatsInt8ForPV) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const Metrics i8 = run("P~,V", "INT8"), e5 = run("P~,V", "E5M2"), e4 = run("P~,V", "E4M3"),
                f16 = run("P~,V", "FP16");
  EXPECT_LT(f16.rel_l1, e4.rel_l1);
  EXPECT_LT(e4.rel_l1, e5.rel_l1);
  EXPECT_LT(e4.rel_l1, i8.rel_l1);
  // E5M2 against INT8 depends on the draw: rel-L1 E5M2 / INT8 is mostly 0.35-0.70, with a tail
  // past 1 (1.10 with seed 5342693309267417140, 1.36 with 6104437904472863037: INT8's per-block P
  // error varies with the outliers far more than E5M2's), so the paper's order is checked with
  // that tail's room.
  EXPECT_LT(e5.rel_l1, 1.5 * i8.rel_l1);
  EXPECT_GT(e4.cos, e5.cos);
  EXPECT_GT(e4.cos, i8.cos);
  // E5M2 against INT8 by cosine is within noise on fresh draws of this problem (about 1 run in
  // 8 had INT8 ahead by 1e-4, seen 2026-11-22); by relative L1 the order holds (checked above).
}

// One power-of-two V scale per key block against the paper's (and the presets') per-channel
// scale, on the
// built-in problem (V has a channel bias; massive channels in Q and K). With V smoothed (the
// presets) the bias is gone and one scale for every channel costs nothing measurable; without
// it the bias channels set each block's scale, and per block still does as well. Measured over
// 49 fresh seeds (2026-11-24), rel-L1 per block / per channel: 8-bit 0.95-1.04 (median 0.997),
// 4-bit 0.995-1.003, without smooth V 0.92-1.04; 1.1 leaves room without hiding a real loss.
TEST_F(PaperOrderings, PerBlockPowerOfTwoVScaleIsAboutAsAccurateAsPerChannel) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  for (sage_variant variant : {SAGE_VARIANT_SAGE2_8B, SAGE_VARIANT_SAGE2_4B})
    for (bool smooth_v : {true, false}) {
      SCOPED_TRACE("variant " + std::to_string(variant) + (smooth_v ? "" : ", no smooth V"));
      sage_quant_config block = quant_preset(variant);
      block.v_scale = SAGE_V_SCALE_PER_BLOCK;
      if (!smooth_v) block.smooth &= ~SAGE_SMOOTH_V;
      sage_quant_config channel = block;
      channel.v_scale = SAGE_V_SCALE_PER_CHANNEL;
      const Metrics b = run(block), c = run(channel);
      EXPECT_LE(b.rel_l1, 1.1 * c.rel_l1)
          << "per block " << b.rel_l1 << ", per channel " << c.rel_l1;
    }
}

// K's smoothing mean from 256 sampled tokens (the presets; every 8th of 2048 here) against the
// mean over every token, on the built-in problem with its channel biases: a residual bias in
// K - k̄ only adds a constant to each score row and widens the K groups a little. Measured over
// 24 fresh seeds (2026-11-23), rel-L1 sampled / every token: 8-bit 0.91-1.13 (median 1.00),
// 4-bit 0.987-1.009; the sampled mean keeps the gain of smoothing K (rel-L1 0.34-0.70x that of
// no K smoothing). (Sampling V's mean too varied the 8-bit rel-L1 0.87x-1.34x over 69 seeds:
// what the mean misses stays in V - v̄; V's mean therefore takes every token.)
TEST_F(PaperOrderings, SampledKMeanIsAsAccurateAsTheFullMean) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  for (sage_variant variant : {SAGE_VARIANT_SAGE2_8B, SAGE_VARIANT_SAGE2_4B}) {
    SCOPED_TRACE("variant " + std::to_string(variant));
    const sage_quant_config sampled = quant_preset(variant);
    ASSERT_EQ(sampled.k_mean_tokens, 256);
    ASSERT_EQ(mean_token_stride(inputs_->spec.seq_kv, sampled.k_mean_tokens), 8);
    sage_quant_config full = sampled, unsmoothed_k = sampled;
    full.k_mean_tokens = 0;
    unsmoothed_k.smooth &= ~SAGE_SMOOTH_K;
    const Metrics s = run(sampled), f = run(full), u = run(unsmoothed_k);
    const double bound = variant == SAGE_VARIANT_SAGE2_8B ? 1.25 : 1.05;
    EXPECT_LE(s.rel_l1, bound * f.rel_l1) << "sampled " << s.rel_l1 << ", full " << f.rel_l1;
    // Not vacuous: smoothing K matters on this problem, and the sample keeps it.
    EXPECT_LT(s.rel_l1, 0.8 * u.rel_l1)
        << "sampled " << s.rel_l1 << ", K not smoothed " << u.rel_l1;
  }
}

TEST(QuantConfig, InvalidCombinationsAreRejectedByName) {
  sage_quant_config c = quant_preset(SAGE_VARIANT_SAGE2_8B);
  EXPECT_EQ(quant_config_error(c), "");
  c.v_scale = SAGE_V_SCALE_PER_BLOCK_CHANNEL;
  c.pv_flush_interval = 2;
  EXPECT_NE(quant_config_error(c).find("v_scale"), std::string::npos);
  c = quant_preset(SAGE_VARIANT_SAGE2_8B);
  c.block_q = 96;  // 96 / 4 warps = 24 rows: not whole m16 tiles
  EXPECT_NE(quant_config_error(c).find("block_q"), std::string::npos);
  c = quant_preset(SAGE_VARIANT_SAGE2_8B);
  c.k_mean_tokens = -1;
  EXPECT_NE(quant_config_error(c).find("k_mean_tokens"), std::string::npos);
  c.k_mean_tokens = 0;  // every token
  EXPECT_EQ(quant_config_error(c), "");
  // The power-of-two V scale per block is E4M3's alone (its exponent targets 448), and needs no
  // flush: any accumulator and flush interval go with it.
  for (sage_pv_format f : {SAGE_PV_NONE, SAGE_PV_FP16, SAGE_PV_FP8_E5M2, SAGE_PV_INT8}) {
    c = quant_preset(SAGE_VARIANT_SAGE2_8B);
    c.v_scale = SAGE_V_SCALE_PER_BLOCK;
    c.pv_format = f;
    EXPECT_NE(quant_config_error(c).find("v_scale"), std::string::npos) << f;
  }
  for (sage_pv_accum a :
       {SAGE_PV_ACCUM_FP32, SAGE_PV_ACCUM_HW, SAGE_PV_ACCUM_TWO_LEVEL, SAGE_PV_ACCUM_ALIGNED}) {
    c = quant_preset(SAGE_VARIANT_SAGE2_8B);
    c.v_scale = SAGE_V_SCALE_PER_BLOCK;
    c.pv_accum = a;
    c.pv_flush_interval = 4;
    EXPECT_EQ(quant_config_error(c), "") << a;
  }
  c = quant_preset(SAGE_VARIANT_SAGE2_8B);
  c.accum_mantissa_bits = 0;
  EXPECT_NE(quant_config_error(c).find("accum_mantissa_bits"), std::string::npos);
  // The reference refuses a bad config instead of computing garbage.
  const Problem p{1, 1, 1, 4, 4, 64, 0.125, SAGE_MASK_NONE};
  std::vector<uint16_t> zeros(4 * 64, 0);
  const TensorView t{zeros.data(), SAGE_DTYPE_FP16, contiguous_strides(SAGE_LAYOUT_HND, 1, 4, 64)};
  std::vector<float> o(256);
  EXPECT_THROW(attention_quant(p, c, t, t, t, o.data(), nullptr), Error);
}

}  // namespace
}  // namespace sage::ref
