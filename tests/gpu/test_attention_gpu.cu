// The SageAttention2 kernels through the C API, each kernel family the GPU has (mma.sync on
// sm_89+, the wgmma kernel on sm_90 with fused or pre-pass Q) against the CPU emulation of what
// the call runs (sage_attention_plan(...).emulation, tight) and float64 attention (accuracy
// bands): head dims (native and zero-padded), dtypes, layouts, sizes that are not multiples of
// the blocks, Nq != Nk, GQA/MQA, both causal alignments, LSE, poisoned outputs, determinism, the
// wgmma accumulator model (a diagnostic table), and the GPU-specific argument errors.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "api/backend.h"
#include "common/test_util.h"
#include "gpu/attention_run.h"
#include "gpu/gpu_test_util.h"
#include "sage/sage.h"

namespace {

using namespace sage::gpu_test;
using sage::test::Fp16Tensor;

// The CPU side of a case: views of the dtype-rounded inputs, the problem, float64 attention, and
// the emulations run so far (one per distinct config: the two sm90 Q paths usually share one).
struct CpuSide {
  sage::ref::TensorView qv, kv, vv;
  sage::ref::Problem p;
  std::vector<double> exact;
  double v_spread = 0;  // max |V - channel mean| over heads and channels (the smoothed V)
  struct Emulation {
    sage_quant_config cfg;
    std::vector<float> o, lse;
  };
  std::vector<Emulation> emulations;

  // Per (batch, head, row): the row's largest float64 weight (max_weights), on first use.
  const std::vector<double>& max_weight() {
    if (w_max.empty()) w_max = max_weights(p, qv, kv);
    return w_max;
  }
  std::vector<double> w_max;

  CpuSide(const Case& c, const Inputs& in, double scale)
      : qv{in.qd.data(), c.dtype, in.q.strides},
        kv{in.kd.data(), c.dtype, in.k.strides},
        vv{in.vd.data(), c.dtype, in.v.strides},
        p{c.B, c.Hq, c.Hkv, c.Nq, c.Nk, c.D, scale, c.mask} {
    exact.resize(size_t(p.out_elems()));
    sage::ref::attention_exact(p, qv, kv, vv, exact.data(), nullptr);
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t h = 0; h < c.Hkv; ++h) {
        const std::vector<float> x = sage::ref::load_matrix(vv, b, h, c.Nk, c.D);
        for (int64_t d = 0; d < c.D; ++d) {
          double mean = 0;
          for (int64_t j = 0; j < c.Nk; ++j) mean += x[size_t(j * c.D + d)];
          mean /= double(c.Nk);
          for (int64_t j = 0; j < c.Nk; ++j)
            v_spread = std::max(v_spread, std::fabs(x[size_t(j * c.D + d)] - mean));
        }
      }
  }
  const Emulation& emulate(const sage_quant_config& cfg) {
    for (const Emulation& e : emulations)
      if (std::memcmp(&e.cfg, &cfg, sizeof cfg) == 0) return e;
    Emulation e{cfg, std::vector<float>(size_t(p.out_elems())),
                std::vector<float>(size_t(p.lse_elems()))};
    sage::ref::attention_quant(p, cfg, qv, kv, vv, e.o.data(), e.lse.data());
    emulations.push_back(std::move(e));
    return emulations.back();
  }
};

std::string describe(const sage_quant_config& e) {
  char buf[200];
  std::snprintf(buf, sizeof(buf), "tile %d k %d/%d %s/%d poly %d", e.block_q, e.block_k,
                e.softmax_block_k, e.pv_accum == SAGE_PV_ACCUM_ALIGNED ? "aligned"
                                   : e.pv_accum == SAGE_PV_ACCUM_FP32  ? "fp32"
                                                                       : "fp22",
                e.accum_mantissa_bits, e.exp2_poly_every);
  std::string d = buf;
  if (e.split_tiles > 0)
    d += " split " + std::to_string(e.split_tiles) + "/" + std::to_string(e.split_ctas);
  return d;
}

// The GPU output of a case as floats [B, Hq, Nq, D]; false (with a failure) on an unwritten or
// non-finite element.
bool output_floats(const Case& c, const GpuRun& g, std::vector<float>* got) {
  const sage_strides os = sage::ref::contiguous_strides(c.layout, c.Hq, c.Nq, c.D);
  const sage::FloatFormat& fmt = c.dtype == SAGE_DTYPE_BF16 ? sage::kBf16 : sage::kFp16;
  got->resize(size_t(c.B * c.Hq * c.Nq * c.D));
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.Hq; ++h)
      for (int64_t i = 0; i < c.Nq; ++i)
        for (int64_t d = 0; d < c.D; ++d) {
          const size_t at = size_t(((b * c.Hq + h) * c.Nq + i) * c.D + d);
          (*got)[at] =
              sage::decode_float(fmt, g.o[size_t(b * os.batch + h * os.head + i * os.token + d)]);
          if (!std::isfinite((*got)[at])) {
            ADD_FAILURE() << "output (" << b << "," << h << "," << i << "," << d
                          << ") not written or not finite";
            return false;
          }
        }
  return true;
}

// Where the largest difference sits, for the failure message and the printed line.
std::string worst_at(const Case& c, const std::vector<double>& want, const std::vector<float>& got) {
  size_t at = 0;
  double worst = -1;
  for (size_t i = 0; i < want.size(); ++i)
    if (std::fabs(want[i] - got[i]) > worst) worst = std::fabs(want[i] - got[i]), at = i;
  const int64_t d = int64_t(at) % c.D, row = int64_t(at) / c.D;
  char buf[160];
  std::snprintf(buf, sizeof(buf), "(bh %lld, row %lld, ch %lld: emu %.6g gpu %.6g)",
                (long long)(row / c.Nq), (long long)(row % c.Nq), (long long)d, want[at],
                double(got[at]));
  return buf;
}

class GpuVsEmulation : public ::testing::TestWithParam<Case> {};

