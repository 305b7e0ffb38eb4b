// SageBwd's main kernel on Hopper (sm_90a): the products of the mma.sync kernel (kernel.cuh) as
// warpgroup MMAs. One CTA is one warpgroup that owns 64 keys of a KV head (the M rows of Sᵀ, dPᵀ,
// dV and dK) and streams the 64-query blocks of its group's query heads; two CTAs share an SM at
// D = 128, three at D = 64. Per block:
//   Sᵀ = K^·Q^ᵀ (s8, both operands in shared memory) and dPᵀ = V·dOᵀ (fp16/bf16), one batch
//   Pᵀ, dSᵀ, their per-key ψ packed into A fragments in registers (the mma.sync A layout, so the
//     pre-pass's permuted Q^ᵀ and dO^ᵀ serve as B: bwd::query_at)
//   dV += P^ᵀ·dO^ and dK += dS^ᵀ·Q^ (s8, A from registers, 64 channels at a time; at D = 128
//     dV's upper half accumulates in shared memory)
//   dQ += dS^·K^ (s8: dS^ per query through shared memory, [query][key]), staged a 64-channel
//     panel at a time in dq_acc's layout (bwd::dq_offset) and added into the fp32 accumulator by
//     one bulk reduction a warp, or in key-block order (dq_order.cuh)
// The workspace, the ψ scales and the arithmetic are the mma.sync kernel's, so both match one
// emulation. Shared memory: K-major tiles in wgmma's swizzled layouts, written by cp.async; the
// query block arrives in two halves that are prefetched as soon as the block has finished with
// them: A (Q^, dO, L', D, the ψ scales) after the scores, B (Q^ᵀ, dO^ᵀ) after dK.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "bwd/dq_order.cuh"
#include "bwd/kernel.cuh"
#include "bwd/params.h"
#include "ptx/async.cuh"
#include "ptx/atomic.cuh"
#include "ptx/math.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"

