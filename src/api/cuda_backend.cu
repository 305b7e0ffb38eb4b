// The CUDA backend: pointer classification, device description, the check that a kernel exists
// for the arguments (else a clear UNSUPPORTED, never an unwritten output), the workspace plan,
// and the launches (pre-pass, then attention) on the caller's stream. Host code (nvcc).
#include <cuda_runtime.h>

#include <cstdio>

#include "api/backend.h"
#include "attn/mma/launch.h"
#include "attn/sm90/launch.h"
#include "common/error.h"
#include "quant/prepass.h"

namespace sage::cuda {

PointerKind pointer_kind(const void* ptr) {
  if (!ptr) return PointerKind::kHost;
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: clear the error; it is host memory
    return PointerKind::kHost;
  }
  return (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged)
             ? PointerKind::kDevice
             : PointerKind::kHost;
}

std::string describe_devices(bool* has_gpu) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  *has_gpu = false;
  if (err != cudaSuccess) {
    cudaGetLastError();
    return std::string("no GPU: ") + cudaGetErrorString(err);
  }
  if (count == 0) return "no GPU: no CUDA device is visible";
  std::string s;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    char line[256];
    std::snprintf(line, sizeof(line), "GPU %d: %s, sm_%d%d, %d SMs, %.1f GiB%s", i, prop.name,
                  prop.major, prop.minor, prop.multiProcessorCount,
                  double(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0),
                  i + 1 < count ? "\n" : "");
    s += line;
    *has_gpu = true;
  }
  return s;
}

