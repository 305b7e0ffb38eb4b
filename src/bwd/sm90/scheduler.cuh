// What one CTA of SageBwd's Hopper main kernel does: its 64 keys of a KV head (blockIdx.x, the
// grid's outer index) and the query blocks it streams, in order: every block of each query head
// of the KV head's group from the first one a causal mask lets see its keys.
#pragma once

#include "bwd/kernel.cuh"  // cta_outer_index
#include "bwd/params.h"

namespace sage::bwd::sm90 {

struct CtaWork {
  int64_t kb, bkv, b, hkv, k0;  // key block, KV head (b·Hkv + hkv), its first key
  int64_t iters;                // query blocks streamed: n_q per query head of the group
  BlockWalk first;              // the first of them

  // Whether the grid's outer index is past the last KV head (the whole CTA returns).
  __device__ bool idle(const MainParams& p) const { return bkv >= p.batch * p.heads_kv; }
};

template <bool kCausal>
__device__ __forceinline__ CtaWork cta_work(const MainParams& p) {
  CtaWork w;
  w.kb = blockIdx.x;
  w.bkv = cta_outer_index();
  w.k0 = w.kb * kBlockK;
  w.b = w.bkv / p.heads_kv;
  w.hkv = w.bkv % p.heads_kv;
  const QueryStream q = query_stream<kCausal>(p, w.b, w.hkv, w.k0);
  w.iters = q.iters;
  w.first = q.first;
  return w;
}

}  // namespace sage::bwd::sm90