TEST_P(GpuVsEmulation, EachKernelMatchesItsEmulationAndFloat64) {
  SAGE_REQUIRE_GPU();
  const std::vector<KernelChoice> kernels = kernels_of_this_gpu();
  if (kernels.empty()) GTEST_SKIP() << "no SageAttention2 kernel below sm_89";
  const Case c = GetParam();
  const uint64_t seed = sage::test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const Inputs in = draw_inputs(rng, c);
  CpuSide cpu(c, in, 1.0 / std::sqrt(double(c.D)));

  for (const KernelChoice& kc : kernels) {
    SCOPED_TRACE(kc.label);
    const GpuRun g = run_gpu(c, in.qd, in.kd, in.vd, kc, 0.0f, c.kv_shift);
    if (g.status == SAGE_ERROR_UNSUPPORTED && kc.kernel == SAGE_KERNEL_SM90 &&
        (c.variant == SAGE_VARIANT_SAGE2_4B || (c.smooth & SAGE_SMOOTH_Q))) {
      std::printf("    %-15s %s: not run (UNSUPPORTED as expected: %s)\n", kc.label,
                  name(c).c_str(), g.error.c_str());
      continue;
    }
    ASSERT_EQ(g.status, SAGE_OK) << g.error;
    ASSERT_EQ(g.plan.kernel, kc.kernel) << "the plan runs another kernel than the one forced";
    std::vector<float> got;
    if (!output_floats(c, g, &got)) continue;

    // CPU: the emulation of what the plan says the call runs, rounded to the output dtype.
    const CpuSide::Emulation& emu = cpu.emulate(g.plan.emulation);
    const std::vector<double> want = rounded(c, emu.o);
    double out_max = 0;
    for (double x : want) out_max = std::max(out_max, std::fabs(x));
    const Bound bound = emulation_bound(c, cpu.v_spread, out_max);
    const sage::ref::Metrics vs_emu = sage::ref::compare(want.data(), got.data(), cpu.p.out_elems());
    EXPECT_LE(vs_emu.rel_l1, bound.rel_l1) << worst_at(c, want, got);
    EXPECT_LE(vs_emu.max_abs, bound.max_abs) << worst_at(c, want, got);
    size_t differ = 0;
    for (size_t i = 0; i < want.size(); ++i) differ += want[i] != double(got[i]);

    // Accuracy band vs float64 (SageAttention2-8b/4b quality on these inputs), and no worse than
    // the emulation's own error by more than the emulation bound. The emulation is taken rounded
    // to the output dtype, as the GPU's output is (bf16's 2^-9 alone is ~1e-3 rel-L1).
    const sage::ref::Metrics vs_exact = sage::ref::compare(cpu.exact.data(), got.data(), cpu.p.out_elems());
    const std::vector<float> want_f(want.begin(), want.end());  // exact: fp16/bf16 values
    const sage::ref::Metrics emu_vs_exact =
        sage::ref::compare(cpu.exact.data(), want_f.data(), cpu.p.out_elems());
    // (4-bit on unbiased N(0,1) inputs sits at cos ~0.980 with a spread of a few 1e-3 over seeds,
    // so its floor there is 0.97; with channel bias it is above 0.9998.)
    EXPECT_GT(vs_exact.cos,
              c.variant == SAGE_VARIANT_SAGE2_4B ? (c.bias == 0 ? 0.97 : 0.98) : 0.995);
    EXPECT_LE(vs_exact.rel_l1, emu_vs_exact.rel_l1 * 1.02 + bound.rel_l1);

    // LSE: same rows empty (-inf), the rest within lse_bound of the emulation (1e-5·(1 + |LSE|),
    // and on the sm90 kernel, whose l sums P^, a quarter of the row's largest weight for a P^
    // rounded the other way on an E4M3 tie; O's check above holds the sum itself).
    const bool phat_sum = kc.kernel == SAGE_KERNEL_SM90;
    const std::vector<double> no_weights;
    const std::vector<double>& w = phat_sum ? cpu.max_weight() : no_weights;
    double lse_worst = 0;
    size_t lse_past = 0;
    for (size_t i = 0; i < emu.lse.size(); ++i) {
      if (std::isinf(emu.lse[i])) {
        EXPECT_EQ(g.lse[i], emu.lse[i]) << "lse " << i;
        continue;
      }
      const double diff = std::fabs(double(g.lse[i]) - double(emu.lse[i]));
      const double tight = lse_bound(emu.lse[i], false, 0.0);
      lse_worst = std::max(lse_worst, diff / (1 + std::fabs(double(emu.lse[i]))));
      lse_past += diff > tight;
      ASSERT_LE(diff, lse_bound(emu.lse[i], phat_sum, phat_sum ? w[i] : 0.0))
          << "lse " << i << ": gpu " << g.lse[i] << " emulation " << emu.lse[i]
          << (phat_sum ? " largest weight " + std::to_string(w[i]) : std::string());
    }
    RecordProperty(std::string(kc.label) + "_rel_l1_vs_emulation", std::to_string(vs_emu.rel_l1));
    // One line per kernel: the emulation it is held to, the distance to it (rel-L1 / bound, max
    // / bound, share of elements not bit-equal after rounding both, worst LSE), and float64.
    std::printf("    %-15s %s [%s]: vs emulation rel-L1 %.2e (<= %.0e) max %.2e (<= %.2e) "
                "differ %.3f%% lse %.1e (%zu rows past 1e-5) %s | vs float64 cos %.6f rel-L1 %.5f "
                "(emulation %.5f)\n",
                kc.label, name(c).c_str(), describe(g.plan.emulation).c_str(), vs_emu.rel_l1,
                bound.rel_l1, vs_emu.max_abs, bound.max_abs, 100.0 * double(differ) / double(want.size()),
                lse_worst, lse_past, worst_at(c, want, got).c_str(), vs_exact.cos, vs_exact.rel_l1,
                emu_vs_exact.rel_l1);
  }
}

constexpr sage_mask kNone = SAGE_MASK_NONE, kBR = SAGE_MASK_CAUSAL_BOTTOM_RIGHT,
                    kTL = SAGE_MASK_CAUSAL_TOP_LEFT;
constexpr sage_layout kHND = SAGE_LAYOUT_HND, kNHD = SAGE_LAYOUT_NHD;
constexpr sage_dtype kF16 = SAGE_DTYPE_FP16, kBF16 = SAGE_DTYPE_BF16;
constexpr sage_variant k8 = SAGE_VARIANT_SAGE2_8B, k4 = SAGE_VARIANT_SAGE2_4B;
constexpr unsigned kSmoothQKV = SAGE_SMOOTH_Q | SAGE_SMOOTH_K | SAGE_SMOOTH_V;

INSTANTIATE_TEST_SUITE_P(
    Sweep, GpuVsEmulation,
    ::testing::Values(
        Case{1, 2, 2, 1, 1, 128, kNone, kHND, kF16, k8, 0},
        Case{1, 2, 2, 17, 17, 64, kNone, kHND, kF16, k8, 4},
        Case{2, 2, 2, 128, 128, 128, kNone, kNHD, kBF16, k8, 4},
        Case{1, 4, 1, 1000, 1000, 128, kBR, kHND, kF16, k8, 8},   // MQA
        Case{1, 4, 1, 1000, 1000, 64, kTL, kNHD, kBF16, k4, 8},
        Case{1, 8, 2, 4097, 4097, 128, kNone, kHND, kF16, k8, 8}, // GQA 4:1
        Case{1, 2, 2, 4097, 4097, 64, kBR, kNHD, kF16, k4, 8},
        Case{1, 2, 2, 1, 4097, 128, kBR, kHND, kBF16, k8, 4},     // decode-like Nq = 1
        Case{1, 2, 2, 300, 77, 128, kBR, kHND, kF16, k8, 4},      // Nq > Nk: empty rows
        Case{1, 2, 2, 300, 77, 64, kTL, kNHD, kF16, k4, 4},
        Case{1, 2, 1, 77, 300, 128, kTL, kHND, kBF16, k4, 8},
        Case{2, 2, 2, 129, 1000, 64, kNone, kNHD, kF16, k4, 0},
        Case{1, 4, 2, 5000, 300, 64, kNone, kNHD, kBF16, k8, 4},  // 160 tiles: > 1 per CTA
        // Flat, unbiased attention over 3000 keys (the accumulator's hardest case), both D.
        Case{1, 2, 2, 700, 3000, 128, kNone, kHND, kBF16, k8, 0},
        Case{1, 2, 2, 700, 3000, 64, kTL, kNHD, kF16, k8, 0},
        // Causal with more tiles than SMs: CTAs draw tiles from the dynamic scheduler.
        Case{2, 6, 2, 3000, 2500, 64, kBR, kNHD, kF16, k8, 4},
        Case{1, 8, 4, 2200, 2200, 128, kTL, kHND, kBF16, k8, 4},
        // D = 64 causal up to 4096 query rows: the two-consumer fused-Q kernel (the planner
        // takes three consumers for D = 64 elsewhere); Nq > Nk and a partial last tile.
        Case{2, 4, 2, 1100, 900, 64, kBR, kHND, kBF16, k8, 4},
        // Q smoothing (mma.sync: ΔS formed in the kernel from the caller's K, a key block
        // ahead), 8-bit and 4-bit: GQA/MQA, both causal alignments, lengths off the 64/128
        // blocks, K rows only 2-byte aligned (kv_shift 1: the kernel's 2-byte loads), a single
        // query row (Q - q_mean = 0: the scores are ΔS alone), many key blocks.
        Case{1, 8, 2, 1000, 1000, 128, kBR, kNHD, kF16, k8, 4, kSmoothQKV, 1},
        Case{2, 4, 2, 777, 1500, 64, kTL, kHND, kBF16, k8, 8, kSmoothQKV},
        Case{1, 2, 2, 1, 65, 128, kBR, kHND, kF16, k8, 4, kSmoothQKV},
        Case{1, 4, 1, 300, 1000, 128, kBR, kHND, kF16, k4, 4, 0, 1},
        Case{1, 6, 3, 129, 4097, 64, kNone, kNHD, kBF16, k4, 0},
        Case{1, 4, 2, 2000, 333, 128, kTL, kNHD, kBF16, k4, 8, 0, 1},
        // The split tail (sm90, non-causal; attn/sm90/split.h): the last round's tiles cut into
        // parts on other CTAs and merged (the plan's emulation config says where). D = 128 with
        // fewer tiles than SMs (48), D = 64's three-consumer tiles with GQA, D = 256's 64-key
        // blocks, key counts off the blocks (the edge block in a later part).
        Case{1, 3, 3, 2000, 2000, 128, kNone, kNHD, kBF16, k8, 4},
        Case{1, 8, 2, 2000, 3000, 64, kNone, kHND, kF16, k8, 8},
        Case{2, 5, 5, 3000, 2900, 64, kNone, kNHD, kBF16, k8, 0},
        Case{1, 4, 2, 1000, 2000, 256, kNone, kHND, kF16, k8, 4}),
    [](const ::testing::TestParamInfo<Case>& info) { return name(info.param); });

