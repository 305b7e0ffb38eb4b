// The e4m3 form of SageBwd's dV, dK and dQ products in the reference (attention_backward_quant's
// fp8 argument): scales fixed along each product's summed dimension, the design a kernel needs
// to sum every block in its accumulator (docs/backward.md). Against float64 on the training
// input classes; the scales follow the data (a power-of-two change of dO changes no bit but the
// exponent); non-finite inputs stay visible; a product without an e4m3 form is refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "../common/test_util.h"
#include "../common/training_util.h"
#include "common/error.h"
#include "common/formats.h"
#include "ref/reference.h"
#include "ref/synthetic.h"
#include "sage/sage.h"

namespace sage {
namespace {

using ref::TrainingClass;
using test::cosine;
using test::exact_grads;
using test::Exact;
using test::fresh_seed;
using test::problem_of;
using test::rel_l1;

constexpr uint32_t kAllFp8 = SAGE_BWD_INT8_PDO | SAGE_BWD_INT8_DSK | SAGE_BWD_INT8_DSQ;

struct Grads {
  std::vector<float> dq, dk, dv;
  ref::BackwardCheck check;
};
Grads quant_grads(const ref::Problem& p, const ref::TrainingInputs& in, uint32_t fp8,
                  const ref::TensorView* d_o = nullptr) {
  Grads g;
  g.dq.resize(size_t(p.out_elems()));
  g.dk.resize(in.k.size());
  g.dv.resize(in.k.size());
  ref::attention_backward_quant(p, ref::backward_preset(), in.q_view(), in.k_view(), in.v_view(),
                                d_o ? *d_o : in.d_o_view(), g.dq.data(), g.dk.data(),
                                g.dv.data(), 2, nullptr, &g.check, fp8);
  return g;
}

ref::TrainingSpec spec(TrainingClass kind, float strength, int64_t n, int64_t d, bool gqa,
                       sage_dtype dtype, uint64_t seed) {
  ref::TrainingSpec s;
  s.kind = kind;
  s.strength = strength;
  s.seq_q = s.seq_kv = n;
  s.head_dim = d;
  s.heads_q = 4;
  s.heads_kv = gqa ? 1 : 4;
  s.dtype = dtype;
  s.seed = seed;
  return s;
}

// N(0,1) inputs, every shape class: each e4m3 product alone and all three meet the 0.999 bar
// (and 10 % rel-L1) against float64 (the e4m3 operands cost more than the per-token INT8 ones; docs/backward.md).
TEST(BackwardFp8, NormalInputsMeetTheBar) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  int k = 0;
  for (const int64_t d : {64, 128})
    for (const bool causal : {false, true}) {
      const ref::TrainingSpec s =
          spec(TrainingClass::kNormal, 1, causal ? 321 : 200, d, causal,
               causal ? SAGE_DTYPE_BF16 : SAGE_DTYPE_FP16, seed + uint64_t(k++));
      const ref::TrainingInputs in = ref::make_training_inputs(s);
      const ref::Problem p =
          problem_of(s, causal ? SAGE_MASK_CAUSAL_TOP_LEFT : SAGE_MASK_NONE);
      const Exact t = exact_grads(p, in);
      for (const uint32_t fp8 : {uint32_t(SAGE_BWD_INT8_PDO), uint32_t(SAGE_BWD_INT8_DSK),
                                 uint32_t(SAGE_BWD_INT8_DSQ), kAllFp8}) {
        SCOPED_TRACE("D " + std::to_string(d) + (causal ? " causal" : "") + " fp8 " +
                     std::to_string(fp8));
        const Grads g = quant_grads(p, in, fp8);
        ASSERT_FALSE(g.check.untrusted);
        EXPECT_GT(cosine(t.dq, g.dq), 0.999);
        EXPECT_GT(cosine(t.dk, g.dk), 0.999);
        EXPECT_GT(cosine(t.dv, g.dv), 0.999);
        // (the cosine cannot see a gradient off by a constant factor)
        EXPECT_LT(rel_l1(t.dq, g.dq), 0.1);
        EXPECT_LT(rel_l1(t.dk, g.dk), 0.1);
        EXPECT_LT(rel_l1(t.dv, g.dv), 0.1);
      }
    }
}

// The fixed scales come from the data: dO times 2^-20 (gradients that small are common; bf16, so
// the inputs scale exactly) gives gradients times 2^-20 exactly, e4m3's range reached as before.
TEST(BackwardFp8, ScalesFollowTheData) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const ref::TrainingSpec s =
      spec(TrainingClass::kNormal, 1, 150, 64, true, SAGE_DTYPE_BF16, seed);
  ref::TrainingInputs in = ref::make_training_inputs(s);
  const ref::Problem p = problem_of(s, SAGE_MASK_NONE);
  const Grads g = quant_grads(p, in, kAllFp8);
  for (uint16_t& h : in.d_o)
    h = uint16_t(encode_float(kBf16, std::ldexp(decode_float(kBf16, h), -20), false));
  const Grads small = quant_grads(p, in, kAllFp8);
  const float f = std::ldexp(1.0f, -20);
  for (size_t i = 0; i < g.dq.size(); ++i) ASSERT_EQ(small.dq[i], g.dq[i] * f) << i;
  for (size_t i = 0; i < g.dk.size(); ++i) ASSERT_EQ(small.dk[i], g.dk[i] * f) << i;
  for (size_t i = 0; i < g.dv.size(); ++i) ASSERT_EQ(small.dv[i], g.dv[i] * f) << i;
}

