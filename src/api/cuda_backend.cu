// The CUDA backend: pointer classification, device description and the per-device properties the
// planner takes (api/plan.h: the one place a kernel is chosen), and the launches the plan names
// (pre-pass, then attention) on the caller's stream. Host code (nvcc).
#include <cuda_runtime.h>

#include <cstdio>
#include <mutex>

#include "api/backend.h"
#include "api/plan.h"
#include "attn/mma/launch.h"
#include "attn/sm90/launch.h"
#include "bwd/launch.h"
#include "common/error.h"
#include "common/grid.h"
#include "fp4/fp4.h"
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
  if (err != cudaSuccess) cudaGetLastError();
  // In plain words: the runtime's own string blames the driver's version even where there is no
  // driver at all ("CUDA driver version is insufficient for CUDA runtime version").
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);  // 0 when no driver is installed
  cudaRuntimeGetVersion(&runtime);
  char line[256];
  if (err == cudaErrorInsufficientDriver && driver == 0)
    return "no NVIDIA GPU driver found: libcuda.so.1 is not installed or cannot be loaded";
  if (err == cudaErrorInsufficientDriver) {
    std::snprintf(line, sizeof(line),
                  "no GPU: the NVIDIA driver supports CUDA %d.%d, older than libsage's runtime "
                  "(%d.%d); update the driver",
                  driver / 1000, driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10);
    return line;
  }
  if (err == cudaErrorNoDevice || (err == cudaSuccess && count == 0))
    return "no NVIDIA GPU found: the driver sees no device (is CUDA_VISIBLE_DEVICES set?)";
  if (err != cudaSuccess)
    return std::string("no GPU: ") + cudaGetErrorString(err) + " (" + cudaGetErrorName(err) + ")";
  std::string s;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    std::snprintf(line, sizeof(line), "GPU %d: %s, sm_%d%d, %d SMs, %.1f GiB%s", i, prop.name,
                  prop.major, prop.minor, prop.multiProcessorCount,
                  double(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0),
                  i + 1 < count ? "\n" : "");
    s += line;
    *has_gpu = true;
  }
  return *has_gpu ? s : "no GPU: the driver lists devices but describes none of them";
}

namespace {

// The current device's properties, queried once per device (the planner's input).
sage_status current_device(api::Device* out) {
  constexpr int kMaxDevices = 64;
  struct Entry {
    std::once_flag once;
    api::Device dev;
    cudaError_t err = cudaSuccess;
  };
  static Entry entries[kMaxDevices];
  int index = 0;
  cudaError_t e = cudaGetDevice(&index);
  if (e == cudaSuccess && (index < 0 || index >= kMaxDevices)) e = cudaErrorInvalidDevice;
  if (e != cudaSuccess) {
    cudaGetLastError();
    return set_error(SAGE_ERROR_CUDA, "cannot query the current device: %s", cudaGetErrorString(e));
  }
  Entry& entry = entries[index];
  std::call_once(entry.once, [&] {
    int major = 0, minor = 0, sms = 0;
    entry.err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index);
    if (entry.err == cudaSuccess)
      entry.err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, index);
    if (entry.err == cudaSuccess)
      entry.err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, index);
    if (entry.err != cudaSuccess) cudaGetLastError();
    entry.dev = {index, major * 10 + minor, sms};
    // The crossover model's rows are per GPU (SMs and memory bus): unknown (0) if not reported.
    int bus = 0;
    if (entry.err == cudaSuccess &&
        cudaDeviceGetAttribute(&bus, cudaDevAttrGlobalMemoryBusWidth, index) != cudaSuccess) {
      cudaGetLastError();
      bus = 0;
    }
    entry.dev.mem_bus_bits = bus;
    if (entry.err == cudaSuccess && entry.dev.cc >= 90) {
      // K/V's one-launch pre-pass needs thread-block clusters (sm_90+) that hold a head's chunks.
      entry.dev.kv_cluster = quant::max_kv_cluster(index);
      // The staged K/V quantization: on sm_90+ only, where it was measured.
      entry.dev.staged_kv_ctas = quant::staged_quant_kv_ctas(index);
    }
  });
  if (entry.err != cudaSuccess)
    return set_error(SAGE_ERROR_CUDA, "cannot query device %d: %s", index,
                     cudaGetErrorString(entry.err));
  *out = entry.dev;
  return SAGE_OK;
}