// Head dims zero-padded to the native 64 or 128 (32, 48 -> 64; 80, 96, 112 -> 128), held to the
// same emulation bound and accuracy bands as the native ones: the emulation runs at the caller's
// D (the plan's config is the native head dim's: plan.cpp says why that is exact). Both masks,
// fp16/bf16, both layouts, GQA/MQA, 8- and 4-bit, sizes that are not multiples of the blocks,
// decode-like and Nq > Nk rows, several tiles per CTA, D = 32/48 on the three-consumer sm90 tile,
// Q smoothing (8-bit cases with it; the 4-bit preset has it) with K rows 2-byte aligned.
INSTANTIATE_TEST_SUITE_P(
    HeadDims, GpuVsEmulation,
    ::testing::Values(
        Case{1, 2, 2, 17, 17, 32, kNone, kHND, kF16, k8, 4},
        Case{1, 4, 1, 1000, 1000, 32, kTL, kNHD, kBF16, k4, 8},    // MQA
        Case{1, 2, 2, 1, 4097, 48, kBR, kHND, kBF16, k8, 4},       // decode-like Nq = 1
        Case{2, 6, 2, 3000, 2500, 48, kBR, kNHD, kF16, k8, 4},     // GQA 3:1, causal, many tiles
        Case{1, 4, 2, 5000, 300, 48, kNone, kNHD, kBF16, k8, 4},   // > 1 tile per CTA
        Case{1, 8, 2, 2100, 2100, 80, kNone, kHND, kF16, k8, 8},   // GQA 4:1
        Case{1, 2, 2, 700, 3000, 80, kTL, kNHD, kBF16, k8, 0},     // flat
        Case{1, 2, 2, 300, 77, 80, kBR, kHND, kF16, k4, 4},        // Nq > Nk: empty rows
        Case{2, 2, 2, 129, 1000, 96, kNone, kNHD, kF16, k4, 0},
        Case{1, 2, 1, 77, 300, 96, kTL, kHND, kBF16, k8, 8},
        Case{2, 4, 2, 1100, 900, 96, kBR, kNHD, kBF16, k8, 4},
        Case{1, 4, 4, 1500, 1500, 112, kBR, kNHD, kF16, k8, 4},
        Case{1, 2, 2, 4097, 4097, 112, kNone, kHND, kBF16, k4, 8},
        Case{1, 2, 2, 700, 3000, 112, kNone, kHND, kF16, k8, 0},   // flat
        // Q smoothing: ΔS from the caller's K reads only its D channels (4-bit has it too).
        Case{1, 4, 2, 500, 700, 80, kBR, kNHD, kF16, k8, 4, kSmoothQKV, 1},
        Case{1, 2, 2, 300, 1000, 48, kTL, kHND, kBF16, k8, 8, kSmoothQKV}),
    [](const ::testing::TestParamInfo<Case>& info) { return name(info.param); });

// Head dims 144..256: the native D = 256 kernels (mma.sync; on sm_90 also the wgmma kernel with
// 64-key blocks, fused Q and pre-pass Q), and 144..240 zero-padded to them, held to the same
// emulation bound and accuracy bands as 64 and 128. 8- and 4-bit, fp16/bf16, both layouts, every
// mask, N = 1, 17 and lengths off the 64/128 blocks (200, 1000, 4097), Nq > Nk (empty rows),
// decode-like Nq = 1, GQA/MQA, a flat 3000-key case, several tiles per CTA, Q smoothing with K
// rows 2-byte aligned (ΔS's element loads; mma.sync only).
INSTANTIATE_TEST_SUITE_P(
    WideHeadDims, GpuVsEmulation,
    ::testing::Values(
        Case{1, 2, 2, 1, 1, 256, kNone, kHND, kF16, k8, 0},
        Case{1, 2, 2, 17, 17, 256, kBR, kNHD, kBF16, k8, 4},
        Case{1, 4, 1, 200, 200, 256, kTL, kHND, kF16, k4, 8},      // MQA
        Case{1, 8, 2, 1000, 1000, 256, kNone, kNHD, kBF16, k8, 4},  // GQA 4:1
        Case{1, 4, 2, 1000, 1000, 256, kBR, kHND, kF16, k4, 4},
        Case{1, 2, 2, 700, 3000, 256, kNone, kHND, kBF16, k8, 0},   // flat
        Case{1, 2, 2, 1, 4097, 256, kBR, kHND, kF16, k8, 4},        // decode-like Nq = 1
        Case{1, 2, 2, 300, 77, 256, kBR, kHND, kF16, k8, 4},        // Nq > Nk: empty rows
        Case{1, 4, 2, 2000, 2000, 256, kTL, kNHD, kF16, k8, 4},
        Case{1, 4, 2, 4097, 4097, 256, kBR, kHND, kBF16, k8, 4},   // GQA, causal, 4097
        Case{1, 2, 1, 4097, 1000, 256, kTL, kNHD, kF16, k8, 8},    // Nq > Nk, top-left
        Case{2, 8, 8, 1000, 1000, 256, kNone, kHND, kF16, k8, 4},  // 128 tiles: > 1 per CTA
        Case{1, 2, 2, 200, 1000, 144, kNone, kHND, kF16, k8, 4},
        Case{1, 4, 2, 1000, 1000, 160, kBR, kNHD, kBF16, k4, 8},
        Case{1, 4, 1, 1000, 1000, 192, kTL, kHND, kBF16, k8, 4},   // MQA
        Case{2, 2, 2, 17, 200, 192, kNone, kNHD, kF16, k4, 0},
        Case{1, 2, 2, 200, 200, 224, kBR, kHND, kF16, k8, 4},
        Case{1, 4, 2, 1000, 777, 240, kTL, kNHD, kBF16, k8, 8},
        Case{1, 2, 2, 1000, 1000, 240, kNone, kHND, kF16, k4, 4},
        // Q smoothing, 8-bit: ΔS from the caller's K (native, and padded: only D channels read).
        Case{1, 4, 2, 500, 700, 256, kBR, kNHD, kF16, k8, 4, kSmoothQKV, 1},
        Case{1, 2, 2, 300, 1000, 208, kTL, kHND, kBF16, k8, 8, kSmoothQKV}),
    [](const ::testing::TestParamInfo<Case>& info) { return name(info.param); });

