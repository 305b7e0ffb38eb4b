// The float64 reference against naive long-double loops (masks, GQA/MQA, strides, Nq != Nk,
// LSE), and the exactness of smoothing: with no quantization, smoothing Q, K and V changes
// neither the output nor the LSE (beyond 1e-12).
#include <gtest/gtest.h>

#include <cmath>

#include "common/test_util.h"

namespace sage::ref {
namespace {

using test::Fp16Tensor;

struct Case {
  int64_t B, Hq, Hkv, Nq, Nk, D;
  sage_mask mask;
};

void expect_close(const std::vector<double>& want, const double* got, double tol,
                  const char* what) {
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isinf(want[i])) {
      ASSERT_EQ(want[i], got[i]) << what << " [" << i << "]";
      continue;
    }
    ASSERT_NEAR(got[i], want[i], tol * (1.0 + std::fabs(want[i]))) << what << " [" << i << "]";
  }
}

class ExactVsNaive : public ::testing::TestWithParam<Case> {};

TEST_P(ExactVsNaive, MatchesOutputAndLse) {
  const Case c = GetParam();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (sage_layout layout : {SAGE_LAYOUT_HND, SAGE_LAYOUT_NHD}) {
    const Fp16Tensor q = test::random_tensor(rng, c.B, c.Hq, c.Nq, c.D,
                                             contiguous_strides(layout, c.Hq, c.Nq, c.D));
    const Fp16Tensor k = test::random_tensor(rng, c.B, c.Hkv, c.Nk, c.D,
                                             contiguous_strides(layout, c.Hkv, c.Nk, c.D), 2.0f);
    const Fp16Tensor v = test::random_tensor(rng, c.B, c.Hkv, c.Nk, c.D,
                                             contiguous_strides(layout, c.Hkv, c.Nk, c.D), 1.0f);
    const Problem p{c.B, c.Hq, c.Hkv, c.Nq, c.Nk, c.D, 1.0 / std::sqrt(double(c.D)), c.mask};
    std::vector<double> want_o, want_lse;
    test::naive_attention(c.B, c.Hq, c.Hkv, c.Nq, c.Nk, c.D, p.scale, c.mask, q.view(), k.view(),
                          v.view(), &want_o, &want_lse);
    std::vector<double> o(want_o.size(), std::nan("")), lse(want_lse.size(), std::nan(""));
    attention_exact(p, q.view(), k.view(), v.view(), o.data(), lse.data(), 2);
    expect_close(want_o, o.data(), 1e-12, "out");
    expect_close(want_lse, lse.data(), 1e-12, "lse");
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ExactVsNaive,
    ::testing::Values(Case{1, 1, 1, 1, 1, 64, SAGE_MASK_NONE},
                      Case{2, 2, 2, 17, 33, 64, SAGE_MASK_NONE},
                      Case{1, 4, 2, 40, 40, 64, SAGE_MASK_CAUSAL_TOP_LEFT},      // GQA 2:1
                      Case{1, 4, 1, 23, 57, 32, SAGE_MASK_CAUSAL_BOTTOM_RIGHT},  // MQA
                      Case{1, 2, 2, 57, 23, 32, SAGE_MASK_CAUSAL_BOTTOM_RIGHT},  // empty rows
                      Case{1, 2, 2, 57, 23, 32, SAGE_MASK_CAUSAL_TOP_LEFT},
                      Case{2, 2, 1, 1, 100, 128, SAGE_MASK_CAUSAL_BOTTOM_RIGHT}));

TEST(Exact, FullyMaskedRowsAreZeroWithMinusInfLse) {
  std::mt19937_64 rng(test::fresh_seed());
  const Fp16Tensor q = test::random_tensor(rng, 1, 1, 10, 32);
  const Fp16Tensor k = test::random_tensor(rng, 1, 1, 4, 32);
  const Problem p{1, 1, 1, 10, 4, 32, 0.2, SAGE_MASK_CAUSAL_BOTTOM_RIGHT};
  std::vector<double> o(320, 7.0), lse(10, 7.0);
  attention_exact(p, q.view(), k.view(), k.view(), o.data(), lse.data());
  for (int i = 0; i < 10; ++i) {
    const bool empty = i < 6;  // query i sees keys j <= i + 4 - 10
    EXPECT_EQ(p.visible_keys(i), empty ? 0 : i - 5);
    if (empty) {
      EXPECT_EQ(lse[size_t(i)], -std::numeric_limits<double>::infinity());
      for (int d = 0; d < 32; ++d) EXPECT_EQ(o[size_t(i * 32 + d)], 0.0);
    } else {
      EXPECT_TRUE(std::isfinite(lse[size_t(i)]));
    }
  }
}

TEST(Exact, PaddedStridesGiveTheSameResultAsContiguous) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t B = 2, H = 3, N = 29, D = 64;
  // Heads interleaved with padding: token stride 3*D+16, head stride D+5, batch stride large.
  const sage_strides padded{N * (3 * D + 16) + 7, D + 5, 3 * D + 16};
  std::mt19937_64 rng_a(seed), rng_b(seed);
  const Fp16Tensor qa = test::random_tensor(rng_a, B, H, N, D);
  const Fp16Tensor qb = test::random_tensor(rng_b, B, H, N, D, padded);
  const Fp16Tensor k = test::random_tensor(rng_a, B, H, N, D, 3.0f);
  const Fp16Tensor v = test::random_tensor(rng_a, B, H, N, D);
  const Problem p{B, H, H, N, N, D, 0.125, SAGE_MASK_CAUSAL_TOP_LEFT};
  std::vector<double> oa(size_t(p.out_elems())), ob(oa.size());
  attention_exact(p, qa.view(), k.view(), v.view(), oa.data(), nullptr);
  attention_exact(p, qb.view(), k.view(), v.view(), ob.data(), nullptr);
  EXPECT_EQ(oa, ob);
}