// A NaN in dO reaches the gradients it feeds (never scaled away); a product without an e4m3 form
// is refused by name.
TEST(BackwardFp8, NonFiniteStaysVisibleAndBadFlagsAreRefused) {
  const ref::TrainingSpec s = spec(TrainingClass::kNormal, 1, 100, 64, false, SAGE_DTYPE_FP16, 7);
  ref::TrainingInputs in = ref::make_training_inputs(s);
  const ref::Problem p = problem_of(s, SAGE_MASK_NONE);
  in.d_o[size_t(5 * 64 + 3)] = 0x7E00;  // fp16 NaN: query 5 of head 0, channel 3
  const Grads g = quant_grads(p, in, kAllFp8);
  auto has_nan = [](const std::vector<float>& x) {
    for (float e : x)
      if (std::isnan(e)) return true;
    return false;
  };
  EXPECT_TRUE(has_nan(g.dv));
  EXPECT_TRUE(has_nan(g.dq));
  EXPECT_TRUE(has_nan(g.dk));
  std::vector<float> dq(g.dq.size()), dk(g.dk.size()), dv(g.dv.size());
  try {
    ref::attention_backward_quant(p, ref::backward_preset(), in.q_view(), in.k_view(),
                                  in.v_view(), in.d_o_view(), dq.data(), dk.data(), dv.data(), 1,
                                  nullptr, nullptr, SAGE_BWD_INT8_QK);
    FAIL() << "an e4m3 Q·Kᵀ was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status, SAGE_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(e.message.find("fp8"), std::string::npos) << e.message;
  }
}

