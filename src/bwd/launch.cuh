// Host side of SageBwd's kernels: the launch sequence of one backward call on the caller's stream
// (pre-pass, stats pass and main kernel: both mma.sync or both wgmma, verdict, dQ store, NaN on
// a refused call), instantiated per head dim in backward_d*.cu.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>

#include "bwd/kernel.cuh"
#include "bwd/launch.h"
#include "bwd/prepass.cuh"
#include "bwd/sm90/kernel.cuh"
#include "bwd/sm90/stats.cuh"
#include "bwd/stats.cuh"
#include "common/grid.h"
#include "common/launch.h"

namespace sage::bwd {

// kKernel (the stats pass or the main kernel, <causal>) with its dynamic shared memory set once
// per device.
template <auto kKernel, typename P>
cudaError_t launch_smem(const P& p, dim3 grid, int smem, int device, cudaStream_t stream) {
  const cudaError_t e = set_max_dynamic_smem_once<kKernel>(device, smem);
  if (e != cudaSuccess) return e;
  kKernel<<<grid, kThreads, smem, stream>>>(p);
  return cudaSuccess;
}

template <typename T, int D>
cudaError_t run_typed(const Params& p, bool sm90, int device, cudaStream_t stream) {
  // B·H over the grids' y and z (common/grid.h); judge_kernel's along x (the backend refuses more
  // than 2^31 - 1).
  const int64_t bq = p.batch * p.heads_q, bk = p.batch * p.heads_kv;
  sum_kernel<T, D, false><<<outer_dims(p.k_chunks, bk), D, 0, stream>>>(SumParams(p));
  sum_kernel<T, D, true><<<outer_dims(p.q_chunks, bq), D, 0, stream>>>(SumParams(p));
  mean_kernel<D, false><<<outer_dims(1, bk), D, 0, stream>>>(MeanParams(p));
  mean_kernel<D, true><<<outer_dims(1, bq), D, 0, stream>>>(MeanParams(p));
  const int k_smem = kBlockK * (D + 1) * 4, q_smem = 2 * kBlockQ * (D + 1) * 4;
  cudaError_t e = set_max_dynamic_smem_once<k_prep_kernel<T, D>>(device, k_smem);
  if (e == cudaSuccess) e = set_max_dynamic_smem_once<q_prep_kernel<T, D>>(device, q_smem);
  if (e != cudaSuccess) return e;
  const dim3 q_grid = outer_dims(p.q_blocks, bq), k_grid = outer_dims(p.k_blocks, bk);
  k_prep_kernel<T, D><<<k_grid, kThreads, k_smem, stream>>>(KPrepParams(p));
  q_prep_kernel<T, D><<<q_grid, kThreads, q_smem, stream>>>(QPrepParams(p));
  // The stats pass in the main kernel's family: wgmma where that is (sm_90a), else mma.sync.
  const StatsParams sp(p);
  if (sm90) {
    constexpr int kSmem = sm90::StatsSmem<D>::kBytes;
    e = p.causal
            ? launch_smem<sm90::stats_kernel<T, D, true>>(sp, q_grid, kSmem, device, stream)
            : launch_smem<sm90::stats_kernel<T, D, false>>(sp, q_grid, kSmem, device, stream);
  } else {
    constexpr int kSmem = StatsSmem<D>::kBytes;
    e = p.causal ? launch_smem<stats_kernel<T, D, true>>(sp, q_grid, kSmem, device, stream)
                 : launch_smem<stats_kernel<T, D, false>>(sp, q_grid, kSmem, device, stream);
  }
  if (e != cudaSuccess) return e;
  judge_kernel<D><<<unsigned((bq + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      JudgeParams(p));
  const MainParams mp(p);
  if (sm90) {
    constexpr int kSmem = sm90::Smem<D>::kBytes;
    e = p.causal
            ? launch_smem<sm90::backward_kernel<T, D, true>>(mp, k_grid, kSmem, device, stream)
            : launch_smem<sm90::backward_kernel<T, D, false>>(mp, k_grid, kSmem, device, stream);
  } else {
    constexpr int kSmem = Smem<D>::kBytes;
    e = p.causal ? launch_smem<backward_kernel<T, D, true>>(mp, k_grid, kSmem, device, stream)
                 : launch_smem<backward_kernel<T, D, false>>(mp, k_grid, kSmem, device, stream);
  }
  if (e != cudaSuccess) return e;
  dq_store_kernel<T, D><<<q_grid, kThreads, 0, stream>>>(DqStoreParams(p));
  // The poison grid strides over the gradients: at most 1024 CTAs, enough to fill a GPU on an
  // untrusted call and few to launch on the usual one, where each returns at once.
  const int64_t most = std::max(bq * p.seq_q, bk * p.seq_kv) * D;
  const unsigned blocks = unsigned(std::min<int64_t>(1024, (most + kThreads - 1) / kThreads));
  poison_kernel<T, D><<<blocks, kThreads, 0, stream>>>(PoisonParams(p));
  return cudaGetLastError();
}

template <int D>
cudaError_t run(const Params& p, bool bf16, bool sm90, int device, cudaStream_t stream) {
  return bf16 ? run_typed<__nv_bfloat16, D>(p, sm90, device, stream)
              : run_typed<__half, D>(p, sm90, device, stream);
}

}  // namespace sage::bwd
