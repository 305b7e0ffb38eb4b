// The SageAttention3 paper's Algorithm 1 (FP4 microscaling attention) in the CPU emulation: against
// a direct transcription of the algorithm written here, against float64 attention within bands, the
// config checks of the FP4 formats, and Table 1's orderings on the built-in outlier problem
// (fresh seeds throughout; sizes that are not multiples of any block). Host only.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "ref/ablations.h"
#include "ref/synthetic.h"

namespace sage::ref {
namespace {

using test::Fp16Tensor;

// Values rounded through float (the GPU's registers) and quantized in FP4 runs of `n` values
// `stride` apart, from the first.
void fp4_in_place(double* x, int64_t n, int64_t stride, const MicroscaleFormat& f) {
  std::vector<float> buf(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) buf[size_t(i)] = float(x[i * stride]);
  quantize_fp4(buf.data(), n, 1, f, buf.data());
  for (int64_t i = 0; i < n; ++i) x[i * stride] = buf[size_t(i)];
}

struct Alg1Config {
  MicroscaleFormat qk_format, pv_format;
  bool two_level;
  int64_t block_q, block_kv;
};

// Algorithm 1 of the SageAttention3 paper for one head, line by line, in double with the natural
// exponential: Q [Nq][D], K, V [Nk][D]; visible(i) = keys query i sees.
template <typename Visible>
std::vector<double> algorithm1(std::vector<double> Q, std::vector<double> K, std::vector<double> V,
                               int64_t Nq, int64_t Nk, int64_t D, double scale, Visible visible,
                               const Alg1Config& c) {
  // Line 2: K = K - mean(K) (the sum over tokens divided once, as the pre-pass does).
  for (int64_t d = 0; d < D; ++d) {
    double sum = 0;
    for (int64_t j = 0; j < Nk; ++j) sum += K[size_t(j * D + d)];
    for (int64_t j = 0; j < Nk; ++j) K[size_t(j * D + d)] -= sum / double(Nk);
  }
  // Line 7: φ(K_jᵀ) in runs along D per key, φ(V_j) in runs along the keys per channel.
  std::vector<double> Kq = K;
  for (int64_t j = 0; j < Nk; ++j) fp4_in_place(&Kq[size_t(j * D)], D, 1, c.qk_format);
  for (int64_t d = 0; d < D; ++d) fp4_in_place(&V[size_t(d)], Nk, D, c.pv_format);
  std::vector<double> out(size_t(Nq * D), 0.0);
  for (int64_t r0 = 0; r0 < Nq; r0 += c.block_q) {
    const int64_t r1 = std::min(Nq, r0 + c.block_q);
    // Line 5: q̄_i = mean(Q_i), φ(Q_i - q̄_i).
    std::vector<double> qbar(static_cast<size_t>(D), 0.0);
    for (int64_t d = 0; d < D; ++d) {
      for (int64_t i = r0; i < r1; ++i) qbar[size_t(d)] += Q[size_t(i * D + d)];
      qbar[size_t(d)] /= double(r1 - r0);
    }
    for (int64_t i = r0; i < r1; ++i) {
      for (int64_t d = 0; d < D; ++d) Q[size_t(i * D + d)] -= qbar[size_t(d)];
      fp4_in_place(&Q[size_t(i * D)], D, 1, c.qk_format);
    }
    for (int64_t i = r0; i < r1; ++i) {
      const int64_t n = visible(i);
      double m = -std::numeric_limits<double>::infinity(), l = 0;
      std::vector<double> o(static_cast<size_t>(D), 0.0);
      for (int64_t j0 = 0; j0 < n; j0 += c.block_kv) {
        const int64_t j1 = std::min(Nk, j0 + c.block_kv);
        // Line 8: S = FP4MM(Q^, K^) + GEMV(q̄_i, K_jᵀ), then the softmax scale.
        std::vector<double> P(size_t(j1 - j0), 0.0);
        double row_max = -std::numeric_limits<double>::infinity();
        for (int64_t j = j0; j < std::min(j1, n); ++j) {
          double s = 0;
          for (int64_t d = 0; d < D; ++d)
            s += Q[size_t(i * D + d)] * Kq[size_t(j * D + d)] +
                 qbar[size_t(d)] * K[size_t(j * D + d)];
          P[size_t(j - j0)] = s * scale;
          row_max = std::max(row_max, s * scale);
        }
        // Line 9: the online softmax.
        const double m_new = std::max(m, row_max), alpha = std::exp(m - m_new);
        double p_max = 0, p_sum = 0;
        for (int64_t j = j0; j < j1; ++j) {
          double& p = P[size_t(j - j0)];
          p = j < n ? std::exp(p - m_new) : 0.0;
          p_sum += p;
          p_max = std::max(p_max, p);
        }
        l = alpha * l + p_sum;
        // Line 10: s_P1 = rowmax(P) / (448·6), P / s_P1, φ (or φ(P) directly).
        const double s_p1 = c.two_level ? p_max / (448.0 * 6.0) : 1.0;
        for (double& p : P) p /= s_p1;
        fp4_in_place(P.data(), j1 - j0, 1, c.pv_format);
        // Line 11: O = diag(e^(m_old - m_new))·O + FP4MM(P^, V^)·s_P1.
        for (int64_t d = 0; d < D; ++d) {
          double pv = 0;
          for (int64_t j = j0; j < j1; ++j) pv += P[size_t(j - j0)] * V[size_t(j * D + d)];
          o[size_t(d)] = alpha * o[size_t(d)] + pv * s_p1;
        }
        m = m_new;
      }
      // Line 13: O_i = diag(l)^-1 O_i.
      for (int64_t d = 0; d < D; ++d) out[size_t(i * D + d)] = n > 0 ? o[size_t(d)] / l : 0.0;
    }
  }
  return out;
}

struct Fp4Case {
  const char* name;
  sage_qk_format qk;
  sage_pv_format pv;
};
const Fp4Case kCases[] = {{"NVFP4 two-level", SAGE_QK_NVFP4, SAGE_PV_NVFP4},
                          {"NVFP4 direct", SAGE_QK_NVFP4, SAGE_PV_NVFP4_DIRECT},
                          {"MXFP4", SAGE_QK_MXFP4, SAGE_PV_MXFP4}};

sage_quant_config config_of(const Fp4Case& k) {
  sage_quant_config c = quant_preset(SAGE_VARIANT_SAGE3_FP4);
  c.qk_format = k.qk;
  c.pv_format = k.pv;
  return c;
}

// The double emulation computes Algorithm 1: every quantized value is the same, what remains is
// double rounding (base-2 vs natural softmax, summation order).
TEST(Fp4Algorithm1, EmulationMatchesTheAlgorithmAsWritten) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t Nq = 150, Nk = 203, D = 72;  // 2 Q blocks, 4 key blocks, 4.5 NVFP4 runs a row
  const Fp16Tensor q = test::random_tensor(rng, 1, 1, Nq, D, 2.0f);
  const Fp16Tensor k = test::random_tensor(rng, 1, 1, Nk, D, 4.0f);
  const Fp16Tensor v = test::random_tensor(rng, 1, 1, Nk, D, 2.0f);
  for (sage_mask mask : {SAGE_MASK_NONE, SAGE_MASK_CAUSAL_BOTTOM_RIGHT, SAGE_MASK_CAUSAL_TOP_LEFT})
    for (const Fp4Case& k4 : kCases) {
      SCOPED_TRACE(std::string(k4.name) + ", mask " + std::to_string(mask));
      const Problem p{1, 1, 1, Nq, Nk, D, 1.0 / std::sqrt(double(D)), mask};
      const sage_quant_config cfg = config_of(k4);
      const Alg1Config a{*qk_microscale(k4.qk), *pv_microscale(k4.pv), k4.pv == SAGE_PV_NVFP4,
                         cfg.block_q, cfg.block_k};
      const std::vector<double> want = algorithm1(
          test::head_matrix(q, 0, Nq, D), test::head_matrix(k, 0, Nk, D),
          test::head_matrix(v, 0, Nk, D), Nq, Nk, D, p.scale,
          [&](int64_t i) { return p.visible_keys(i); }, a);
      std::vector<double> got(want.size());
      attention_quant(p, cfg, q.view(), k.view(), v.view(), got.data(), nullptr);
      for (size_t i = 0; i < want.size(); ++i)
        ASSERT_NEAR(got[i], want[i], 1e-9 * (1 + std::fabs(want[i]))) << "element " << i;
    }
}

// The GPU's arithmetic (the float emulation) against float64 attention of the same inputs: FP4
// is coarse, so the bands are wide, but a broken step (a scale applied twice, a run misplaced)
// lands far outside them. Random data with channel biases, GQA, every mask.
TEST(Fp4Algorithm1, FloatEmulationIsNearFloat64Attention) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t B = 1, Hq = 4, Hkv = 2, Nq = 150, Nk = 203, D = 72;
  const Fp16Tensor q = test::random_tensor(rng, B, Hq, Nq, D, 2.0f);
  const Fp16Tensor k = test::random_tensor(rng, B, Hkv, Nk, D, 4.0f);
  const Fp16Tensor v = test::random_tensor(rng, B, Hkv, Nk, D, 0.5f);
  for (sage_mask mask :
       {SAGE_MASK_NONE, SAGE_MASK_CAUSAL_BOTTOM_RIGHT, SAGE_MASK_CAUSAL_TOP_LEFT}) {
    const Problem p{B, Hq, Hkv, Nq, Nk, D, 1.0 / std::sqrt(double(D)), mask};
    std::vector<double> exact(size_t(p.out_elems())), exact_lse(size_t(p.lse_elems()));
    attention_exact(p, q.view(), k.view(), v.view(), exact.data(), exact_lse.data());
    for (const Fp4Case& k4 : kCases) {
      SCOPED_TRACE(std::string(k4.name) + ", mask " + std::to_string(mask));
      std::vector<float> o(exact.size()), lse(exact_lse.size());
      attention_quant(p, config_of(k4), q.view(), k.view(), v.view(), o.data(), lse.data());
      const Metrics m = compare(exact.data(), o.data(), p.out_elems());
      EXPECT_GT(m.cos, 0.98) << "rel_l1 " << m.rel_l1;  // measured 0.989-0.996
      EXPECT_LT(m.rel_l1, 0.2);                         // measured 0.088-0.140
      // The LSE (with the smoothing shift added back) is a score: off by the FP4 Q·K error.
      double lse_err = 0;
      for (size_t i = 0; i < lse.size(); ++i)
        lse_err = std::max(lse_err, std::fabs(double(lse[i]) - exact_lse[i]));
      EXPECT_LT(lse_err, 1.0);
    }
  }
}

