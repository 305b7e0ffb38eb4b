// Host side of SageBwd's kernels: the launch sequence of one backward call (pre-pass, main
// kernel: mma.sync or wgmma, dQ store) on the caller's stream, instantiated per head dim in
// backward_d*.cu.
#pragma once

#include <cuda_runtime.h>

#include "bwd/kernel.cuh"
#include "bwd/launch.h"
#include "bwd/prepass.cuh"
#include "bwd/sm90_kernel.cuh"
#include "common/grid.h"
#include "common/launch.h"

namespace sage::bwd {

// The main kernel <causal> with its dynamic shared memory set once per device.
template <auto kKernel>
cudaError_t launch_main(const Params& p, int smem, int device, cudaStream_t stream) {
  const cudaError_t e = set_max_dynamic_smem_once<kKernel>(device, smem);
  if (e != cudaSuccess) return e;
  kKernel<<<outer_dims(p.k_blocks, p.batch * p.heads_kv), kThreads, smem, stream>>>(p);
  return cudaSuccess;
}

template <typename T, int D>
cudaError_t run_typed(const Params& p, bool sm90, int device, cudaStream_t stream) {
  // B·H over the grids' y and z (common/grid.h); k_mean's along x (the backend refuses more than
  // 2^31 - 1).
  const int64_t bq = p.batch * p.heads_q, bk = p.batch * p.heads_kv;
  k_sum_kernel<T, D><<<outer_dims(p.k_chunks, bk), D, 0, stream>>>(p);
  k_mean_kernel<D><<<unsigned(bk), D, 0, stream>>>(p);
  const int k_smem = kBlockK * (D + 1) * 4, q_smem = 2 * kBlockQ * (D + 1) * 4;
  cudaError_t e = set_max_dynamic_smem_once<k_prep_kernel<T, D>>(device, k_smem);
  if (e == cudaSuccess) e = set_max_dynamic_smem_once<q_prep_kernel<T, D>>(device, q_smem);
  if (e != cudaSuccess) return e;
  k_prep_kernel<T, D><<<outer_dims(p.k_blocks, bk), kThreads, k_smem, stream>>>(p);
  q_prep_kernel<T, D><<<outer_dims(p.q_blocks, bq), kThreads, q_smem, stream>>>(p);
  if (sm90) {
    constexpr int kSmem = sm90::Smem<D>::kBytes;
    e = p.causal ? launch_main<sm90::backward_kernel<T, D, true>>(p, kSmem, device, stream)
                 : launch_main<sm90::backward_kernel<T, D, false>>(p, kSmem, device, stream);
  } else {
    constexpr int kSmem = Smem<D>::kBytes;
    e = p.causal ? launch_main<backward_kernel<T, D, true>>(p, kSmem, device, stream)
                 : launch_main<backward_kernel<T, D, false>>(p, kSmem, device, stream);
  }
  if (e != cudaSuccess) return e;
  dq_store_kernel<T, D><<<outer_dims(p.q_blocks, bq), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <int D>
cudaError_t run(const Params& p, bool bf16, bool sm90, int device, cudaStream_t stream) {
  return bf16 ? run_typed<__nv_bfloat16, D>(p, sm90, device, stream)
              : run_typed<__half, D>(p, sm90, device, stream);
}

}  // namespace sage::bwd
