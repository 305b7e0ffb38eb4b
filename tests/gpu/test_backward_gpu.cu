// SageBwd on the GPU through sage_attention_backward(): against the CPU emulation of the same
// configuration (tight) and float64 gradients (cos >= 0.999 where the bar is stated), over head
// dims, dtypes, layouts, GQA/MQA, both causal alignments, Nq != Nk, sizes that are not multiples
// of the 64-row blocks, poisoned outputs; the deterministic mode (bit-identical runs); NaN
// propagation; the GPU-specific refusals.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "gpu/gpu_test_util.h"
#include "sage/sage.h"

namespace {

struct BwdCase {
  int64_t B, Hq, Hkv, Nq, Nk, D;
  sage_mask mask;
  sage_layout layout;
  sage_dtype dtype;
  float bias = 0.0f;  // channel bias (a per-channel offset of this spread): Q at half, K and V full
};

std::string case_name(const BwdCase& c) {
  char buf[160];
  std::snprintf(buf, sizeof(buf), "B%lld_Hq%lld_Hkv%lld_Nq%lld_Nk%lld_D%lld_mask%d_%s_%s",
                (long long)c.B, (long long)c.Hq, (long long)c.Hkv, (long long)c.Nq, (long long)c.Nk,
                (long long)c.D, int(c.mask), c.layout == SAGE_LAYOUT_HND ? "HND" : "NHD",
                c.dtype == SAGE_DTYPE_BF16 ? "bf16" : "fp16");
  std::string name = buf;
  if (c.bias != 0.0f) name += "_bias" + std::to_string(int(c.bias));
  return name;
}

// Random N(0,1) values stored in dtype, strided as `layout`, plus a per-channel offset drawn from
// N(0, bias²) (channels are the contiguous last dimension of either layout).
std::vector<uint16_t> random_bits(std::mt19937_64& rng, size_t n, sage_dtype dtype, int64_t D = 1,
                                  float bias = 0.0f) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> offset(static_cast<size_t>(D));
  for (float& o : offset) o = bias * normal(rng);
  std::vector<uint16_t> x(n);
  const sage::FloatFormat& f = dtype == SAGE_DTYPE_BF16 ? sage::kBf16 : sage::kFp16;
  for (size_t i = 0; i < n; ++i)
    x[i] = uint16_t(sage::encode_float(f, normal(rng) + offset[i % size_t(D)], false));
  return x;
}

float bits_to_float(uint16_t b, sage_dtype dtype) {
  return sage::decode_float(dtype == SAGE_DTYPE_BF16 ? sage::kBf16 : sage::kFp16, b);
}

// Everything of one problem on the host: inputs, the float64 forward (O in dtype, LSE), dO.
struct Problem {
  BwdCase c;
  sage::ref::Problem p;
  sage_strides qs, ks;
  std::vector<uint16_t> q, k, v, o, d_o;
  std::vector<float> lse, d_lse;  // d_lse: a gradient reaching the LSE too
  std::vector<double> o64, lse64;