// Head dims that are multiples of 8 but not of 16 (Stable Diffusion 1.x's 40, DiT's and PixArt's
// 72; 8 .. 56 -> 64, 72 .. 120 -> 128, 136 .. 248 -> 256), held to the same emulation bound and
// accuracy bands: a pre-pass read of 8 channels (a K chunk, a staged piece, a D = 128 V slice;
// D = 64's V slice is 4) is wholly inside or past D, while D = 256's 16-channel V slice is half
// inside at 136, 200 and 248 (read as two pieces of 8). 8- and 4-bit, fp16/bf16, both layouts,
// every mask, N = 1, 17, 300 and lengths off the blocks, Nq > Nk, decode-like Nq = 1, GQA/MQA,
// the two- and three-consumer sm90 tiles at Dk = 64, a flat case, Q smoothing, and K/V rows only
// 2-byte aligned (kv_shift 1: the pre-pass's element loads, ΔS's too). Q rows 2-byte aligned,
// and memory past head_dim: GpuHeadDims (test_head_dims_gpu.cu).
INSTANTIATE_TEST_SUITE_P(
    HeadDims8, GpuVsEmulation,
    ::testing::Values(
        Case{1, 2, 2, 1, 1, 8, kNone, kHND, kF16, k8, 0},           // N = 1, the smallest D
        Case{1, 4, 2, 17, 17, 8, kBR, kNHD, kBF16, k4, 4},          // GQA, 4-bit
        Case{1, 4, 1, 300, 300, 24, kTL, kHND, kF16, k8, 4},        // MQA
        Case{2, 2, 2, 300, 17, 24, kBR, kNHD, kBF16, k4, 8},        // Nq > Nk: empty rows
        Case{1, 8, 2, 1000, 1000, 40, kNone, kNHD, kF16, k8, 4},    // SD 1.x; GQA 4:1
        Case{1, 2, 2, 1, 300, 40, kBR, kHND, kBF16, k8, 4},         // decode-like Nq = 1
        Case{2, 4, 2, 300, 1000, 40, kTL, kHND, kF16, k4, 8, 0, 1},  // K/V 2-byte aligned
        Case{1, 4, 2, 4200, 4200, 40, kBR, kNHD, kBF16, k8, 4},     // causal, three consumers
        Case{1, 2, 2, 17, 300, 72, kNone, kHND, kF16, k8, 4},       // DiT-XL/2, PixArt
        Case{1, 8, 2, 1000, 1000, 72, kTL, kNHD, kBF16, k8, 8},     // GQA 4:1
        Case{1, 4, 4, 300, 300, 72, kNone, kNHD, kF16, k4, 4, 0, 1},  // K/V 2-byte aligned
        Case{1, 2, 2, 700, 3000, 72, kNone, kHND, kBF16, k8, 0},    // flat
        Case{1, 4, 2, 300, 300, 88, kBR, kHND, kF16, k8, 4, kSmoothQKV, 1},  // Q smoothing
        Case{1, 2, 1, 1000, 777, 120, kTL, kNHD, kBF16, k4, 8},
        Case{1, 2, 2, 17, 17, 120, kNone, kHND, kF16, k8, 4},
        Case{1, 4, 2, 1000, 1000, 136, kBR, kNHD, kF16, k8, 4},     // a V slice half inside D
        Case{1, 2, 2, 300, 300, 136, kNone, kHND, kBF16, k4, 8, 0, 1},
        Case{1, 2, 2, 300, 300, 136, kTL, kNHD, kF16, k8, 4, 0, 1},
        Case{1, 4, 1, 300, 1000, 200, kTL, kHND, kF16, k8, 4},      // MQA
        Case{1, 2, 2, 1, 17, 200, kNone, kNHD, kBF16, k8, 4, kSmoothQKV, 1},
        Case{1, 4, 2, 1000, 1000, 248, kNone, kNHD, kF16, k8, 8, 0, 1},
        Case{2, 2, 2, 300, 300, 248, kBR, kHND, kBF16, k4, 4}),
    [](const ::testing::TestParamInfo<Case>& info) { return name(info.param); });

// The wgmma E4M3 accumulator model, checked against the kernel's outputs: for flat and peaked
// attention at each head dim, the sm90 kernel's distance to emulations that differ only in the
// P·V accumulator (aligned with 12, 13 or 14 kept bits, and a true fp32). One GPU run shows
// which model the kernel follows: the right one sits at the noise floor of the sweep's bound
// (~1e-5..1e-4 rel-L1), a wrong one at 1e-3 and up on the flat rows. Only the plan's model (the
// one the sweep uses) is asserted.
TEST(GpuAttention, Sm90AccumulatorModelTable) {
  SAGE_REQUIRE_GPU();
  if (compute_capability() != 90) GTEST_SKIP() << "the wgmma kernel runs on sm_90 only";
  const uint64_t seed = sage::test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Shape {
    Case c;
    float scale;
    const char* label;
  };
  // Flat: scale 0.02 makes every key carry P~ (many products of one size in every wgmma step);
  // peaked: 3/sqrt(D) leaves a few keys per row.
  for (const Shape& s : {Shape{Case{1, 1, 1, 4096, 4096, 128, kNone, kHND, kF16, k8, 0}, 0.02f, "flat"},
                         Shape{Case{1, 1, 1, 1024, 1024, 128, kNone, kHND, kF16, k8, 0}, 0.265f, "peaked"},
                         Shape{Case{1, 1, 1, 4096, 4096, 64, kNone, kHND, kF16, k8, 0}, 0.02f, "flat"},
                         Shape{Case{1, 2, 2, 2048, 2048, 64, kBR, kHND, kF16, k8, 0}, 0.375f, "peaked"},
                         // D = 256: m64n256k32 P̃·V steps, 64-key blocks.
                         Shape{Case{1, 1, 1, 4096, 4096, 256, kNone, kHND, kF16, k8, 0}, 0.02f, "flat"},
                         Shape{Case{1, 1, 1, 1024, 1024, 256, kBR, kHND, kF16, k8, 0}, 0.1875f, "peaked"},
                         Shape{Case{1, 1, 1, 3000, 3000, 128, kBR, kHND, kBF16, k8, 4}, 0.02f,
                               "flat, biased V"}}) {
    const Case& c = s.c;
    SCOPED_TRACE(name(c) + " " + s.label);
    const Inputs in = draw_inputs(rng, c);
    const GpuRun g = run_gpu(c, in.qd, in.kd, in.vd, kSm90, s.scale);
    ASSERT_EQ(g.status, SAGE_OK) << g.error;
    std::vector<float> got;
    if (!output_floats(c, g, &got)) continue;
    CpuSide cpu(c, in, double(s.scale));
    double out_max = 0;
    const sage_quant_config chosen = g.plan.emulation;
    std::printf("    sm90 %s %s [%s] (scale %g):\n", name(c).c_str(), s.label,
                describe(chosen).c_str(), double(s.scale));
    for (int model = 0; model < 4; ++model) {
      sage_quant_config cfg = chosen;
      if (model < 3) {
        cfg.pv_accum = SAGE_PV_ACCUM_ALIGNED;
        cfg.accum_mantissa_bits = 12 + model;
      } else {
        // (At D = 256 this also leaves the sm90 softmax form, which the wgmma groups select only
        // with the aligned accumulator: ref::sm90_softmax_form; the split tail, modelled in that
        // form only, is then left out. Printed, not asserted.)
        cfg.pv_accum = SAGE_PV_ACCUM_FP32;
        if (!sage::ref::sm90_softmax_form(cfg)) cfg.split_tiles = cfg.split_ctas = 0;
      }
      const std::vector<double> want = rounded(c, cpu.emulate(cfg).o);
      for (double x : want) out_max = std::max(out_max, std::fabs(x));
      const sage::ref::Metrics m = sage::ref::compare(want.data(), got.data(), cpu.p.out_elems());
      const bool is_chosen = std::memcmp(&cfg, &chosen, sizeof cfg) == 0;
      std::printf("      accumulator %-12s rel-L1 %.3e max %.3e%s\n",
                  model < 3 ? ("aligned/" + std::to_string(cfg.accum_mantissa_bits)).c_str()
                            : "fp32",
                  m.rel_l1, m.max_abs, is_chosen ? "   <- the plan's model" : "");
      if (is_chosen) {
        const Bound bound = emulation_bound(c, cpu.v_spread, out_max);
        EXPECT_LE(m.rel_l1, bound.rel_l1) << "accumulator model " << describe(cfg);
        EXPECT_LE(m.max_abs, bound.max_abs) << "accumulator model " << describe(cfg);
      }
    }
  }
}

