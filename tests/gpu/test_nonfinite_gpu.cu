// Non-finite inputs on the GPU (docs/c-api.md, "Non-finite inputs"), each kernel family the GPU has, 8-
// and 4-bit, SageAttention3's FP4, both layouts, every mask, native and zero-padded head dims:
// an Inf/NaN in Q row i makes row i NaN, one in K or V row j makes every row that sees key j NaN
// (output and LSE), and every other row is bit-identical to the same call with the bad elements
// set to zero; float64 is non-finite only in marked rows.
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

struct Bad {
  char tensor;  // 'q', 'k' or 'v'
  int64_t b, h, n, d;
  int kind;  // 0 NaN, 1 +Inf, 2 -Inf
};

uint16_t special_bits(sage_dtype dtype, int kind) {
  if (dtype == SAGE_DTYPE_BF16) return kind == 0 ? 0x7FC0 : kind == 1 ? 0x7F80 : 0xFF80;
  return kind == 0 ? 0x7E00 : kind == 1 ? 0x7C00 : 0xFC00;
}

class GpuNonFinite : public ::testing::TestWithParam<Case> {};

TEST_P(GpuNonFinite, MarksExactlyTheRowsItReaches) {
  SAGE_REQUIRE_GPU();
  const Case c = GetParam();
  // SageAttention3's FP4 runs its own kernel (never forced); the others, each family there is.
  const std::vector<KernelChoice> kernels =
      c.variant == SAGE_VARIANT_SAGE3_FP4 && compute_capability() >= 89
          ? std::vector<KernelChoice>{{SAGE_KERNEL_AUTO, 0u, "fp4"}}
          : kernels_of_this_gpu();
  if (kernels.empty()) GTEST_SKIP() << "no SageAttention2 kernel below sm_89";
  const uint64_t seed = sage::test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " " + name(c));
  std::mt19937_64 rng(seed);
  Inputs in = draw_inputs(rng, c);
  std::uniform_int_distribution<int64_t> dq(0, c.Nq - 1), dk(0, c.Nk - 1), dd(0, c.D - 1);
  std::uniform_int_distribution<int64_t> db(0, c.B - 1), dhq(0, c.Hq - 1), dhk(0, c.Hkv - 1);
  std::vector<Bad> bad;
  for (int i = 0; i < 2; ++i) bad.push_back({'q', db(rng), dhq(rng), dq(rng), dd(rng), i});
  for (int i = 0; i < 2; ++i) bad.push_back({'k', db(rng), dhk(rng), dk(rng), dd(rng), 2 * i});
  for (int i = 0; i < 2; ++i) bad.push_back({'v', db(rng), dhk(rng), dk(rng), dd(rng), 1 + i});
  std::vector<uint16_t> qz = in.qd, kz = in.kd, vz = in.vd;  // bad elements set to zero
  for (const Bad& x : bad) {
    const Fp16Tensor& t = x.tensor == 'q' ? in.q : x.tensor == 'k' ? in.k : in.v;
    const size_t at =
        size_t(x.b * t.strides.batch + x.h * t.strides.head + x.n * t.strides.token + x.d);
    (x.tensor == 'q' ? in.qd : x.tensor == 'k' ? in.kd : in.vd)[at] = special_bits(c.dtype, x.kind);
    (x.tensor == 'q' ? qz : x.tensor == 'k' ? kz : vz)[at] = 0;
  }
  const sage::ref::Problem p{c.B, c.Hq, c.Hkv, c.Nq, c.Nk, c.D, 1.0 / std::sqrt(double(c.D)),
                             c.mask};
  std::vector<double> exact(size_t(p.out_elems()));
  sage::ref::attention_exact(p, {in.qd.data(), c.dtype, in.q.strides},
                             {in.kd.data(), c.dtype, in.k.strides},
                             {in.vd.data(), c.dtype, in.v.strides}, exact.data(), nullptr);
  const sage_strides os = sage::ref::contiguous_strides(c.layout, c.Hq, c.Nq, c.D);

  for (const KernelChoice& kc : kernels) {
    SCOPED_TRACE(kc.label);
    const GpuRun g = run_gpu(c, in.qd, in.kd, in.vd, kc);
    if (g.status == SAGE_ERROR_UNSUPPORTED && kc.kernel == SAGE_KERNEL_SM90 &&
        c.variant == SAGE_VARIANT_SAGE2_4B)
      continue;  // the wgmma kernel has no 4-bit Q·K
    ASSERT_EQ(g.status, SAGE_OK) << g.error;
    const GpuRun z = run_gpu(c, qz, kz, vz, kc);
    ASSERT_EQ(z.status, SAGE_OK) << z.error;
    int64_t marked = 0;
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t h = 0; h < c.Hq; ++h)
        for (int64_t i = 0; i < c.Nq; ++i) {
          const int64_t n = p.visible_keys(i), hk = h / p.group_ratio();
          bool expect = false;
          for (const Bad& x : bad)
            if (x.b == b) expect |= x.tensor == 'q' ? (x.h == h && x.n == i) : (x.h == hk && x.n < n);
          expect &= n > 0;
          marked += expect;
          const int64_t row = (b * c.Hq + h) * c.Nq + i;
          bool exact_finite = true;
          for (int64_t d = 0; d < c.D; ++d) exact_finite &= std::isfinite(exact[size_t(row * c.D + d)]);
          SCOPED_TRACE("b " + std::to_string(b) + " h " + std::to_string(h) + " row " +
                       std::to_string(i));
          ASSERT_TRUE(expect || exact_finite) << "float64 is non-finite in a row not marked";
          for (int64_t d = 0; d < c.D; ++d) {
            const size_t at = size_t(b * os.batch + h * os.head + i * os.token + d);
            const uint16_t mag = g.o[at] & 0x7FFFu;
            const bool is_nan = mag > (c.dtype == SAGE_DTYPE_BF16 ? 0x7F80u : 0x7C00u);
            if (expect)
              ASSERT_TRUE(is_nan) << "channel " << d;
            else
              ASSERT_EQ(g.o[at], z.o[at]) << "channel " << d;
          }
          if (expect)
            ASSERT_TRUE(std::isnan(g.lse[size_t(row)]));
          else
            ASSERT_EQ(sage::test::float_bits(g.lse[size_t(row)]),
                      sage::test::float_bits(z.lse[size_t(row)]));
        }
    EXPECT_GT(marked, 0);
    std::printf("    %-15s %s: %lld rows marked\n", kc.label, name(c).c_str(), (long long)marked);
  }
}