  Problem(const BwdCase& cs, std::mt19937_64& rng) : c(cs) {
    p.batch = c.B, p.heads_q = c.Hq, p.heads_kv = c.Hkv, p.seq_q = c.Nq, p.seq_kv = c.Nk;
    p.head_dim = c.D, p.scale = 1.0 / std::sqrt(double(c.D)), p.mask = c.mask;
    qs = sage::ref::contiguous_strides(c.layout, c.Hq, c.Nq, c.D);
    ks = sage::ref::contiguous_strides(c.layout, c.Hkv, c.Nk, c.D);
    const size_t qn = size_t(c.B * c.Hq * c.Nq * c.D), kn = size_t(c.B * c.Hkv * c.Nk * c.D);
    q = random_bits(rng, qn, c.dtype, c.D, 0.5f * c.bias);
    k = random_bits(rng, kn, c.dtype, c.D, c.bias);
    v = random_bits(rng, kn, c.dtype, c.D, c.bias);
    d_o = random_bits(rng, qn, c.dtype);
    o64.resize(qn);
    lse64.resize(size_t(c.B * c.Hq * c.Nq));
    sage::ref::attention_exact(p, view(q, qs), view(k, ks), view(v, ks), o64.data(), lse64.data(),
                               0);
    // O in dtype and in the layout; the LSE as the forward returns it (contiguous fp32).
    o.resize(qn);
    const sage::FloatFormat& f = c.dtype == SAGE_DTYPE_BF16 ? sage::kBf16 : sage::kFp16;
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t h = 0; h < c.Hq; ++h)
        for (int64_t i = 0; i < c.Nq; ++i)
          for (int64_t d = 0; d < c.D; ++d)
            o[size_t(b * qs.batch + h * qs.head + i * qs.token + d)] = uint16_t(
                sage::encode_float(f, o64[size_t(((b * c.Hq + h) * c.Nq + i) * c.D + d)], false));
    lse.assign(lse64.begin(), lse64.end());
    std::uniform_real_distribution<float> u(-0.5f, 0.5f);
    d_lse.resize(lse.size());
    for (float& x : d_lse) x = u(rng);
  }

  sage::ref::TensorView view(const std::vector<uint16_t>& x, sage_strides s) const {
    return {x.data(), c.dtype, s};
  }
};

struct GpuGrads {
  sage_status status = SAGE_OK;
  std::string error;
  std::vector<uint16_t> dq, dk, dv;  // in the layout
};

