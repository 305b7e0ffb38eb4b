// SageAttention3's FP4 attention on the GPU (src/fp4: NVFP4 on fp16 tensor cores, variant
// SAGE3_FP4) against the CPU emulation of the same configuration (tight) and float64 (a band):
// head dims, dtypes, layouts, GQA, masks, sizes off the blocks, and the non-finite rule.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gpu/attention_run.h"
#include "gpu/gpu_test_util.h"
#include "ref/reference.h"

namespace {

using namespace sage::gpu_test;

class GpuFp4 : public ::testing::TestWithParam<Case> {};

// The bound against the emulation. The kernel takes every step of the emulation with the same
// float operations and the reference's own codecs; what differs is the tensor cores' fp32 sums
// of Q^·K^ (per 64 channels) and P^·V^ (per 64 keys), which the emulation sums exactly, the
// order of a row's float sum of P~, and exp2 (double, rounded, vs the host's exp2f within half
// an ulp). Those move a score or P~ by ~1e-7 relative, which flips an E2M1 rounding of P^ (or
// E4M3 of a run scale) only within ~1e-7 of a rounding boundary: rarely, but one flip moves a
// P^ by up to a third of its value. A row sees few such flips, so rel-L1 stays ~1e-5 or below;
// bound 3e-4 (a flip concentrated on a small row shows in max-abs, bounded by a tenth of V's
// range). The LSE: the same maxima, row sums within ~1e-6: 1e-5·(1 + |LSE|).
TEST_P(GpuFp4, MatchesItsEmulationAndFloat64) {
  SAGE_REQUIRE_GPU();
  if (compute_capability() < 89) GTEST_SKIP() << "the library's kernels need sm_89+";
  const Case c = GetParam();
  const uint64_t seed = sage::test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " " + name(c));
  std::mt19937_64 rng(seed);
  const Inputs in = draw_inputs(rng, c);
  const GpuRun g = run_gpu(c, in.qd, in.kd, in.vd);
  ASSERT_EQ(g.status, SAGE_OK) << g.error;
  ASSERT_EQ(g.plan.kernel, SAGE_KERNEL_FP4);

  const sage::ref::Problem p{c.B, c.Hq, c.Hkv, c.Nq, c.Nk, c.D, 1.0 / std::sqrt(double(c.D)),
                             c.mask};
  const sage::ref::TensorView qv{in.qd.data(), c.dtype, in.q.strides},
      kv{in.kd.data(), c.dtype, in.k.strides}, vv{in.vd.data(), c.dtype, in.v.strides};
  std::vector<float> emu(size_t(p.out_elems())), emu_lse(size_t(p.lse_elems()));
  sage::ref::attention_quant(p, g.plan.emulation, qv, kv, vv, emu.data(), emu_lse.data());
  std::vector<double> exact(emu.size());
  sage::ref::attention_exact(p, qv, kv, vv, exact.data(), nullptr);

  const sage_strides os = sage::ref::contiguous_strides(c.layout, c.Hq, c.Nq, c.D);
  const sage::FloatFormat& fmt = c.dtype == SAGE_DTYPE_BF16 ? sage::kBf16 : sage::kFp16;
  std::vector<float> got(emu.size());
  std::vector<double> want(emu.size());
  double vmax = 0;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.Hq; ++h)
      for (int64_t i = 0; i < c.Nq; ++i)
        for (int64_t d = 0; d < c.D; ++d) {
          const size_t at = size_t(((b * c.Hq + h) * c.Nq + i) * c.D + d);
          got[at] = sage::decode_float(fmt, g.o[size_t(b * os.batch + h * os.head + i * os.token + d)]);
          ASSERT_TRUE(std::isfinite(got[at])) << "output " << at << " not written or not finite";
          want[at] = c.dtype == SAGE_DTYPE_BF16 ? sage::round_bf16(emu[at]) : sage::round_fp16(emu[at]);
          vmax = std::max(vmax, std::fabs(want[at]));
        }
  const sage::ref::Metrics vs_emu = sage::ref::compare(want.data(), got.data(), p.out_elems());
  const sage::ref::Metrics vs_exact = sage::ref::compare(exact.data(), got.data(), p.out_elems());
  size_t differ = 0;
  for (size_t i = 0; i < want.size(); ++i) differ += want[i] != double(got[i]);
  EXPECT_LE(vs_emu.rel_l1, 3e-4);
  EXPECT_LE(vs_emu.max_abs, 0.1 * vmax + 1e-3);
  // FP4 against float64 (the band, not the check): cos ~0.982 on unbiased N(0,1) inputs (as
  // 4-bit, measured on an H200), higher with channel bias.
  EXPECT_GT(vs_exact.cos, c.bias == 0 ? 0.97 : 0.99);
  double lse_worst = 0;
  for (size_t i = 0; i < emu_lse.size(); ++i) {
    if (std::isinf(emu_lse[i])) {
      EXPECT_EQ(g.lse[i], emu_lse[i]) << "lse " << i;
      continue;
    }
    const double diff = std::fabs(double(g.lse[i]) - double(emu_lse[i]));
    lse_worst = std::max(lse_worst, diff / (1 + std::fabs(double(emu_lse[i]))));
    ASSERT_LE(diff, 1e-5 * (1 + std::fabs(double(emu_lse[i])))) << "lse " << i;
  }
  std::printf("    fp4 %s: vs emulation rel-L1 %.2e max %.2e differ %.3f%% lse %.1e | vs float64 "
              "cos %.6f rel-L1 %.5f\n",
              name(c).c_str(), vs_emu.rel_l1, vs_emu.max_abs,
              100.0 * double(differ) / double(want.size()), lse_worst, vs_exact.cos,
              vs_exact.rel_l1);
}

constexpr sage_mask kNone = SAGE_MASK_NONE, kBR = SAGE_MASK_CAUSAL_BOTTOM_RIGHT,
                    kTL = SAGE_MASK_CAUSAL_TOP_LEFT;
constexpr sage_layout kHND = SAGE_LAYOUT_HND, kNHD = SAGE_LAYOUT_NHD;
constexpr sage_dtype kF16 = SAGE_DTYPE_FP16, kBF16 = SAGE_DTYPE_BF16;
constexpr sage_variant kFp4 = SAGE_VARIANT_SAGE3_FP4;

INSTANTIATE_TEST_SUITE_P(
    Sweep, GpuFp4,
    ::testing::Values(Case{1, 2, 2, 1, 1, 128, kNone, kHND, kF16, kFp4, 0},
                      Case{1, 2, 2, 17, 17, 64, kNone, kHND, kF16, kFp4, 4},
                      Case{2, 4, 2, 300, 500, 128, kNone, kNHD, kBF16, kFp4, 4},
                      Case{1, 4, 1, 1000, 1000, 128, kBR, kHND, kF16, kFp4, 8},
                      Case{1, 4, 2, 777, 600, 64, kTL, kNHD, kBF16, kFp4, 4},
                      Case{1, 2, 2, 300, 77, 128, kBR, kHND, kF16, kFp4, 4},
                      Case{1, 2, 2, 2049, 2049, 64, kNone, kHND, kF16, kFp4, 0}),
    [](const ::testing::TestParamInfo<Case>& info) { return name(info.param); });

}  // namespace