namespace sage::bwd::sm90 {

// Byte offsets of one CTA's tiles (each 1024-byte aligned: the swizzle atoms' alignment).
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

// cp.async of kRows rows of kW bytes (global row stride ld bytes) into a swizzled tile. Thread
// i's chunks sit kThreads / kChunks rows apart, a multiple of the 8-row swizzle period, so each
// is the first one's offsets plus constants.
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
__device__ __forceinline__ uint64_t desc8(const uint8_t* tile, int k_byte) {
  return ptx::wgmma_desc<D>(tile + k_byte);
}
// The 16-bit operand's descriptor at k-step ks (16 channels): panel ks / 4, 32 bytes a step.
template <int D>
__device__ __forceinline__ uint64_t desc16(const uint8_t* tile, int ks) {
  return ptx::wgmma_desc<128>(tile + (ks / 4) * Smem<D>::kPanel + (ks % 4) * 32);
}
// quant::quantize_bits for |x·inv| <= 127 (x bounded by the max its scale came from): the
// clamp and the NaN test drop out (a NaN makes its ψ scale NaN, which reaches the result anyway).
__device__ __forceinline__ uint32_t q8_bounded(float x, float inv) {
  return __float_as_uint(__fadd_rn(__fmul_rn(x, inv), 12582912.0f));
}
// One butterfly step over the lanes g ^ 2^kBit (lane = 4g + t): the lower half of m[0..2·kHalf)
// stays with the lanes whose bit kBit of g is clear, the upper half with the others, each the max
// of the pair.
template <int kHalf, int kBit>
__device__ __forceinline__ void halve_max(float (&m)[16], int g) {
  const bool upper = (g >> kBit) & 1;
#pragma unroll
  for (int k = 0; k < kHalf; ++k) {
    const float mine = upper ? m[k + kHalf] : m[k], theirs = upper ? m[k] : m[k + kHalf];
    m[k] = ptx::max_nan(mine, __shfl_xor_sync(0xFFFFFFFFu, theirs, 4 << kBit));
  }
}
// Packs 64 queries x this thread's two keys of ψ(x) (x: a 64-key x 64-query accumulator) into the
// two k32 A fragments of a product over the queries.
__device__ __forceinline__ void pack_a(uint32_t (&f)[2][4], const float (&x)[32], float inv_a,
                                       float inv_b) {
  auto q8 = [&](int n, int e) { return q8_bounded(x[4 * n + e], e < 2 ? inv_a : inv_b); };
#pragma unroll
  for (int kq = 0; kq < 2; ++kq) {
    const int n0 = 4 * kq;
    f[kq][0] = pack4(q8(n0, 0), q8(n0, 1), q8(n0 + 1, 0), q8(n0 + 1, 1));
    f[kq][1] = pack4(q8(n0, 2), q8(n0, 3), q8(n0 + 1, 2), q8(n0 + 1, 3));
    f[kq][2] = pack4(q8(n0 + 2, 0), q8(n0 + 2, 1), q8(n0 + 3, 0), q8(n0 + 3, 1));
    f[kq][3] = pack4(q8(n0 + 2, 2), q8(n0 + 2, 3), q8(n0 + 3, 2), q8(n0 + 3, 3));
  }
}
// acc = the sum of issue(acc, kq) over the block's two k32 steps: one wgmma batch, waited for.
template <typename Issue>
__device__ __forceinline__ void mma_k64(int (&acc)[32], Issue issue) {
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0;
  ptx::wgmma_fence();
#pragma unroll
  for (int kq = 0; kq < 2; ++kq) issue(acc, kq);
  ptx::wgmma_commit();
  ptx::wgmma_wait<0>();
  ptx::wgmma_fence_regs(acc);
}
// dV += P^ᵀ·dO^ and dK += dS^ᵀ·Q^ over the block's 64 queries (two k32 steps each), 64 channels
// at a time, scaled per row (key) into fp32 by add_v(i, x) and add_k(i, x). kPaired: both
// products of a panel in one wgmma batch (two 32-register int32 accumulators, one wait instead
// of two); at D = 128 the second accumulator made the kernel spill, so there each waits alone.
template <int D, bool kPaired, typename AddV, typename AddK>
__device__ __forceinline__ void mma_dv_dk(AddV add_v, AddK add_k, const uint32_t (&pf)[2][4],
                                          const uint32_t (&sf)[2][4], const uint8_t* dot_tile,
                                          const uint8_t* qt_tile, float va, float vb, float ka,
                                          float kb) {
  // d (+)= a·B for k32 step kq of channel panel h of a [D][64] B tile.
  auto issue = [](int(&d)[32], const uint32_t(&a)[2][4], const uint8_t* tile, int h, int kq) {
    ptx::wgmma_m64n64k32_s8_rs(d, a[kq], ptx::wgmma_desc<64>(tile + h * 4096 + kq * 32), kq > 0);
  };
  auto scaled = [](const int(&acc)[32], int i, float a, float b) {
    return float(acc[i]) * ((i & 2) ? b : a);
  };
  if constexpr (kPaired) {
#pragma unroll
    for (int h = 0; h < D / 64; ++h) {
      int av[32], ak[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) av[i] = ak[i] = 0;
      ptx::wgmma_fence();
#pragma unroll
      for (int kq = 0; kq < 2; ++kq) issue(av, pf, dot_tile, h, kq);
#pragma unroll
      for (int kq = 0; kq < 2; ++kq) issue(ak, sf, qt_tile, h, kq);
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
      ptx::wgmma_fence_regs(av);
      ptx::wgmma_fence_regs(ak);
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        add_v(h * 32 + i, scaled(av, i, va, vb));
        add_k(h * 32 + i, scaled(ak, i, ka, kb));
      }
    }
  } else {
    // One product over both panels, then the other: dV, then dK.
    auto product = [&](auto add, const uint32_t(&a)[2][4], const uint8_t* tile, float sa,
                       float sb) {
#pragma unroll
      for (int h = 0; h < D / 64; ++h) {
        int acc[32];
        mma_k64(acc, [&](int(&d)[32], int kq) { issue(d, a, tile, h, kq); });
#pragma unroll
        for (int i = 0; i < 32; ++i) add(h * 32 + i, scaled(acc, i, sa, sb));
      }
    };
    product(add_v, pf, dot_tile, va, vb);
    product(add_k, sf, qt_tile, ka, kb);
  }
}