// One call's device buffers; run() may be called again on the same buffers and workspace.
// out_pad > 0: dq, dk and dv are rows of D + out_pad elements (strided views, rows not 16-byte
// aligned for an odd pad); run() hands them back in the inputs' layout and checks that the pad
// elements kept their poison.
class GpuCall {
 public:
  GpuCall(const Problem& pr, uint32_t options, sage_kernel kernel = SAGE_KERNEL_AUTO,
          const sage_backward_config* config = nullptr, int64_t out_pad = 0)
      : pr_(pr),
        pad_(out_pad),
        qb_(pr.q.size() * 2),
        kb_(pr.k.size() * 2),
        qo_(qb_ / size_t(pr.c.D) * size_t(pr.c.D + out_pad)),
        ko_(kb_ / size_t(pr.c.D) * size_t(pr.c.D + out_pad)),
        q_(qb_),
        k_(kb_),
        v_(kb_),
        o_(qb_),
        d_o_(qb_),
        lse_(pr.lse.size() * 4),
        dlse_(pr.lse.size() * 4),
        dq_(qo_),
        dk_(ko_),
        dv_(ko_) {
    const BwdCase& c = pr.c;
    cudaMemcpy(dlse_.ptr, pr.d_lse.data(), pr.lse.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(q_.ptr, pr.q.data(), qb_, cudaMemcpyHostToDevice);
    cudaMemcpy(k_.ptr, pr.k.data(), kb_, cudaMemcpyHostToDevice);
    cudaMemcpy(v_.ptr, pr.v.data(), kb_, cudaMemcpyHostToDevice);
    cudaMemcpy(o_.ptr, pr.o.data(), qb_, cudaMemcpyHostToDevice);
    cudaMemcpy(d_o_.ptr, pr.d_o.data(), qb_, cudaMemcpyHostToDevice);
    cudaMemcpy(lse_.ptr, pr.lse.data(), pr.lse.size() * 4, cudaMemcpyHostToDevice);
    sage_backward_args_init(&a_);
    a_.q = q_.ptr, a_.k = k_.ptr, a_.v = v_.ptr, a_.o = o_.ptr, a_.d_o = d_o_.ptr;
    a_.lse = static_cast<const float*>(lse_.ptr);
    a_.d_lse = static_cast<const float*>(dlse_.ptr);
    a_.dq = dq_.ptr, a_.dk = dk_.ptr, a_.dv = dv_.ptr;
    a_.batch = c.B, a_.heads_q = c.Hq, a_.heads_kv = c.Hkv, a_.seq_q = c.Nq, a_.seq_kv = c.Nk;
    a_.head_dim = c.D, a_.layout = c.layout, a_.dtype = c.dtype, a_.mask = c.mask;
    a_.options = options;
    a_.kernel = kernel;
    if (out_pad > 0) {
      oqs_ = sage::ref::contiguous_strides(c.layout, c.Hq, c.Nq, c.D + out_pad);
      oks_ = sage::ref::contiguous_strides(c.layout, c.Hkv, c.Nk, c.D + out_pad);
      a_.dq_strides = oqs_, a_.dk_strides = oks_, a_.dv_strides = oks_;
    }
    if (config) a_.variant = SAGE_VARIANT_CUSTOM, a_.config = *config;
    size_t ws_bytes = 0;
    status_ = sage_backward_workspace_size(&a_, &ws_bytes);
    if (status_ != SAGE_OK) {
      error_ = sage_last_error();
      return;
    }
    ws_ = std::make_unique<DeviceBuffer>(ws_bytes);
    cudaMemset(ws_->ptr, 0xFF, ws_bytes);  // the pre-pass must write everything it reads
    a_.workspace = ws_->ptr, a_.workspace_size = ws_bytes;
  }

  // Outputs poisoned (NaN in fp16 and bf16), the backward, the outputs copied back. The
  // workspace is as the last run left it: the pre-pass must reset what the main kernel reads.
  GpuGrads run() {
    GpuGrads r;
    r.status = status_;
    r.error = error_;
    if (r.status != SAGE_OK) return r;
    cudaMemset(dq_.ptr, 0xFF, qo_);
    cudaMemset(dk_.ptr, 0xFF, ko_);
    cudaMemset(dv_.ptr, 0xFF, ko_);
    r.status = sage_attention_backward(&a_);
    if (r.status != SAGE_OK) {
      r.error = sage_last_error();
      return r;
    }
    if (cudaDeviceSynchronize() != cudaSuccess) {
      r.status = SAGE_ERROR_CUDA;
      r.error = cudaGetErrorString(cudaGetLastError());
      return r;
    }
    r.dq.resize(qo_ / 2);
    r.dk.resize(ko_ / 2);
    r.dv.resize(ko_ / 2);
    cudaMemcpy(r.dq.data(), dq_.ptr, qo_, cudaMemcpyDeviceToHost);
    cudaMemcpy(r.dk.data(), dk_.ptr, ko_, cudaMemcpyDeviceToHost);
    cudaMemcpy(r.dv.data(), dv_.ptr, ko_, cudaMemcpyDeviceToHost);
    if (pad_ > 0) {
      const BwdCase& c = pr_.c;
      r.dq = unpad(r.dq, oqs_, pr_.qs, c.Hq, c.Nq);
      r.dk = unpad(r.dk, oks_, pr_.ks, c.Hkv, c.Nk);
      r.dv = unpad(r.dv, oks_, pr_.ks, c.Hkv, c.Nk);
    }
    return r;
  }

 private:
  // x (strides `from`, rows of D + pad_) in the inputs' layout (strides `to`); a pad element that
  // lost its poison fails the test.
  std::vector<uint16_t> unpad(const std::vector<uint16_t>& x, sage_strides from, sage_strides to,
                              int64_t H, int64_t N) const {
    const int64_t D = pr_.c.D;
    std::vector<uint16_t> out(size_t(pr_.c.B * H * N * D));
    for (int64_t b = 0; b < pr_.c.B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t n = 0; n < N; ++n) {
          const int64_t row = b * from.batch + h * from.head + n * from.token;
          for (int64_t d = 0; d < D; ++d)
            out[size_t(b * to.batch + h * to.head + n * to.token + d)] = x[size_t(row + d)];
          for (int64_t d = D; d < D + pad_; ++d)
            EXPECT_EQ(x[size_t(row + d)], 0xFFFF) << "a pad element was written";
        }
    return out;
  }

  const Problem& pr_;
  int64_t pad_;
  sage_strides oqs_{}, oks_{};
  size_t qb_, kb_, qo_, ko_;
  DeviceBuffer q_, k_, v_, o_, d_o_, lse_, dlse_, dq_, dk_, dv_;
  std::unique_ptr<DeviceBuffer> ws_;
  sage_backward_args a_{};
  sage_status status_ = SAGE_OK;
  std::string error_;
};

GpuGrads run_backward(const Problem& pr, uint32_t options = 0,
                      sage_kernel kernel = SAGE_KERNEL_AUTO) {
  return GpuCall(pr, options, kernel).run();
}

// The kernel families this GPU runs: mma.sync everywhere, the wgmma kernel on sm_90.
std::vector<sage_kernel> kernels_here() {
  int dev = 0, major = 0, minor = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (major == 9 && minor == 0) return {SAGE_KERNEL_MMA, SAGE_KERNEL_SM90};
  return {SAGE_KERNEL_MMA};
}
const char* kernel_name(sage_kernel k) {
  return k == SAGE_KERNEL_SM90 ? "kernel SM90" : "kernel MMA";
}

// A [B, H, N, D] tensor in `layout` as contiguous HND floats.
std::vector<float> to_hnd(const std::vector<uint16_t>& x, sage_strides s, int64_t B, int64_t H,
                          int64_t N, int64_t D, sage_dtype dtype) {
  std::vector<float> out(size_t(B * H * N * D));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t d = 0; d < D; ++d)
          out[size_t(((b * H + h) * N + n) * D + d)] =
              bits_to_float(x[size_t(b * s.batch + h * s.head + n * s.token + d)], dtype);
  return out;
}