constexpr sage_mask kNone = SAGE_MASK_NONE, kBR = SAGE_MASK_CAUSAL_BOTTOM_RIGHT,
                    kTL = SAGE_MASK_CAUSAL_TOP_LEFT;
constexpr sage_layout kHND = SAGE_LAYOUT_HND, kNHD = SAGE_LAYOUT_NHD;
constexpr sage_dtype kF16 = SAGE_DTYPE_FP16, kBF16 = SAGE_DTYPE_BF16;
constexpr sage_variant k8 = SAGE_VARIANT_SAGE2_8B, k4 = SAGE_VARIANT_SAGE2_4B;

INSTANTIATE_TEST_SUITE_P(
    Sweep, GpuNonFinite,
    ::testing::Values(Case{2, 4, 2, 300, 500, 128, kNone, kHND, kF16, k8, 4},
                      Case{2, 4, 2, 500, 300, 128, kBR, kNHD, kBF16, k8, 4},
                      Case{1, 4, 4, 700, 700, 64, kTL, kHND, kF16, k8, 0},
                      Case{1, 4, 1, 1500, 1500, 64, kBR, kNHD, kF16, k8, 4},  // MQA, 3 chunks+
                      Case{1, 2, 2, 2100, 2100, 128, kTL, kHND, kBF16, k8, 4},  // three launches
                      Case{2, 4, 2, 300, 500, 64, kNone, kNHD, kF16, k4, 4},
                      Case{1, 4, 2, 500, 300, 128, kTL, kHND, kBF16, k4, 4},
                      Case{1, 2, 2, 2100, 2100, 64, kBR, kNHD, kF16, k4, 4},
                      Case{1, 4, 2, 500, 300, 128, kNone, kHND, kF16, SAGE_VARIANT_SAGE3_FP4, 4},
                      Case{1, 4, 2, 300, 500, 64, kTL, kNHD, kBF16, SAGE_VARIANT_SAGE3_FP4, 4},
                      // Zero-padded head dims (the bad element is among the caller's channels).
                      Case{2, 4, 2, 300, 500, 80, kNone, kNHD, kBF16, k8, 4},
                      Case{1, 4, 2, 500, 300, 48, kTL, kHND, kF16, k8, 4},
                      Case{1, 4, 2, 700, 700, 112, kBR, kHND, kF16, k4, 4},
                      // D = 256 (the wgmma kernel's 64-key blocks on sm_90) and 192 padded to it.
                      Case{2, 4, 2, 300, 500, 256, kNone, kHND, kF16, k8, 4},
                      Case{1, 4, 2, 500, 300, 256, kBR, kNHD, kBF16, k8, 4},
                      Case{1, 4, 1, 700, 700, 192, kTL, kHND, kBF16, k8, 4}),
    [](const ::testing::TestParamInfo<Case>& info) { return name(info.param); });

}  // namespace