template <typename T, int D, bool kCausal>
__global__ void __launch_bounds__(kThreads, D == 64 ? 3 : 2) backward_kernel(const Params p) {
#ifdef SAGE_PTX_HAS_WGMMA
  using S = Smem<D>;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // Aligned by an offset from smem_raw (not by casting an integer), so that the compiler keeps
  // the shared address space: LDS/STS instead of generic loads and stores.
  uint8_t* smem = smem_raw + ((1024 - (__cvta_generic_to_shared(smem_raw) & 1023)) & 1023);

  const int64_t kb = blockIdx.x, bkv = cta_outer_index(), k0 = kb * kBlockK;
  if (bkv >= p.batch * p.heads_kv) return;  // (the whole CTA, before any barrier)
  const int64_t b = bkv / p.heads_kv, hkv = bkv % p.heads_kv, G = p.group();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int ka = warp * 16 + g;  // this thread's keys (local): ka and ka + 8

  const uint8_t* qhat = reinterpret_cast<const uint8_t*>(p.qhat);
  const uint8_t* qhat_t = reinterpret_cast<const uint8_t*>(p.qhat_t);
  const uint8_t* dohat_t = reinterpret_cast<const uint8_t*>(p.dohat_t);
  const uint8_t* do_ws = reinterpret_cast<const uint8_t*>(p.do_ws);
  // The CTA's keys: K^ rows, K^ᵀ, V rows (in the first cp.async group, with block 0's half A).
  load_tile<D, 64>(smem + S::kK,
                   reinterpret_cast<const uint8_t*>(p.khat) + (bkv * p.nk_pad + k0) * D, D);
  load_tile<64, D>(smem + S::kKt,
                   reinterpret_cast<const uint8_t*>(p.khat_t) + bkv * D * p.nk_pad + k0, p.nk_pad);
  load_tile16<D>(smem + S::kV,
                 reinterpret_cast<const uint8_t*>(p.v_ws) + (bkv * p.nk_pad + k0) * D * 2);

  const int64_t q_begin = kCausal ? max(int64_t(0), k0 - p.causal_offset) / kBlockQ : 0;
  const int64_t n_q = max(int64_t(0), p.q_blocks - q_begin), iters = n_q * G;
  auto load_a = [&](const BlockWalk& w) {
    const int64_t bh = w.bh, i0 = w.qb * kBlockQ;
    load_tile<D, 64>(smem + S::kQ, qhat + (bh * p.nq_pad + i0) * D, D);
    load_tile16<D>(smem + S::kDo, do_ws + (bh * p.nq_pad + i0) * D * 2);
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
  };
  auto load_b = [&](const BlockWalk& w) {
    const int64_t off = w.bh * D * p.nq_pad + w.qb * kBlockQ;
    load_tile<64, D>(smem + S::kQt, qhat_t + off, p.nq_pad);
    load_tile<64, D>(smem + S::kDot, dohat_t + off, p.nq_pad);
  };
  // Two cp.async groups in flight per block (A, then B), committed even when empty so that the
  // waits below always count the same.
  BlockWalk cur{b * p.heads_q + hkv * G, int(q_begin), int(q_begin), int(p.q_blocks)};
  if (iters > 0) load_a(cur);
  ptx::cp_async_commit();
  if (iters > 0) load_b(cur);
  ptx::cp_async_commit();

  const float k_scale = p.k_scale[bkv * p.k_blocks + kb];
  float dk[D / 2], dv[S::kDvRegs];
  float* dv_s = reinterpret_cast<float*>(smem + S::kDv) + threadIdx.x;  // value j at j · kThreads
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < S::kDvRegs; ++i) dv[i] = 0.0f;
#pragma unroll
  for (int j = 0; j < S::kDvSmem; ++j) dv_s[j * kThreads] = 0.0f;
  auto add_dv = [&](int i, float x) {
    if (i < S::kDvRegs)
      dv[i] += x;
    else
      dv_s[(i - S::kDvRegs) * kThreads] += x;
  };
  const int64_t key_a = k0 + ka, key_b = key_a + 8;
  float* qmax_s = reinterpret_cast<float*>(smem + S::kQmax);
  float* qpsi_s = reinterpret_cast<float*>(smem + S::kQpsi);
  const float* lse_s = reinterpret_cast<const float*>(smem + S::kLse);
  const float* delta_s = reinterpret_cast<const float*>(smem + S::kDelta);

  for (int64_t it = 0; it < iters; ++it) {
    ptx::cp_async_wait<1>();  // half A of this block (B may still be landing)
    ptx::fence_proxy_async_smem();
    __syncthreads();
    const int64_t bh = cur.bh, qb = cur.qb, i0 = qb * kBlockQ;
    cur.next();
    const float q_scale = reinterpret_cast<const float*>(smem + S::kScales)[0];
    const float do_scale = reinterpret_cast<const float*>(smem + S::kScales)[1];

    // Sᵀ = K^·Q^ᵀ and dPᵀ = V·dOᵀ: 64 keys x 64 queries each.
    int s[32];
    float dp[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = 0, dp[i] = 0.0f;
    ptx::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D / 32; ++ks)
      ptx::wgmma_m64n64k32_s8_ss(s, desc8<D>(smem + S::kK, ks * 32),
                                 desc8<D>(smem + S::kQ, ks * 32), ks > 0);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      if constexpr (kBf16)
        ptx::wgmma_m64n64k16_bf16_ss(dp, desc16<D>(smem + S::kV, ks), desc16<D>(smem + S::kDo, ks),
                                     ks > 0);
      else
        ptx::wgmma_m64n64k16_f16_ss(dp, desc16<D>(smem + S::kV, ks), desc16<D>(smem + S::kDo, ks),
                                    ks > 0);
    }
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    ptx::wgmma_fence_regs(s);
    ptx::wgmma_fence_regs(dp);

    // Pᵀ = 2^(Sᵀ·s_Q·s_K·scale·log2 e - L'), masked, and its per-key ψ into A fragments.
    const float c = q_scale * k_scale * p.scale_log2;
    // Row r (0: key_a, 1: key_b) sees local query qi when qi >= first[r]: 0 without a mask,
    // 64 (none) past the keys, else the first query whose diagonal reaches the key.
    int first[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t key = r ? key_b : key_a;
      const int64_t f = kCausal ? key - p.causal_offset - i0 : 0;
      first[r] = key >= p.seq_kv ? kBlockQ : int(min(int64_t(kBlockQ), max(int64_t(0), f)));
    }
    float P[32];
    float pmax[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int qi = (i / 4) * 8 + 2 * t + (i & 1);
      P[i] = qi >= first[(i >> 1) & 1] ? ptx::ex2(float(s[i]) * c - lse_s[qi]) : 0.0f;
      pmax[(i >> 1) & 1] = ptx::max_nan(pmax[(i >> 1) & 1], P[i]);
    }
    uint32_t pf[2][4];
    const Psi pa = psi_scale(quad_max(pmax[0])), pb = psi_scale(quad_max(pmax[1]));
    pack_a(pf, P, pa.inv, pb.inv);
    // dSᵀ = Pᵀ∘(dPᵀ - D) in place; per-key ψ into A fragments; per-query partial maxima.
    float kmax[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      P[i] *= dp[i] - delta_s[(i / 4) * 8 + 2 * t + (i & 1)];
      kmax[(i >> 1) & 1] = ptx::max_nan(kmax[(i >> 1) & 1], fabsf(P[i]));
    }
    const float(&dS)[32] = P;
    uint32_t sf[2][4];
    const Psi da = psi_scale(quad_max(kmax[0])), db = psi_scale(quad_max(kmax[1]));
    pack_a(sf, dS, da.inv, db.inv);
    // Each of the thread's 16 queries (n, e) over the warp's 16 keys: a halving butterfly over
    // the 8 lanes of a column (14 shuffles, not 48), after which lane g holds query
    // n = 4(g & 1) + 2(g >> 1 & 1) + (g >> 2), e = 0 and 1.
    float m[16];