// The GPU's gradients against the emulation of the same configuration (tight) and float64.
void expect_close_to_references(const Problem& pr, const GpuGrads& g,
                                const sage_backward_config* config = nullptr) {
  const BwdCase& c = pr.c;
  const std::vector<float> dq = to_hnd(g.dq, pr.qs, c.B, c.Hq, c.Nq, c.D, c.dtype);
  const std::vector<float> dk = to_hnd(g.dk, pr.ks, c.B, c.Hkv, c.Nk, c.D, c.dtype);
  const std::vector<float> dv = to_hnd(g.dv, pr.ks, c.B, c.Hkv, c.Nk, c.D, c.dtype);
  // The emulation of the same configuration, rounded to dtype as the GPU stores.
  std::vector<float> eq(dq.size()), ek(dk.size()), ev(dv.size());
  // A forward-normalized config reads the forward's O (the dtype's, as the GPU is given it) and
  // LSE.
  const std::vector<float> o = to_hnd(pr.o, pr.qs, c.B, c.Hq, c.Nq, c.D, c.dtype);
  sage::ref::attention_backward_quant(pr.p, config ? *config : sage::ref::backward_preset(),
                                      pr.view(pr.q, pr.qs), pr.view(pr.k, pr.ks),
                                      pr.view(pr.v, pr.ks), pr.view(pr.d_o, pr.qs), eq.data(),
                                      ek.data(), ev.data(), 0, pr.d_lse.data(), nullptr, 0,
                                      o.data(), pr.lse.data());
  const sage::FloatFormat& f = c.dtype == SAGE_DTYPE_BF16 ? sage::kBf16 : sage::kFp16;
  for (auto* x : {&eq, &ek, &ev})
    for (float& y : *x) y = sage::round_float(f, y, false);
  // float64 truth.
  std::vector<double> tq(dq.size()), tk(dk.size()), tv(dv.size());
  const std::vector<double> dlse64(pr.d_lse.begin(), pr.d_lse.end());
  sage::ref::attention_backward_exact(
      pr.p, pr.view(pr.q, pr.qs), pr.view(pr.k, pr.ks), pr.view(pr.v, pr.ks), pr.o64.data(),
      pr.lse64.data(), pr.view(pr.d_o, pr.qs), tq.data(), tk.data(), tv.data(), 0, dlse64.data());
  const char* names[] = {"dq", "dk", "dv"};
  const std::vector<float>* gpu[] = {&dq, &dk, &dv};
  const std::vector<float>* emu[] = {&eq, &ek, &ev};
  const std::vector<double>* truth[] = {&tq, &tk, &tv};
  for (int x = 0; x < 3; ++x) {
    SCOPED_TRACE(names[x]);
    const int64_t n = int64_t(gpu[x]->size());
    std::vector<double> e64(emu[x]->begin(), emu[x]->end());
    const sage::ref::Metrics me = sage::ref::compare(e64.data(), gpu[x]->data(), n);
    const sage::ref::Metrics mt = sage::ref::compare(truth[x]->data(), gpu[x]->data(), n);
    const sage::ref::Metrics et = sage::ref::compare(truth[x]->data(), emu[x]->data(), n);
    // Against its emulation: what differs is fp32 summation order (the MMAs, dQ's sum over key
    // blocks, the stats pass's L' and D), ex2.approx against exp2f, and the rare INT8 rounding of
    // P or dS those flip, each one element of one tile; then each side is rounded to dtype.
    // Bound: a tenth of a dtype step on average. K smoothing's k̄ is no such difference: the
    // emulation sums it in the pre-pass's own order, because an ulp of k̄ can flip one element
    // of K^ and so move a whole key's scores on every query row (ref/backward.cpp), far past
    // this bound when that key draws much of the attention.
    const double step = c.dtype == SAGE_DTYPE_BF16 ? 1.0 / 256 : 1.0 / 2048;
    EXPECT_LT(me.rel_l1, 0.1 * step + 2e-4) << "GPU vs emulation";
    EXPECT_GT(me.cos, 0.99999) << "GPU vs emulation";
    // Against float64: the emulation's own accuracy, within a hair.
    EXPECT_LT(mt.rel_l1, et.rel_l1 * 1.05 + 1e-4) << "GPU vs float64";
    if (c.Nq >= 64 && c.Nk >= 64) {
      EXPECT_GT(mt.cos, 0.999) << "GPU vs float64";
    }
    std::printf(
        "  %s: vs emulation cos %.7f rel-l1 %.2e | vs float64 cos %.6f rel-l1 %.4f (emulation "
        "%.4f)\n",
        names[x], me.cos, me.rel_l1, mt.cos, mt.rel_l1, et.rel_l1);
  }
}