// On sm_90 the wgmma kernel quantizes Q itself (fused_q) unless args.options has
// SAGE_OPTION_PREPASS_Q, which sends Q through the pre-pass's quant_q: both quantize with the
// same operations, so where both run the same tile (the plan's emulation is the same config) O
// must match bit for bit; LSE within 1e-6 (the LSE shift's double sum runs in another order).
// Several tiles per CTA (the next tile's Q is quantized while the current one runs), partial last
// Q blocks, GQA, LSE.
TEST(GpuAttention, FusedQQuantizationMatchesPrepass) {
  SAGE_REQUIRE_GPU();
  if (compute_capability() != 90) GTEST_SKIP() << "the wgmma kernel runs on sm_90 only";
  std::mt19937_64 rng(sage::test::fresh_seed());
  for (const Case& c : {Case{2, 8, 2, 2100, 700, 128, kNone, kHND, kBF16, k8, 4},
                        Case{1, 6, 3, 3000, 999, 64, kNone, kNHD, kF16, k8, 4},
                        Case{1, 4, 4, 1500, 1500, 128, kBR, kNHD, kF16, k8, 4},
                        // D = 256: two 128-byte panels per Q row, in both paths; and 160 padded.
                        Case{1, 8, 2, 2100, 700, 256, kNone, kNHD, kBF16, k8, 4},
                        Case{1, 4, 4, 1000, 1000, 256, kBR, kHND, kF16, k8, 4},
                        Case{1, 4, 2, 777, 500, 160, kTL, kHND, kF16, k8, 4}}) {
    SCOPED_TRACE(name(c));
    const Inputs in = draw_inputs(rng, c);
    const GpuRun fused = run_gpu(c, in.qd, in.kd, in.vd, kSm90);
    const GpuRun prepass = run_gpu(c, in.qd, in.kd, in.vd, kSm90PrepassQ);
    ASSERT_EQ(fused.status, SAGE_OK) << fused.error;
    ASSERT_EQ(prepass.status, SAGE_OK) << prepass.error;
    EXPECT_EQ(fused.plan.fused_q, 1);
    EXPECT_EQ(prepass.plan.fused_q, 0);
    ASSERT_EQ(fused.o.size(), prepass.o.size());
    // Different tiles (three consumers with fused Q at D = 64) change which blocks take the
    // fast path only under a causal mask; the non-causal cases here must still agree bit for bit.
    if (c.mask != kNone && std::memcmp(&fused.plan.emulation, &prepass.plan.emulation,
                                       sizeof(sage_quant_config)) != 0) {
      std::printf("    %s: tiles differ (%d vs %d rows), compared through the sweep only\n",
                  name(c).c_str(), fused.plan.block_q, prepass.plan.block_q);
      continue;
    }
    size_t differ = 0;
    for (size_t i = 0; i < fused.o.size(); ++i) differ += fused.o[i] != prepass.o[i];
    EXPECT_EQ(differ, 0u) << "outputs differ in " << differ << " of " << fused.o.size();
    for (size_t i = 0; i < fused.lse.size(); ++i)
      ASSERT_NEAR(fused.lse[i], prepass.lse[i], 1e-6 * (1 + std::fabs(prepass.lse[i]))) << i;
  }
}

// Case c run with pre-pass choices a and b, each on rows 16-byte aligned and on K and V one
// element off (2-byte aligned rows: plain loads where the aligned runs use cp.async), where the
// two choices compute the same bytes by the same operations: the four O and LSE must equal a's
// bit for bit, and no poison is left in O. Returns a's and b's aligned runs.
std::pair<GpuRun, GpuRun> expect_same_bits(const Case& c, const Inputs& in, const KernelChoice& a,
                                           const KernelChoice& b) {
  GpuRun ra = run_gpu(c, in.qd, in.kd, in.vd, a);
  GpuRun rb = run_gpu(c, in.qd, in.kd, in.vd, b);
  const GpuRun a_off = run_gpu(c, in.qd, in.kd, in.vd, a, 0.0f, 1);
  const GpuRun b_off = run_gpu(c, in.qd, in.kd, in.vd, b, 0.0f, 1);
  const GpuRun* const runs[] = {&ra, &rb, &a_off, &b_off};
  for (const GpuRun* g : runs) EXPECT_EQ(g->status, SAGE_OK) << g->error;
  if (ra.status != SAGE_OK) return {std::move(ra), std::move(rb)};
  for (const GpuRun* g : runs) {
    if (g == &ra || g->status != SAGE_OK) continue;
    size_t differ = 0, lse_differ = 0;
    for (size_t i = 0; i < ra.o.size(); ++i) differ += ra.o[i] != g->o[i];
    for (size_t i = 0; i < ra.lse.size(); ++i)
      lse_differ += std::memcmp(&ra.lse[i], &g->lse[i], 4) != 0;
    EXPECT_EQ(differ, 0u) << "O differs in " << differ << " of " << ra.o.size();
    EXPECT_EQ(lse_differ, 0u) << "LSE differs in " << lse_differ << " of " << ra.lse.size();
  }
  size_t nan = 0;
  for (uint16_t x : ra.o) nan += (x & 0x7FFFu) > (c.dtype == kF16 ? 0x7C00u : 0x7F80u);
  EXPECT_EQ(nan, 0u) << "poison left in O";
  return {std::move(ra), std::move(rb)};
}