TEST(Fp4Config, InvalidCombinationsAreRejectedByName) {
  struct Bad {
    const char* what;
    void (*mutate)(sage_quant_config&);
    const char* word;
  };
  const Bad bad[] = {
      {"block_k not a run multiple", [](sage_quant_config& c) { c.block_k = 40; }, "block_k"},
      {"MXFP4 runs of 32",
       [](sage_quant_config& c) { c.pv_format = SAGE_PV_MXFP4, c.block_k = 48; }, "block_k"},
      {"sm90 softmax form", [](sage_quant_config& c) { c.softmax_block_k = 128; },
       "softmax_block_k"},
      {"polynomial 2^x", [](sage_quant_config& c) { c.exp2_poly_every = 8; }, "exp2_poly_every"},
      {"block V scale", [](sage_quant_config& c) { c.v_scale = SAGE_V_SCALE_PER_BLOCK_CHANNEL; },
       "v_scale"},
      {"two-level, unflushed",
       [](sage_quant_config& c) { c.pv_accum = SAGE_PV_ACCUM_TWO_LEVEL, c.pv_flush_interval = 4; },
       "pv_flush_interval"},
      {"two-level, never flushed", [](sage_quant_config& c) { c.pv_accum = SAGE_PV_ACCUM_HW; },
       "pv_accum"},
  };
  for (const Bad& b : bad) {
    sage_quant_config c = quant_preset(SAGE_VARIANT_SAGE3_FP4);
    b.mutate(c);
    const std::string e = quant_config_error(c);
    EXPECT_NE(e.find(b.word), std::string::npos) << b.what << ": \"" << e << "\"";
    EXPECT_NE(e.find("pv_format"), std::string::npos) << b.what << ": \"" << e << "\"";
  }
  // Direct P~ needs no flush; Q·K in FP4 mixes with any P·V format.
  sage_quant_config c = quant_preset(SAGE_VARIANT_SAGE3_FP4);
  c.pv_format = SAGE_PV_NVFP4_DIRECT;
  c.pv_accum = SAGE_PV_ACCUM_TWO_LEVEL;
  c.pv_flush_interval = 4;
  EXPECT_EQ(quant_config_error(c), "");
  c = quant_preset(SAGE_VARIANT_SAGE3_FP4);
  c.pv_format = SAGE_PV_FP8_E4M3;
  c.pv_accum = SAGE_PV_ACCUM_TWO_LEVEL;
  EXPECT_EQ(quant_config_error(c), "");
}