class GpuBackward : public ::testing::TestWithParam<BwdCase> {};

TEST_P(GpuBackward, MatchesItsEmulationAndFloat64) {
  SAGE_REQUIRE_GPU();
  const BwdCase c = GetParam();
  const uint64_t seed = sage::test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const Problem pr(c, rng);
  for (const sage_kernel kernel : kernels_here()) {
    SCOPED_TRACE(kernel_name(kernel));
    const GpuGrads g = run_backward(pr, 0, kernel);
    ASSERT_EQ(g.status, SAGE_OK) << g.error;
    expect_close_to_references(pr, g);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuBackward,
    ::testing::Values(
        BwdCase{1, 2, 2, 1, 1, 64, SAGE_MASK_NONE, SAGE_LAYOUT_HND, SAGE_DTYPE_FP16},
        BwdCase{1, 2, 1, 17, 17, 128, SAGE_MASK_CAUSAL_TOP_LEFT, SAGE_LAYOUT_HND, SAGE_DTYPE_BF16},
        BwdCase{2, 4, 2, 1000, 1000, 64, SAGE_MASK_CAUSAL_BOTTOM_RIGHT, SAGE_LAYOUT_NHD,
                SAGE_DTYPE_FP16},
        BwdCase{1, 4, 1, 300, 700, 128, SAGE_MASK_CAUSAL_BOTTOM_RIGHT, SAGE_LAYOUT_HND,
                SAGE_DTYPE_BF16},
        BwdCase{1, 2, 2, 700, 300, 64, SAGE_MASK_CAUSAL_BOTTOM_RIGHT, SAGE_LAYOUT_HND,
                SAGE_DTYPE_FP16},
        BwdCase{1, 3, 3, 333, 333, 128, SAGE_MASK_CAUSAL_TOP_LEFT, SAGE_LAYOUT_NHD,
                SAGE_DTYPE_FP16},
        BwdCase{1, 2, 1, 4097, 4097, 128, SAGE_MASK_NONE, SAGE_LAYOUT_HND, SAGE_DTYPE_BF16},
        // Channel-bias inputs at N = 4k, D = 128 (issue 18's second accuracy bar).
        BwdCase{1, 2, 1, 4096, 4096, 128, SAGE_MASK_NONE, SAGE_LAYOUT_HND, SAGE_DTYPE_FP16, 4.0f}),
    [](const ::testing::TestParamInfo<BwdCase>& info) { return case_name(info.param); });

// SAGE_BWD_OPTION_DETERMINISTIC: two runs on the same buffers and workspace (outputs poisoned
// before each) give the same bits, and the result meets the bounds above. The second run finds
// the first's dQ sums and turn counters in the workspace.
class GpuBackwardDeterministic : public ::testing::TestWithParam<BwdCase> {};

TEST_P(GpuBackwardDeterministic, BitIdenticalRunsAndMatchesItsEmulation) {
  SAGE_REQUIRE_GPU();
  const BwdCase c = GetParam();
  const uint64_t seed = sage::test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const Problem pr(c, rng);
  for (const sage_kernel kernel : kernels_here()) {
    SCOPED_TRACE(kernel_name(kernel));
    GpuCall call(pr, SAGE_BWD_OPTION_DETERMINISTIC, kernel);
    const GpuGrads first = call.run();
    ASSERT_EQ(first.status, SAGE_OK) << first.error;
    const GpuGrads second = call.run();
    ASSERT_EQ(second.status, SAGE_OK) << second.error;
    EXPECT_TRUE(first.dq == second.dq) << "dq differs between runs";
    EXPECT_TRUE(first.dk == second.dk) << "dk differs between runs";
    EXPECT_TRUE(first.dv == second.dv) << "dv differs between runs";
    expect_close_to_references(pr, first);
  }
}

// Odd sizes, GQA, both causal alignments with Nq < Nk and Nq > Nk (where key block 0's first
// query block is not 0), no mask (every key block adds to every tile); the last case has more
// CTAs (512) than fit on the GPU at once; the Nq130 ones are the sanitizer's (scripts/gpu-check).
INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuBackwardDeterministic,
    ::testing::Values(
        BwdCase{1, 2, 1, 130, 200, 64, SAGE_MASK_CAUSAL_BOTTOM_RIGHT, SAGE_LAYOUT_HND,
                SAGE_DTYPE_FP16},
        BwdCase{1, 4, 2, 130, 200, 128, SAGE_MASK_NONE, SAGE_LAYOUT_NHD, SAGE_DTYPE_BF16},
        BwdCase{2, 4, 2, 1000, 1000, 64, SAGE_MASK_CAUSAL_BOTTOM_RIGHT, SAGE_LAYOUT_NHD,
                SAGE_DTYPE_FP16},
        BwdCase{1, 3, 3, 333, 333, 128, SAGE_MASK_CAUSAL_TOP_LEFT, SAGE_LAYOUT_HND,
                SAGE_DTYPE_BF16},
        BwdCase{1, 4, 2, 300, 700, 128, SAGE_MASK_CAUSAL_BOTTOM_RIGHT, SAGE_LAYOUT_HND,
                SAGE_DTYPE_BF16},
        BwdCase{1, 2, 2, 700, 300, 64, SAGE_MASK_CAUSAL_BOTTOM_RIGHT, SAGE_LAYOUT_HND,
                SAGE_DTYPE_FP16},
        BwdCase{1, 4, 2, 1000, 333, 128, SAGE_MASK_CAUSAL_TOP_LEFT, SAGE_LAYOUT_NHD,
                SAGE_DTYPE_FP16},
        BwdCase{1, 4, 2, 333, 1000, 64, SAGE_MASK_NONE, SAGE_LAYOUT_HND, SAGE_DTYPE_BF16},
        BwdCase{4, 8, 8, 1000, 1000, 64, SAGE_MASK_NONE, SAGE_LAYOUT_HND, SAGE_DTYPE_FP16}),
    [](const ::testing::TestParamInfo<BwdCase>& info) { return case_name(info.param); });