// With V smoothing (the sampled path takes none: its exact mean needs a pass over all of V),
// K/V's pre-pass as one cluster launch (a CTA per 128-token chunk, a cluster per KV head) and as
// three launches (SAGE_OPTION_PREPASS_KV_SPLIT) take the same statistics in the same order and
// quantize with the same operations, so O and LSE must agree bit for bit: for rows 16-byte
// aligned (staged by cp.async) and for K and V one element off (rows 2-byte aligned: staged by
// plain loads), from one chunk to eight (partial last chunks), fp16 and bf16, D 64 and 128,
// GQA, both masks, both kernel families and the 4-bit mma kernel; past eight chunks both run the
// three launches. Where the device holds the clusters, the split plan launches two kernels more.
TEST(GpuAttention, OneLaunchKvPrepassMatchesThreeLaunches) {
  SAGE_REQUIRE_GPU();
  const std::vector<KernelChoice> kernels = kernels_of_this_gpu();
  if (kernels.empty()) GTEST_SKIP() << "no SageAttention2 kernel below sm_89";
  std::mt19937_64 rng(sage::test::fresh_seed());
  constexpr unsigned kKV = SAGE_SMOOTH_K | SAGE_SMOOTH_V, kQKV = kKV | SAGE_SMOOTH_Q;
  for (const Case& c : {Case{1, 4, 2, 70, 1, 64, kNone, kHND, kF16, k8, 4, kKV},
                        Case{2, 4, 2, 90, 255, 128, kBR, kNHD, kBF16, k8, 4, kKV},
                        Case{1, 3, 3, 130, 1000, 128, kNone, kHND, kF16, k8, 4, kKV},
                        Case{1, 2, 1, 64, 1024, 64, kTL, kNHD, kBF16, k8, 4, kKV},
                        Case{1, 2, 2, 100, 1999, 128, kNone, kNHD, kF16, k8, 4, kKV},
                        Case{1, 2, 2, 257, 700, 128, kNone, kHND, kF16, k4, 4, kQKV}}) {
    SCOPED_TRACE(name(c));
    const Inputs in = draw_inputs(rng, c);
    for (const KernelChoice& kc : kernels) {
      if (kc.options != 0u || (kc.kernel == SAGE_KERNEL_SM90 && c.variant == k4)) continue;
      SCOPED_TRACE(kc.label);
      const KernelChoice split{kc.kernel, SAGE_OPTION_PREPASS_KV_SPLIT, "split"};
      const auto [one, three] = expect_same_bits(c, in, kc, split);
      if (compute_capability() == 90 && c.Nk <= 1024)
        EXPECT_EQ(three.plan.launches, one.plan.launches + 2);
      std::printf("    %-6s %s: launches %d (one-launch K/V plan) / %d (split)\n", kc.label,
                  name(c).c_str(), one.plan.launches, three.plan.launches);
    }
  }
}

// The three launches' K/V quantization on the staged grid (about the CTAs the SMs hold, each
// taking every grid-th 64-key block through a two-stage shared-memory pipeline; sm_90, D = 64)
// and a CTA per block (SAGE_OPTION_PREPASS_KV_BLOCKS) run the same arithmetic on the same bytes,
// so O and LSE must agree bit for bit: for rows 16-byte aligned (cp.async) and one element off
// (plain loads), lengths that end inside a block, a head of one key, GQA, both masks, fp16 and
// bf16, D 64 and the zero-padded 40 and 56, both kernel families and the 4-bit mma kernel, and
// calls of more blocks than the grid (a CTA takes several, across heads). (At D = 128 both plans
// run a CTA per block: the same comparison, which stays as a check of the option.)
TEST(GpuAttention, StagedKvQuantizationMatchesOneCtaABlock) {
  SAGE_REQUIRE_GPU();
  const std::vector<KernelChoice> kernels = kernels_of_this_gpu();
  if (kernels.empty()) GTEST_SKIP() << "no SageAttention2 kernel below sm_89";
  std::mt19937_64 rng(sage::test::fresh_seed());
  constexpr uint32_t kSplit = SAGE_OPTION_PREPASS_KV_SPLIT;
  for (const Case& c : {Case{1, 4, 2, 70, 1, 64, kNone, kHND, kF16, k8, 4},
                        Case{2, 4, 2, 90, 1089, 64, kBR, kNHD, kBF16, k8, 4},
                        Case{1, 3, 3, 130, 65, 64, kNone, kHND, kF16, k8, 4},
                        Case{2, 8, 4, 100, 7001, 64, kNone, kNHD, kF16, k8, 4},
                        Case{3, 6, 6, 64, 3000, 64, kTL, kHND, kBF16, k8, 4},
                        Case{1, 2, 2, 200, 1300, 40, kNone, kNHD, kF16, k8, 4},
                        Case{1, 2, 2, 100, 1200, 56, kBR, kHND, kF16, k8, 4},
                        Case{1, 2, 2, 257, 1500, 64, kNone, kHND, kF16, k4, 4},
                        Case{1, 2, 2, 90, 2000, 128, kNone, kHND, kBF16, k8, 4}}) {
    SCOPED_TRACE(name(c));
    const Inputs in = draw_inputs(rng, c);
    for (const KernelChoice& kc : kernels) {
      if (kc.options != 0u || (kc.kernel == SAGE_KERNEL_SM90 && c.variant == k4)) continue;
      SCOPED_TRACE(kc.label);
      const KernelChoice staged{kc.kernel, kSplit, "staged"};
      const KernelChoice blocks{kc.kernel, kSplit | SAGE_OPTION_PREPASS_KV_BLOCKS, "blocks"};
      expect_same_bits(c, in, blocks, staged);
    }
  }
}