// The SageAttention3 paper's Table 1 on the built-in outlier problem (the `sage accuracy` default,
// fresh seed): NVFP4 beats MXFP4 and the two-level P~ beats the direct one. Measured before this
// test was written (seeds 1-3, rel-L1): Q·K alone NVFP4 0.018-0.020 vs MXFP4 0.022-0.025; both
// products NVFP4 two-level 0.061-0.073 vs MXFP4 0.085-0.093 vs NVFP4 direct 0.098-0.104. So NVFP4
// with a direct P~ is *worse* than MXFP4 (its E4M3 scales of P~ / 6 underflow): the format wins
// only with the two-level P~, and that pair is not ordered here.
class Fp4Table1 : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    SyntheticSpec spec;
    spec.seed = test::fresh_seed();
    seed_ = spec.seed;
    inputs_ = new SyntheticInputs(make_inputs(spec));
    const Problem p = inputs_->problem();
    exact_ = new std::vector<double>(size_t(p.out_elems()));
    attention_exact(p, inputs_->q_view(), inputs_->k_view(), inputs_->v_view(), exact_->data(),
                    nullptr);
  }
  static void TearDownTestSuite() {
    delete inputs_;
    delete exact_;
  }
  static Metrics run(const std::string& label) {
    for (const AblationRow& row : paper_ablations())
      if (row.table.rfind("FP4 microscaling", 0) == 0 && row.label == label) {
        const Problem p = inputs_->problem();
        std::vector<float> o(exact_->size());
        attention_quant(p, row.cfg, inputs_->q_view(), inputs_->k_view(), inputs_->v_view(),
                        o.data(), nullptr);
        return compare(exact_->data(), o.data(), p.out_elems());
      }
    ADD_FAILURE() << "no FP4 ablation row " << label;
    return {};
  }
  static inline uint64_t seed_ = 0;
  static inline SyntheticInputs* inputs_ = nullptr;
  static inline std::vector<double>* exact_ = nullptr;
};

