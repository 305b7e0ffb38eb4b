// The loads of SageBwd's Hopper main kernel: cp.async from the pre-pass's workspace into the
// swizzled tiles of Smem. The CTA's keys (K^, K^ᵀ, V) once; each query block in two halves, so
// that each is prefetched for the next block as soon as this one has finished with it:
//   A: Q^, dO, L', D - g and the block's ψ scales (read by the scores and dS),
//   B: Q^ᵀ and dO^ᵀ (read by dV and dK).
// Each half is one cp.async group, committed even when empty so that the waits always count the
// same: at most two groups are in flight.
#pragma once

#include "bwd/params.h"
#include "bwd/sm90/scheduler.cuh"
#include "bwd/sm90/smem.h"
#include "ptx/async.cuh"

namespace sage::bwd::sm90 {

// kRows rows of kW bytes (global row stride ld bytes) into a swizzled tile. Thread i's chunks sit
// kThreads / kChunks rows apart, a multiple of the 8-row swizzle period, so each is the first
// one's offsets plus constants.
template <int kW, int kRows>
__device__ __forceinline__ void load_tile(uint8_t* dst, const uint8_t* src, int64_t ld) {
  constexpr int kChunks = kW / 16, kStep = kThreads / kChunks;
  static_assert(kRows % kStep == 0 && kStep % 8 == 0, "whole swizzle periods a thread");
  const int r = threadIdx.x / kChunks, c = threadIdx.x % kChunks;
  uint8_t* d = dst + swz<kW>(r, c * 16);
  const uint8_t* g = src + r * ld + c * 16;
#pragma unroll
  for (int j = 0; j < kRows / kStep; ++j) ptx::cp_async_16(d + j * kStep * kW, g + j * kStep * ld);
}
// 64 rows of D 16-bit channels (contiguous rows) into 128-byte panels, chunks as above.
template <int D>
__device__ __forceinline__ void load_tile16(uint8_t* dst, const uint8_t* src) {
  constexpr int kChunks = D * 2 / 16, kStep = kThreads / kChunks;
  static_assert(64 % kStep == 0 && kStep % 8 == 0, "whole swizzle periods a thread");
  const int r = threadIdx.x / kChunks, b = (threadIdx.x % kChunks) * 16;
  uint8_t* d = dst + (b / 128) * Smem<D>::kPanel + swz<128>(r, b % 128);
  const uint8_t* g = src + r * D * 2 + b;
#pragma unroll
  for (int j = 0; j < 64 / kStep; ++j) ptx::cp_async_16(d + j * kStep * 128, g + j * kStep * D * 2);
}

template <int D>
struct Loads {
  using S = Smem<D>;
  const MainParams& p;
  uint8_t* smem;

  // The CTA's keys: K^ rows, K^ᵀ, V rows (they join the first group, with block 0's half A).
  __device__ void keys(const CtaWork& w) const {
    const int64_t row = w.bkv * p.nk_pad + w.k0;
    load_tile<D, 64>(smem + S::kK, reinterpret_cast<const uint8_t*>(p.khat) + row * D, D);
    load_tile<64, D>(smem + S::kKt,
                     reinterpret_cast<const uint8_t*>(p.khat_t) + w.bkv * D * p.nk_pad + w.k0,
                     p.nk_pad);
    load_tile16<D>(smem + S::kV, reinterpret_cast<const uint8_t*>(p.v_ws) + row * D * 2);
  }
  // Half A of block w (when `load`), committed.
  __device__ void half_a(const BlockWalk& w, bool load) const {
    if (load) {
      const int64_t bh = w.bh, i0 = w.qb * kBlockQ;
      load_tile<D, 64>(smem + S::kQ,
                       reinterpret_cast<const uint8_t*>(p.qhat) + (bh * p.nq_pad + i0) * D, D);
      load_tile16<D>(smem + S::kDo,
                     reinterpret_cast<const uint8_t*>(p.do_ws) + (bh * p.nq_pad + i0) * D * 2);
      if (threadIdx.x < 16)
        ptx::cp_async_16(smem + S::kLse + threadIdx.x * 16,
                         p.lse2 + bh * p.nq_pad + i0 + threadIdx.x * 4);
      else if (threadIdx.x < 32)
        ptx::cp_async_16(smem + S::kDelta + (threadIdx.x - 16) * 16,
                         p.delta + bh * p.nq_pad + i0 + (threadIdx.x - 16) * 4);
      else if (threadIdx.x == 32)
        ptx::cp_async_4(smem + S::kScales, p.q_scale + bh * p.q_blocks + w.qb);
      else if (threadIdx.x == 33)
        ptx::cp_async_4(smem + S::kScales + 4, p.do_scale + bh * p.q_blocks + w.qb);
    }
    ptx::cp_async_commit();
  }
  // Half B of block w (when `load`), committed.
  __device__ void half_b(const BlockWalk& w, bool load) const {
    if (load) {
      const int64_t off = w.bh * D * p.nq_pad + w.qb * kBlockQ;
      load_tile<64, D>(smem + S::kQt, reinterpret_cast<const uint8_t*>(p.qhat_t) + off, p.nq_pad);
      load_tile<64, D>(smem + S::kDot, reinterpret_cast<const uint8_t*>(p.dohat_t) + off,
                       p.nq_pad);
    }
    ptx::cp_async_commit();
  }
  // The older of the two groups in flight has landed and is visible to every thread (and to the
  // wgmma's async proxy).
  __device__ void wait_older() const {
    ptx::cp_async_wait<1>();
    ptx::fence_proxy_async_smem();
    __syncthreads();
  }
};

}  // namespace sage::bwd::sm90