// The kernels take batch·heads (batch entries or sequences, times heads) over their grids' y and z
// (common/grid.h: up to 65535²), a few of them along x (up to 2^31 - 1), and the sm90 kernel's
// tiles hold b, h and the KV head's index in 32 bits: a call of more pairs is refused, naming
// them, rather than failing to launch. (Its workspace alone would exceed any GPU's memory.)
sage_status check_batch_heads(const char* what, int64_t batch, int64_t heads_q) {
  if (batch * heads_q <= kGridXMax) return SAGE_OK;
  return set_error(SAGE_ERROR_UNSUPPORTED,
                   "batch = %lld, heads_q = %lld: %s on the GPU takes at most 2^31 - 1 "
                   "(batch, head) pairs, this call has %lld",
                   static_cast<long long>(batch), static_cast<long long>(heads_q), what,
                   static_cast<long long>(batch * heads_q));
}

sage_status plan_call(const api::Resolved& r, const sage_attention_args& a, api::Device* dev,
                      api::Plan* plan) {
  SAGE_RETURN_IF_ERROR(check_batch_heads("attention", r.problem.batch, r.problem.heads_q));
  SAGE_RETURN_IF_ERROR(current_device(dev));
  return api::make_plan(r, a, *dev, plan);
}

// Query i sees keys j <= i + causal_offset under a causal mask.
int64_t causal_offset(const ref::Problem& p) {
  return p.mask == SAGE_MASK_CAUSAL_BOTTOM_RIGHT ? p.seq_kv - p.seq_q : 0;
}

// What both kernels' params structs (sm90::Params, mma::AttnParams) hold alike, under the same
// names: the pre-pass products they read, the caller's output and LSE, the problem.
template <typename P>
void fill_common(P& x, const api::Resolved& r, const sage_attention_args& a, const api::Plan& plan,
                 uint8_t* ws) {
  const quant::PrepassPlan& w = plan.prepass;
  const ref::Problem& p = r.problem;
  auto f32 = [&](size_t off) { return reinterpret_cast<float*>(ws + off); };
  x.q = ws + w.q, x.k = ws + w.k, x.v = ws + w.v;
  x.q_scale = f32(w.q_scale), x.k_scale = f32(w.k_scale);
  x.v_scale = f32(w.v_scale), x.v_mean = f32(w.v_mean);
  x.lse_shift = f32(w.lse_shift);
  x.o = a.o, x.o_batch = r.o.batch, x.o_head = r.o.head, x.o_token = r.o.token;
  x.head_dim = p.head_dim;  // the caller's (the kernel's is plan.prepass.head_dim)
  x.lse = a.lse, x.lse_batch = r.lse.batch, x.lse_head = r.lse.head, x.lse_token = r.lse.token;
  x.batch = p.batch, x.heads_q = p.heads_q, x.heads_kv = p.heads_kv;
  x.seq_q = p.seq_q, x.seq_kv = p.seq_kv, x.nq_pad = w.nq_pad, x.nk_pad = w.nk_pad;
  x.q_blocks = w.q_blocks, x.k_blocks = w.k_blocks;
  x.causal_offset = causal_offset(p);
  x.scale_log2 = float(p.scale * 1.4426950408889634);
  if (r.packed()) x.o_batch = x.lse_batch = 0;  // sequences found by cu_seqlens (validated 0)
}