std::string str(const Metrics& m) {
  return "cos " + std::to_string(m.cos) + " rel_l1 " + std::to_string(m.rel_l1) + " rmse " +
         std::to_string(m.rmse);
}

TEST_F(Fp4Table1, Nvfp4BeatsMxfp4) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const Metrics mx_qk = run("MXFP4 Q·K only (P~, V in fp16)");
  const Metrics nv_qk = run("NVFP4 Q·K only (P~, V in fp16)");
  EXPECT_LT(nv_qk.rel_l1, mx_qk.rel_l1) << "NVFP4 " << str(nv_qk) << "; MXFP4 " << str(mx_qk);
  EXPECT_GT(nv_qk.cos, mx_qk.cos);
  const Metrics mx = run("MXFP4 (E8M0 scale / 32), P~ direct");
  const Metrics nv = run("NVFP4, P~ two-level (SageAttn3)");
  EXPECT_LT(nv.rel_l1, mx.rel_l1) << "NVFP4 " << str(nv) << "; MXFP4 " << str(mx);
  EXPECT_LT(nv.rmse, mx.rmse);
  // Whole pipelines by cosine are within noise of each other: 2 of 21 fresh seeds had MXFP4 ahead
  // by 1.2e-4 and 1.9e-4 (seeds 10353782188539820638, 15586275665628; 2026-11-26) while rel-L1 and
  // RMSE kept NVFP4 ahead, as the Q·K-only rows' cosine above does.
  EXPECT_GT(nv.cos, mx.cos - 5e-4);
}

TEST_F(Fp4Table1, TwoLevelBeatsDirect) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const Metrics direct = run("NVFP4 (E4M3 scale / 16), P~ direct");
  const Metrics two = run("NVFP4, P~ two-level (SageAttn3)");
  EXPECT_LT(two.rel_l1, direct.rel_l1) << "two-level " << str(two) << "; direct " << str(direct);
  EXPECT_LT(two.rmse, direct.rmse);
  EXPECT_GT(two.cos, direct.cos);
  // And every FP4 row is far behind the 8-bit kernel, which is far behind fp16.
  const Metrics b8 = run("SageAttn2-8b"), f16 = run("fp16 (P~, V in fp16, fp32 accumulator)");
  EXPECT_LT(f16.rel_l1, b8.rel_l1);
  EXPECT_LT(b8.rel_l1, two.rel_l1);
}

}  // namespace
}  // namespace sage::ref
