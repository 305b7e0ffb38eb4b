// The attention GPU suites' common ground: a case, its random inputs, and one call of the C API on
// the device with the output and LSE poisoned first, forced onto a kernel family where asked; the
// bound of a GPU output against its emulation. Host code; included by the GPU attention suites.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "gpu/gpu_test_util.h"
#include "ref/reference.h"
#include "sage/sage.h"

namespace sage::gpu_test {

using sage::test::Fp16Tensor;

struct Case {
  int64_t B, Hq, Hkv, Nq, Nk, D;
  sage_mask mask;
  sage_layout layout;
  sage_dtype dtype;
  sage_variant variant;
  float bias;  // channel bias of Q (x0.5), K (x1) and V (x1)
  unsigned smooth = 0;  // 0: the variant's preset; else the preset with these smoothing flags
  int kv_shift = 0;     // the sweep's K and V start this many elements into their buffers
};

inline std::string name(const Case& c) {
  char buf[200];
  std::snprintf(buf, sizeof(buf), "B%lld_Hq%lld_Hkv%lld_Nq%lld_Nk%lld_D%lld_mask%d_%s_%s_%s_bias%g",
                (long long)c.B, (long long)c.Hq, (long long)c.Hkv, (long long)c.Nq,
                (long long)c.Nk, (long long)c.D, int(c.mask),
                c.layout == SAGE_LAYOUT_HND ? "HND" : "NHD", c.dtype == SAGE_DTYPE_BF16 ? "bf16" : "fp16",
                c.variant == SAGE_VARIANT_SAGE2_4B ? "4b" : c.variant == SAGE_VARIANT_SAGE3_FP4 ? "fp4" : "8b", double(c.bias));
  std::string s = buf;
  if (c.smooth) s += "_smooth" + std::to_string(c.smooth);
  if (c.kv_shift) s += "_kvshift" + std::to_string(c.kv_shift);
  return s;
}

// Converts fp16 bits to bf16 bits (exact for the values drawn here, which fit bf16's range).
inline std::vector<uint16_t> to_dtype(const std::vector<uint16_t>& fp16, sage_dtype dtype) {
  if (dtype == SAGE_DTYPE_FP16) return fp16;
  std::vector<uint16_t> out(fp16.size());
  for (size_t i = 0; i < fp16.size(); ++i)
    out[i] = uint16_t(sage::encode_float(sage::kBf16, sage::decode_float(sage::kFp16, fp16[i]), false));
  return out;
}

// Which kernel family a call is forced onto, and its options.
struct KernelChoice {
  sage_kernel kernel;
  uint32_t options;
  const char* label;
};
constexpr KernelChoice kMma{SAGE_KERNEL_MMA, 0u, "mma"};
constexpr KernelChoice kSm90{SAGE_KERNEL_SM90, 0u, "sm90"};
constexpr KernelChoice kSm90PrepassQ{SAGE_KERNEL_SM90, SAGE_OPTION_PREPASS_Q, "sm90/prepass-q"};

inline int compute_capability() {
  int dev = 0, major = 0, minor = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  return major * 10 + minor;
}

// The families this GPU has: mma.sync on sm_89 and later; the wgmma kernel on sm_90 (with Q
// quantized in the kernel, and by the pre-pass). A case the plan refuses for a family is skipped
// there only where that is expected (the wgmma kernel has no 4-bit Q·K and no Q smoothing).
inline std::vector<KernelChoice> kernels_of_this_gpu() {
  const int cc = compute_capability();
  std::vector<KernelChoice> k;
  if (cc >= 89) k.push_back(kMma);
  if (cc == 90) {
    k.push_back(kSm90);
    k.push_back(kSm90PrepassQ);
  }
  return k;
}

struct GpuRun {
  sage_status status = SAGE_OK;
  std::string error;
  sage_plan_info plan{};    // what the planner says the call runs (emulation included)
  std::vector<uint16_t> o;  // in the output's layout (contiguous in args.layout)
  std::vector<float> lse;
};

// The plan, the workspace and the call of prepared args (a.o and a.lse on the device), then
// o_elems outputs and lse_elems LSE values copied back into r (status and error set).
template <typename Run>
void run_args(sage_attention_args* a, Run* r, size_t o_elems, size_t lse_elems) {
  r->plan.struct_size = sizeof(sage_plan_info);
  size_t ws_bytes = 0;
  r->status = sage_attention_plan(a, &r->plan);
  if (r->status == SAGE_OK) r->status = sage_attention_workspace_size(a, &ws_bytes);
  if (r->status != SAGE_OK) {
    r->error = sage_last_error();
    return;
  }
  DeviceBuffer ws(ws_bytes ? ws_bytes : 1);
  // Poisoned, as a caching allocator's block may be: nothing may rely on a zeroed workspace
  // (the tile counters and the streamed pre-pass's flags are set by the call itself).
  cudaMemset(ws.ptr, 0xFF, ws_bytes ? ws_bytes : 1);
  a->workspace = ws.ptr, a->workspace_size = ws_bytes;
  r->status = sage_attention(a);
  r->error = sage_last_error();
  if (cudaDeviceSynchronize() != cudaSuccess) {
    r->status = SAGE_ERROR_CUDA;
    r->error = cudaGetErrorString(cudaGetLastError());
  }
  r->o.resize(o_elems);
  r->lse.resize(lse_elems);
  cudaMemcpy(r->o.data(), a->o, o_elems * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(r->lse.data(), a->lse, lse_elems * 4, cudaMemcpyDeviceToHost);
}

// Runs the GPU kernel on host tensors (copied to the device), with o and lse poisoned first.
// scale 0: 1/sqrt(D). The plan is taken from the same args the call gets.
inline GpuRun run_gpu(const Case& c, const std::vector<uint16_t>& q, const std::vector<uint16_t>& k,
               const std::vector<uint16_t>& v, KernelChoice kc = {SAGE_KERNEL_AUTO, 0u, "auto"},
               float scale = 0.0f, int kv_shift = 0) {
  GpuRun r;
  const size_t o_elems = size_t(c.B * c.Hq * c.Nq * c.D), lse_elems = size_t(c.B * c.Hq * c.Nq);
  // kv_shift: K and V start that many elements into their buffers (1: rows 2-byte aligned only).
  DeviceBuffer dq(q.size() * 2), dk((k.size() + 8) * 2), dv((v.size() + 8) * 2),
      dout(o_elems * 2), dlse(lse_elems * 4);
  uint16_t* kp = static_cast<uint16_t*>(dk.ptr) + kv_shift;
  uint16_t* vp = static_cast<uint16_t*>(dv.ptr) + kv_shift;
  cudaMemcpy(dq.ptr, q.data(), q.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(kp, k.data(), k.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(vp, v.data(), v.size() * 2, cudaMemcpyHostToDevice);
  cudaMemset(dout.ptr, 0xFF, o_elems * 2);  // NaN in fp16 and bf16
  cudaMemset(dlse.ptr, 0xFF, lse_elems * 4);
  sage_attention_args a;
  sage_attention_args_init(&a);
  a.q = dq.ptr, a.k = kp, a.v = vp, a.o = dout.ptr, a.lse = static_cast<float*>(dlse.ptr);
  a.batch = c.B, a.heads_q = c.Hq, a.heads_kv = c.Hkv, a.seq_q = c.Nq, a.seq_kv = c.Nk;
  a.head_dim = c.D, a.layout = c.layout, a.dtype = c.dtype, a.mask = c.mask;
  a.variant = c.variant;
  if (c.smooth) {
    a.variant = SAGE_VARIANT_CUSTOM;
    sage_quant_config_init(&a.quant, c.variant);
    a.quant.smooth = c.smooth;
  }
  a.scale = scale;
  a.kernel = kc.kernel;
  a.options = kc.options;
  run_args(&a, &r, o_elems, lse_elems);
  return r;
}

// A case's inputs: Q, K, V drawn as fp16 in the case's layout with its channel bias (Q at half),
// and their bits in the case's dtype.
struct Inputs {
  Fp16Tensor q, k, v;
  std::vector<uint16_t> qd, kd, vd;
};
inline Inputs draw_inputs(std::mt19937_64& rng, const Case& c) {
  auto strides = [&](int64_t H, int64_t N) {
    return sage::ref::contiguous_strides(c.layout, H, N, c.D);
  };
  Inputs in;
  in.q = sage::test::random_tensor(rng, c.B, c.Hq, c.Nq, c.D, strides(c.Hq, c.Nq), 0.5f * c.bias);
  in.k = sage::test::random_tensor(rng, c.B, c.Hkv, c.Nk, c.D, strides(c.Hkv, c.Nk), c.bias);
  in.v = sage::test::random_tensor(rng, c.B, c.Hkv, c.Nk, c.D, strides(c.Hkv, c.Nk), c.bias);
  in.qd = to_dtype(in.q.data, c.dtype);
  in.kd = to_dtype(in.k.data, c.dtype);
  in.vd = to_dtype(in.v.data, c.dtype);
  return in;
}

// The bound of a GPU output against its own emulation (both rounded to the output dtype).
// Both quantize identically (the pre-pass and the emulation share every formula: means summed in
// double, make_quant_scale, E4M3 rounding), and the sm90 emulation has the kernel's fp32 score,
// row-sum and finalize forms. What remains:
//  - ex2.approx (relative error ~2^-22) for the CPU's exp2, and the mma kernel's score formula
//    (not modelled: x = Q^K^·f (+ ΔS·scale·log2 e by FMA) with f = q_scale·scale·log2 e·k_scale,
//    against (Q^K^·q_scale·k_scale + ΔS)·scale·log2 e): P~ differs by ~1e-7..1e-6 relative, which
//    flips an E4M3 rounding tie of P^ with probability ~1e-5 (4-bit with ΔS: ~1e-4). A flip moves
//    one P^ by one E4M3 step (at most 1/8 of it), so one flip moves O by at most
//    max|V - v_mean| / 8 times the key's weight.
//    On the flat inputs here a row sees ~1e-2 flips of ~1/16 of a 1/N weight: rel-L1 ~1e-5,
//    up to ~1e-4 where |O| is small (flat, unbiased V), so the bound is 5e-4 (1e-3 for 4-bit).
//  - summation order of fp32 sums (the mma kernel's P·V into O, its row sums): ~1e-7 relative.
//  - the output rounding: the emulation is rounded to the dtype like the kernel's result, so a
//    difference is 0 or one output ulp wherever the fp32 results differ by less than that.
//  - LSE: the same row maxima (same floats) and row sums within ~2^-22: |ΔLSE| ~1e-6 plus one
//    fp32 ulp of the LSE; bound 1e-5·(1 + |LSE|). Where the row sum adds P^ (the sm90 kernel:
//    the weights O takes) a flip above moves it by up to 1/8 of that key's weight: the bound
//    adds a quarter of the row's largest weight there (lse_bound).
// A wrong accumulator model (13 vs 12 or 14 bits, or fp32) shows at 1e-3..1e-2 on flat rows (the
// diagnostic test of test_attention_gpu.cu prints them), a wrong scale, group, key order, tile or
// mask at 1e-2 and up.
struct Bound {
  double rel_l1, max_abs;
};
inline Bound emulation_bound(const Case& c, double v_spread, double out_max) {
  const int mantissa = c.dtype == SAGE_DTYPE_BF16 ? 7 : 10;
  const double ulp = out_max > 0 ? std::ldexp(1.0, std::ilogb(out_max) - mantissa) : 0.0;
  const bool delta_s = c.variant == SAGE_VARIANT_SAGE2_4B || (c.smooth & SAGE_SMOOTH_Q);
  return {delta_s ? 1e-3 : 5e-4, v_spread / 16 + 2 * ulp};
}

// Per (batch, head, row) of p: the row's largest softmax weight in float64, 1 / Σ_j exp(s_ij -
// max_j s_ij) (0 for a row that sees no key).
inline std::vector<double> max_weights(const sage::ref::Problem& p, const sage::ref::TensorView& qv,
                                       const sage::ref::TensorView& kv) {
  std::vector<double> w(size_t(p.lse_elems()), 0.0);
  const int64_t D = p.head_dim, group = p.heads_q / p.heads_kv;
  sage::ref::parallel_for(p.batch * p.heads_q, 0, [&](int64_t bh) {
    const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
    const std::vector<float> q = sage::ref::load_matrix(qv, b, h, p.seq_q, D);
    const std::vector<float> k = sage::ref::load_matrix(kv, b, h / group, p.seq_kv, D);
    std::vector<double> s(size_t(p.seq_kv));
    for (int64_t i = 0; i < p.seq_q; ++i) {
      const int64_t n = p.visible_keys(i);
      if (n == 0) continue;
      double smax = -INFINITY, l = 0;
      for (int64_t j = 0; j < n; ++j) {
        double x = 0;
        for (int64_t d = 0; d < D; ++d) x += double(q[size_t(i * D + d)]) * k[size_t(j * D + d)];
        s[size_t(j)] = x * p.scale, smax = std::max(smax, s[size_t(j)]);
      }
      for (int64_t j = 0; j < n; ++j) l += std::exp(s[size_t(j)] - smax);
      w[size_t(bh * p.seq_q + i)] = 1 / l;
    }
  });
  return w;
}

// The bound of a GPU LSE against its emulation's emu (above); phat_sum: the kernel's row sum adds
// P^ (the sm90 kernel), w_max: the row's largest weight (max_weights).
inline double lse_bound(double emu, bool phat_sum, double w_max) {
  return 1e-5 * (1 + std::fabs(emu)) + (phat_sum ? 0.25 * w_max : 0.0);
}

// The emulation rounded to the output dtype (as the kernel rounds its fp32 result), as doubles.
inline std::vector<double> rounded(const Case& c, const std::vector<float>& emu) {
  std::vector<double> out(emu.size());
  for (size_t i = 0; i < emu.size(); ++i)
    out[i] = c.dtype == SAGE_DTYPE_BF16 ? sage::round_bf16(emu[i]) : sage::round_fp16(emu[i]);
  return out;
}

}  // namespace sage::gpu_test
