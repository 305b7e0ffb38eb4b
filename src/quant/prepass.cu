// Pre-pass kernels of both attention kernels (sm_89+), each the GPU twin of a step of the CPU
// emulation (src/ref/prepass.cpp), with the same float operations in the same order where
// the result is quantized. Bytes moved (B·H·N·D elements of 2 bytes each for Q, K, V):
//   kv_prepass   (sm_90+, a KV head of at most 8 chunks: PrepassPlan::kv_cluster) reads K and V
//                once (2+2 B/elem), writes the chunk statistics, INT8/INT4 K + scales and E4M3
//                Vᵀ as the next three do, in one launch
//   kv_stats     reads V (2 B/elem) and every k_mean_stride-th row of K (the smoothing mean
//                of K from a sample: ~256 rows a head with the presets), writes 24 B per (head,
//                128-token chunk, channel), in the bytes the head's Vᵀ later takes
//   kv_finalize  reads those statistics, writes 16 B per (head, channel)
//   quant_kv     reads K and V (2+2 B/elem, kept in registers), writes INT8 (1 B) or INT4
//                (0.5 B) K + 4 scales per 64 keys, and E4M3 Vᵀ (1 B)
//   quant_q      reads Q (2 B/elem; again from L2 for the mean with Q smoothing), writes
//                INT8/INT4 Q + scales (+ the block means with Q smoothing) and the LSE
//                correction (4 B/row, NaN for a poisoned row); skipped when the sm90 kernel
//                quantizes Q itself (PrepassPlan::quantize_q false: attn/sm90 producer)
// (ΔS of Q smoothing is no pre-pass product: the mma kernel forms it from the caller's K.)
// Per call: Q 2 B read, K 2 B and V 4 B read (2 B with kv_prepass), ~1 + 1 + 1 (+0.5) B written
// per element. In three launches V is read twice (its exact channel mean and range, then
// quantize): the sm90 kernel's wgmma accumulator needs V - v_mean to sum to zero
// (docs/sm90-kernel.md, Tried and rejected).
//
// Throughput notes (the kernels are memory-bound only if nothing else is slower):
// - A thread issues every load of its rows before it uses any (kv_stats, kv_prepass: a whole
//   chunk staged by cp.async), as 16-byte loads when every row of the tensor is 16-byte aligned,
//   decided once on the host by the planner: kVec (PrepassPlan::vec_kv, vec_q).
// - No fp32→fp64 conversion instruction on the hot paths (F2F.F64 issues at a small fraction of
//   the FP64 rate). The sums of kv_stats and the LSE dot product of quant_q need each fp16/bf16
//   value x as a double: its sign, exponent and mantissa bits placed in a double's fields give
//   exactly x·2^-kScaleExp (subnormals included), a power-of-two multiply (or, for sums, the
//   scale invariance of the rounding) gives x itself. Inf/NaN inputs break that and take the
//   original converting path (detected per slice or per thread).
// - Integer quantization rounds with the 1.5·2^23 addition instead of FRND + F2I, and drops the
//   clamp and NaN test where they cannot act (no NaN, finite group amax and inv); no per-element
//   branches (rows past the sequence are zeroed by a mask on the packed word).
// - Max/min that need no float rounding run on the packed 16-bit inputs (kv_stats' V range,
//   quant_q's max |q| without smoothing).
// - Grids are (blocks, batch·heads spread over y and z: common/grid.h), so any count of heads
//   launches; a CTA decodes its (b, h) once in its prologue (one division), none in a loop.
// - Every kernel is PDL-launched (launch_pdl) and waits in its prologue (pdl_enter).
// The kernels are in role files under quant/prepass/ (common, stage, stats, kv_block,
// kv_cluster, kv_split, q_quant), each __global__ a few lines in kernels.cuh taking one Params
// (params.h); this file includes them and holds the launcher, which fills each kernel's Params
// from the plan and launches what the plan names.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "common/formats.h"
#include "common/grid.h"
#include "common/launch.h"
#include "ptx/async.cuh"
#include "ptx/barrier.cuh"
#include "ptx/cvt.cuh"
#include "quant/elements.cuh"
#include "quant/prepass.h"
#include "quant/prepass/kernels.cuh"
#include "quant/prepass/params.h"

