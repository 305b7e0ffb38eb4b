// The pre-pass's __global__ functions (sm_89+; kv_prepass sm_90+): each takes its one Params
// (params.h), which the launcher (quant/prepass.cu) fills from the plan, enters the
// programmatic-dependent-launch chain (pdl_enter) and runs its role (kv_cluster.cuh,
// kv_split.cuh, q_quant.cuh). The template arguments are the plan's choices: element type, head
// dim D, K's bits, the loads' width (kVec: PrepassPlan::vec_kv, vec_q) and, for Q, smoothing.
// The thread counts below are the roles' (4 threads a key or a row), shared with the launcher.
// (Included only by quant/prepass.cu, the pre-pass's one translation unit: the code sits in
// that file's anonymous namespace, so the kernels stay internal to it.)
#pragma once

#include "quant/prepass/common.cuh"
#include "quant/prepass/kv_cluster.cuh"
#include "quant/prepass/kv_split.cuh"
#include "quant/prepass/params.h"
#include "quant/prepass/q_quant.cuh"
#include "quant/prepass/sample.cuh"

namespace sage::quant {
namespace {

// Each kernel takes its Params by value and copies it part by part at entry, before pdl_enter
// (in_registers): a parameter block read where the roles use its fields is loaded at each use,
// while the copy loads it once, as the positional arguments were (docs/sm90-kernel.md, Tried 45).
template <typename... Parts>
__device__ __forceinline__ ParamsOf<Parts...> in_registers(const ParamsOf<Parts...>& p) {
  ParamsOf<Parts...> q;
  ((static_cast<Parts&>(q) = static_cast<const Parts&>(p)), ...);
  return q;
}

constexpr int kKvThreads = 256;  // kv_prepass, kv_stats, quant_kv: 4 a key, 64 keys
constexpr int kQThreads = 512;   // quant_q: 4 a row, 128 rows

// K/V in one launch, a cluster per KV head (PrepassPlan::kv_cluster > 0).
template <typename T, int D, int kBits, bool kVec>
__global__ void __launch_bounds__(kKvThreads, D <= 64 ? 3 : 2)
    kv_prepass_kernel(const KvPrepassParams params) {
  const auto p = in_registers(params);
  pdl_enter();
  extern __shared__ __align__(16) uint8_t stage[];
  kv_prepass<T, D, kBits, kVec>(p, stage);
}

// K/V in three launches: statistics, finalize, quantization (or, sampled: sample, quantization,
// fix).
template <typename T, int D, bool kVec>
__global__ void __launch_bounds__(kKvThreads, 2)
    kv_stats_kernel(const KvStatsParams params) {
  const auto p = in_registers(params);
  pdl_enter();
  extern __shared__ __align__(16) uint8_t stage[];
  kv_stats<T, D, kVec>(p, stage);
}

template <int D>
__global__ void __launch_bounds__(kFinalizeThreads)
    kv_finalize_kernel(const KvFinalizeParams params) {
  const auto p = in_registers(params);
  pdl_enter();
  kv_finalize<D>(p);
}

// At D = 256 a thread holds twice the K and V words: two CTAs an SM (128 registers; at three,
// ptxas spilled ~0.5 KB a thread).
// kCheck: the sampled path's, which checks V against its bounds (PrepassPlan::kv_sampled).
template <typename T, int D, int kBits, bool kVec, bool kCheck>
__global__ void __launch_bounds__(kKvThreads, D <= 64 ? 4 : D <= 128 ? 3 : 2)
    quant_kv_kernel(const QuantKvParams params) {
  const auto p = in_registers(params);
  if constexpr (!kCheck) pdl_enter();  // (the sampled path's: in quant_kv, after its loads)
  quant_kv<T, D, kBits, kVec, kCheck>(p);
}

// The staged quantization (planned at D = 64): a grid of about the CTAs the SMs hold
// (PrepassPlan::kv_grid), two stages of a block each in dynamic shared memory
// (kStagedQuantKvBytes).
template <typename T, int D, int kBits, bool kVec, bool kCheck>
__global__ void __launch_bounds__(kKvThreads, D <= 64 ? 4 : 3)
    quant_kv_staged_kernel(const QuantKvParams params) {
  const auto p = in_registers(params);
  pdl_enter();
  extern __shared__ __align__(16) uint8_t stage[];
  quant_kv_staged<T, D, kBits, kVec, kCheck>(p, stage);
}

// The sampled path's first and last launches (sample.cuh): a CTA per (sequence, KV head).
template <typename T, int D, bool kVec>
__global__ void __launch_bounds__(kSampleThreads) kv_sample_kernel(const KvSampleParams params) {
  const auto p = in_registers(params);
  pdl_enter();
  kv_sample<T, D, kVec>(p);
}

template <typename T, int D, bool kVec>
__global__ void __launch_bounds__(kKvThreads) fix_v_kernel(const VFixParams params) {
  const auto p = in_registers(params);
  pdl_enter();
  fix_v<T, D, kVec>(p);
}

// Q (PrepassPlan::quantize_q). At D = 256, one CTA an SM: 128 registers for the row's 32 words.
template <typename T, int D, int kBits, bool kVec, bool kSmooth>
__global__ void __launch_bounds__(kQThreads, D <= 128 ? 2 : 1)
    quant_q_kernel(const QuantQParams params) {
  const auto p = in_registers(params);
  pdl_enter();
  quant_q<T, D, kBits, kVec, kSmooth>(p);
}

}  // namespace
}  // namespace sage::quant
