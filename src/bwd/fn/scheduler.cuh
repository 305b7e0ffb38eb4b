// What one CTA of the forward-normalized backward does: kKeys keys of a KV head (blockIdx.x, the
// grid's outer index) and the query blocks it streams: every block of each query head of the KV
// head's group from the first one a causal mask lets see its keys.
#pragma once

#include <cudaTypedefs.h>

#include "bwd/fn/params.h"
#include "common/grid.h"

namespace sage::bwd::fn {

// The caller's Q, dO ({D, Nq, Hq, B}, box {64, 64}) and K, V ({D, Nk, Hkv, B}, box {64, 128}),
// 16-bit, 128-byte swizzle; rows past the tensor read as zeros.
struct TmaMaps {
  CUtensorMap q, d_o, k, v;
};

struct CtaWork {
  int64_t b, hkv, k0;  // batch, KV head, first key
  int64_t iters;       // query blocks streamed
  BlockWalk first;
};

template <bool kCausal>
__device__ __forceinline__ CtaWork cta_work(const Params& p) {
  CtaWork w;
  const int64_t bkv = cta_outer_index();
  w.b = bkv / p.heads_kv;
  w.hkv = bkv % p.heads_kv;
  w.k0 = int64_t(blockIdx.x) * kKeys;
  const QueryStream q = query_stream<kCausal>(p, w.b, w.hkv, w.k0);
  w.iters = q.iters;
  w.first = q.first;
  return w;
}

}  // namespace sage::bwd::fn