// What the e4m3 products cost on each training class beside the per-token INT8 ones (printed for
// docs/backward.md). Asserted: the check, which reads the scores alone, refuses the same calls;
// on the accepted ones each e4m3 product is less accurate than its INT8 form (3-bit mantissas),
// and dV in e4m3 stays above the 0.999 bar (e4m3 dK and dQ do not).
TEST(BackwardFp8, TrainingClassesBesideInt8) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  struct Case {
    TrainingClass kind;
    float strength;
    const char* name;
  };
  const Case cases[] = {{TrainingClass::kNormal, 1, "normal"},
                        {TrainingClass::kOutlierScale, 3, "x3"},
                        {TrainingClass::kOutlierBias, 8, "bias 8"},
                        {TrainingClass::kSink, 5, "sink 5"},
                        {TrainingClass::kPeaked, 4, "peaked 4"}};
  struct Products {
    uint32_t fp8;
    const char* name;
  };
  const Products sets[] = {{SAGE_BWD_INT8_PDO, "dV"},
                           {SAGE_BWD_INT8_DSQ, "dK"},
                           {SAGE_BWD_INT8_DSK, "dQ"},
                           {kAllFp8, "all"}};
  for (const Case& c : cases)
    for (const int64_t d : {64, 128}) {
      const ref::TrainingSpec s =
          spec(c.kind, c.strength, 256, d, true, SAGE_DTYPE_BF16, seed + uint64_t(d));
      const ref::TrainingInputs in = ref::make_training_inputs(s);
      const ref::Problem p = problem_of(s, SAGE_MASK_CAUSAL_TOP_LEFT);
      const Exact t = exact_grads(p, in);
      const Grads i8 = quant_grads(p, in, 0);
      double err = 0.0;
      for (double e : i8.check.head_error) err = std::max(err, e);
      const double i8_cos[3] = {cosine(t.dq, i8.dq), cosine(t.dk, i8.dk), cosine(t.dv, i8.dv)};
      std::printf("%-8s D %3lld score error %.4f: int8 dQ %.5f dK %.5f dV %.5f%s\n", c.name,
                  (long long)d, err, i8_cos[0], i8_cos[1], i8_cos[2],
                  i8.check.untrusted ? " (refused)" : "");
      for (const Products& set : sets) {
        SCOPED_TRACE(std::string(c.name) + " D " + std::to_string(d) + " e4m3 " + set.name);
        const Grads f8 = quant_grads(p, in, set.fp8);
        ASSERT_EQ(i8.check.untrusted, f8.check.untrusted);
        if (f8.check.untrusted) continue;
        const double f8_cos[3] = {cosine(t.dq, f8.dq), cosine(t.dk, f8.dk), cosine(t.dv, f8.dv)};
        std::printf("    e4m3 %-3s dQ %.5f dK %.5f dV %.5f\n", set.name, f8_cos[0], f8_cos[1],
                    f8_cos[2]);
        const int changed[3] = {bool(set.fp8 & SAGE_BWD_INT8_DSK),
                                bool(set.fp8 & SAGE_BWD_INT8_DSQ),
                                bool(set.fp8 & SAGE_BWD_INT8_PDO)};
        for (int g = 0; g < 3; ++g) {
          if (changed[g])
            EXPECT_LT(f8_cos[g], i8_cos[g]) << "gradient " << g;
          else  // (P = e·μ rounds otherwise than 2^(x - L'): the last bits move)
            EXPECT_NEAR(f8_cos[g], i8_cos[g], 1e-5) << "gradient " << g;
          // dV alone in e4m3 keeps dV above the bar; dQ and dK are then INT8's own (equal
          // above), whose draws at N = 256 can fall under 0.999 on an accepted call (the check's
          // margin, docs/backward.md), so they are not held to it here.
          if (set.fp8 == SAGE_BWD_INT8_PDO && changed[g]) {
            EXPECT_GT(f8_cos[g], 0.999) << "gradient " << g;
          }
        }
      }
    }
}

