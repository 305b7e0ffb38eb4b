// The mainloop of SageBwd's Hopper main kernel: per query block, with the CTA's 64 keys as the M
// rows of every product (one warpgroup; thread (warp, g, t) holds keys 16·warp + g and + 8):
//   Sᵀ = K^·Q^ᵀ (s8, both operands in shared memory) and dPᵀ = V·dOᵀ (fp16/bf16), one batch
//   Pᵀ = 2^(Sᵀ·s + t - L') (t: the key's Q-smoothing term), dSᵀ = Pᵀ∘(dPᵀ - D), their per-key ψ
//     packed into A fragments in registers
//     (the mma.sync A layout, so the pre-pass's permuted Q^ᵀ and dO^ᵀ serve as B: bwd::query_at)
//   dV += P^ᵀ·dO^ and dK += dS^ᵀ·Q^ (s8, A from registers, 64 channels at a time; at D = 128
//     dV's upper half accumulates in shared memory)
//   dS^ per query (its ψ from every warp's partial maxima) into shared memory, [query][key], the
//     A operand of dQ += dS^·K^ (dq_product; the epilogue adds it into dQ's accumulator)
//   after a query head's last block, dK += q̄ ⊗ Σ_i dS_i (add_q_term, as the mma.sync kernel).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "bwd/kernel.cuh"  // Psi, psi_scale, pack_a8
#include "bwd/params.h"
#include "bwd/sm90/scheduler.cuh"
#include "bwd/sm90/smem.h"
#include "common/fragment.cuh"
#include "ptx/math.cuh"
#include "ptx/wgmma.cuh"

namespace sage::bwd::sm90 {

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
  pack_a8(f, [&](int n, int e) {
    return q8_bounded(x[Frag::reg(n, e)], Frag::half(e) ? inv_b : inv_a);
  });
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

// One query block's operands from the scores to the products: where it is, its ψ scales, dSᵀ,
// and the A fragments of P^ᵀ and dS^ᵀ with their per-key ψ.
struct Block {
  int64_t bh, qb, i0;
  float q_scale, do_scale;
  float ds[32];
  uint32_t pf[2][4], sf[2][4];
  Psi pa, pb, da, db;
};

template <typename T, int D, bool kCausal>
struct Mainloop {
  using S = Smem<D>;
  static constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  const MainParams& p;
  uint8_t* const smem;
  const int warp, g, t;
  const int64_t key_a, key_b;  // this thread's keys: rows ka = 16·warp + g and ka + 8
  const float k_scale;
  float dk[D / 2], dv[S::kDvRegs];
  float cs[2];        // Σ dS of each key over the head's queries this thread holds
  float* const dv_s;  // dV's values past kDvRegs: value j at j · kThreads

  __device__ Mainloop(const MainParams& params, uint8_t* sm, const CtaWork& w)
      : p(params),
        smem(sm),
        warp(threadIdx.x / 32),
        g(threadIdx.x % 32 / 4),
        t(threadIdx.x % 4),
        key_a(w.k0 + warp * 16 + g),
        key_b(key_a + 8),
        k_scale(params.k_scale[w.bkv * params.k_blocks + w.kb]),
        dv_s(reinterpret_cast<float*>(sm + S::kDv) + threadIdx.x) {
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk[i] = 0.0f;
    cs[0] = cs[1] = 0.0f;
#pragma unroll
    for (int i = 0; i < S::kDvRegs; ++i) dv[i] = 0.0f;
#pragma unroll
    for (int j = 0; j < S::kDvSmem; ++j) dv_s[j * kThreads] = 0.0f;
  }

  __device__ void add_dv(int i, float x) {
    if (i < S::kDvRegs)
      dv[i] += x;
    else
      dv_s[(i - S::kDvRegs) * kThreads] += x;
  }
  __device__ float dv_at(int i) const {
    return i < S::kDvRegs ? dv[i] : dv_s[(i - S::kDvRegs) * kThreads];
  }