namespace {

// The one place that decides whether the GPU has a kernel for these args, and plans it.
sage_status plan_for(const api::Resolved& r, const sage_attention_args& a, mma::Plan* plan) {
  const sage_quant_config& c = r.quant;
  if (r.exact)
    return set_error(SAGE_ERROR_UNSUPPORTED,
                     "variant = EXACT has no GPU kernel (float64 runs on the CPU reference)");
  if (a.dtype != SAGE_DTYPE_FP16 && a.dtype != SAGE_DTYPE_BF16)
    return set_error(SAGE_ERROR_UNSUPPORTED,
                     "dtype = FP32 has no GPU kernel: pass fp16 or bf16 (fp32 runs on the CPU "
                     "reference)");
  const int64_t D = r.problem.head_dim;
  if (D != 64 && D != 128)
    return set_error(SAGE_ERROR_UNSUPPORTED,
                     "head_dim = %lld has no GPU kernel yet (supported: 64, 128)",
                     static_cast<long long>(D));
  const bool kernel_shape = c.granularity == SAGE_GRANULARITY_PER_THREAD_MMA &&
                            c.block_q == mma::kBlockQ && c.warps == mma::kWarps &&
                            c.block_k == mma::kBlockK;
  const bool kernel_pv = c.pv_format == SAGE_PV_FP8_E4M3 && c.v_scale == SAGE_V_SCALE_PER_CHANNEL &&
                         c.pv_accum == SAGE_PV_ACCUM_TWO_LEVEL && c.pv_flush_interval == 1;
  if ((c.qk_format != SAGE_QK_INT8 && c.qk_format != SAGE_QK_INT4) || !kernel_shape || !kernel_pv)
    return set_error(SAGE_ERROR_UNSUPPORTED,
                     "quant: no GPU kernel for this combination; the mma.sync kernel takes "
                     "qk_format INT8/INT4, granularity PER_THREAD_MMA with block_q %d, warps %d, "
                     "block_k %d, pv_format FP8_E4M3, v_scale PER_CHANNEL, pv_accum TWO_LEVEL with "
                     "pv_flush_interval 1 (any smoothing)",
                     mma::kBlockQ, mma::kWarps, mma::kBlockK);
  if (reinterpret_cast<uintptr_t>(a.o) % 4 != 0 || r.o.batch % 2 || r.o.head % 2 || r.o.token % 2)
    return set_error(SAGE_ERROR_UNSUPPORTED,
                     "o: the GPU kernel stores channel pairs, so o must be 4-byte aligned and its "
                     "strides even (o = %p, strides {%lld, %lld, %lld})",
                     a.o, static_cast<long long>(r.o.batch), static_cast<long long>(r.o.head),
                     static_cast<long long>(r.o.token));
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    const cudaError_t e = cudaGetLastError();
    return set_error(SAGE_ERROR_CUDA, "cannot query the current device: %s", cudaGetErrorString(e));
  }
  if (major * 10 + minor < 89)
    return set_error(SAGE_ERROR_UNSUPPORTED,
                     "the GPU is sm_%d%d; the SageAttention2 kernels need sm_89 or newer (FP8 MMA)",
                     major, minor);
  const ref::Problem& p = r.problem;
  // Two-level P·V accumulation guards an FP8 MMA accumulator narrower than fp32 (the paper's
  // FP22 on sm_89). sm_90's is a true fp32 (measured, docs/fp8-accumulator.md): one level.
  const bool two_level = major * 10 + minor != 90;
  *plan = mma::make_plan(p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_kv, D,
                         c.qk_format == SAGE_QK_INT8 ? 8 : 4, c.smooth & SAGE_SMOOTH_Q,
                         c.smooth & SAGE_SMOOTH_K, c.smooth & SAGE_SMOOTH_V,
                         ref::mean_token_stride(p.seq_kv, c.k_mean_tokens));  // as the emulation
  plan->two_level = two_level;
  // sm_90: the wgmma kernel takes what it supports (8-bit, no Q smoothing); args.kernel forces a
  // family (tests and benchmarks compare them).
  const bool sm90_ok = major == 9 && minor == 0 && sm90::supports(*plan);
  if (a.kernel == SAGE_KERNEL_SM90 && !sm90_ok)
    return set_error(SAGE_ERROR_UNSUPPORTED,
                     "kernel = SM90: the wgmma kernel needs an sm_90 GPU (this is sm_%d%d), 8-bit "
                     "Q·K and no Q smoothing",
                     major, minor);
  plan->sm90 = sm90_ok && a.kernel != SAGE_KERNEL_MMA;
  // The sm90 kernel quantizes Q itself (reading it once, through TMA; a tile ahead of its use,
  // the CTAs being persistent) when a TMA map can describe Q: rows 16-byte aligned, positive
  // strides. options & SAGE_OPTION_PREPASS_Q keeps the pre-pass's quant_q (to compare the two).
  plan->fused_q = plan->sm90 && !(a.options & SAGE_OPTION_PREPASS_Q) &&
                  quant::rows_aligned16(a.q, r.q) && r.q.batch > 0 && r.q.head > 0 &&
                  r.q.token > 0;
  return SAGE_OK;
}

}  // namespace

sage_status workspace_size(const api::Resolved& r, const sage_attention_args& a, size_t* bytes) {
  mma::Plan plan;
  SAGE_RETURN_IF_ERROR(plan_for(r, a, &plan));
  *bytes = plan.total;
  return SAGE_OK;
}

sage_status plan_info(const api::Resolved& r, const sage_attention_args& a, sage_plan_info* info) {
  mma::Plan plan;
  SAGE_RETURN_IF_ERROR(plan_for(r, a, &plan));
  *info = sage_plan_info{};
  info->struct_size = sizeof(sage_plan_info);
  info->backend = SAGE_BACKEND_CUDA;
  info->kernel = plan.sm90 ? SAGE_KERNEL_SM90 : SAGE_KERNEL_MMA;
  info->block_q = mma::kBlockQ;
  info->block_k = plan.sm90 ? 2 * mma::kBlockK : mma::kBlockK;
  info->fused_q = plan.fused_q;
  info->workspace_size = plan.total;
  info->emulation = r.quant;
  if (!plan.two_level) info->emulation.pv_accum = SAGE_PV_ACCUM_FP32;
  return SAGE_OK;
}

sage_status attention(const api::Resolved& r, const sage_attention_args& a) {
  return attention_stages(r, a, kStagePrepass | kStageKernel);
}

