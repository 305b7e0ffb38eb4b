// One CTA's turn at a tile of an fp32 accumulator that several CTAs of a grid add into (sm_80+):
// SageBwd's dQ, where the CTA of each key block adds its dS^·K^ to the 64-query tiles it sees.
// Unordered, the adds are atomics (the sum's order, hence its bits, follow CTA timing). Ordered
// (SAGE_BWD_OPTION_DETERMINISTIC), the CTAs add one after another in key-block order, through an
// int32 counter per tile that the pre-pass zeroes: the same bits on every run.
#pragma once

#include "ptx/barrier.cuh"

namespace sage::bwd {

struct CtaSync {
  __device__ __forceinline__ void operator()() const { __syncthreads(); }
};

// A tile's contributors are key blocks 0..K of one KV head (the first query block a key block
// sees never decreases with the key block, causal or not, either alignment), so key block kb's
// turn is kb and it passes kb + 1.
//
// Forward progress: a CTA waits only on CTAs of its own outer index (blockIdx.y and .z:
// common/grid.h) with a lower blockIdx.x (kb on kb - 1, on kb - 2, ... on 0, which never waits).
// The block scheduler hands out a grid's CTAs in increasing linear index (x fastest, then y, then
// z), so every CTA a waiter depends on was placed on an SM before it, keeps that SM until it ends,
// and waits on no CTA after it: no cycle, however few CTAs fit at once. The CUDA programming
// model does not promise that order; the hardware keeps it, and ordered mode would hang, not
// err, without it.
//
// The adding threads are `sync`'s (the CTA for CtaSync; a warp-specialized kernel passes the
// named barrier of its dQ warps); `leader` is one of them.
struct TileTurn {
  int* counters;  // every tile's turn counter; null: unordered (atomics)
  int tile;       // an index, not a pointer: one register live across the adds, not two
  int mine;       // this CTA's turn

  // Waits for this CTA's turn (one thread spins), then the adding threads' barrier, which the
  // caller may count as its own.
  template <typename Sync = CtaSync>
  __device__ __forceinline__ void wait(bool leader, Sync sync = {}) const {
    if (counters != nullptr && leader)
      while (ptx::ld_acquire_gpu(counters + tile) != mine) {
      }
    sync();
  }
  // tile[0..1] += (x, y); `at` is 8-byte aligned. Ordered: plain loads and stores through L2
  // (the previous turn's values were written from another SM; L1 may hold stale lines).
  __device__ __forceinline__ void add2(float* at, float x, float y) const {
    if (counters != nullptr) {
      float2 v = __ldcg(reinterpret_cast<const float2*>(at));
      v.x += x;
      v.y += y;
      __stcg(reinterpret_cast<float2*>(at), v);
    } else {
      atomicAdd(at, x);
      atomicAdd(at + 1, y);
    }
  }
  // The adding threads' barrier (the caller may count it as its own), then the next turn. The
  // barrier orders every adding thread's stores before the leader's fence, which makes them
  // visible at gpu scope before the atomic (a release pattern; an st.release in inline asm instead
  // had ptxas spill the D = 128 kernel on sm_89).
  template <typename Sync = CtaSync>
  __device__ __forceinline__ void pass(bool leader, Sync sync = {}) const {
    sync();
    if (counters != nullptr && leader) {
      __threadfence();
      atomicExch(counters + tile, mine + 1);
    }
  }
};

}  // namespace sage::bwd