  // Sᵀ and dPᵀ of block w (half A in shared memory), then Pᵀ and dSᵀ into b (dS's sums into cs),
  // and each warp's partial max |dS| of every query into shared memory.
  __device__ void scores(const BlockWalk& w, Block& b) {
    b.bh = w.bh, b.qb = w.qb, b.i0 = w.qb * kBlockQ;
    b.q_scale = reinterpret_cast<const float*>(smem + S::kScales)[0];
    b.do_scale = reinterpret_cast<const float*>(smem + S::kScales)[1];
    const float kt_a = p.key_term[b.bh * p.nk_pad + key_a],
                kt_b = p.key_term[b.bh * p.nk_pad + key_b];

    // Sᵀ = K^·Q^ᵀ and dPᵀ = V·dOᵀ: 64 keys x 64 queries each.
    int s[32];
    float dp[32];
    s_and_dp<kBf16, D>(s, dp, smem + S::kK, smem + S::kQ, smem + S::kV, smem + S::kDo);

    // Pᵀ = 2^(Sᵀ·s_Q·s_K·scale·log2 e + t - L'), masked (x as the stats pass forms it), and its
    // per-key ψ into A fragments.
    const float* lse_s = reinterpret_cast<const float*>(smem + S::kLse);
    const float* delta_s = reinterpret_cast<const float*>(smem + S::kDelta);
    const float c = b.q_scale * k_scale * p.scale_log2;
    // Row r (0: key_a, 1: key_b) sees local query qi when qi >= first[r]: 0 without a mask,
    // 64 (none) past the keys, else the first query whose diagonal reaches the key.
    int first[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t key = r ? key_b : key_a;
      const int64_t f = kCausal ? key - p.causal_offset - b.i0 : 0;
      first[r] = key >= p.seq_kv ? kBlockQ : int(min(int64_t(kBlockQ), max(int64_t(0), f)));
    }
    float(&P)[32] = b.ds;
    float pmax[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int qi = Frag::col(i, t);
      const float kt = Frag::half(i) ? kt_b : kt_a;
      P[i] =
          qi >= first[Frag::half(i)] ? ptx::ex2(__fmaf_rn(float(s[i]), c, kt) - lse_s[qi]) : 0.0f;
      pmax[Frag::half(i)] = ptx::max_nan(pmax[Frag::half(i)], P[i]);
    }
    b.pa = psi_scale(Frag::quad_max(pmax[0]));
    b.pb = psi_scale(Frag::quad_max(pmax[1]));
    pack_a(b.pf, P, b.pa.inv, b.pb.inv);
    // dSᵀ = Pᵀ∘(dPᵀ - D) in place; per-key ψ into A fragments; per-query partial maxima.
    float kmax[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      P[i] *= dp[i] - delta_s[Frag::col(i, t)];
      cs[Frag::half(i)] += P[i];
      kmax[Frag::half(i)] = ptx::max_nan(kmax[Frag::half(i)], fabsf(P[i]));
    }
    const float(&dS)[32] = b.ds;
    b.da = psi_scale(Frag::quad_max(kmax[0]));
    b.db = psi_scale(Frag::quad_max(kmax[1]));
    pack_a(b.sf, dS, b.da.inv, b.db.inv);
    // Each of the thread's 16 queries (n, e) over the warp's 16 keys: a halving butterfly over
    // the 8 lanes of a column (14 shuffles, not 48), after which lane g holds query
    // n = 4(g & 1) + 2(g >> 1 & 1) + (g >> 2), e = 0 and 1.
    float m[16];
#pragma unroll
    for (int j = 0; j < 16; ++j)
      m[j] = ptx::max_nan(fabsf(dS[Frag::of_half(0, j)]), fabsf(dS[Frag::of_half(1, j)]));
    halve_max<8, 0>(m, g);
    halve_max<4, 1>(m, g);
    halve_max<2, 2>(m, g);
    const int n = 4 * (g & 1) + 2 * ((g >> 1) & 1) + (g >> 2);
    float* qmax_s = reinterpret_cast<float*>(smem + S::kQmax);
    *reinterpret_cast<float2*>(Frag::at_pair(qmax_s + warp * kBlockQ, n, t)) =
        make_float2(m[0], m[1]);
  }

  // Each query's ψ of dS (scale, inv) from every warp's partial maxima, once (after a barrier).
  __device__ void query_scales() const {
    if (threadIdx.x >= kBlockQ) return;
    const float* qmax_s = reinterpret_cast<const float*>(smem + S::kQmax);
    float* qpsi_s = reinterpret_cast<float*>(smem + S::kQpsi);
    float m = qmax_s[threadIdx.x];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) m = ptx::max_nan(m, qmax_s[w * kBlockQ + threadIdx.x]);
    const Psi q = psi_scale(m);
    qpsi_s[threadIdx.x] = q.scale;
    qpsi_s[kBlockQ + threadIdx.x] = q.inv;
  }