sage_status attention_stages(const api::Resolved& r, const sage_attention_args& a, int stages) {
  mma::Plan plan;
  SAGE_RETURN_IF_ERROR(plan_for(r, a, &plan));
  if (a.workspace_size < plan.total || (plan.total > 0 && a.workspace == nullptr))
    return set_error(
        SAGE_ERROR_WORKSPACE_TOO_SMALL,
        "workspace_size = %zu, this call needs %zu bytes (sage_attention_workspace_size)",
        a.workspace_size, plan.total);
  if (reinterpret_cast<uintptr_t>(a.workspace) % 256 != 0)
    return set_error(SAGE_ERROR_INVALID_ARGUMENT, "workspace = %p must be 256-byte aligned",
                     a.workspace);
  if (pointer_kind(a.workspace) != PointerKind::kDevice)
    return set_error(SAGE_ERROR_INVALID_ARGUMENT, "workspace = %p is not device memory",
                     a.workspace);
  cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
  uint8_t* ws = static_cast<uint8_t*>(a.workspace);
  const ref::Problem& p = r.problem;
  const quant::PrepassInputs in{a.q, a.k, a.v, a.dtype, r.q, r.k, r.v, float(p.scale)};
  cudaError_t e = cudaSuccess;
  if (stages & kStagePrepass) e = quant::run_prepass(plan, in, ws, stream);
  if (e != cudaSuccess)
    return set_error(SAGE_ERROR_CUDA, "pre-pass launch: %s", cudaGetErrorString(e));
  if (!(stages & kStageKernel)) return SAGE_OK;

  auto f32 = [&](size_t off) { return reinterpret_cast<const float*>(ws + off); };
  mma::AttnParams ap{};
  ap.q = ws + plan.q;
  ap.q_scale = f32(plan.q_scale);
  ap.k = ws + plan.k;
  ap.k_scale = f32(plan.k_scale);
  ap.v = ws + plan.v;
  ap.v_scale = f32(plan.v_scale);
  ap.v_mean = f32(plan.v_mean);
  ap.delta_s = plan.smooth_q ? f32(plan.delta_s) : nullptr;
  ap.lse_shift = reinterpret_cast<float*>(ws + plan.lse_shift);
  ap.o = a.o;
  ap.o_batch = r.o.batch, ap.o_head = r.o.head, ap.o_token = r.o.token;
  ap.lse = a.lse;
  ap.lse_batch = r.lse.batch, ap.lse_head = r.lse.head, ap.lse_token = r.lse.token;
  ap.batch = p.batch, ap.heads_q = p.heads_q, ap.heads_kv = p.heads_kv;
  ap.seq_q = p.seq_q, ap.seq_kv = p.seq_kv, ap.nq_pad = plan.nq_pad, ap.nk_pad = plan.nk_pad;
  ap.q_blocks = plan.q_blocks, ap.k_blocks = plan.k_blocks;
  ap.causal_offset = p.mask == SAGE_MASK_CAUSAL_BOTTOM_RIGHT ? p.seq_kv - p.seq_q : 0;
  ap.scale_log2 = float(p.scale * 1.4426950408889634);
  ap.fused_q = plan.fused_q;
  ap.scale = float(p.scale);
  ap.k_mean = f32(plan.k_mean);
  ap.tile_counter = reinterpret_cast<unsigned*>(ws + plan.tile_counter);
  ap.q_in = a.q;
  ap.q_in_batch = r.q.batch, ap.q_in_head = r.q.head, ap.q_in_token = r.q.token;
  const bool causal = p.mask != SAGE_MASK_NONE, bf16 = a.dtype == SAGE_DTYPE_BF16;
  if (plan.sm90)
    e = p.head_dim == 64 ? sm90::launch_attention<64>(ap, bf16, causal, stream)
                         : sm90::launch_attention<128>(ap, bf16, causal, stream);
  else
    e = p.head_dim == 64
            ? mma::launch_attention<64>(ap, plan.bits, bf16, causal, plan.two_level, stream)
            : mma::launch_attention<128>(ap, plan.bits, bf16, causal, plan.two_level, stream);
  if (e != cudaSuccess)
    return set_error(SAGE_ERROR_CUDA, "attention launch: %s", cudaGetErrorString(e));
  return SAGE_OK;
}

}  // namespace sage::cuda
