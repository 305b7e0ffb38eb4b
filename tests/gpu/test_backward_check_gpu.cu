// SageBwd's own normalizer and its accuracy check on the GPU, both kernel families: on the
// training input classes (ref::make_training_inputs) the verdict agrees with the emulation's, a
// refused call's gradients are all NaN and `untrusted` is 1, an accepted one matches its
// emulation and float64 (cos >= 0.999); and the stats pass's row normalizers and D, read back
// from the workspace, are the emulation's: so every row of the kernel's P sums to 1.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "bwd/params.h"
#include "common/test_util.h"
#include "gpu/gpu_test_util.h"
#include "ref/reference.h"
#include "ref/synthetic.h"
#include "sage/sage.h"

namespace {

using sage::ref::TrainingClass;

struct CheckCase {
  TrainingClass kind;
  float strength;
  int64_t Hq, Hkv, N, D;
  sage_mask mask;
  sage_dtype dtype;
};

std::string name_of(const CheckCase& c) {
  static const char* kinds[] = {"normal", "outlier_scale", "outlier_bias",
                                "sink",   "peaked",        "outlier_sink"};
  char buf[160];
  std::snprintf(buf, sizeof(buf), "%s_%g_Hq%lld_Hkv%lld_N%lld_D%lld_mask%d_%s",
                kinds[int(c.kind)], double(c.strength), (long long)c.Hq, (long long)c.Hkv,
                (long long)c.N, (long long)c.D, int(c.mask),
                c.dtype == SAGE_DTYPE_BF16 ? "bf16" : "fp16");
  return buf;
}

const sage::FloatFormat& format_of(sage_dtype t) {
  return t == SAGE_DTYPE_BF16 ? sage::kBf16 : sage::kFp16;
}

std::vector<float> decode(const std::vector<uint16_t>& x, sage_dtype t) {
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = sage::decode_float(format_of(t), x[i]);
  return out;
}

class GpuBackwardCheck : public ::testing::TestWithParam<CheckCase> {};

TEST_P(GpuBackwardCheck, VerdictNormalizerAndGradients) {
  SAGE_REQUIRE_GPU();
  const CheckCase c = GetParam();
  const uint64_t seed = sage::test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  sage::ref::TrainingSpec s;
  s.kind = c.kind;
  s.strength = c.strength;
  s.heads_q = c.Hq;
  s.heads_kv = c.Hkv;
  s.seq_q = s.seq_kv = c.N;
  s.head_dim = c.D;
  s.dtype = c.dtype;
  s.seed = seed;
  const sage::ref::TrainingInputs in = sage::ref::make_training_inputs(s);
  const sage::ref::Problem p{1, c.Hq, c.Hkv, c.N, c.N, c.D, 1.0 / std::sqrt(double(c.D)), c.mask};

  // The emulation and its verdict; float64 for the accepted case.
  std::vector<float> eq(in.q.size()), ek(in.k.size()), ev(in.k.size());
  sage::ref::BackwardCheck check;
  sage::ref::attention_backward_quant(p, sage::ref::backward_preset(), in.q_view(), in.k_view(),
                                      in.v_view(), in.d_o_view(), eq.data(), ek.data(), ev.data(),
                                      0, nullptr, &check);
  double worst = 0.0;
  for (double e : check.head_error) worst = std::max(worst, e);
  std::vector<double> o(in.q.size()), lse(size_t(p.lse_elems())), tq(in.q.size()),
      tk(in.k.size()), tv(in.k.size());
  sage::ref::attention_exact(p, in.q_view(), in.k_view(), in.v_view(), o.data(), lse.data(), 0);
  sage::ref::attention_backward_exact(p, in.q_view(), in.k_view(), in.v_view(), o.data(),
                                      lse.data(), in.d_o_view(), tq.data(), tk.data(), tv.data(),
                                      0);

  const size_t qb = in.q.size() * 2, kb = in.k.size() * 2;
  DeviceBuffer q(qb), k(kb), v(kb), d_o(qb), ob(qb), lseb(lse.size() * 4), dq(qb), dk(kb), dv(kb),
      flag(4);
  SAGE_ASSERT_CUDA(cudaMemcpy(q.ptr, in.q.data(), qb, cudaMemcpyHostToDevice));
  SAGE_ASSERT_CUDA(cudaMemcpy(k.ptr, in.k.data(), kb, cudaMemcpyHostToDevice));
  SAGE_ASSERT_CUDA(cudaMemcpy(v.ptr, in.v.data(), kb, cudaMemcpyHostToDevice));
  SAGE_ASSERT_CUDA(cudaMemcpy(d_o.ptr, in.d_o.data(), qb, cudaMemcpyHostToDevice));
  // SageBwd reads neither: garbage in them must not matter.
  SAGE_ASSERT_CUDA(cudaMemset(ob.ptr, 0x7C, qb));
  SAGE_ASSERT_CUDA(cudaMemset(lseb.ptr, 0xFF, lse.size() * 4));

  int dev = 0, major = 0, minor = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  std::vector<sage_kernel> kernels = {SAGE_KERNEL_MMA};
  if (major == 9 && minor == 0) kernels.push_back(SAGE_KERNEL_SM90);
  for (const sage_kernel kernel : kernels) {
    SCOPED_TRACE(kernel == SAGE_KERNEL_SM90 ? "kernel SM90" : "kernel MMA");
    sage_backward_args a;
    ASSERT_EQ(sage_backward_args_init(&a), SAGE_OK);
    a.q = q.ptr, a.k = k.ptr, a.v = v.ptr, a.o = ob.ptr, a.d_o = d_o.ptr;
    a.lse = static_cast<const float*>(lseb.ptr);
    a.dq = dq.ptr, a.dk = dk.ptr, a.dv = dv.ptr;
    a.batch = 1, a.heads_q = c.Hq, a.heads_kv = c.Hkv, a.seq_q = c.N, a.seq_kv = c.N;
    a.head_dim = c.D, a.dtype = c.dtype, a.mask = c.mask, a.kernel = kernel;
    a.untrusted = static_cast<int32_t*>(flag.ptr);
    size_t ws_bytes = 0;
    ASSERT_EQ(sage_backward_workspace_size(&a, &ws_bytes), SAGE_OK) << sage_last_error();
    DeviceBuffer ws(ws_bytes);
    SAGE_ASSERT_CUDA(cudaMemset(ws.ptr, 0xFF, ws_bytes));
    SAGE_ASSERT_CUDA(cudaMemset(flag.ptr, 0x55, 4));
    a.workspace = ws.ptr, a.workspace_size = ws_bytes;
    ASSERT_EQ(sage_attention_backward(&a), SAGE_OK) << sage_last_error();
    SAGE_ASSERT_CUDA(cudaDeviceSynchronize());
    int32_t untrusted = -1;
    SAGE_ASSERT_CUDA(cudaMemcpy(&untrusted, flag.ptr, 4, cudaMemcpyDeviceToHost));
    ASSERT_TRUE(untrusted == 0 || untrusted == 1) << untrusted;

    // The stats pass: L and D of every row as the emulation has them.
    const sage::bwd::Layout w = sage::bwd::make_layout(p);
    const int64_t rows = p.batch * p.heads_q * w.nq_pad;
    std::vector<float> lse2(static_cast<size_t>(rows)), delta(static_cast<size_t>(rows));
    SAGE_ASSERT_CUDA(cudaMemcpy(lse2.data(), static_cast<uint8_t*>(ws.ptr) + w.lse2, rows * 4,
                                cudaMemcpyDeviceToHost));
    SAGE_ASSERT_CUDA(cudaMemcpy(delta.data(), static_cast<uint8_t*>(ws.ptr) + w.delta, rows * 4,
                                cudaMemcpyDeviceToHost));
    double worst_l = 0.0, worst_d = 0.0, d_scale = 0.0;
    for (int64_t bh = 0; bh < p.batch * p.heads_q; ++bh)
      for (int64_t i = 0; i < p.seq_q; ++i) {
        const float want = check.lse2[size_t(bh * p.seq_q + i)];
        const float got = lse2[size_t(bh * w.nq_pad + i)];
        if (std::isinf(want)) {
          EXPECT_EQ(got, want) << "row " << i;
          continue;
        }
        worst_l = std::max(worst_l, std::fabs(double(got) - want));
        const float dw = check.delta[size_t(bh * p.seq_q + i)];
        worst_d = std::max(worst_d, std::fabs(double(delta[size_t(bh * w.nq_pad + i)]) - dw));
        d_scale = std::max(d_scale, std::fabs(double(dw)));
      }
    // |Σ_j P_ij - 1| = |2^(L_emulation - L_gpu) - 1| over the emulation's exact sum of 1.
    EXPECT_LT(worst_l * std::log(2.0), 1e-4) << "row normalizers (log2 units)";
    EXPECT_LT(worst_d, 1e-4 * (1.0 + d_scale)) << "D";

    std::vector<uint16_t> gq(in.q.size()), gk(in.k.size()), gv(in.k.size());
    SAGE_ASSERT_CUDA(cudaMemcpy(gq.data(), dq.ptr, qb, cudaMemcpyDeviceToHost));
    SAGE_ASSERT_CUDA(cudaMemcpy(gk.data(), dk.ptr, kb, cudaMemcpyDeviceToHost));
    SAGE_ASSERT_CUDA(cudaMemcpy(gv.data(), dv.ptr, kb, cudaMemcpyDeviceToHost));
    const std::vector<float> fq = decode(gq, c.dtype), fk = decode(gk, c.dtype),
                             fv = decode(gv, c.dtype);
    // The verdicts agree (away from the threshold, where the sums' order may tip it).
    const double margin = std::fabs(worst / double(SAGE_BWD_MAX_SCORE_ERROR) - 1.0);
    if (margin > 0.02) {
      EXPECT_EQ(untrusted, check.untrusted ? 1 : 0) << "emulation's estimate " << worst;
    }
    if (untrusted) {
      for (const auto* g : {&fq, &fk, &fv})
        for (float x : *g) ASSERT_TRUE(std::isnan(x)) << "a refused call's gradient";
      continue;
    }
    const std::vector<float>* gpu[] = {&fq, &fk, &fv};
    const std::vector<float>* emu[] = {&eq, &ek, &ev};
    const std::vector<double>* truth[] = {&tq, &tk, &tv};
    for (int x = 0; x < 3; ++x) {
      std::vector<double> e64(emu[x]->begin(), emu[x]->end());
      for (double& y : e64) y = sage::round_float(format_of(c.dtype), float(y), false);
      const int64_t n = int64_t(gpu[x]->size());
      const sage::ref::Metrics me = sage::ref::compare(e64.data(), gpu[x]->data(), n);
      const sage::ref::Metrics mt = sage::ref::compare(truth[x]->data(), gpu[x]->data(), n);
      const double step = c.dtype == SAGE_DTYPE_BF16 ? 1.0 / 256 : 1.0 / 2048;
      EXPECT_LT(me.rel_l1, 0.1 * step + 2e-4) << "d" << "qkv"[x] << " vs emulation";
      EXPECT_GT(mt.cos, 0.999) << "d" << "qkv"[x] << " vs float64";
      std::printf("  %s d%c: estimate %.4f; vs emulation rel-l1 %.2e; vs float64 cos %.6f\n",
                  kernel == SAGE_KERNEL_SM90 ? "sm90" : "mma", "qkv"[x], worst, me.rel_l1,
                  mt.cos);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Classes, GpuBackwardCheck,
    ::testing::Values(
        CheckCase{TrainingClass::kNormal, 1, 4, 1, 1000, 128, SAGE_MASK_CAUSAL_BOTTOM_RIGHT,
                  SAGE_DTYPE_BF16},
        CheckCase{TrainingClass::kNormal, 1, 2, 2, 777, 64, SAGE_MASK_NONE, SAGE_DTYPE_FP16},
        CheckCase{TrainingClass::kOutlierScale, 3, 4, 1, 1000, 128, SAGE_MASK_CAUSAL_BOTTOM_RIGHT,
                  SAGE_DTYPE_BF16},
        CheckCase{TrainingClass::kOutlierScale, 16, 4, 1, 1000, 128,
                  SAGE_MASK_CAUSAL_BOTTOM_RIGHT, SAGE_DTYPE_BF16},
        CheckCase{TrainingClass::kOutlierBias, 8, 2, 2, 600, 64, SAGE_MASK_NONE, SAGE_DTYPE_FP16},
        CheckCase{TrainingClass::kSink, 5, 4, 2, 900, 128, SAGE_MASK_CAUSAL_TOP_LEFT,
                  SAGE_DTYPE_FP16},
        CheckCase{TrainingClass::kPeaked, 20, 4, 1, 1000, 64, SAGE_MASK_CAUSAL_BOTTOM_RIGHT,
                  SAGE_DTYPE_BF16},
        CheckCase{TrainingClass::kOutlierSink, 10, 4, 1, 1000, 128, SAGE_MASK_NONE,
                  SAGE_DTYPE_BF16}),
    [](const ::testing::TestParamInfo<CheckCase>& info) {
      std::string n = name_of(info.param);
      for (char& ch : n)
        if (ch == '.') ch = 'p';
      return n;
    });

}  // namespace
