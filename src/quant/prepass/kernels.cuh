// The pre-pass kernels (sm_89+; kv_prepass sm_90+): each takes its one Params (params.h), enters
// the programmatic-dependent-launch chain (pdl_enter) and runs its role's body (stats.cuh,
// kv_block.cuh, kv_cluster.cuh, q_quant.cuh). The template arguments are the plan's choices:
// element type, head dim D, K's bits, the loads' width (kVec: PrepassPlan::vec_kv, vec_q) and,
// for Q, smoothing. Their thread counts are the bodies' (kKvThreads, kQThreads,
// finalize_threads), so the launcher and the bounds below share them.
#pragma once

#include <cstdint>

#include "quant/prepass/common.cuh"
#include "quant/prepass/kv_block.cuh"
#include "quant/prepass/kv_cluster.cuh"
#include "quant/prepass/params.h"
#include "quant/prepass/q_quant.cuh"
#include "quant/prepass/stats.cuh"

namespace sage::quant::prepass {

constexpr int kKvThreads = 256;  // kv_prepass, kv_stats, quant_kv: 4 a key, 64 keys
constexpr int kQThreads = 512;   // quant_q: 4 a row, 128 rows
// kv_finalize: a thread per channel, at most 128 (D = 256 loops twice).
constexpr int finalize_threads(int D) { return D < 128 ? D : 128; }

// K/V in one launch (a cluster per KV head: kv_cluster.cuh).
template <typename T, int D, int kBits, bool kVec>
__global__ void __launch_bounds__(kKvThreads, D <= 64 ? 3 : 2)
    kv_prepass_kernel(const KvPrepassParams params) {
  const KvPrepassParams p = in_registers(params);
  pdl_enter();
  extern __shared__ __align__(16) uint8_t stage[];
  kv_prepass<T, D, kBits, kVec>(p, stage);
}

// The three-launch path: statistics, finalize, quantization.
template <typename T, int D, bool kVec>
__global__ void __launch_bounds__(kKvThreads, 2) kv_stats_kernel(const KvStatsParams params) {
  const KvStatsParams p = in_registers(params);
  pdl_enter();
  extern __shared__ __align__(16) uint8_t stage[];
  kv_stats<T, D, kVec>(p, stage);
}

template <int D>
__global__ void __launch_bounds__(128) kv_finalize_kernel(const KvFinalizeParams params) {
  const KvFinalizeParams p = in_registers(params);
  pdl_enter();
  kv_finalize<D>(p);
}

// At D = 256 a thread holds twice the K and V words: two CTAs an SM (128 registers; at three,
// ptxas spilled ~0.5 KB a thread).
template <typename T, int D, int kBits, bool kVec>
__global__ void __launch_bounds__(kKvThreads, D <= 64 ? 4 : D <= 128 ? 3 : 2)
    quant_kv_kernel(const QuantKvParams params) {
  const QuantKvParams p = in_registers(params);
  pdl_enter();
  quant_kv<T, D, kBits, kVec>(p);
}

// (At D = 256, one CTA an SM: 128 registers for the row's 32 words.)
template <typename T, int D, int kBits, bool kVec, bool kSmooth>
__global__ void __launch_bounds__(kQThreads, D <= 128 ? 2 : 1)
    quant_q_kernel(const QuantQParams params) {
  const QuantQParams p = in_registers(params);
  pdl_enter();
  quant_q<T, D, kBits, kVec, kSmooth>(p);
}

}  // namespace sage::quant::prepass
