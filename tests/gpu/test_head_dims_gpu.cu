// Zero-padded head dims on the GPU: a head dim that is a multiple of 8 from 8 to 256 runs the
// native 64, 128 or 256 kernel with the channels past it zero.
// Here, for every kernel family this GPU has: the caller's memory past head_dim is never read
// (the channels past D of strided Q, K and V hold NaN) nor written (an output with a longer token
// stride keeps its poison there), the result is bit for bit the contiguous call's, and the plan
// reports the kernel's head dim. Accuracy of these head dims against their emulation and float64:
// GpuVsEmulation's HeadDims, WideHeadDims and HeadDims8 sweeps (test_attention_gpu.cu).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "gpu/attention_run.h"
#include "gpu/gpu_test_util.h"
#include "sage/sage.h"

namespace {

using namespace sage::gpu_test;

constexpr uint16_t kInputPoison = 0xFFFF;   // NaN in fp16 and bf16
constexpr uint16_t kOutputPoison = 0x7B7B;  // finite in both: a write shows as a changed value

// A contiguous tensor [B, H, N, D] of the case's layout copied into one whose rows hold `pitch`
// elements (the layout's contiguous strides at an inner size of pitch), the rest kInputPoison.
std::vector<uint16_t> with_pitch(const Case& c, const std::vector<uint16_t>& x, int64_t H,
                                 int64_t N, int64_t pitch, sage_strides* strides) {
  const sage_strides from = sage::ref::contiguous_strides(c.layout, H, N, c.D);
  *strides = sage::ref::contiguous_strides(c.layout, H, N, pitch);
  std::vector<uint16_t> out(size_t(c.B * H * N * pitch), kInputPoison);
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t n = 0; n < N; ++n)
        std::memcpy(&out[size_t(b * strides->batch + h * strides->head + n * strides->token)],
                    &x[size_t(b * from.batch + h * from.head + n * from.token)], size_t(c.D) * 2);
  return out;
}

struct StridedRun {
  sage_status status = SAGE_OK;
  std::string error;
  sage_plan_info plan{};
  std::vector<uint16_t> o;  // the whole output buffer (rows of out_pitch elements)
  std::vector<float> lse;
  sage_strides o_strides{};
};

// One call with Q, K, V rows of in_pitch elements (past D: NaN) and O rows of out_pitch elements
// (past D: kOutputPoison), on the kernel kc.
StridedRun run_strided(const Case& c, const Inputs& in, const KernelChoice& kc, int64_t in_pitch,
                       int64_t out_pitch) {
  StridedRun r;
  sage_strides qs{}, ks{}, vs{};
  const std::vector<uint16_t> q = with_pitch(c, in.qd, c.Hq, c.Nq, in_pitch, &qs);
  const std::vector<uint16_t> k = with_pitch(c, in.kd, c.Hkv, c.Nk, in_pitch, &ks);
  const std::vector<uint16_t> v = with_pitch(c, in.vd, c.Hkv, c.Nk, in_pitch, &vs);
  r.o_strides = sage::ref::contiguous_strides(c.layout, c.Hq, c.Nq, out_pitch);
  const size_t o_elems = size_t(c.B * c.Hq * c.Nq * out_pitch);
  const size_t lse_elems = size_t(c.B * c.Hq * c.Nq);
  DeviceBuffer dq(q.size() * 2), dk(k.size() * 2), dv(v.size() * 2), dout(o_elems * 2),
      dlse(lse_elems * 4);
  cudaMemcpy(dq.ptr, q.data(), q.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dk.ptr, k.data(), k.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dv.ptr, v.data(), v.size() * 2, cudaMemcpyHostToDevice);
  const std::vector<uint16_t> poison(o_elems, kOutputPoison);
  cudaMemcpy(dout.ptr, poison.data(), o_elems * 2, cudaMemcpyHostToDevice);
  cudaMemset(dlse.ptr, 0xFF, lse_elems * 4);
  sage_attention_args a;
  sage_attention_args_init(&a);
  a.q = dq.ptr, a.k = dk.ptr, a.v = dv.ptr, a.o = dout.ptr, a.lse = static_cast<float*>(dlse.ptr);
  a.batch = c.B, a.heads_q = c.Hq, a.heads_kv = c.Hkv, a.seq_q = c.Nq, a.seq_kv = c.Nk;
  a.head_dim = c.D, a.layout = c.layout, a.dtype = c.dtype, a.mask = c.mask;
  a.variant = c.variant;
  if (c.smooth) {  // as run_gpu
    a.variant = SAGE_VARIANT_CUSTOM;
    sage_quant_config_init(&a.quant, c.variant);
    a.quant.smooth = c.smooth;
  }
  a.q_strides = qs, a.k_strides = ks, a.v_strides = vs, a.o_strides = r.o_strides;
  a.kernel = kc.kernel;
  a.options = kc.options;
  run_args(&a, &r, o_elems, lse_elems);
  return r;
}

