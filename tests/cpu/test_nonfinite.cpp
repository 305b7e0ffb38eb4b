// Non-finite inputs in the CPU emulation (docs/c-api.md, "Non-finite inputs"): an Inf/NaN element of Q,
// K or V counts as a zero in every statistic and quantization, and exactly the rows it reaches
// are NaN (a query row: itself; a key or value row: the rows that see it). Every other row is
// bit-identical to the same call on the inputs with the bad elements set to zero, and the
// float64 result is non-finite only in rows marked here.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "common/formats.h"
#include "ref/reference.h"
#include "common/test_util.h"

namespace sage {
namespace {

using ref::Problem;
using test::Fp16Tensor;

constexpr uint16_t kNaN16 = 0x7E00, kInf16 = 0x7C00, kNegInf16 = 0xFC00;

struct Poison {
  char tensor;  // 'q', 'k' or 'v'
  int64_t b, h, n, d;
  uint16_t bits;
};

void put(Fp16Tensor& t, const Poison& x, uint16_t bits) {
  t.data[size_t(x.b * t.strides.batch + x.h * t.strides.head + x.n * t.strides.token + x.d)] =
      bits;
}

struct Case {
  sage_variant variant;
  bool sm90_form;  // the sm90 kernel's softmax form (softmax_block_k 128, polynomial 2^x)
  sage_mask mask;
  int64_t nq, nk;
};

std::string name(const Case& c) {
  return std::string(c.variant == SAGE_VARIANT_SAGE2_4B ? "4b" : "8b") + (c.sm90_form ? "-sm90" : "") +
         " mask " + std::to_string(c.mask) + " Nq " + std::to_string(c.nq) + " Nk " +
         std::to_string(c.nk);
}

class NonFinite : public ::testing::TestWithParam<Case> {};

TEST_P(NonFinite, MarksExactlyTheRowsItReachesAndLeavesTheRestAsIfZero) {
  const Case c = GetParam();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " " + name(c));
  std::mt19937_64 rng(seed);
  Problem p;
  p.batch = 2, p.heads_q = 4, p.heads_kv = 2, p.seq_q = c.nq, p.seq_kv = c.nk, p.head_dim = 64;
  p.scale = 1.0 / 8.0, p.mask = c.mask;
  sage_quant_config cfg = ref::quant_preset(c.variant);
  if (c.sm90_form) cfg.softmax_block_k = 128, cfg.exp2_poly_every = 4;
  const int64_t D = p.head_dim;
  Fp16Tensor q = test::random_tensor(rng, 2, 4, c.nq, D), k = test::random_tensor(rng, 2, 2, c.nk, D),
             v = test::random_tensor(rng, 2, 2, c.nk, D);
  std::uniform_int_distribution<int64_t> dq(0, c.nq - 1), dk(0, c.nk - 1), dd(0, D - 1);
  // One of each kind, in different heads so that each head shows one effect, plus a second bad
  // element in the same head as the first key (the first bad key decides).
  const std::vector<Poison> bad = {
      {'q', 0, 1, dq(rng), dd(rng), kNaN16}, {'q', 1, 3, dq(rng), dd(rng), kInf16},
      {'k', 0, 0, dk(rng), dd(rng), kNaN16}, {'k', 0, 0, dk(rng), dd(rng), kNegInf16},
      {'v', 1, 0, dk(rng), dd(rng), kInf16}, {'v', 1, 1, dk(rng), dd(rng), kNaN16}};
  Fp16Tensor qz = q, kz = k, vz = v;  // the same inputs with the bad elements zeroed
  for (const Poison& x : bad) {
    Fp16Tensor& t = x.tensor == 'q' ? q : x.tensor == 'k' ? k : v;
    Fp16Tensor& z = x.tensor == 'q' ? qz : x.tensor == 'k' ? kz : vz;
    put(t, x, x.bits);
    put(z, x, 0);
  }