// Without V smoothing V's E4M3 scale is bounded from K's mean sample of the tokens
// (v_sample_bound: 4x the sample's max), and where a value lies past its channel's bound the
// pre-pass re-quantizes that head's V with the channel's exact max (fix_v), as the emulation's
// rule amax = max(bound, exact max) says. Spikes of ±80 on tokens the sample skips, in a few
// channels of one head (the others stay within their bounds), must give the emulation's output
// (a value saturated at the bound would be off by far more than the bound allows) for both
// kernel families, fp16 and bf16, D 64 (the staged quantization grid) and 128, GQA, both masks,
// one spike in the last, partial block; and the same calls without spikes.
TEST(GpuAttention, VPastItsSampledBoundIsRequantized) {
  SAGE_REQUIRE_GPU();
  const std::vector<KernelChoice> kernels = kernels_of_this_gpu();
  if (kernels.empty()) GTEST_SKIP() << "no SageAttention2 kernel below sm_89";
  std::mt19937_64 rng(sage::test::fresh_seed());
  for (const Case& base : {Case{1, 4, 2, 200, 1000, 64, kNone, kHND, kF16, k8, 0},
                           Case{2, 4, 4, 130, 3001, 128, kBR, kNHD, kBF16, k8, 0},
                           Case{1, 2, 1, 64, 700, 128, kTL, kHND, kF16, k8, 2},
                           Case{2, 6, 3, 100, 2500, 64, kNone, kNHD, kBF16, k8, 0}}) {
    for (const bool spikes : {true, false}) {
      const Case c = base;
      SCOPED_TRACE(name(c) + (spikes ? " spikes" : " no spikes"));
      Inputs in = draw_inputs(rng, c);
      const int64_t stride = std::max<int64_t>(1, c.Nk / 256);  // the presets' k_mean_tokens
      ASSERT_GT(stride, 1);
      if (spikes) {
        const int64_t b = c.B - 1, h = c.Hkv - 1;
        const int64_t tokens[3] = {1, c.Nk / 2 + 1, c.Nk - 1 - (c.Nk - 1) % stride + 1};
        for (int s = 0; s < 3; ++s) {
          const int64_t n = std::min(tokens[s], c.Nk - 1);
          if (n % stride == 0) continue;
          for (const int64_t d : {int64_t(3), c.D / 2 + 1, c.D - 1}) {
            const float x = (s + d) % 2 ? 80.0f : -80.0f;
            in.v.data[size_t(b * in.v.strides.batch + h * in.v.strides.head +
                             n * in.v.strides.token + d)] =
                uint16_t(sage::encode_float(sage::kFp16, x, false));
          }
        }
        in.vd = to_dtype(in.v.data, c.dtype);
      }
      CpuSide cpu(c, in, 1.0 / std::sqrt(double(c.D)));
      for (const KernelChoice& kc : kernels) {
        SCOPED_TRACE(kc.label);
        const GpuRun g = run_gpu(c, in.qd, in.kd, in.vd, kc);
        ASSERT_EQ(g.status, SAGE_OK) << g.error;
        std::vector<float> got;
        if (!output_floats(c, g, &got)) continue;
        const CpuSide::Emulation& e = cpu.emulate(g.plan.emulation);
        const std::vector<double> want = rounded(c, e.o);
        double diff = 0, norm = 0, worst = 0, err = 0, ref = 0;
        for (size_t i = 0; i < want.size(); ++i) {
          diff += std::fabs(want[i] - got[i]), norm += std::fabs(want[i]);
          worst = std::max(worst, std::fabs(want[i] - got[i]));
          err += std::fabs(cpu.exact[i] - got[i]), ref += std::fabs(cpu.exact[i]);
        }
        double out_max = 0;
        for (double w : want) out_max = std::max(out_max, std::fabs(w));
        const Bound bound = emulation_bound(c, cpu.v_spread, out_max);
        EXPECT_LE(diff / norm, bound.rel_l1) << worst_at(c, want, got);
        EXPECT_LE(worst, bound.max_abs) << worst_at(c, want, got);
        EXPECT_LT(err / ref, 0.1);  // against float64: nothing saturated
        std::printf("    %-14s %s%s: rel-L1 vs emulation %.2e, vs float64 %.4f\n", kc.label,
                    name(c).c_str(), spikes ? " spikes" : "", diff / norm, err / ref);
      }
    }
  }
}

// The causal kernel's CTAs draw tiles from a counter in the workspace, and the split tail's
// mergers wait on flags there; the pre-pass zeroes both and the kernel resets them (the causal
// scheduler's last CTA, each merger its own flag), so the kernel alone may run again on a
// prepared workspace (the benchmark's kernel-only figure). Each relaunch must cover every tile
// and give the same bits: a counter left behind would skip tiles (NaN poison stays), a flag left
// behind would hang or merge early, and the split's merge order is fixed. Causal: a grid with more
// tiles than SMs; non-causal: a call whose tiles (48) the plan splits among the SMs.
TEST(GpuAttention, PersistentKernelRelaunchCoversEveryTile) {
  SAGE_REQUIRE_GPU();
  std::mt19937_64 rng(sage::test::fresh_seed());
  struct Shape {
    int64_t B, Hq, Hkv, N;
    sage_mask mask;
  };
  for (const Shape sh : {Shape{2, 8, 2, 2100, kBR}, Shape{1, 3, 3, 2000, kNone}}) {
    SCOPED_TRACE("mask " + std::to_string(int(sh.mask)));
    const int64_t B = sh.B, Hq = sh.Hq, Hkv = sh.Hkv, N = sh.N, D = 128;
    const Fp16Tensor q = sage::test::random_tensor(rng, B, Hq, N, D, 2.0f);
    const Fp16Tensor k = sage::test::random_tensor(rng, B, Hkv, N, D, 4.0f);
    const Fp16Tensor v = sage::test::random_tensor(rng, B, Hkv, N, D, 4.0f);
    const size_t o_bytes = size_t(B * Hq * N * D) * 2;
    DeviceBuffer dq(q.data.size() * 2), dk(k.data.size() * 2), dv(v.data.size() * 2),
        dout(o_bytes);
    SAGE_ASSERT_CUDA(cudaMemcpy(dq.ptr, q.data.data(), q.data.size() * 2, cudaMemcpyHostToDevice));
    SAGE_ASSERT_CUDA(cudaMemcpy(dk.ptr, k.data.data(), k.data.size() * 2, cudaMemcpyHostToDevice));
    SAGE_ASSERT_CUDA(cudaMemcpy(dv.ptr, v.data.data(), v.data.size() * 2, cudaMemcpyHostToDevice));
    sage_attention_args args;
    sage_attention_args_init(&args);
    args.q = dq.ptr, args.k = dk.ptr, args.v = dv.ptr, args.o = dout.ptr;
    args.batch = B, args.heads_q = Hq, args.heads_kv = Hkv, args.seq_q = N, args.seq_kv = N;
    args.head_dim = D, args.mask = sh.mask, args.variant = k8;
    sage_plan_info info{};
    info.struct_size = sizeof info;
    ASSERT_EQ(sage_attention_plan(&args, &info), SAGE_OK) << sage_last_error();
    if (sh.mask == kNone && info.kernel == SAGE_KERNEL_SM90)
      ASSERT_GT(info.emulation.split_tiles, 0) << "the plan no longer splits this call";
    size_t ws = 0;
    ASSERT_EQ(sage_attention_workspace_size(&args, &ws), SAGE_OK) << sage_last_error();
    DeviceBuffer dws(ws);
    args.workspace = dws.ptr, args.workspace_size = ws;
    sage::api::Resolved r;
    ASSERT_EQ(sage::api::validate(&args, &r), SAGE_OK) << sage_last_error();
    std::vector<std::vector<uint16_t>> outs;
    for (int call = 0; call < 3; ++call) {
      SAGE_ASSERT_CUDA(cudaMemset(dout.ptr, 0xFF, o_bytes));  // NaN
      const int stages = call == 0 ? sage::cuda::kStagePrepass | sage::cuda::kStageKernel
                                   : sage::cuda::kStageKernel;
      ASSERT_EQ(sage::cuda::attention_stages(r, args, stages), SAGE_OK) << sage_last_error();
      SAGE_ASSERT_CUDA(cudaDeviceSynchronize());
      outs.emplace_back(o_bytes / 2);
      SAGE_ASSERT_CUDA(cudaMemcpy(outs.back().data(), dout.ptr, o_bytes, cudaMemcpyDeviceToHost));
    }
    for (size_t i = 0; i < outs[0].size(); ++i)
      ASSERT_TRUE(std::isfinite(sage::decode_float(sage::kFp16, outs[0][i]))) << "output " << i;
    EXPECT_EQ(outs[0], outs[1]) << "first kernel-only relaunch";
    EXPECT_EQ(outs[0], outs[2]) << "second kernel-only relaunch";
  }
}

