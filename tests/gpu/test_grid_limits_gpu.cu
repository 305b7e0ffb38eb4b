// Calls with more (batch, head) pairs than CUDA's 65535 limit on gridDim.y and gridDim.z
// (common/grid.h): windowed attention's images × windows at short sequences. The forward on each
// kernel family (AUTO: the wgmma kernel on sm_90 for 8-bit; mma.sync 8- and 4-bit), GQA, both K/V
// pre-pass paths, causal or not; the backward; the refusal past the 2^31 - 1 pairs the kernels
// take. Outputs are poisoned first and must be written everywhere; the batch entries around the
// grid's seams (pairs 0, 65534, 65535, 65536, each row of the (y, z) grid, the last) and a random
// sample are held to the CPU emulation of the same configuration run on those entries alone (an
// entry is a batch-of-one problem), with the sweep's bound (attention_run.h). GPU memory: up to
// ~2.5 GB a forward case (FP4: ~2.8 GB); ~4.7 GB the backward, whose workspace alone is ~54 KB a
// pair (those two skip where the GPU has less free). Host code; skips itself without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/grid.h"
#include "common/test_util.h"
#include "gpu/attention_run.h"
#include "gpu/gpu_test_util.h"
#include "ref/reference.h"
#include "sage/sage.h"