sm90::Params sm90_params(const api::Resolved& r, const sage_attention_args& a,
                         const api::Plan& plan, uint8_t* ws) {
  sm90::Params s{};
  fill_common(s, r, a, plan, ws);
  const quant::PrepassPlan& w = plan.prepass;
  s.k_mean = reinterpret_cast<const float*>(ws + w.k_mean);  // fused Q's LSE shift
  s.tile_counter = reinterpret_cast<unsigned*>(ws + w.tile_counter);
  s.split_tiles = plan.split.tiles, s.split_ctas = plan.split.ctas;
  s.split_parts = reinterpret_cast<float*>(ws + w.split_parts);
  s.split_flags = s.tile_counter + 2;  // after the causal scheduler's two (quant/layout.h)
  s.kv_bad = reinterpret_cast<const unsigned long long*>(ws + w.kv_bad);
  s.q_in = a.q, s.q_in_batch = r.packed() ? 0 : r.q.batch, s.q_in_head = r.q.head;
  s.q_in_token = r.q.token;
  s.scale = float(r.problem.scale);
  s.fused_q = plan.fused_q;
  s.q_rows = w.q_rows, s.kv_rows = w.kv_rows, s.shift_rows = w.shift_rows;
  s.bottom_right = r.problem.mask == SAGE_MASK_CAUSAL_BOTTOM_RIGHT;
  return s;
}

mma::AttnParams mma_params(const api::Resolved& r, const sage_attention_args& a,
                           const api::Plan& plan, uint8_t* ws) {
  mma::AttnParams m{};
  fill_common(m, r, a, plan, ws);
  const quant::PrepassPlan& w = plan.prepass;
  m.q_rows = w.q_rows, m.kv_rows = w.kv_rows, m.shift_rows = w.shift_rows;
  m.bottom_right = r.problem.mask == SAGE_MASK_CAUSAL_BOTTOM_RIGHT;
  if (w.smooth_q) {  // ΔS from the block means and the caller's K (attn/mma DeltaS)
    m.q_mean = reinterpret_cast<const float*>(ws + w.q_mean);
    m.k_mean = reinterpret_cast<const float*>(ws + w.k_mean);
    m.k_in = a.k, m.k_in_batch = r.packed() ? 0 : r.k.batch, m.k_in_head = r.k.head;
    m.k_in_token = r.k.token;
    m.k_in_vec = quant::rows_aligned16(a.k, r.k);
  }
  return m;
}

fp4::Params fp4_params(const api::Resolved& r, const sage_attention_args& a,
                       const api::Plan& plan, uint8_t* ws) {
  const ref::Problem& p = r.problem;
  const sage_quant_config& c = r.quant;
  fp4::Params f{};
  f.q = a.q, f.k = a.k, f.v = a.v, f.qs = r.q, f.ks = r.k, f.vs = r.v;
  f.o = a.o, f.o_batch = r.o.batch, f.o_head = r.o.head, f.o_token = r.o.token;
  f.lse = a.lse, f.lse_batch = r.lse.batch, f.lse_head = r.lse.head, f.lse_token = r.lse.token;
  f.batch = p.batch, f.heads_q = p.heads_q, f.heads_kv = p.heads_kv;
  f.seq_q = p.seq_q, f.seq_kv = p.seq_kv, f.head_dim = p.head_dim;
  f.k_mean_stride = ref::mean_token_stride(p.seq_kv, c.k_mean_tokens);
  f.smooth_q = c.smooth & SAGE_SMOOTH_Q, f.smooth_k = c.smooth & SAGE_SMOOTH_K;
  f.causal = p.mask != SAGE_MASK_NONE, f.causal_offset = causal_offset(p);
  f.scale = p.scale;
  f.bf16 = a.dtype == SAGE_DTYPE_BF16;
  f.workspace = ws;
  f.layout = plan.fp4;
  return f;
}

}  // namespace

sage_status workspace_size(const api::Resolved& r, const sage_attention_args& a, size_t* bytes) {
  api::Device dev;
  api::Plan plan;
  SAGE_RETURN_IF_ERROR(plan_call(r, a, &dev, &plan));
  *bytes = plan.prepass.total;
  return SAGE_OK;
}

sage_status plan_info(const api::Resolved& r, const sage_attention_args& a, sage_plan_info* info) {
  api::Device dev;
  api::Plan plan;
  SAGE_RETURN_IF_ERROR(plan_call(r, a, &dev, &plan));
  api::describe(plan, info);
  return SAGE_OK;
}

sage_status attention(const api::Resolved& r, const sage_attention_args& a) {
  return attention_stages(r, a, kStagePrepass | kStageKernel);
}

