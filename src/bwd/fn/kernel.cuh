// The forward-normalized 16-bit backward's main kernel on Hopper (sm_90a; other architectures
// compile an empty body): FlashAttention-3's shape of a backward. A CTA owns 128 keys of a KV head
// (scheduler.cuh); a producer warpgroup brings K and V once and each 64-query block's Q and dO by
// TMA into two stages (producer.cuh); two consumer warpgroups of 64 keys each run the block's
// products (mainloop.cuh) and add its dQ into the workspace (epilogue.cuh); dK and dV stay in
// their registers until the CTA's last block.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "bwd/fn/epilogue.cuh"
#include "bwd/fn/mainloop.cuh"
#include "bwd/fn/producer.cuh"
#include "bwd/fn/scheduler.cuh"
#include "bwd/fn/smem.h"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"

namespace sage::bwd::fn {

constexpr int kThreads = 384;
constexpr int kProducerRegs = 40, kConsumerRegs = 232;

template <typename T, int D, bool kCausal>
__global__ void __launch_bounds__(kThreads, 1)
    main_kernel(const Params p, const __grid_constant__ TmaMaps maps) {
#ifdef SAGE_PTX_HAS_WGMMA
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (__cvta_generic_to_shared(smem_raw) & 1023)) & 1023);
  __shared__ Barriers bar;
  if (cta_outer_index() >= p.batch * p.heads_kv) return;  // (the whole CTA)
  const CtaWork w = cta_work<kCausal>(p);
  if (threadIdx.x == 0) {
    ptx::mbar_init(&bar.keys, 1);
    for (int s = 0; s < 2; ++s) {
      ptx::mbar_init(&bar.full[s], 1);
      ptx::mbar_init(&bar.empty[s], 256);  // every consumer thread
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    ptx::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0) Producer<D>{p, maps, bar, smem}.run(w);
    return;
  }
  ptx::setmaxnreg_inc<kConsumerRegs>();
  Mainloop<T, D, kCausal> m(p, bar, smem, w);
  const Epilogue<T, D, kCausal> epi{p, smem};
  ptx::mbar_wait(&bar.keys, 0);
  BlockWalk walk = w.first;
  for (int64_t it = 0; it < w.iters; ++it, walk.next()) {
    m.block(walk, it);
    epi.dq(walk, m);
  }
  epi.dk_dv(w, m);
#endif
}

}  // namespace sage::bwd::fn