#pragma unroll
    for (int j = 0; j < 16; ++j)
      m[j] = ptx::max_nan(fabsf(dS[4 * (j / 2) + j % 2]), fabsf(dS[4 * (j / 2) + j % 2 + 2]));
    halve_max<8, 0>(m, g);
    halve_max<4, 1>(m, g);
    halve_max<2, 2>(m, g);
    {
      const int n = 4 * (g & 1) + 2 * ((g >> 1) & 1) + (g >> 2);
      *reinterpret_cast<float2*>(qmax_s + warp * kBlockQ + n * 8 + 2 * t) = make_float2(m[0], m[1]);
    }
    __syncthreads();                  // the maxima are in; half A is free
    if (it + 1 < iters) load_a(cur);  // (cur is the next block now)
    ptx::cp_async_commit();
    if (threadIdx.x < kBlockQ) {  // each query's ψ, once
      float m = qmax_s[threadIdx.x];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) m = ptx::max_nan(m, qmax_s[w * kBlockQ + threadIdx.x]);
      const Psi q = psi_scale(m);
      qpsi_s[threadIdx.x] = q.scale;
      qpsi_s[kBlockQ + threadIdx.x] = q.inv;
    }
    __syncthreads();

    // dS^ per query into shared memory, [query][key].
    // swz<64>(qi, ka) for qi = 8n + 2t + e: the XOR term (ka / 16 ^ qi / 2) & 3 is (warp ^ t) & 3
    // for every n and e, so one base per thread plus constants.
    uint8_t* ds_s = smem + S::kDs;
    uint8_t* ds_t = ds_s + 2 * t * 64 + (((warp ^ t) & 3) << 4) + g;
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float inv = qpsi_s[kBlockQ + n * 8 + 2 * t + e];
        ds_t[(8 * n + e) * 64] = uint8_t(q8_bounded(dS[4 * n + e], inv));
        ds_t[(8 * n + e) * 64 + 8] = uint8_t(q8_bounded(dS[4 * n + e + 2], inv));
      }
    ptx::cp_async_wait<1>();  // half B of this block (A of the next may still be landing)
    ptx::fence_proxy_async_smem();
    __syncthreads();

    // dV += P^ᵀ·dO^ and dK += dS^ᵀ·Q^ (per-key ψ times the block's ψ scale).
    mma_dv_dk<D, D == 64>(
        add_dv, [&](int i, float x) { dk[i] += x; }, pf, sf, smem + S::kDot, smem + S::kQt,
        pa.scale * do_scale, pb.scale * do_scale, da.scale * q_scale, db.scale * q_scale);
    __syncthreads();  // every read of half B is done
    if (it + 1 < iters) load_b(cur);
    ptx::cp_async_commit();

    // dQ += dS^·K^ for the block's 64 queries (rows 16·warp + g, + 8 of this thread), one
    // 64-channel panel at a time, staged in shared memory in dq_acc's own layout (dq_offset):
    // each warp's 16 rows of a panel, 4 KB in one piece there and in dq_acc, then go to the fp32
    // accumulator as one bulk reduction, or in deterministic mode as plain adds on this CTA's
    // turn (dq_order.cuh). A warp touches only its own rows of the staging panel.
    const int qa = warp * 16 + g;
    const float sa = qpsi_s[qa] * k_scale, sb = qpsi_s[qa + 8] * k_scale;
    float* dq_s = reinterpret_cast<float*>(smem + S::kDq);
    const TileTurn turn{p.dq_turn, int(bh * p.q_blocks + qb), int(kb)};
    if (p.deterministic) turn.wait(/*leader=*/threadIdx.x == 0);
