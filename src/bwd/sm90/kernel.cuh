// SageBwd's main kernel on Hopper (sm_90a): the products of the mma.sync kernel (bwd/kernel.cuh)
// as warpgroup MMAs. One CTA is one warpgroup that owns 64 keys of a KV head and streams the
// 64-query blocks of its group's query heads (scheduler.cuh); two CTAs share an SM at D = 128,
// three at D = 64. The roles: loads.cuh (cp.async of the keys and of each block's two halves,
// prefetched a block ahead), mainloop.cuh (scores, P and dS, dV and dK, dS^ for dQ),
// epilogue.cuh (dQ into the workspace's accumulator, dK and dV out). The workspace, the ψ scales
// and the arithmetic are the mma.sync kernel's, so both match one emulation.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "bwd/params.h"
#include "bwd/sm90/epilogue.cuh"
#include "bwd/sm90/loads.cuh"
#include "bwd/sm90/mainloop.cuh"
#include "bwd/sm90/scheduler.cuh"
#include "bwd/sm90/smem.h"
#include "ptx/wgmma.cuh"

namespace sage::bwd::sm90 {

template <typename T, int D, bool kCausal>
__global__ void __launch_bounds__(kThreads, D == 64 ? 3 : 2) backward_kernel(const MainParams p) {
#ifdef SAGE_PTX_HAS_WGMMA
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // Aligned by an offset from smem_raw (not by casting an integer), so that the compiler keeps
  // the shared address space: LDS/STS instead of generic loads and stores.
  uint8_t* smem = smem_raw + ((1024 - (__cvta_generic_to_shared(smem_raw) & 1023)) & 1023);
  const CtaWork w = cta_work<kCausal>(p);
  // (the whole CTA, before any barrier; a call the verdict refused is NaN whatever this computes)
  if (w.idle(p) || refused(p)) return;

  const Loads<D> loads{p, smem};
  BlockWalk next = w.first;
  loads.keys(w);
  loads.half_a(next, w.iters > 0);
  loads.half_b(next, w.iters > 0);
  Mainloop<T, D, kCausal> m(p, smem, w);
  const Epilogue<T, D, kCausal> epi{p, smem, w};
  for (int64_t it = 0; it < w.iters; ++it) {
    const bool more = it + 1 < w.iters;
    Block b;
    loads.wait_older();  // half A of this block (B may still be landing)
    m.scores(next, b);
    next.next();
    __syncthreads();  // the maxima are in; half A is free
    loads.half_a(next, more);
    m.query_scales();
    __syncthreads();
    m.store_ds(b);
    loads.wait_older();  // half B of this block (A of the next may still be landing)
    m.dv_dk(b);
    if (p.smooth_q && (!more || next.bh != b.bh)) m.add_q_term(b.bh);  // the head's last block
    __syncthreads();  // every read of half B is done
    loads.half_b(next, more);
    epi.dq(b, m);
  }
  epi.dk_dv(m);
#endif
}

}  // namespace sage::bwd::sm90