// The forward-normalized 16-bit backward with dV in e4m3 and no statistics pass: P̄ = e4m3(448·P)
// (P <= 1: the forward's L as each row's max) and dO with one scale a channel over the KV head's
// queries, so the sum over the queries has no scale change. What it costs beside every product in
// 16 bits, on the training classes and on flat rows at a longer N (P about 1/N there, so 448·P
// falls toward e4m3's subnormals), printed for docs/backward.md; asserted: dQ and dK are the
// 16-bit form's bit for bit, dV stays above the 0.999 bar, and a NaN of dO stays visible; the
// e4m3 dK and dQ, which need the statistics pass, are refused by name.
TEST(BackwardFp8, ForwardNormalizedDvWithoutStatistics) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  struct Case {
    TrainingClass kind;
    float strength;
    int64_t n;
    const char* name;
  };
  const Case cases[] = {{TrainingClass::kNormal, 1, 200, "normal"},
                        {TrainingClass::kNormal, 1, 1024, "normal N 1024"},
                        {TrainingClass::kOutlierScale, 16, 200, "x16"},
                        {TrainingClass::kOutlierBias, 16, 200, "bias 16"},
                        {TrainingClass::kSink, 10, 200, "sink 10"},
                        {TrainingClass::kPeaked, 20, 200, "peaked 20"}};
  sage_backward_config all16 = ref::backward_preset();
  all16.int8 = 0;
  all16.smooth = 0;
  all16.normalizer = SAGE_BWD_NORM_FORWARD;
  for (const Case& c : cases) {
    for (const bool causal : {false, true}) {
      ref::TrainingSpec s = spec(c.kind, c.strength, c.n, causal ? 128 : 64, causal,
                                 causal ? SAGE_DTYPE_BF16 : SAGE_DTYPE_FP16,
                                 seed + uint64_t(&c - cases) * 2 + causal);
      const ref::TrainingInputs in = ref::make_training_inputs(s);
      const ref::Problem p = problem_of(s, causal ? SAGE_MASK_CAUSAL_BOTTOM_RIGHT : SAGE_MASK_NONE);
      SCOPED_TRACE(std::string(c.name) + (causal ? " causal bf16 D128 GQA" : " fp16 D64"));
      const Exact t = exact_grads(p, in);
      const test::Forward fwd = test::forward_of(p, in, s.dtype);
      const std::vector<float>& o16 = fwd.o16;
      const std::vector<float>& lf = fwd.lse;
      auto run = [&](uint32_t fp8) {
        Grads g;
        g.dq.resize(t.dq.size());
        g.dk.resize(t.dk.size());
        g.dv.resize(t.dv.size());
        ref::attention_backward_quant(p, all16, in.q_view(), in.k_view(), in.v_view(),
                                      in.d_o_view(), g.dq.data(), g.dk.data(), g.dv.data(), 2,
                                      nullptr, nullptr, fp8, o16.data(), lf.data());
        return g;
      };
      const Grads sixteen = run(0), e4m3 = run(SAGE_BWD_INT8_PDO);
      EXPECT_TRUE(e4m3.dq == sixteen.dq);
      EXPECT_TRUE(e4m3.dk == sixteen.dk);
      const double c16 = cosine(t.dv, sixteen.dv), c8 = cosine(t.dv, e4m3.dv);
      EXPECT_GE(c8, 0.999);
      std::printf("    %-14s %s: dV cos 16-bit %.6f, e4m3 %.6f; rel-L1 %.4f, %.4f\n", c.name,
                  causal ? "causal bf16 D128 GQA" : "fp16 D64", c16, c8, rel_l1(t.dv, sixteen.dv),
                  rel_l1(t.dv, e4m3.dv));
    }
  }
  // A NaN of dO stays visible; dK's and dQ's e4m3 forms are refused without the statistics pass.
  const ref::TrainingSpec s = spec(TrainingClass::kNormal, 1, 100, 64, false, SAGE_DTYPE_FP16, 7);
  ref::TrainingInputs in = ref::make_training_inputs(s);
  const ref::Problem p = problem_of(s, SAGE_MASK_NONE);
  std::vector<double> o(size_t(p.out_elems())), lse(size_t(p.lse_elems()));
  ref::attention_exact(p, in.q_view(), in.k_view(), in.v_view(), o.data(), lse.data(), 1);
  const std::vector<float> of(o.begin(), o.end()), lf(lse.begin(), lse.end());
  in.d_o[size_t(5 * 64 + 3)] = 0x7E00;  // fp16 NaN: query 5 of head 0, channel 3
  std::vector<float> dq(size_t(p.out_elems())), dk(in.k.size()), dv(in.k.size());
  ref::attention_backward_quant(p, all16, in.q_view(), in.k_view(), in.v_view(), in.d_o_view(),
                                dq.data(), dk.data(), dv.data(), 1, nullptr, nullptr,
                                SAGE_BWD_INT8_PDO, of.data(), lf.data());
  EXPECT_TRUE(std::any_of(dv.begin(), dv.end(), [](float x) { return std::isnan(x); }));
  for (const uint32_t bad : {uint32_t(SAGE_BWD_INT8_DSK), uint32_t(SAGE_BWD_INT8_DSQ)}) {
    try {
      ref::attention_backward_quant(p, all16, in.q_view(), in.k_view(), in.v_view(),
                                    in.d_o_view(), dq.data(), dk.data(), dv.data(), 1, nullptr,
                                    nullptr, SAGE_BWD_INT8_PDO | bad, of.data(), lf.data());
      ADD_FAILURE() << "an e4m3 dK or dQ without the statistics pass was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.status, SAGE_ERROR_INVALID_ARGUMENT);
      EXPECT_NE(e.message.find("statistics pass"), std::string::npos) << e.message;
    }
  }
}

}  // namespace
}  // namespace sage