sage_status attention_stages(const api::Resolved& r, const sage_attention_args& a, int stages) {
  api::Device dev;
  api::Plan plan;
  SAGE_RETURN_IF_ERROR(plan_call(r, a, &dev, &plan));
  const size_t total = plan.prepass.total;
  if (a.workspace_size < total || (total > 0 && a.workspace == nullptr))
    return set_error(
        SAGE_ERROR_WORKSPACE_TOO_SMALL,
        "workspace_size = %zu, this call needs %zu bytes (sage_attention_workspace_size)",
        a.workspace_size, total);
  if (reinterpret_cast<uintptr_t>(a.workspace) % 256 != 0)
    return set_error(SAGE_ERROR_INVALID_ARGUMENT, "workspace = %p must be 256-byte aligned",
                     a.workspace);
  if (pointer_kind(a.workspace) != PointerKind::kDevice)
    return set_error(SAGE_ERROR_INVALID_ARGUMENT, "workspace = %p is not device memory",
                     a.workspace);
  cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
  uint8_t* ws = static_cast<uint8_t*>(a.workspace);
  const ref::Problem& p = r.problem;
  const bool causal = p.mask != SAGE_MASK_NONE, bf16 = a.dtype == SAGE_DTYPE_BF16;
  const quant::RowSight sight{p.seq_kv, causal_offset(p), causal};
  // A packed batch's tensors have no batch dimension: its strides' batch is 0 (validated so;
  // validation's resolved defaults may fill it in), each sequence's rows are offset by its first
  // token (cu_seqlens, read on the device).
  sage_strides qs = r.q, ks = r.k, vs = r.v;
  if (r.packed()) qs.batch = ks.batch = vs.batch = 0;
  quant::PrepassInputs in{a.q, a.k, a.v, a.dtype, qs, ks, vs, float(p.scale), sight};
  in.bottom_right = p.mask == SAGE_MASK_CAUSAL_BOTTOM_RIGHT;
  cudaError_t e = cudaSuccess;
  if (plan.family == api::Family::kFp4) {
    // Its pre-pass and kernel run together, with the kernel stage (benchmarks time them as one).
    if (!(stages & kStageKernel)) return SAGE_OK;
    e = fp4::run(fp4_params(r, a, plan, ws), stream);
    if (e != cudaSuccess)
      return set_error(SAGE_ERROR_CUDA, "FP4 attention launch: %s", cudaGetErrorString(e));
    return SAGE_OK;
  }
  if (stages & kStagePrepass) e = quant::run_prepass(plan.prepass, in, ws, dev.index, stream);
  if (e != cudaSuccess)
    return set_error(SAGE_ERROR_CUDA, "pre-pass launch: %s", cudaGetErrorString(e));
  if (!(stages & kStageKernel)) return SAGE_OK;

  if (plan.family == api::Family::kSm90) {
    const sm90::Params sp = sm90_params(r, a, plan, ws);
    const sm90::LaunchConfig cfg{plan.consumers, bf16, causal, dev.index, dev.sms};
    e = plan.prepass.head_dim == 64    ? sm90::launch_attention<64>(sp, cfg, stream)
        : plan.prepass.head_dim == 128 ? sm90::launch_attention<128>(sp, cfg, stream)
                                       : sm90::launch_attention<256>(sp, cfg, stream);
  } else {
    const mma::AttnParams mp = mma_params(r, a, plan, ws);
    mma::LaunchConfig cfg{plan.prepass.bits, bf16, causal, plan.two_level,
                          plan.prepass.smooth_q, dev.index};
    cfg.padded = plan.prepass.channels < plan.prepass.head_dim;
    e = plan.prepass.head_dim == 64    ? mma::launch_attention<64>(mp, cfg, stream)
        : plan.prepass.head_dim == 128 ? mma::launch_attention<128>(mp, cfg, stream)
                                       : mma::launch_attention<256>(mp, cfg, stream);
  }
  if (e != cudaSuccess)
    return set_error(SAGE_ERROR_CUDA, "attention launch: %s", cudaGetErrorString(e));
  return SAGE_OK;
}

}  // namespace sage::cuda