namespace sage::quant {
namespace {

using Plan = PrepassPlan;

// The parts of the kernels' Params (params.h), from the plan, the caller's tensors and the
// workspace (the offsets of layout.h); each launch below takes its kernel's parts.
struct Parts {
  KvInput kv_in;
  KvHeads heads;
  KMeanSampling sampling;
  Smoothing smoothing;
  ChunkStatsOut stats;
  HeadFinalOut final_out;
  HeadFinalIn final_in;
  KvQuantOut kv_out;
  VBound v_bound;
  QInput q_in;
  QHeads q_heads;
  QRows q_rows;
  LseShiftIn lse_in;
  QQuantOut q_out;
};

Parts parts_of(const Plan& p, const PrepassInputs& in, uint8_t* ws) {
  auto f32 = [&](size_t off) { return reinterpret_cast<float*>(ws + off); };
  auto* kv_bad = reinterpret_cast<unsigned long long*>(ws + p.kv_bad);
  // The caller's channels (<= D, a multiple of 8): the kernels read these and write the rest of
  // D as zero channels (layout.h, PrepassPlan::channels).
  const int dim = int(p.channels);
  Parts x{};
  x.kv_in = {in.k, in.v, in.k_strides, in.v_strides, dim};
  x.heads = {p.heads_kv, p.batch * p.heads_kv, p.kv_rows};
  x.sampling = {p.k_mean_tokens};
  x.smoothing = {p.smooth_k, p.smooth_v};
  x.stats = {reinterpret_cast<KvStat*>(ws + p.kv_stats)};
  x.final_out = {f32(p.k_mean), f32(p.v_mean), f32(p.v_scale), f32(p.v_inv),
                 reinterpret_cast<unsigned*>(ws + p.tile_counter), kv_bad, int32_t(p.counters)};
  x.final_in = {f32(p.k_mean), f32(p.v_mean), f32(p.v_inv), kv_bad};
  x.kv_out = {ws + p.k, f32(p.k_scale), ws + p.v};
  x.v_bound = {f32(p.v_bound), reinterpret_cast<unsigned*>(ws + p.v_amax),
               reinterpret_cast<unsigned*>(ws + p.v_over)};
  x.q_in = {in.q, in.q_strides, dim};
  x.q_heads = {int(p.heads_kv), int(p.heads_q / p.heads_kv), p.batch * p.heads_q};
  x.q_rows = {p.q_rows, p.kv_rows, p.shift_rows};
  x.lse_in = {in.scale, f32(p.k_mean), kv_bad, in.sight, in.bottom_right};
  x.q_out = {ws + p.q, f32(p.q_scale), p.smooth_q ? f32(p.q_mean) : nullptr, f32(p.lse_shift)};
  return x;
}

// The plan's steps for head dim D, as it names them: K/V in one cluster launch (kv_cluster > 0)
// or three, Q's quantization or none (quantize_q), the loads' width (vec_kv, vec_q), K's bits
// and Q smoothing. Nothing here chooses.
template <typename T, int D>
cudaError_t launch_dim(const Plan& p, const PrepassInputs& in, uint8_t* ws, int device,
                       cudaStream_t st) {
  const Parts x = parts_of(p, in, ws);
  // (blocks, batch·heads_kv over y and z: common/grid.h).
  auto kv_grid = [&](int64_t blocks) { return outer_dims(blocks, x.heads.bk); };
  cudaError_t err = cudaSuccess;
  auto check = [&](cudaError_t e) {
    if (err == cudaSuccess) err = e;
  };
  // K and V: one launch (a cluster per head), or statistics, finalize and quantization.
  auto kv = [&](auto bits, auto vec) {
    constexpr int kBits = decltype(bits)::value;
    constexpr bool kVec = decltype(vec)::value;
    if (p.kv_cluster > 0) {
      if constexpr (Stage<D>::kRows == kStatTokens) {
        constexpr auto kernel = kv_prepass_kernel<T, D, kBits, kVec>;
        check(set_max_dynamic_smem_once<kernel>(device, Stage<D>::kBytes));
        LaunchShape shape{kv_grid(p.stat_chunks), dim3(kKvThreads), size_t(Stage<D>::kBytes)};
        shape.cluster = unsigned(p.kv_cluster);
        check(launch_pdl(kernel, shape, st,
                         KvPrepassParams{x.kv_in, x.heads, x.sampling, x.smoothing, x.stats,
                                         x.final_out, x.kv_out}));
      } else {
        // A chunk is not staged whole at D = 256: the planner plans no cluster there
        // (plan.cpp; tests/cpu/test_plan.cpp holds it).
        check(cudaErrorInvalidConfiguration);
      }
      return;
    }
    // Three launches either way: sampled (kv_sample, quant_kv checking V, fix_v), or the
    // statistics (kv_stats, kv_finalize, quant_kv).
    auto quantize = [&](auto checked) {
      constexpr bool kCheck = decltype(checked)::value;
      const QuantKvParams qp{x.kv_in, x.heads, x.final_in, x.kv_out, x.v_bound};
      if (p.kv_grid > 0) {
        if constexpr (D == 64) {
          constexpr auto kernel = quant_kv_staged_kernel<T, D, kBits, kVec, kCheck>;
          check(set_max_dynamic_smem_once<kernel>(device, kStagedQuantKvBytes<D>));
          check(launch_pdl(kernel,
                           {dim3(unsigned(p.kv_grid)), dim3(kKvThreads),
                            size_t(kStagedQuantKvBytes<D>)},
                           st, qp));
        } else {
          check(cudaErrorInvalidConfiguration);  // planned for D = 64 only (plan.cpp)
        }
      } else {
        check(launch_pdl(quant_kv_kernel<T, D, kBits, kVec, kCheck>,
                         {kv_grid(p.k_blocks), dim3(kKvThreads)}, st, qp));
      }
    };
    if (p.kv_sampled) {
      check(launch_pdl(kv_sample_kernel<T, D, kVec>,
                       {dim3(unsigned(x.heads.bk)), dim3(kSampleThreads)}, st,
                       KvSampleParams{x.kv_in, x.heads, x.sampling, x.smoothing, x.final_out,
                                      x.v_bound}));
      if (err != cudaSuccess) return;
      quantize(std::true_type{});
      if (err != cudaSuccess) return;
      const int64_t fix_ctas = p.k_blocks < kFixCtas ? p.k_blocks : kFixCtas;
      check(launch_pdl(fix_v_kernel<T, D, kVec>, {kv_grid(fix_ctas), dim3(kKvThreads)}, st,
                       VFixParams{x.kv_in, x.heads, x.final_out, x.kv_out, x.v_bound}));
      return;
    }
    constexpr auto stats_kernel = kv_stats_kernel<T, D, kVec>;
    check(set_max_dynamic_smem_once<stats_kernel>(device, Stage<D>::kBytes));
    check(launch_pdl(stats_kernel,
                     {kv_grid(p.stat_chunks), dim3(kKvThreads), size_t(Stage<D>::kBytes)}, st,
                     KvStatsParams{x.kv_in, x.heads, x.sampling, x.stats}));
    if (err != cudaSuccess) return;
    // A thread per channel, at most kFinalizeThreads (D = 256 loops twice). One CTA per
    // (sequence, KV head) along x (up to 2^31 - 1: the backend refuses more).
    constexpr int kFinalize = D < kFinalizeThreads ? D : kFinalizeThreads;
    check(launch_pdl(kv_finalize_kernel<D>, {dim3(unsigned(x.heads.bk)), dim3(kFinalize)}, st,
                     KvFinalizeParams{x.stats, x.heads, x.sampling, x.smoothing, x.final_out}));
    if (err != cudaSuccess) return;
    quantize(std::false_type{});
  };
  auto quant = [&](auto bits, auto vkv, auto vq) {
    constexpr int kBits = decltype(bits)::value;
    kv(bits, vkv);
    if (err != cudaSuccess || !p.quantize_q) return;  // the sm90 kernel quantizes Q itself
    auto qk = p.smooth_q ? quant_q_kernel<T, D, kBits, decltype(vq)::value, true>
                         : quant_q_kernel<T, D, kBits, decltype(vq)::value, false>;
    check(launch_pdl(qk, {outer_dims(p.q_blocks, x.q_heads.bq), dim3(kQThreads)}, st,
                     QuantQParams{x.q_in, x.q_heads, x.q_rows, x.lse_in, x.q_out}));
  };
  auto with_vec = [&](auto bits) {
    // The loads' width, as planned (PrepassPlan::vec_kv, vec_q).
    if (p.vec_kv && p.vec_q)
      quant(bits, std::true_type{}, std::true_type{});
    else if (p.vec_kv)
      quant(bits, std::true_type{}, std::false_type{});
    else if (p.vec_q)
      quant(bits, std::false_type{}, std::true_type{});
    else
      quant(bits, std::false_type{}, std::false_type{});
  };
  if (p.bits == 8)
    with_vec(std::integral_constant<int, 8>{});
  else
    with_vec(std::integral_constant<int, 4>{});
  return err;
}

template <typename T>
cudaError_t launch_all(const Plan& p, const PrepassInputs& in, uint8_t* ws, int device,
                       cudaStream_t st) {
  const cudaError_t e = p.head_dim == 64    ? launch_dim<T, 64>(p, in, ws, device, st)
                        : p.head_dim == 128 ? launch_dim<T, 128>(p, in, ws, device, st)
                                            : launch_dim<T, 256>(p, in, ws, device, st);
  const cudaError_t last = cudaGetLastError();  // also clears a launch error just returned
  return e != cudaSuccess ? e : last;
}

}  // namespace

int max_kv_cluster(int device) {
  // Portable clusters only: 16-CTA clusters (non-portable on the H100) measured slower than the
  // three launches at N = 2048 (docs/sm90-kernel.md, Tried 41). The largest instantiation
  // (D = 128: 70 KB of staged rows a CTA) decides for all.
  constexpr int kCluster = 8;
  constexpr auto kernel = kv_prepass_kernel<__half, 128, 8, true>;
  if (set_max_dynamic_smem_once<kernel>(device, Stage<128>::kBytes) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  LaunchShape shape{dim3(unsigned(kCluster)), dim3(kKvThreads), size_t(Stage<128>::kBytes)};
  shape.cluster = unsigned(kCluster);
  cudaLaunchAttribute attr[2];
  const cudaLaunchConfig_t cfg = launch_config(shape, nullptr, attr);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess && clusters > 0)
    return kCluster;
  cudaGetLastError();
  return 0;
}

namespace {
// CTAs of `kernel` an SM of `device` holds with `bytes` of dynamic shared memory (0: none, or the
// query failed).
template <auto kKernel>
int ctas_per_sm(int device, int bytes) {
  int n = 0;
  if (set_max_dynamic_smem_once<kKernel>(device, bytes) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, kKvThreads, bytes) !=
          cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}
}  // namespace

int staged_quant_kv_ctas(int device) {
  // The fp16 INT8 16-byte-load instantiation stands for all: the others differ in nothing that
  // limits residency (the same shared memory; registers under the same bounds).
  return ctas_per_sm<quant_kv_staged_kernel<__half, 64, 8, true, true>>(device,
                                                                      kStagedQuantKvBytes<64>);
}

cudaError_t run_prepass(const Plan& plan, const PrepassInputs& in, uint8_t* workspace, int device,
                        cudaStream_t stream) {
  return in.dtype == SAGE_DTYPE_BF16
             ? launch_all<__nv_bfloat16>(plan, in, workspace, device, stream)
             : launch_all<__half>(plan, in, workspace, device, stream);
}

}  // namespace sage::quant