namespace {

using namespace sage::gpu_test;

constexpr int64_t kD = 64;

// ---- Inputs of 10^8 elements, drawn fast ------------------------------------------------------
uint64_t mix64(uint64_t x) {  // splitmix64
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A contiguous [rows, n, D] fp16 tensor (rows = B·H: HND) of values k/256, |k| <= 2048 (exact in
// fp16): per row a channel bias of |k| <= bias_k, plus the sum of four uniform signed bytes (std
// ~0.58), each element from a hash of its index (no per-element distribution object).
std::vector<uint16_t> draw(uint64_t seed, int64_t rows, int64_t n, int bias_k) {
  static const std::vector<uint16_t> fp16_of = [] {
    std::vector<uint16_t> t(4097);
    for (int k = -2048; k <= 2048; ++k)
      t[size_t(k + 2048)] = uint16_t(sage::encode_float(sage::kFp16, double(k) / 256, false));
    return t;
  }();
  std::vector<uint16_t> x(static_cast<size_t>(rows * n * kD));
  std::vector<int> bias(static_cast<size_t>(kD));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < kD; ++c)
      bias[size_t(c)] =
          int(mix64(~seed ^ uint64_t(r * kD + c)) % uint64_t(2 * bias_k + 1)) - bias_k;
    for (int64_t i = r * n * kD; i < (r + 1) * n * kD; ++i) {
      const uint64_t h = mix64(seed + uint64_t(i));
      const int k = int(int8_t(h)) + int(int8_t(h >> 8)) + int(int8_t(h >> 16)) +
                    int(int8_t(h >> 24)) + bias[size_t(i % kD)];
      x[size_t(i)] = fp16_of[size_t(k + 2048)];
    }
  }
  return x;
}

// Batch entries to check: those holding pair 0, 65534, 65535, 65536 and the last, the first and
// last pair of each row of the (y, z) grid, on both sides (B·Hq and B·Hkv), and `random` more.
std::vector<int64_t> sample_entries(int64_t B, int64_t Hq, int64_t Hkv, std::mt19937_64& rng,
                                    int random) {
  std::set<int64_t> s;
  for (const int64_t H : {Hq, Hkv}) {
    const int64_t n = B * H;
    const sage::OuterGrid g = sage::outer_grid(n);
    for (const int64_t i : {int64_t(0), int64_t(65534), int64_t(65535), int64_t(65536), n - 1})
      if (i < n) s.insert(i / H);
    for (int64_t z = 0; z < g.z; ++z) {
      s.insert(std::min(n - 1, z * g.y) / H);
      s.insert(std::min(n - 1, z * g.y + g.y - 1) / H);
    }
  }
  for (int i = 0; i < random; ++i) s.insert(int64_t(rng() % uint64_t(B)));
  return {s.begin(), s.end()};
}

// Skips the test where the GPU has less than `bytes` free (the suites may share it).
bool enough_free_memory(size_t bytes, std::string* why) {
  size_t free_bytes = 0, total = 0;
  if (cudaMemGetInfo(&free_bytes, &total) != cudaSuccess) {
    cudaGetLastError();
    *why = "cudaMemGetInfo failed";
    return false;
  }
  if (free_bytes >= bytes) return true;
  *why = "needs " + std::to_string(bytes >> 20) + " MiB of GPU memory, " +
         std::to_string(free_bytes >> 20) + " MiB free";
  return false;
}

bool finite_fp16(uint16_t x) {
  return (x & 0x7C00) != 0x7C00;
}

// ---- Forward ---------------------------------------------------------------------------------
struct Big {
  int64_t B, Hq, Hkv, N;
  sage_mask mask;
  sage_variant variant;
  uint32_t options = 0;  // SAGE_OPTION_PREPASS_KV_SPLIT: K/V's three-launch pre-pass
};

std::string describe(const Big& c, sage_kernel kernel) {
  char buf[160];
  std::snprintf(buf, sizeof(buf), "B%lld Hq%lld Hkv%lld N%lld D%lld mask%d %s kernel%d options%u",
                (long long)c.B, (long long)c.Hq, (long long)c.Hkv, (long long)c.N, (long long)kD,
                int(c.mask),
                c.variant == SAGE_VARIANT_SAGE2_4B    ? "4b"
                : c.variant == SAGE_VARIANT_SAGE3_FP4 ? "fp4"
                                                      : "8b",
                int(kernel), unsigned(c.options));
  return buf;
}

// One forward call of B·Hq (and B·Hkv) pairs past 65535 on `kernel`: every output element and
// LSE written; sampled entries against the emulation of the plan's configuration.
void forward_case(const Big& c, sage_kernel kernel) {
  SCOPED_TRACE(describe(c, kernel));
  const uint64_t seed = sage::test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t qe = c.B * c.Hq * c.N * kD, ke = c.B * c.Hkv * c.N * kD, le = c.B * c.Hq * c.N;
  const std::vector<uint16_t> q = draw(mix64(seed + 1), c.B * c.Hq, c.N, 128);
  const std::vector<uint16_t> k = draw(mix64(seed + 2), c.B * c.Hkv, c.N, 512);
  const std::vector<uint16_t> v = draw(mix64(seed + 3), c.B * c.Hkv, c.N, 256);

  GpuRun g;
  {
    DeviceBuffer dq(size_t(qe) * 2), dk(size_t(ke) * 2), dv(size_t(ke) * 2), dout(size_t(qe) * 2),
        dlse(size_t(le) * 4);
    ASSERT_TRUE(dq.ptr && dk.ptr && dv.ptr && dout.ptr && dlse.ptr) << "cudaMalloc failed";
    SAGE_ASSERT_CUDA(cudaMemcpy(dq.ptr, q.data(), size_t(qe) * 2, cudaMemcpyHostToDevice));
    SAGE_ASSERT_CUDA(cudaMemcpy(dk.ptr, k.data(), size_t(ke) * 2, cudaMemcpyHostToDevice));
    SAGE_ASSERT_CUDA(cudaMemcpy(dv.ptr, v.data(), size_t(ke) * 2, cudaMemcpyHostToDevice));
    SAGE_ASSERT_CUDA(cudaMemset(dout.ptr, 0xFF, size_t(qe) * 2));  // NaN
    SAGE_ASSERT_CUDA(cudaMemset(dlse.ptr, 0xFF, size_t(le) * 4));
    sage_attention_args a;
    sage_attention_args_init(&a);
    a.q = dq.ptr, a.k = dk.ptr, a.v = dv.ptr, a.o = dout.ptr;
    a.lse = static_cast<float*>(dlse.ptr);
    a.batch = c.B, a.heads_q = c.Hq, a.heads_kv = c.Hkv, a.seq_q = c.N, a.seq_kv = c.N;
    a.head_dim = kD, a.layout = SAGE_LAYOUT_HND, a.dtype = SAGE_DTYPE_FP16, a.mask = c.mask;
    a.variant = c.variant, a.kernel = kernel, a.options = c.options;
    run_args(&a, &g, size_t(qe), size_t(le));
  }
  ASSERT_EQ(g.status, SAGE_OK) << g.error;
  const bool fp4 = c.variant == SAGE_VARIANT_SAGE3_FP4;
  if (kernel != SAGE_KERNEL_AUTO) ASSERT_EQ(g.plan.kernel, kernel);
  if (fp4) ASSERT_EQ(g.plan.kernel, SAGE_KERNEL_FP4);

  // Every pair's rows were written (the poison is NaN; every row sees a key here).
  int64_t unwritten = 0, first = -1;
  for (int64_t i = 0; i < qe; ++i)
    if (!finite_fp16(g.o[size_t(i)])) {
      if (first < 0) first = i;
      ++unwritten;
    }
  ASSERT_EQ(unwritten, 0) << "first at pair " << first / (c.N * kD);
  for (int64_t i = 0; i < le; ++i)
    ASSERT_TRUE(std::isfinite(g.lse[size_t(i)])) << "lse of pair " << i / c.N;

  // Sampled entries against the emulation of the plan's configuration, each a batch of one.
  const std::vector<int64_t> entries = sample_entries(c.B, c.Hq, c.Hkv, rng, 24);
  const double scale = 1.0 / std::sqrt(double(kD));
  const sage::ref::Problem p1{1, c.Hq, c.Hkv, c.N, c.N, kD, scale, c.mask};
  const sage_strides qs = sage::ref::contiguous_strides(SAGE_LAYOUT_HND, c.Hq, c.N, kD);
  const sage_strides ks = sage::ref::contiguous_strides(SAGE_LAYOUT_HND, c.Hkv, c.N, kD);
  const int64_t qn = c.Hq * c.N * kD, kn = c.Hkv * c.N * kD, ln = c.Hq * c.N;
  std::vector<float> emu, emu_lse, got, got_lse;
  std::vector<double> w_max;  // the rows' largest float64 weights (lse_bound), on the sm90 kernel
  const bool phat_sum = g.plan.kernel == SAGE_KERNEL_SM90;
  double v_spread = 0;
  for (const int64_t b : entries) {
    const sage::ref::TensorView qv{q.data() + b * qn, SAGE_DTYPE_FP16, qs},
        kv{k.data() + b * kn, SAGE_DTYPE_FP16, ks}, vv{v.data() + b * kn, SAGE_DTYPE_FP16, ks};
    std::vector<float> o(static_cast<size_t>(qn)), l(static_cast<size_t>(ln));
    sage::ref::attention_quant(p1, g.plan.emulation, qv, kv, vv, o.data(), l.data(), 1);
    emu.insert(emu.end(), o.begin(), o.end());
    emu_lse.insert(emu_lse.end(), l.begin(), l.end());
    if (phat_sum) {
      const std::vector<double> w = max_weights(p1, qv, kv);
      w_max.insert(w_max.end(), w.begin(), w.end());
    }
    for (int64_t i = 0; i < qn; ++i)
      got.push_back(sage::decode_float(sage::kFp16, g.o[size_t(b * qn + i)]));
    got_lse.insert(got_lse.end(), g.lse.begin() + b * ln, g.lse.begin() + (b + 1) * ln);
    for (int64_t h = 0; h < c.Hkv; ++h) {  // max |V - channel mean| (the smoothed V)
      const std::vector<float> x = sage::ref::load_matrix(vv, 0, h, c.N, kD);
      for (int64_t d = 0; d < kD; ++d) {
        double mean = 0;
        for (int64_t j = 0; j < c.N; ++j) mean += x[size_t(j * kD + d)];
        mean /= double(c.N);
        for (int64_t j = 0; j < c.N; ++j)
          v_spread = std::max(v_spread, std::fabs(x[size_t(j * kD + d)] - mean));
      }
    }
  }
  Case cs{};  // what emulation_bound reads: dtype, variant, smoothing
  cs.B = c.B, cs.Hq = c.Hq, cs.Hkv = c.Hkv, cs.Nq = cs.Nk = c.N, cs.D = kD, cs.mask = c.mask;
  cs.layout = SAGE_LAYOUT_HND, cs.dtype = SAGE_DTYPE_FP16, cs.variant = c.variant;
  const std::vector<double> want = rounded(cs, emu);
  double out_max = 0;
  for (const double x : want) out_max = std::max(out_max, std::fabs(x));
  // The sweep's bound; FP4's is test_fp4_gpu.cu's (the kernel takes the emulation's own steps).
  const Bound bound =
      fp4 ? Bound{3e-4, 0.1 * out_max + 1e-3} : emulation_bound(cs, v_spread, out_max);
  const sage::ref::Metrics m = sage::ref::compare(want.data(), got.data(), int64_t(got.size()));
  EXPECT_LE(m.rel_l1, bound.rel_l1);
  EXPECT_LE(m.max_abs, bound.max_abs);
  for (size_t i = 0; i < emu_lse.size(); ++i)
    ASSERT_LE(std::fabs(double(got_lse[i]) - double(emu_lse[i])),
              lse_bound(emu_lse[i], phat_sum, phat_sum ? w_max[i] : 0.0))
        << "lse " << i << " of the sampled entries: gpu " << got_lse[i] << " emulation "
        << emu_lse[i];
  std::printf(
      "    %s: kernel %d, %zu entries vs emulation rel-L1 %.2e (<= %.0e) max %.2e "
      "(<= %.2e)\n",
      describe(c, kernel).c_str(), int(g.plan.kernel), entries.size(), m.rel_l1, bound.rel_l1,
      m.max_abs, bound.max_abs);
}

#define SAGE_REQUIRE_SM89()                                                                \
  do {                                                                                     \
    SAGE_REQUIRE_GPU();                                                                    \
    if (compute_capability() < 89) GTEST_SKIP() << "no SageAttention2 kernel below sm_89"; \
  } while (0)

constexpr sage_mask kNone = SAGE_MASK_NONE, kBR = SAGE_MASK_CAUSAL_BOTTOM_RIGHT,
                    kTL = SAGE_MASK_CAUSAL_TOP_LEFT;
constexpr sage_variant k8 = SAGE_VARIANT_SAGE2_8B, k4 = SAGE_VARIANT_SAGE2_4B,
                       kFp4 = SAGE_VARIANT_SAGE3_FP4;

// AUTO: on sm_90 the wgmma kernel (persistent; causal draws tiles from its counter), elsewhere
// mma.sync. B·Hq = 66000 or 132000, B·Hkv = 66000; the K/V pre-pass in one cluster launch (sm_90)
// and in three launches. (Where AUTO is mma.sync, ~2.5 GB: Q̂ is padded to 128 rows a pair.)
TEST(GpuGridLimits, ForwardAuto8Bit) {
  SAGE_REQUIRE_SM89();
  forward_case({66000, 1, 1, 17, kNone, k8}, SAGE_KERNEL_AUTO);
  forward_case({66000, 1, 1, 33, kBR, k8}, SAGE_KERNEL_AUTO);
  forward_case({33000, 4, 2, 17, kNone, k8, SAGE_OPTION_PREPASS_KV_SPLIT}, SAGE_KERNEL_AUTO);
}

// mma.sync, 8-bit (Q quantized by the pre-pass: quant_q's grid too). GQA at B·Hq = 68000 (its Q̂
// at B = 33000 would take 1.1 GB alone).
TEST(GpuGridLimits, ForwardMma8Bit) {
  SAGE_REQUIRE_SM89();
  forward_case({66000, 1, 1, 17, kTL, k8}, SAGE_KERNEL_MMA);
  forward_case({17000, 4, 2, 17, kNone, k8, SAGE_OPTION_PREPASS_KV_SPLIT}, SAGE_KERNEL_MMA);
}

// mma.sync, 4-bit (Q smoothing's ΔS from the caller's K).
TEST(GpuGridLimits, ForwardMma4Bit) {
  SAGE_REQUIRE_SM89();
  forward_case({66000, 1, 1, 33, kNone, k4}, SAGE_KERNEL_MMA);
  forward_case({33000, 4, 2, 17, kBR, k4}, SAGE_KERNEL_MMA);
}

// SageAttention3's FP4 path (src/fp4, sm_89+): its pre-pass and kernel grids. Its workspace holds
// Q̂, K̂ and V̂ᵀ in fp16, Q̂ padded to 128 rows: 32 KB a pair at N <= 64, ~2.8 GB in all here (no
// count past 65535 fits in 2 GB); it skips where less than 4 GB is free.
TEST(GpuGridLimits, ForwardFp4) {
  SAGE_REQUIRE_SM89();
  std::string why;
  if (!enough_free_memory(size_t(4) << 30, &why)) GTEST_SKIP() << why;
  forward_case({66000, 1, 1, 17, kNone, kFp4}, SAGE_KERNEL_AUTO);
}

// ---- Backward --------------------------------------------------------------------------------
// B = 66000 pairs of one head, Nq = Nk = 17, causal: every gradient written (poisoned first, the
// workspace too), sampled entries against the backward's emulation with test_backward_gpu.cu's
// bound (rel-L1 within a tenth of an fp16 step + 2e-4, cos > 0.99999), atomic and deterministic
// dQ, each kernel family of this GPU.
TEST(GpuGridLimits, Backward) {
  SAGE_REQUIRE_SM89();
  const int64_t B = 66000, H = 1, N = 17;
  std::string why;
  if (!enough_free_memory(size_t(6) << 30, &why)) GTEST_SKIP() << why;
  const uint64_t seed = sage::test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t n = B * H * N * kD;
  const std::vector<uint16_t> q = draw(mix64(seed + 1), B * H, N, 128);
  const std::vector<uint16_t> k = draw(mix64(seed + 2), B * H, N, 512);
  const std::vector<uint16_t> v = draw(mix64(seed + 3), B * H, N, 256);
  const std::vector<uint16_t> d_o = draw(mix64(seed + 4), B * H, N, 0);
  const sage_strides st = sage::ref::contiguous_strides(SAGE_LAYOUT_HND, H, N, kD);
  auto view = [&](const std::vector<uint16_t>& x, int64_t b) {
    return sage::ref::TensorView{x.data() + b * H * N * kD, SAGE_DTYPE_FP16, st};
  };
  // The forward's O (fp16) and LSE from float64 attention.
  sage::ref::Problem p{B, H, H, N, N, kD, 1.0 / std::sqrt(double(kD)), kBR};
  std::vector<uint16_t> o(static_cast<size_t>(n));
  std::vector<float> lse(static_cast<size_t>(B * H * N));
  {
    std::vector<double> o64(static_cast<size_t>(n)), lse64(lse.size());
    sage::ref::attention_exact(p, view(q, 0), view(k, 0), view(v, 0), o64.data(), lse64.data());
    for (int64_t i = 0; i < n; ++i)
      o[size_t(i)] = uint16_t(sage::encode_float(sage::kFp16, o64[size_t(i)], false));
    std::copy(lse64.begin(), lse64.end(), lse.begin());
  }
  const std::vector<int64_t> entries = sample_entries(B, H, H, rng, 16);
  sage::ref::Problem p1 = p;
  p1.batch = 1;

  std::vector<sage_kernel> kernels = {SAGE_KERNEL_MMA};
  if (compute_capability() == 90) kernels.push_back(SAGE_KERNEL_SM90);
  const size_t bytes = size_t(n) * 2, lse_bytes = lse.size() * 4;
  DeviceBuffer dq_in(bytes), dk(bytes), dv(bytes), dout(bytes), ddo(bytes), dlse(lse_bytes),
      gq(bytes), gk(bytes), gv(bytes);
  ASSERT_TRUE(dq_in.ptr && dk.ptr && dv.ptr && dout.ptr && ddo.ptr && dlse.ptr && gq.ptr &&
              gk.ptr && gv.ptr)
      << "cudaMalloc failed";
  SAGE_ASSERT_CUDA(cudaMemcpy(dq_in.ptr, q.data(), bytes, cudaMemcpyHostToDevice));
  SAGE_ASSERT_CUDA(cudaMemcpy(dk.ptr, k.data(), bytes, cudaMemcpyHostToDevice));
  SAGE_ASSERT_CUDA(cudaMemcpy(dv.ptr, v.data(), bytes, cudaMemcpyHostToDevice));
  SAGE_ASSERT_CUDA(cudaMemcpy(dout.ptr, o.data(), bytes, cudaMemcpyHostToDevice));
  SAGE_ASSERT_CUDA(cudaMemcpy(ddo.ptr, d_o.data(), bytes, cudaMemcpyHostToDevice));
  SAGE_ASSERT_CUDA(cudaMemcpy(dlse.ptr, lse.data(), lse_bytes, cudaMemcpyHostToDevice));

  // The emulation of the sampled entries (the same for every run), rounded to fp16.
  std::vector<float> eq, ek, ev;
  for (const int64_t b : entries) {
    const int64_t e = H * N * kD;
    std::vector<float> x(static_cast<size_t>(e)), y(static_cast<size_t>(e)),
        z(static_cast<size_t>(e));
    sage::ref::attention_backward_quant(p1, sage::ref::backward_preset(), view(q, b), view(k, b),
                                        view(v, b), view(d_o, b), x.data(), y.data(), z.data(), 1);
    for (auto* w : {&x, &y, &z})
      for (float& f : *w) f = sage::round_fp16(f);
    eq.insert(eq.end(), x.begin(), x.end());
    ek.insert(ek.end(), y.begin(), y.end());
    ev.insert(ev.end(), z.begin(), z.end());
  }

  for (const sage_kernel kernel : kernels)
    for (const uint32_t options : {0u, unsigned(SAGE_BWD_OPTION_DETERMINISTIC)}) {
      SCOPED_TRACE(std::string(kernel == SAGE_KERNEL_SM90 ? "kernel SM90" : "kernel MMA") +
                   (options ? " deterministic" : ""));
      sage_backward_args a;
      sage_backward_args_init(&a);
      a.q = dq_in.ptr, a.k = dk.ptr, a.v = dv.ptr, a.o = dout.ptr, a.d_o = ddo.ptr;
      a.lse = static_cast<const float*>(dlse.ptr);
      a.dq = gq.ptr, a.dk = gk.ptr, a.dv = gv.ptr;
      a.batch = B, a.heads_q = H, a.heads_kv = H, a.seq_q = N, a.seq_kv = N;
      a.head_dim = kD, a.layout = SAGE_LAYOUT_HND, a.dtype = SAGE_DTYPE_FP16, a.mask = kBR;
      a.kernel = kernel, a.options = options;
      size_t ws_bytes = 0;
      ASSERT_EQ(sage_backward_workspace_size(&a, &ws_bytes), SAGE_OK) << sage_last_error();
      DeviceBuffer ws(ws_bytes);
      ASSERT_NE(ws.ptr, nullptr) << "cudaMalloc of " << ws_bytes << " bytes failed";
      SAGE_ASSERT_CUDA(cudaMemset(ws.ptr, 0xFF, ws_bytes));  // the pre-pass writes what it reads
      a.workspace = ws.ptr, a.workspace_size = ws_bytes;
      for (void* g : {gq.ptr, gk.ptr, gv.ptr}) SAGE_ASSERT_CUDA(cudaMemset(g, 0xFF, bytes));
      ASSERT_EQ(sage_attention_backward(&a), SAGE_OK) << sage_last_error();
      SAGE_ASSERT_CUDA(cudaDeviceSynchronize());
      const char* names[] = {"dq", "dk", "dv"};
      const DeviceBuffer* outs[] = {&gq, &gk, &gv};
      const std::vector<float>* emus[] = {&eq, &ek, &ev};
      for (int t = 0; t < 3; ++t) {
        SCOPED_TRACE(names[t]);
        std::vector<uint16_t> grad(static_cast<size_t>(n));
        SAGE_ASSERT_CUDA(cudaMemcpy(grad.data(), outs[t]->ptr, bytes, cudaMemcpyDeviceToHost));
        for (int64_t i = 0; i < n; ++i)
          ASSERT_TRUE(finite_fp16(grad[size_t(i)])) << "not written: pair " << i / (N * kD);
        std::vector<float> got;
        for (const int64_t b : entries)
          for (int64_t i = 0; i < H * N * kD; ++i)
            got.push_back(sage::decode_float(sage::kFp16, grad[size_t(b * H * N * kD + i)]));
        const std::vector<double> want(emus[t]->begin(), emus[t]->end());
        const sage::ref::Metrics m =
            sage::ref::compare(want.data(), got.data(), int64_t(got.size()));
        EXPECT_LT(m.rel_l1, 0.1 / 2048 + 2e-4) << "GPU vs emulation";
        EXPECT_GT(m.cos, 0.99999) << "GPU vs emulation";
        std::printf("    backward %s%s %s: %zu entries vs emulation cos %.7f rel-L1 %.2e\n",
                    kernel == SAGE_KERNEL_SM90 ? "SM90" : "MMA", options ? " deterministic" : "",
                    names[t], entries.size(), m.cos, m.rel_l1);
      }
    }
}

// ---- What the kernels cannot take ------------------------------------------------------------
// Past 2^31 - 1 (batch, head) pairs (1-D grids along x, the sm90 kernel's 32-bit tile fields) a
// call is refused with UNSUPPORTED naming batch and heads_q, before anything launches; at 2^31 - 1
// it plans. Only the plan and the workspace size are asked for: the inputs read one row for every
// (b, h) (strides {0, 0, 64}), and the one output whose extent is that of 2^31 pairs lies last in
// a small buffer (validation checks extents arithmetically; nothing is read or written).
TEST(GpuGridLimits, RefusesMorePairsThanTheKernelsTake) {
  SAGE_REQUIRE_SM89();
  DeviceBuffer buf(1 << 20);
  ASSERT_NE(buf.ptr, nullptr);
  char* base = static_cast<char*>(buf.ptr);
  const sage_strides one_row{0, 0, 64};
  sage_attention_args a;
  sage_attention_args_init(&a);
  a.q = base, a.k = base + 256, a.v = base + 512, a.o = base + 4096;
  a.q_strides = a.k_strides = a.v_strides = one_row;
  a.heads_q = a.heads_kv = 1, a.seq_q = a.seq_kv = 1, a.head_dim = 64;
  a.batch = int64_t(1) << 31;
  size_t ws = 0;
  EXPECT_EQ(sage_attention_workspace_size(&a, &ws), SAGE_ERROR_UNSUPPORTED);
  const std::string e = sage_last_error();
  EXPECT_NE(e.find("batch = 2147483648"), std::string::npos) << e;
  EXPECT_NE(e.find("heads_q = 1"), std::string::npos) << e;
  sage_plan_info info{};
  info.struct_size = sizeof info;
  EXPECT_EQ(sage_attention_plan(&a, &info), SAGE_ERROR_UNSUPPORTED);
  a.workspace = base + 8192, a.workspace_size = 4096;
  EXPECT_EQ(sage_attention(&a), SAGE_ERROR_UNSUPPORTED);
  a.workspace = nullptr, a.workspace_size = 0;
  a.batch = (int64_t(1) << 30) - 1, a.heads_q = 4, a.heads_kv = 2;  // 2^32 - 4 pairs
  EXPECT_EQ(sage_attention_workspace_size(&a, &ws), SAGE_ERROR_UNSUPPORTED);
  a.batch = (int64_t(1) << 31) - 1, a.heads_q = a.heads_kv = 1;
  EXPECT_EQ(sage_attention_workspace_size(&a, &ws), SAGE_OK) << sage_last_error();
  EXPECT_GT(ws, size_t(2) * size_t(a.batch) * 64 * 64);  // K̂ and V̂ᵀ of 64 rows a pair

  sage_backward_args b;
  sage_backward_args_init(&b);
  b.q = base, b.k = base + 256, b.v = base + 512, b.o = base + 768, b.d_o = base + 1024;
  b.lse = reinterpret_cast<const float*>(base + 1280);
  b.dk = base + 2048, b.dv = base + 2304, b.dq = base + 4096;
  b.q_strides = b.o_strides = b.do_strides = one_row;
  b.lse_strides = sage_strides{0, 0, 1};
  b.batch = 1, b.heads_q = int64_t(1) << 31, b.heads_kv = 1, b.seq_q = b.seq_kv = 1;
  b.head_dim = 64;
  EXPECT_EQ(sage_backward_workspace_size(&b, &ws), SAGE_ERROR_UNSUPPORTED);
  const std::string eb = sage_last_error();
  EXPECT_NE(eb.find("heads_q = 2147483648"), std::string::npos) << eb;
}

}  // namespace