  std::vector<float> out(size_t(p.out_elems())), lse(size_t(p.lse_elems()));
  std::vector<float> outz(out.size()), lsez(lse.size());
  ref::attention_quant(p, cfg, q.view(), k.view(), v.view(), out.data(), lse.data());
  ref::attention_quant(p, cfg, qz.view(), kz.view(), vz.view(), outz.data(), lsez.data());
  std::vector<double> exact(out.size()), exact_lse(lse.size());
  ref::attention_exact(p, q.view(), k.view(), v.view(), exact.data(), exact_lse.data());

  int64_t marked = 0;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads_q; ++h)
      for (int64_t i = 0; i < p.seq_q; ++i) {
        const int64_t n = p.visible_keys(i), hk = h / p.group_ratio();
        bool expect = false;
        for (const Poison& x : bad) {
          if (x.b != b) continue;
          if (x.tensor == 'q') expect |= x.h == h && x.n == i;
          else expect |= x.h == hk && x.n < n;
        }
        expect &= n > 0;
        marked += expect;
        const int64_t row = (b * p.heads_q + h) * p.seq_q + i;
        bool any_nan = false, all_nan = true, exact_finite = true;
        for (int64_t d = 0; d < D; ++d) {
          const float o = out[size_t(row * D + d)];
          any_nan |= !std::isfinite(o);
          all_nan &= std::isnan(o);
          exact_finite &= std::isfinite(exact[size_t(row * D + d)]);
        }
        SCOPED_TRACE("b " + std::to_string(b) + " h " + std::to_string(h) + " row " +
                     std::to_string(i));
        if (expect) {
          ASSERT_TRUE(all_nan);
          ASSERT_TRUE(std::isnan(lse[size_t(row)]));
        } else {
          ASSERT_FALSE(any_nan);
          ASSERT_TRUE(exact_finite) << "float64 has a non-finite value in a row not marked";
          for (int64_t d = 0; d < D; ++d)
            ASSERT_EQ(test::float_bits(out[size_t(row * D + d)]),
                      test::float_bits(outz[size_t(row * D + d)]));
          ASSERT_EQ(test::float_bits(lse[size_t(row)]), test::float_bits(lsez[size_t(row)]));
        }
      }
  EXPECT_GT(marked, 0);
  // The zeroed call itself is within the usual band of float64 on the zeroed inputs.
  std::vector<double> exact_z(out.size());
  ref::attention_exact(p, qz.view(), kz.view(), vz.view(), exact_z.data(), nullptr);
  double num = 0, den = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    num += std::fabs(double(outz[i]) - exact_z[i]);
    den += std::fabs(exact_z[i]);
  }
  EXPECT_LT(num / den, c.variant == SAGE_VARIANT_SAGE2_4B ? 0.2 : 0.06);
}

INSTANTIATE_TEST_SUITE_P(
    Variants, NonFinite,
    ::testing::Values(Case{SAGE_VARIANT_SAGE2_8B, false, SAGE_MASK_NONE, 200, 300},
                      Case{SAGE_VARIANT_SAGE2_8B, false, SAGE_MASK_CAUSAL_BOTTOM_RIGHT, 300, 200},
                      Case{SAGE_VARIANT_SAGE2_8B, false, SAGE_MASK_CAUSAL_TOP_LEFT, 177, 177},
                      Case{SAGE_VARIANT_SAGE2_8B, true, SAGE_MASK_NONE, 130, 260},
                      Case{SAGE_VARIANT_SAGE2_8B, true, SAGE_MASK_CAUSAL_BOTTOM_RIGHT, 260, 150},
                      Case{SAGE_VARIANT_SAGE2_4B, false, SAGE_MASK_NONE, 200, 300},
                      Case{SAGE_VARIANT_SAGE2_4B, false, SAGE_MASK_CAUSAL_TOP_LEFT, 300, 200}));

}  // namespace
}  // namespace sage