// The forward-normalized 16-bit backward (config.normalizer SAGE_BWD_NORM_FORWARD, every product
// in the dtype; sm_90's bwd/fn kernel): P from the forward's LSE, D from its O. Held to its
// emulation and to float64 as the preset is, over the shapes above: 128-key CTAs with keys past
// Nk, GQA, both causal alignments with Nq != Nk, a gradient on the LSE, outputs poisoned.
sage_backward_config forward_normalized_16() {
  sage_backward_config c = sage::ref::backward_preset();
  c.int8 = 0;
  c.smooth = 0;
  c.normalizer = SAGE_BWD_NORM_FORWARD;
  return c;
}

class GpuBackwardForwardNormalized : public ::testing::TestWithParam<BwdCase> {};

TEST_P(GpuBackwardForwardNormalized, MatchesItsEmulationAndFloat64) {
  SAGE_REQUIRE_GPU();
  if (kernels_here().size() < 2) GTEST_SKIP() << "the forward-normalized backward needs sm_90";
  const BwdCase c = GetParam();
  const uint64_t seed = sage::test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const Problem pr(c, rng);
  const sage_backward_config config = forward_normalized_16();
  GpuCall call(pr, 0, SAGE_KERNEL_AUTO, &config);
  const GpuGrads g = call.run();
  ASSERT_EQ(g.status, SAGE_OK) << g.error;
  expect_close_to_references(pr, g, &config);
  const GpuGrads again = call.run();  // the workspace as the first run left it
  ASSERT_EQ(again.status, SAGE_OK) << again.error;
  expect_close_to_references(pr, again, &config);
}