namespace sage::cuda {
namespace {

// The backward's plan on this device (refused with UNSUPPORTED, never approximated).
sage_status plan_backward(const api::ResolvedBackward& r, const sage_backward_args& a,
                          api::Device* dev, api::BackwardPlan* plan) {
  SAGE_RETURN_IF_ERROR(current_device(dev));
  SAGE_RETURN_IF_ERROR(check_batch_heads("the backward", r.problem.batch, r.problem.heads_q));
  return api::make_backward_plan(r, a, *dev, plan);
}

bwd::Params backward_params(const api::ResolvedBackward& r, const sage_backward_args& a,
                            const bwd::Layout& w, uint8_t* ws) {
  const ref::Problem& p = r.problem;
  bwd::Params x{};
  // (Not the forward's O and LSE: the stats pass computes L' and D from the backward's scores.)
  x.q = a.q, x.k = a.k, x.v = a.v, x.d_o = a.d_o, x.d_lse = a.d_lse;
  x.dq = a.dq, x.dk = a.dk, x.dv = a.dv;
  x.q_st = r.q, x.k_st = r.k, x.v_st = r.v, x.do_st = r.d_o, x.dlse_st = r.dlse;
  x.dq_st = r.dq, x.dk_st = r.dk, x.dv_st = r.dv;
  auto f32 = [&](size_t off) { return reinterpret_cast<float*>(ws + off); };
  auto s8 = [&](size_t off) { return reinterpret_cast<int8_t*>(ws + off); };
  x.k_part = f32(w.k_part), x.k_mean = f32(w.k_mean), x.k_scale = f32(w.k_scale);
  x.q_part = f32(w.q_part), x.q_mean = f32(w.q_mean), x.key_term = f32(w.key_term);
  x.khat = s8(w.khat), x.khat_t = s8(w.khat_t);
  x.v_ws = reinterpret_cast<uint16_t*>(ws + w.v);
  x.q_scale = f32(w.q_scale), x.qhat = s8(w.qhat), x.qhat_t = s8(w.qhat_t);
  x.do_scale = f32(w.do_scale), x.dohat_t = s8(w.dohat_t);
  x.do_ws = reinterpret_cast<uint16_t*>(ws + w.d_o);
  x.qnorm2 = f32(w.qnorm2), x.knorm2 = f32(w.knorm2);
  x.lse2 = f32(w.lse2), x.delta = f32(w.delta), x.err2 = f32(w.err2);
  x.verdict = reinterpret_cast<int32_t*>(ws + w.verdict);
  x.dq_acc = f32(w.dq_acc);
  x.dq_turn = reinterpret_cast<int*>(ws + w.dq_turn);
  x.untrusted = a.untrusted;
  x.max_score_err = SAGE_BWD_MAX_SCORE_ERROR;
  x.deterministic = (a.options & SAGE_BWD_OPTION_DETERMINISTIC) != 0;
  x.batch = p.batch, x.heads_q = p.heads_q, x.heads_kv = p.heads_kv;
  x.seq_q = p.seq_q, x.seq_kv = p.seq_kv, x.nq_pad = w.nq_pad, x.nk_pad = w.nk_pad;
  x.q_blocks = w.q_blocks, x.k_blocks = w.k_blocks, x.k_chunks = w.k_chunks;
  x.q_chunks = w.q_chunks;
  x.causal = p.mask != SAGE_MASK_NONE;
  x.causal_offset = causal_offset(p);
  x.smooth_k = (r.config.smooth & SAGE_SMOOTH_K) != 0;
  x.smooth_q = (r.config.smooth & SAGE_SMOOTH_Q) != 0;
  x.scale = float(p.scale);
  x.scale_log2 = float(p.scale * 1.4426950408889634);
  return x;
}

// The forward-normalized backward's params (its workspace: plan.fn_layout).
bwd::fn::Params fn_params(const api::ResolvedBackward& r, const sage_backward_args& a,
                          const bwd::fn::Layout& w, uint8_t* ws) {
  const ref::Problem& p = r.problem;
  bwd::fn::Params x{};
  x.q = a.q, x.k = a.k, x.v = a.v, x.d_o = a.d_o, x.d_lse = a.d_lse;
  x.o = a.o, x.lse = a.lse;
  x.dq = a.dq, x.dk = a.dk, x.dv = a.dv;
  x.q_st = r.q, x.k_st = r.k, x.v_st = r.v, x.do_st = r.d_o, x.dlse_st = r.dlse;
  x.o_st = r.o, x.lse_st = r.lse;
  x.dq_st = r.dq, x.dk_st = r.dk, x.dv_st = r.dv;
  x.lse2 = reinterpret_cast<float*>(ws + w.lse2);
  x.delta = reinterpret_cast<float*>(ws + w.delta);
  x.dq_acc = reinterpret_cast<float*>(ws + w.dq_acc);
  x.batch = p.batch, x.heads_q = p.heads_q, x.heads_kv = p.heads_kv;
  x.seq_q = p.seq_q, x.seq_kv = p.seq_kv, x.nq_pad = w.nq_pad, x.q_blocks = w.q_blocks;
  x.causal = p.mask != SAGE_MASK_NONE;
  x.causal_offset = causal_offset(p);
  x.scale = float(p.scale);
  x.scale_log2 = float(p.scale * 1.4426950408889634);
  return x;
}

}  // namespace

sage_status backward_workspace_size(const api::ResolvedBackward& r, const sage_backward_args& a,
                                    size_t* bytes) {
  api::Device dev;
  api::BackwardPlan plan;
  SAGE_RETURN_IF_ERROR(plan_backward(r, a, &dev, &plan));
  *bytes = plan.workspace();
  return SAGE_OK;
}

sage_status backward(const api::ResolvedBackward& r, const sage_backward_args& a) {
  api::Device dev;
  api::BackwardPlan plan;
  SAGE_RETURN_IF_ERROR(plan_backward(r, a, &dev, &plan));
  if (a.workspace_size < plan.workspace() || a.workspace == nullptr)
    return set_error(SAGE_ERROR_WORKSPACE_TOO_SMALL,
                     "workspace_size = %zu, this call needs %zu bytes "
                     "(sage_backward_workspace_size)",
                     a.workspace_size, plan.workspace());
  if (reinterpret_cast<uintptr_t>(a.workspace) % 256 != 0)
    return set_error(SAGE_ERROR_INVALID_ARGUMENT, "workspace = %p must be 256-byte aligned",
                     a.workspace);
  if (pointer_kind(a.workspace) != PointerKind::kDevice)
    return set_error(SAGE_ERROR_INVALID_ARGUMENT, "workspace = %p is not device memory",
                     a.workspace);
  cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
  const bool bf16 = a.dtype == SAGE_DTYPE_BF16;
  if (plan.forward_normalized) {
    if (a.untrusted) {  // nothing is quantized: the gradients are always the 16-bit ones
      const cudaError_t z = cudaMemsetAsync(a.untrusted, 0, sizeof(int32_t), stream);
      if (z != cudaSuccess)
        return set_error(SAGE_ERROR_CUDA, "backward: %s", cudaGetErrorString(z));
    }
    const bwd::fn::Params x =
        fn_params(r, a, plan.fn_layout, static_cast<uint8_t*>(a.workspace));
    const cudaError_t e = r.problem.head_dim == 64
                              ? bwd::fn::run<64>(x, bf16, dev.index, stream)
                              : bwd::fn::run<128>(x, bf16, dev.index, stream);
    if (e != cudaSuccess)
      return set_error(SAGE_ERROR_CUDA, "backward launch: %s", cudaGetErrorString(e));
    return SAGE_OK;
  }
  const bwd::Params x = backward_params(r, a, plan.layout, static_cast<uint8_t*>(a.workspace));
  const bool sm90 = plan.family == api::Family::kSm90;
  const cudaError_t e = r.problem.head_dim == 64
                            ? bwd::run<64>(x, bf16, sm90, dev.index, stream)
                            : bwd::run<128>(x, bf16, sm90, dev.index, stream);
  if (e != cudaSuccess)
    return set_error(SAGE_ERROR_CUDA, "backward launch: %s", cudaGetErrorString(e));
  return SAGE_OK;
}

}  // namespace sage::cuda