constexpr sage_mask kNone = SAGE_MASK_NONE, kBR = SAGE_MASK_CAUSAL_BOTTOM_RIGHT,
                    kTL = SAGE_MASK_CAUSAL_TOP_LEFT;
constexpr sage_layout kHND = SAGE_LAYOUT_HND, kNHD = SAGE_LAYOUT_NHD;
constexpr sage_dtype kF16 = SAGE_DTYPE_FP16, kBF16 = SAGE_DTYPE_BF16;
constexpr sage_variant k8 = SAGE_VARIANT_SAGE2_8B, k4 = SAGE_VARIANT_SAGE2_4B;
constexpr unsigned kSmoothQKV = SAGE_SMOOTH_Q | SAGE_SMOOTH_K | SAGE_SMOOTH_V;

// Input rows of D + 16 elements (16-byte aligned: the pre-pass's 16-byte loads and, on sm_90,
// fused Q's TMA map, whose inner extent is D and whose box is the kernel's head dim) and of D + 3
// (2-byte aligned: element loads, and the pre-pass's Q); output rows of D + 24 elements. The
// call's O and LSE must be the contiguous call's bits (the same plan: pre-pass Q where the
// strided Q cannot take fused Q), the output's elements past D untouched. Native 64, 128 and
// 256 are the control; 208 and 136 with Q smoothing check that ΔS (formed from the caller's K)
// reads only D channels. The multiples of 8 that are not of 16 (8 .. 248) end half-way through
// a 16-element piece: D = 256's V slices (136, 200, 248) are read as two pieces of 8.
TEST(GpuHeadDims, MemoryPastHeadDimIsNeitherReadNorWritten) {
  SAGE_REQUIRE_GPU();
  const std::vector<KernelChoice> kernels = kernels_of_this_gpu();
  if (kernels.empty()) GTEST_SKIP() << "no SageAttention2 kernel below sm_89";
  std::mt19937_64 rng(sage::test::fresh_seed());
  for (const Case& c : {Case{1, 4, 2, 200, 333, 32, kNone, kHND, kF16, k8, 4},
                        Case{2, 4, 1, 333, 200, 48, kBR, kNHD, kBF16, k8, 4},
                        Case{1, 6, 2, 300, 300, 80, kTL, kHND, kBF16, k8, 4},
                        Case{1, 2, 2, 129, 500, 96, kNone, kNHD, kF16, k8, 4},
                        Case{2, 2, 1, 250, 250, 112, kBR, kHND, kF16, k8, 4},
                        Case{1, 4, 2, 190, 270, 80, kNone, kNHD, kF16, k4, 4},
                        Case{1, 2, 2, 150, 150, 64, kBR, kNHD, kBF16, k8, 4},
                        Case{1, 2, 2, 150, 150, 128, kNone, kHND, kF16, k8, 4},
                        Case{1, 4, 2, 200, 333, 144, kBR, kHND, kF16, k8, 4},
                        Case{2, 2, 1, 129, 250, 192, kTL, kNHD, kBF16, k4, 4},
                        Case{1, 2, 2, 300, 300, 240, kNone, kNHD, kBF16, k8, 4},
                        Case{1, 4, 2, 257, 190, 192, kBR, kHND, kF16, k8, 4},
                        Case{2, 2, 2, 200, 333, 256, kTL, kNHD, kBF16, k8, 4},
                        Case{1, 4, 2, 190, 270, 208, kNone, kHND, kF16, k8, 4, kSmoothQKV},
                        Case{1, 2, 2, 150, 150, 256, kBR, kHND, kF16, k8, 4},
                        Case{1, 2, 2, 17, 17, 8, kNone, kHND, kF16, k8, 4},
                        Case{1, 4, 2, 200, 333, 24, kBR, kNHD, kBF16, k4, 4},
                        Case{1, 4, 2, 300, 300, 40, kNone, kHND, kF16, k8, 4},
                        Case{2, 4, 1, 333, 200, 40, kTL, kNHD, kBF16, k8, 4},
                        Case{1, 6, 2, 300, 300, 72, kBR, kHND, kBF16, k8, 4},
                        Case{1, 2, 2, 190, 270, 72, kNone, kNHD, kF16, k4, 4},
                        Case{1, 2, 2, 129, 500, 88, kNone, kHND, kF16, k8, 4, kSmoothQKV},
                        Case{2, 2, 1, 250, 250, 120, kBR, kNHD, kF16, k8, 4},
                        Case{1, 4, 2, 200, 333, 136, kNone, kHND, kF16, k8, 4},
                        Case{1, 4, 2, 190, 270, 136, kBR, kNHD, kBF16, k8, 4, kSmoothQKV},
                        Case{2, 2, 1, 129, 250, 200, kTL, kHND, kBF16, k4, 4},
                        Case{1, 2, 2, 300, 300, 248, kNone, kNHD, kBF16, k8, 4},
                        Case{1, 4, 2, 257, 190, 248, kBR, kHND, kF16, k8, 4}}) {
    SCOPED_TRACE(name(c));
    const Inputs in = draw_inputs(rng, c);
    const int64_t dk = c.D <= 64 ? 64 : c.D <= 128 ? 128 : 256;
    for (const KernelChoice& kc : kernels) {
      SCOPED_TRACE(kc.label);
      for (const int64_t in_pad : {16, 3}) {
        SCOPED_TRACE("input rows of D + " + std::to_string(in_pad));
        const int64_t out_pitch = c.D + 24;
        const StridedRun s = run_strided(c, in, kc, c.D + in_pad, out_pitch);
        if (s.status == SAGE_ERROR_UNSUPPORTED && kc.kernel == SAGE_KERNEL_SM90 &&
            (c.variant == k4 || c.smooth != 0u)) {
          continue;  // no 4-bit or Q-smoothing wgmma kernel (the sweep says so too)
        }
        ASSERT_EQ(s.status, SAGE_OK) << s.error;
        EXPECT_EQ(s.plan.kernel_head_dim, dk);
        if (kc.kernel == SAGE_KERNEL_SM90) {
          EXPECT_EQ(s.plan.fused_q, in_pad == 16 && kc.options == 0u);
        }
        // The contiguous call with the same plan (pre-pass Q where the strided call has it).
        KernelChoice same = kc;
        if (kc.kernel == SAGE_KERNEL_SM90 && !s.plan.fused_q) same.options |= SAGE_OPTION_PREPASS_Q;
        const GpuRun ref = run_gpu(c, in.qd, in.kd, in.vd, same);
        ASSERT_EQ(ref.status, SAGE_OK) << ref.error;
        ASSERT_EQ(std::memcmp(&ref.plan.emulation, &s.plan.emulation, sizeof(sage_quant_config)),
                  0);
        const sage_strides cs = sage::ref::contiguous_strides(c.layout, c.Hq, c.Nq, c.D);
        size_t differ = 0, written = 0;
        for (int64_t b = 0; b < c.B; ++b)
          for (int64_t h = 0; h < c.Hq; ++h)
            for (int64_t i = 0; i < c.Nq; ++i) {
              const uint16_t* got = &s.o[size_t(b * s.o_strides.batch + h * s.o_strides.head +
                                                i * s.o_strides.token)];
              const uint16_t* want = &ref.o[size_t(b * cs.batch + h * cs.head + i * cs.token)];
              for (int64_t d = 0; d < c.D; ++d) differ += got[d] != want[d];
              for (int64_t d = c.D; d < out_pitch; ++d) written += got[d] != kOutputPoison;
            }
        EXPECT_EQ(written, 0u) << "output elements past head_dim written";
        EXPECT_EQ(differ, 0u) << "O differs from the contiguous call's in " << differ;
        EXPECT_EQ(std::memcmp(s.lse.data(), ref.lse.data(), s.lse.size() * 4), 0)
            << "LSE differs from the contiguous call's";
        size_t nan = 0;
        for (uint16_t x : ref.o) nan += (x & 0x7FFFu) > (c.dtype == kF16 ? 0x7C00u : 0x7F80u);
        EXPECT_EQ(nan, 0u) << "NaN in O: an input channel past head_dim was read";
      }
    }
  }
}