TEST(GpuAttention, DeterministicAndStridedOutputPaddingUntouched) {
  SAGE_REQUIRE_GPU();
  std::mt19937_64 rng(sage::test::fresh_seed());
  const Case c{1, 2, 2, 333, 333, 128, kBR, kHND, kF16, k8, 4};
  const Fp16Tensor q = sage::test::random_tensor(rng, 1, 2, 333, 128, 2.0f);
  const Fp16Tensor k = sage::test::random_tensor(rng, 1, 2, 333, 128, 4.0f);
  const Fp16Tensor v = sage::test::random_tensor(rng, 1, 2, 333, 128, 4.0f);
  const GpuRun a = run_gpu(c, q.data, k.data, v.data), b = run_gpu(c, q.data, k.data, v.data);
  ASSERT_EQ(a.status, SAGE_OK) << a.error;
  EXPECT_EQ(a.o, b.o);
  EXPECT_EQ(0, std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * 4));

  // Output with padded token stride: the padding keeps its poison.
  const int64_t stride = 128 + 64;
  DeviceBuffer dq(q.data.size() * 2), dk(k.data.size() * 2), dv(v.data.size() * 2),
      dout(size_t(2 * 333 * stride) * 2);
  cudaMemcpy(dq.ptr, q.data.data(), q.data.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dk.ptr, k.data.data(), k.data.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dv.ptr, v.data.data(), v.data.size() * 2, cudaMemcpyHostToDevice);
  cudaMemset(dout.ptr, 0x7B, size_t(2 * 333 * stride) * 2);
  sage_attention_args args;
  sage_attention_args_init(&args);
  args.q = dq.ptr, args.k = dk.ptr, args.v = dv.ptr, args.o = dout.ptr;
  args.batch = 1, args.heads_q = 2, args.heads_kv = 2, args.seq_q = 333, args.seq_kv = 333;
  args.head_dim = 128, args.mask = kBR, args.variant = k8;
  args.o_strides = {2 * 333 * stride, 333 * stride, stride};
  size_t ws = 0;
  ASSERT_EQ(sage_attention_workspace_size(&args, &ws), SAGE_OK) << sage_last_error();
  DeviceBuffer dws(ws);
  args.workspace = dws.ptr, args.workspace_size = ws;
  ASSERT_EQ(sage_attention(&args), SAGE_OK) << sage_last_error();
  std::vector<uint16_t> out(size_t(2 * 333 * stride));
  SAGE_ASSERT_CUDA(cudaMemcpy(out.data(), dout.ptr, out.size() * 2, cudaMemcpyDeviceToHost));
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t i = 0; i < 333; ++i)
      for (int64_t d = 0; d < stride; ++d) {
        const uint16_t x = out[size_t((h * 333 + i) * stride + d)];
        if (d < 128)
          ASSERT_EQ(x, a.o[size_t((h * 333 + i) * 128 + d)]) << h << " " << i << " " << d;
        else
          ASSERT_EQ(x, 0x7B7B) << "padding written at " << h << " " << i << " " << d;
      }
}

TEST(GpuAttention, ArgumentErrorsAreClear) {
  SAGE_REQUIRE_GPU();
  DeviceBuffer q(2 * 64 * 64 * 4), k(2 * 64 * 64 * 4), v(2 * 64 * 64 * 4), o(2 * 64 * 64 * 4);
  std::vector<uint16_t> host(2 * 64 * 64);
  sage_attention_args a;
  sage_attention_args_init(&a);
  a.q = q.ptr, a.k = k.ptr, a.v = v.ptr, a.o = o.ptr;
  a.batch = 1, a.heads_q = 2, a.heads_kv = 2, a.seq_q = 64, a.seq_kv = 64, a.head_dim = 64;
  size_t ws = 0;
  ASSERT_EQ(sage_attention_workspace_size(&a, &ws), SAGE_OK) << sage_last_error();
  EXPECT_GT(ws, 0u);
  // No workspace.
  EXPECT_EQ(sage_attention(&a), SAGE_ERROR_WORKSPACE_TOO_SMALL);
  EXPECT_NE(std::string(sage_last_error()).find("workspace"), std::string::npos);
  DeviceBuffer w(ws);
  a.workspace = w.ptr, a.workspace_size = ws - 1;
  EXPECT_EQ(sage_attention(&a), SAGE_ERROR_WORKSPACE_TOO_SMALL);
  a.workspace_size = ws;
  EXPECT_EQ(sage_attention(&a), SAGE_OK) << sage_last_error();
  // Unsupported combinations are refused, never half-done.
  sage_attention_args b = a;
  b.head_dim = 76;  // not a multiple of 8
  EXPECT_EQ(sage_attention(&b), SAGE_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(sage_last_error()).find("head_dim = 76"), std::string::npos);
  b.head_dim = 132, b.seq_q = b.seq_kv = 16;  // (within the buffers)
  EXPECT_EQ(sage_attention(&b), SAGE_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(sage_last_error()).find("multiples of 8 from 8 to 256"),
            std::string::npos)
      << sage_last_error();
  b = a;
  b.dtype = SAGE_DTYPE_FP32;
  EXPECT_EQ(sage_attention(&b), SAGE_ERROR_UNSUPPORTED);
  b = a;
  b.variant = SAGE_VARIANT_EXACT;
  EXPECT_EQ(sage_attention(&b), SAGE_ERROR_UNSUPPORTED);
  b = a;
  b.variant = SAGE_VARIANT_CUSTOM;
  sage_quant_config_init(&b.quant, SAGE_VARIANT_SAGE2_8B);
  b.quant.pv_format = SAGE_PV_FP8_E5M2;
  EXPECT_EQ(sage_attention(&b), SAGE_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(sage_last_error()).find("quant"), std::string::npos);
  // Per-block power-of-two V scales are valid (the CPU reference runs them) but no kernel takes
  // them.
  sage_quant_config_init(&b.quant, SAGE_VARIANT_SAGE2_8B);
  b.quant.v_scale = SAGE_V_SCALE_PER_BLOCK;
  EXPECT_EQ(sage_attention(&b), SAGE_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(sage_last_error()).find("v_scale"), std::string::npos);
  // A packed batch on the wgmma kernel needs Q quantized in the kernel: forcing SM90 with the
  // pre-pass's Q is refused, naming cu_seqlens_q, by the call and both queries (cu_seqlens stay
  // unread on the host: no synchronization).
  DeviceBuffer cu(2 * sizeof(int32_t));
  b = a;
  b.layout = SAGE_LAYOUT_NHD;
  b.cu_seqlens_q = b.cu_seqlens_k = static_cast<const int32_t*>(cu.ptr);
  b.total_q = b.total_k = 64;
  b.kernel = SAGE_KERNEL_SM90;
  b.options = SAGE_OPTION_PREPASS_Q;
  EXPECT_EQ(sage_attention(&b), SAGE_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(sage_last_error()).find("cu_seqlens_q"), std::string::npos)
      << sage_last_error();
  size_t packed_ws = 0;
  EXPECT_EQ(sage_attention_workspace_size(&b, &packed_ws), SAGE_ERROR_UNSUPPORTED);
  sage_plan_info packed_info{};
  packed_info.struct_size = sizeof packed_info;
  EXPECT_EQ(sage_attention_plan(&b, &packed_info), SAGE_ERROR_UNSUPPORTED);
  // Mixed host and device pointers.
  b = a;
  b.k = host.data();
  EXPECT_EQ(sage_attention(&b), SAGE_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(sage_last_error()).find("k ="), std::string::npos) << sage_last_error();
  // Odd output strides cannot take the kernel's paired stores.
  b = a;
  b.o_strides = {64 * 65 * 2 + 1, 64 * 65, 65};
  EXPECT_NE(sage_attention(&b), SAGE_OK);
  SAGE_ASSERT_CUDA(cudaDeviceSynchronize());
}

}  // namespace