#pragma unroll
    for (int h = 0; h < D / 64; ++h) {
      int acc[32];
      mma_k64(acc, [&](int(&d)[32], int kk) {
        ptx::wgmma_m64n64k32_s8_ss(d, ptx::wgmma_desc<64>(ds_s + kk * 32),
                                   ptx::wgmma_desc<64>(smem + S::kKt + h * 64 * 64 + kk * 32),
                                   kk > 0);
      });
      if (lane == 0) ptx::bulk_wait_read<0>();  // the last reduction has read this warp's rows
      __syncwarp();
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const int d = n * 8 + 2 * t;
        *reinterpret_cast<float2*>(dq_s + qa * 64 + dq_col(qa, d)) =
            make_float2(float(acc[4 * n]) * sa, float(acc[4 * n + 1]) * sa);
        *reinterpret_cast<float2*>(dq_s + (qa + 8) * 64 + dq_col(qa + 8, d)) =
            make_float2(float(acc[4 * n + 2]) * sb, float(acc[4 * n + 3]) * sb);
      }
      const float* rows_s = dq_s + warp * 16 * 64;
      float* rows_g = p.dq_acc + bh * p.nq_pad * D + dq_offset(i0 + warp * 16, h * 64, D);
      __syncwarp();
      if (p.deterministic) {
#pragma unroll 4
        for (int i = 2 * lane; i < 16 * 64; i += 64)
          turn.add2(rows_g + i, rows_s[i], rows_s[i + 1]);
        __syncwarp();  // every lane has read its values before the next panel's stores
      } else {
        ptx::fence_proxy_async_smem();
        __syncwarp();
        if (lane == 0) {
          ptx::bulk_reduce_add(rows_g, rows_s, 16 * 64 * 4);
          ptx::bulk_commit();
        }
      }
    }
    if (p.deterministic) turn.pass(/*leader=*/threadIdx.x == 0);
  }
  if (lane == 0) ptx::bulk_wait<0>();
  ptx::cp_async_wait<0>();

  // dK (times the softmax scale) and dV in the caller's dtype.
  T* dkp = static_cast<T*>(p.dk) + b * p.dk_st.batch + hkv * p.dk_st.head;
  T* dvp = static_cast<T*>(p.dv) + b * p.dv_st.batch + hkv * p.dv_st.head;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t key = half == 0 ? key_a : key_b;
    if (key >= p.seq_kv) continue;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const int d = n * 8 + 2 * t, i = 4 * n + 2 * half;
      dkp[key * p.dk_st.token + d] = T(dk[i] * p.scale);
      dkp[key * p.dk_st.token + d + 1] = T(dk[i + 1] * p.scale);
      const float v0 = i < S::kDvRegs ? dv[i] : dv_s[(i - S::kDvRegs) * kThreads];
      const float v1 = i + 1 < S::kDvRegs ? dv[i + 1] : dv_s[(i + 1 - S::kDvRegs) * kThreads];
      dvp[key * p.dv_st.token + d] = T(v0);
      dvp[key * p.dv_st.token + d + 1] = T(v1);
    }
  }
#endif
}

}  // namespace sage::bwd::sm90