// The backward has no padded head dims yet: refused naming head_dim and the backward's set.
TEST(GpuHeadDims, BackwardRefusesPaddedHeadDimsClearly) {
  SAGE_REQUIRE_GPU();
  if (compute_capability() < 89) GTEST_SKIP() << "the library's kernels need sm_89";
  const int64_t B = 1, H = 2, N = 64, D = 80;
  DeviceBuffer t(size_t(B * H * N * D) * 2 * 9), lse(size_t(B * H * N) * 4);
  uint16_t* base = static_cast<uint16_t*>(t.ptr);
  const size_t n = size_t(B * H * N * D);
  sage_backward_args a;
  sage_backward_args_init(&a);
  a.q = base, a.k = base + n, a.v = base + 2 * n, a.o = base + 3 * n, a.d_o = base + 4 * n;
  a.dq = base + 5 * n, a.dk = base + 6 * n, a.dv = base + 7 * n;
  a.lse = static_cast<float*>(lse.ptr);
  a.batch = B, a.heads_q = H, a.heads_kv = H, a.seq_q = N, a.seq_kv = N, a.head_dim = D;
  size_t ws = 0;
  EXPECT_EQ(sage_backward_workspace_size(&a, &ws), SAGE_ERROR_UNSUPPORTED);
  const std::string msg = sage_last_error();
  EXPECT_NE(msg.find("head_dim = 80"), std::string::npos) << msg;
  EXPECT_NE(msg.find("64, 128"), std::string::npos) << msg;
}

}  // namespace