  // dS^ per query into shared memory, [query][key]. swz<64>(qi, ka) for qi = 8n + 2t + e: the
  // XOR term (ka / 16 ^ qi / 2) & 3 is (warp ^ t) & 3 for every n and e, so one base per thread
  // plus constants.
  __device__ void store_ds(const Block& b) const {
    const float* qpsi_s = reinterpret_cast<const float*>(smem + S::kQpsi);
    uint8_t* ds_t = smem + S::kDs + 2 * t * 64 + (((warp ^ t) & 3) << 4) + g;
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float inv = qpsi_s[kBlockQ + Frag::col(n, e, t)];
        ds_t[(8 * n + e) * 64] = uint8_t(q8_bounded(b.ds[Frag::reg(n, e)], inv));
        ds_t[(8 * n + e) * 64 + 8] = uint8_t(q8_bounded(b.ds[Frag::reg(n, e + 2)], inv));
      }
  }

  // dV += P^ᵀ·dO^ and dK += dS^ᵀ·Q^ over the block's 64 queries (two k32 steps each, half B in
  // shared memory), 64 channels at a time, each row (key) scaled by its ψ times the block's.
  // At D = 64 both products of a panel go in one wgmma batch (two 32-register int32
  // accumulators, one wait instead of two); at D = 128 the second accumulator made the kernel
  // spill, so there each waits alone.
  __device__ void dv_dk(const Block& b) {
    const float va = b.pa.scale * b.do_scale, vb = b.pb.scale * b.do_scale;
    const float ka = b.da.scale * b.q_scale, kb = b.db.scale * b.q_scale;
    const uint8_t* dot_tile = smem + S::kDot;
    const uint8_t* qt_tile = smem + S::kQt;
    // d (+)= a·B for k32 step kq of channel panel h of a [D][64] B tile.
    auto issue = [](int(&d)[32], const uint32_t(&a)[2][4], const uint8_t* tile, int h, int kq) {
      ptx::wgmma_m64n64k32_s8_rs(d, a[kq], ptx::wgmma_desc<64>(tile + h * 4096 + kq * 32), kq > 0);
    };
    auto scaled = [](const int(&acc)[32], int i, float sa, float sb) {
      return float(acc[i]) * ((i & 2) ? sb : sa);
    };
    if constexpr (D == 64) {
#pragma unroll
      for (int h = 0; h < D / 64; ++h) {
        int av[32], ak[32];
#pragma unroll
        for (int i = 0; i < 32; ++i) av[i] = ak[i] = 0;
        ptx::wgmma_fence();
#pragma unroll
        for (int kq = 0; kq < 2; ++kq) issue(av, b.pf, dot_tile, h, kq);
#pragma unroll
        for (int kq = 0; kq < 2; ++kq) issue(ak, b.sf, qt_tile, h, kq);
        ptx::wgmma_commit();
        ptx::wgmma_wait<0>();
        ptx::wgmma_fence_regs(av);
        ptx::wgmma_fence_regs(ak);
#pragma unroll
        for (int i = 0; i < 32; ++i) {
          add_dv(h * 32 + i, scaled(av, i, va, vb));
          dk[h * 32 + i] += scaled(ak, i, ka, kb);
        }
      }
    } else {
#pragma unroll
      for (int h = 0; h < D / 64; ++h) {
        int acc[32];
        mma_k64(acc, [&](int(&d)[32], int kq) { issue(d, b.pf, dot_tile, h, kq); });
#pragma unroll
        for (int i = 0; i < 32; ++i) add_dv(h * 32 + i, scaled(acc, i, va, vb));
      }
#pragma unroll
      for (int h = 0; h < D / 64; ++h) {
        int acc[32];
        mma_k64(acc, [&](int(&d)[32], int kq) { issue(d, b.sf, qt_tile, h, kq); });
#pragma unroll
        for (int i = 0; i < 32; ++i) dk[h * 32 + i] += scaled(acc, i, ka, kb);
      }
    }
  }

  // After query head bh's last block: dK += q̄ ⊗ Σ_i dS_i (bwd::add_q_term).
  __device__ void add_q_term(int64_t bh) {
    bwd::add_q_term<D>([&](int n, int e) -> float& { return dk[Frag::reg(n, e)]; }, cs,
                       p.q_mean + bh * D, t);
  }

  // dS^·K^ for channel panel h: the block's 64 queries x 64 channels (int32, unscaled).
  __device__ void dq_product(int h, int (&acc)[32]) const {
    const uint8_t* ds_s = smem + S::kDs;
    mma_k64(acc, [&](int(&d)[32], int kk) {
      ptx::wgmma_m64n64k32_s8_ss(d, ptx::wgmma_desc<64>(ds_s + kk * 32),
                                 ptx::wgmma_desc<64>(smem + S::kKt + h * 64 * 64 + kk * 32),
                                 kk > 0);
    });
  }
};

}  // namespace sage::bwd::sm90