// Outputs whose rows are not 16-byte aligned (views with rows of D + 1 elements): the kernel
// writes dK and dV as pairs from its registers there instead of 16-byte pieces through shared
// memory, and touches no pad element.
TEST(GpuBackwardForwardNormalizedStrided, OutputRowsOffTheSixteenByteGrid) {
  SAGE_REQUIRE_GPU();
  if (kernels_here().size() < 2) GTEST_SKIP() << "the forward-normalized backward needs sm_90";
  const uint64_t seed = sage::test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const sage_backward_config config = forward_normalized_16();
  for (const BwdCase& c :
       {BwdCase{1, 4, 2, 200, 300, 128, SAGE_MASK_CAUSAL_BOTTOM_RIGHT, SAGE_LAYOUT_HND,
                SAGE_DTYPE_BF16},
        BwdCase{2, 2, 2, 130, 150, 64, SAGE_MASK_NONE, SAGE_LAYOUT_NHD, SAGE_DTYPE_FP16}}) {
    SCOPED_TRACE(case_name(c));
    const Problem pr(c, rng);
    const GpuGrads g = GpuCall(pr, 0, SAGE_KERNEL_AUTO, &config, /*out_pad=*/1).run();
    ASSERT_EQ(g.status, SAGE_OK) << g.error;
    expect_close_to_references(pr, g, &config);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuBackwardForwardNormalized,
    ::testing::Values(
        BwdCase{1, 2, 2, 1, 1, 64, SAGE_MASK_NONE, SAGE_LAYOUT_HND, SAGE_DTYPE_FP16},
        BwdCase{1, 2, 1, 17, 17, 128, SAGE_MASK_CAUSAL_TOP_LEFT, SAGE_LAYOUT_HND, SAGE_DTYPE_BF16},
        BwdCase{1, 2, 1, 130, 200, 64, SAGE_MASK_CAUSAL_BOTTOM_RIGHT, SAGE_LAYOUT_HND,
                SAGE_DTYPE_FP16},
        BwdCase{1, 4, 2, 130, 200, 128, SAGE_MASK_NONE, SAGE_LAYOUT_NHD, SAGE_DTYPE_BF16},
        BwdCase{2, 4, 2, 1000, 1000, 64, SAGE_MASK_CAUSAL_BOTTOM_RIGHT, SAGE_LAYOUT_NHD,
                SAGE_DTYPE_FP16},
        BwdCase{1, 4, 1, 300, 700, 128, SAGE_MASK_CAUSAL_BOTTOM_RIGHT, SAGE_LAYOUT_HND,
                SAGE_DTYPE_BF16},
        BwdCase{1, 2, 2, 700, 300, 64, SAGE_MASK_CAUSAL_BOTTOM_RIGHT, SAGE_LAYOUT_HND,
                SAGE_DTYPE_FP16},
        BwdCase{1, 3, 3, 333, 333, 128, SAGE_MASK_CAUSAL_TOP_LEFT, SAGE_LAYOUT_NHD,
                SAGE_DTYPE_FP16},
        BwdCase{1, 4, 2, 1000, 333, 128, SAGE_MASK_CAUSAL_TOP_LEFT, SAGE_LAYOUT_NHD,
                SAGE_DTYPE_FP16},
        BwdCase{1, 2, 1, 4097, 4097, 128, SAGE_MASK_NONE, SAGE_LAYOUT_HND, SAGE_DTYPE_BF16},
        BwdCase{1, 2, 1, 4096, 4096, 128, SAGE_MASK_CAUSAL_TOP_LEFT, SAGE_LAYOUT_HND,
                SAGE_DTYPE_FP16, 4.0f}),
    [](const ::testing::TestParamInfo<BwdCase>& info) { return case_name(info.param); });

TEST(GpuBackwardErrors, NanPropagatesAndRefusalsAreClear) {
  SAGE_REQUIRE_GPU();
  std::mt19937_64 rng(7);
  Problem pr(BwdCase{1, 2, 2, 100, 100, 64, SAGE_MASK_NONE, SAGE_LAYOUT_HND, SAGE_DTYPE_FP16}, rng);
  pr.q[size_t(50 * 64 + 3)] = 0x7E00;  // NaN in q, head 0
  const GpuGrads g = run_backward(pr);
  ASSERT_EQ(g.status, SAGE_OK) << g.error;
  auto has_nan = [](const std::vector<uint16_t>& x) {
    for (uint16_t b : x)
      if ((b & 0x7C00) == 0x7C00 && (b & 0x3FF)) return true;
    return false;
  };
  EXPECT_TRUE(has_nan(g.dq));
  EXPECT_TRUE(has_nan(g.dk));
  const GpuGrads det = run_backward(pr, SAGE_BWD_OPTION_DETERMINISTIC);
  ASSERT_EQ(det.status, SAGE_OK) << det.error;
  EXPECT_TRUE(has_nan(det.dq));
  EXPECT_TRUE(has_nan(det.dk));
  if (kernels_here().size() == 2) {  // the forward-normalized kernel (sm_90) hides no NaN either
    const sage_backward_config config = forward_normalized_16();
    const GpuGrads fn = GpuCall(pr, 0, SAGE_KERNEL_AUTO, &config).run();
    ASSERT_EQ(fn.status, SAGE_OK) << fn.error;
    EXPECT_TRUE(has_nan(fn.dq));
    EXPECT_TRUE(has_nan(fn.dk));
  }
  const GpuGrads bad = run_backward(pr, SAGE_BWD_OPTION_DETERMINISTIC | 4u);
  EXPECT_EQ(bad.status, SAGE_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(bad.error.find("options = 0x5"), std::string::npos) << bad.error;
}

}  // namespace