// Smoothing is an identity of exact arithmetic: k_mean shifts every score of a row equally, ΔS
// restores what q_mean removed, and rows of P sum to one so v_mean passes through. With no
// quantization and double arithmetic the emulation must equal the float64 reference, whether
// k_mean takes every token or a sample (k_mean_tokens 64 of 333: every 5th).
TEST(Smoothing, LeavesFullPrecisionAttentionUnchanged) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t B = 1, Hq = 4, Hkv = 2, Nq = 300, Nk = 333, D = 64;
  const Fp16Tensor q = test::random_tensor(rng, B, Hq, Nq, D, 4.0f);
  const Fp16Tensor k = test::random_tensor(rng, B, Hkv, Nk, D, 8.0f);
  const Fp16Tensor v = test::random_tensor(rng, B, Hkv, Nk, D, 8.0f);
  for (sage_mask mask :
       {SAGE_MASK_NONE, SAGE_MASK_CAUSAL_TOP_LEFT, SAGE_MASK_CAUSAL_BOTTOM_RIGHT}) {
    const Problem p{B, Hq, Hkv, Nq, Nk, D, 1.0 / 8.0, mask};
    std::vector<double> want(size_t(p.out_elems())), want_lse(size_t(p.lse_elems()));
    attention_exact(p, q.view(), k.view(), v.view(), want.data(), want_lse.data());
    for (uint32_t smooth : {0u, SAGE_SMOOTH_K, SAGE_SMOOTH_Q, SAGE_SMOOTH_V,
                            SAGE_SMOOTH_Q | SAGE_SMOOTH_K | SAGE_SMOOTH_V})
      for (int32_t k_mean_tokens : {0, 64}) {
        SCOPED_TRACE("smooth flags " + std::to_string(smooth) + " mask " + std::to_string(mask) +
                     " k_mean_tokens " + std::to_string(k_mean_tokens));
        sage_quant_config cfg = quant_preset(SAGE_VARIANT_EXACT);
        cfg.smooth = smooth;
        cfg.k_mean_tokens = k_mean_tokens;
        std::vector<double> o(want.size(), std::nan("")), lse(want_lse.size(), std::nan(""));
        attention_quant(p, cfg, q.view(), k.view(), v.view(), o.data(), lse.data());
        expect_close(want, o.data(), 1e-12, "out");
        expect_close(want_lse, lse.data(), 1e-12, "lse");
      }
  }
}

TEST(Smoothing, Fp32EmulationWithoutQuantizationIsCloseToExact) {
  std::mt19937_64 rng(test::fresh_seed());
  const Fp16Tensor q = test::random_tensor(rng, 1, 2, 200, 128, 4.0f);
  const Fp16Tensor k = test::random_tensor(rng, 1, 2, 200, 128, 8.0f);
  const Fp16Tensor v = test::random_tensor(rng, 1, 2, 200, 128, 8.0f);
  const Problem p{1, 2, 2, 200, 200, 128, 1.0 / std::sqrt(128.0), SAGE_MASK_NONE};
  std::vector<double> want(size_t(p.out_elems()));
  attention_exact(p, q.view(), k.view(), v.view(), want.data(), nullptr);
  sage_quant_config cfg = quant_preset(SAGE_VARIANT_EXACT);
  cfg.smooth = SAGE_SMOOTH_Q | SAGE_SMOOTH_K;
  std::vector<float> o(want.size());
  attention_quant(p, cfg, q.view(), k.view(), v.view(), o.data(), nullptr);
  const Metrics m = compare(want.data(), o.data(), p.out_elems());
  EXPECT_LT(m.rel_l1, 1e-5);
  EXPECT_GT(m.cos, 1.0 - 1e-9);
}

TEST(Metrics, MatchTheirDefinitions) {
  const double ref[4] = {1.0, -2.0, 3.0, 0.5};
  const float x[4] = {1.5f, -2.0f, 2.0f, 0.5f};
  const Metrics m = compare(ref, x, 4);
  const double dot = 1.5 - 2.0 * -2.0 + 6.0 + 0.25;
  EXPECT_NEAR(m.cos, dot / (std::sqrt(1 + 4 + 9 + 0.25) * std::sqrt(2.25 + 4 + 4 + 0.25)), 1e-12);
  EXPECT_NEAR(m.rel_l1, 1.5 / 6.5, 1e-12);
  EXPECT_NEAR(m.rmse, std::sqrt((0.25 + 1.0) / 4.0), 1e-12);
  EXPECT_DOUBLE_EQ(m.max_abs, 1.0);
  const float bad[4] = {1.0f, NAN, 3.0f, 0.5f};
  EXPECT_TRUE(std::isnan(compare(ref, bad, 4).max_abs));
}

}  // namespace
}  // namespace sage::ref
