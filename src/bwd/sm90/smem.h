// Shared memory of SageBwd's Hopper main kernel: one CTA's tiles (byte offsets, each 1024-byte
// aligned: the swizzle atoms' alignment) and the swizzle of its K-major tiles.
#pragma once

#include "bwd/params.h"
#include "ptx/wgmma.cuh"

namespace sage::bwd::sm90 {

template <int D>
struct Smem {
  static constexpr int kPanel = 64 * 128;       // 64 rows of 64 16-bit channels (128-byte rows)
  static constexpr int kK = 0;                  // K^ [64 keys][D], D-byte swizzle
  static constexpr int kKt = kK + 64 * D;       // K^ᵀ [D][64 keys], 64-byte swizzle
  static constexpr int kV = kKt + D * 64;       // V [64 keys][D] 16-bit, D / 64 panels
  static constexpr int kQ = kV + 64 * D * 2;    // A: Q^ [64 queries][D]
  static constexpr int kDo = kQ + 64 * D;       // A: dO [64][D] 16-bit panels
  static constexpr int kQt = kDo + 64 * D * 2;  // B: Q^ᵀ [D][64 queries, permuted]
  static constexpr int kDot = kQt + D * 64;     // B: dO^ᵀ [D][64 queries, permuted]
  static constexpr int kDs = kDot + D * 64;     // dS^ [64 queries][64 keys], 64-byte swizzle
  static constexpr int kDq = kDs + 64 * 64;     // one 64-channel panel of dQ's block [64][64] fp32
                                                // (dq_offset's layout), bulk-reduced out
  // dV's channels past kDvRegs · 2 (D = 128: 64..127) accumulate here, [value][thread], instead of
  // in registers: 128 fp32 accumulators a thread spilled ~40 registers to local memory, which L1
  // (mostly shared memory here) could not hold.
  static constexpr int kDvRegs = 32;               // dV values a thread keeps in registers
  static constexpr int kDvSmem = D / 2 - kDvRegs;  // and in shared memory
  static constexpr int kDv = kDq + 64 * 64 * 4;
  static constexpr int kLse = kDv + kDvSmem * kThreads * 4;  // A: L' [64]
  static constexpr int kDelta = kLse + 256;                  // A: D - g [64]
  static constexpr int kQmax = kDelta + 256;             // per-query partial max |dS| [4 warps][64]
  static constexpr int kQpsi = kQmax + kWarps * 64 * 4;  // per-query ψ of dS: scale, inv [64]
  static constexpr int kScales = kQpsi + 2 * 64 * 4;     // A: the block's ψ scales of Q and dO
  static constexpr int kBytes = kScales + 16 + 1024;     // + the base's alignment
  static_assert(kBytes <= (D == 64 ? 75 : 113) * 1024, "three CTAs an SM at D = 64, two at 128");
};

// Offset of byte `b` of row `r` in a K-major tile of kW-byte rows in wgmma's kW-byte swizzle
// (8-row atoms; the 16-byte chunk index XORed with the row bits above it).
template <int kW>
__device__ __forceinline__ int swz(int r, int b) {
  static_assert(kW == 128 || kW == 64, "64- or 128-byte rows");
  if constexpr (kW == 128)
    return r * 128 + ((((b >> 4) ^ r) & 7) << 4) + (b & 15);
  else
    return r * 64 + ((((b >> 4) ^ (r >> 1)) & 3) << 4) + (b & 15);
}

// The descriptor of an 8-bit K-major tile of D-byte rows at byte k_byte of its rows.
template <int D>
__device__ __forceinline__ uint64_t desc8(const uint8_t* tile, int k_byte) {
  return ptx::wgmma_desc<D>(tile + k_byte);
}
// The 16-bit operand's descriptor at k-step ks (16 channels): panel ks / 4, 32 bytes a step.
template <int D>
__device__ __forceinline__ uint64_t desc16(const uint8_t* tile, int ks) {
  return ptx::wgmma_desc<128>(tile + (ks / 4) * Smem<D>::kPanel + (ks % 4) * 32);
}

// s = A8·B8ᵀ (s8 over D channels) and dp = A16·B16ᵀ (fp16/bf16), 64 x 64 each, from K-major tiles
// in shared memory (8-bit rows of D bytes; 16-bit panels), as one wgmma batch, waited for: the
// scores and dP of the main kernel (keys as M) and of the stats pass (queries as M).
template <bool kBf16, int D>
__device__ __forceinline__ void s_and_dp(int (&s)[32], float (&dp)[32], const uint8_t* a8,
                                         const uint8_t* b8, const uint8_t* a16,
                                         const uint8_t* b16) {
#pragma unroll
  for (int i = 0; i < 32; ++i) s[i] = 0, dp[i] = 0.0f;
  ptx::wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < D / 32; ++ks)
    ptx::wgmma_m64n64k32_s8_ss(s, desc8<D>(a8, ks * 32), desc8<D>(b8, ks * 32), ks > 0);
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    if constexpr (kBf16)
      ptx::wgmma_m64n64k16_bf16_ss(dp, desc16<D>(a16, ks), desc16<D>(b16, ks), ks > 0);
    else
      ptx::wgmma_m64n64k16_f16_ss(dp, desc16<D>(a16, ks), desc16<D>(b16, ks), ks > 0);
  }
  ptx::wgmma_commit();
  ptx::wgmma_wait<0>();
  ptx::wgmma_fence_regs(s);
  ptx::wgmma_fence_regs(dp);
}

}  // namespace sage::bwd::sm90
