// SageBwd's main kernel on mma.sync (sm_80+): one CTA owns 64 keys of one KV head (4 warps x 16
// keys, the M rows of every product it keeps) and streams the 64-query blocks of every query head
// of its group. Per block, with the keys as rows (transposed products):
//   Sᵀ = K^·Q^ᵀ (INT8)  -> Pᵀ = 2^(Sᵀ·s + t - L')  -> ψ per key -> dV += P^ᵀ·dO^ (INT8)
//   dPᵀ = V·dOᵀ (fp16/bf16, fp32 accumulate) -> dSᵀ = Pᵀ∘(dPᵀ - D)
//   -> ψ per key -> dK += dS^ᵀ·Q^ (INT8);  ψ per query -> dS^ via shared memory -> dQ += dS^·K^
//      (INT8, into the workspace's fp32 tile: atomics, or in key-block order, dq_order.cuh)
// Q^ holds Q - q̄ (Q smoothing): each key's score term t = q̄·(K_j - k̄)·scale·log2 e comes from
// the pre-pass, and after a query head's last block dK_j gains q̄·Σ_i dS_ij (the sums of the
// unquantized dS this thread kept for its keys; add_q_term).
// The per-token scales are the ones that factor out of each product's sum (sage.h,
// sage_backward_config.granularity). P^ᵀ and dS^ᵀ are A operands packed straight from the
// accumulator registers: the B operands (Q^ᵀ, dO^ᵀ) arrive with their queries permuted to match
// (bwd::query_at). Registers: dK and dV accumulators D/8 x 4 each, Sᵀ/Pᵀ and dPᵀ 32 each.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "bwd/dq_order.cuh"
#include "bwd/params.h"
#include "bwd/prepass.cuh"
#include "common/fragment.cuh"
#include "ptx/async.cuh"
#include "ptx/math.cuh"
#include "ptx/mma.cuh"

namespace sage::bwd {

template <int D>
struct Smem {
  static constexpr int kS8 = D + 16;        // INT8 row of D (+16: conflict-free 4-byte loads)
  static constexpr int kS16 = 2 * D + 16;   // 16-bit row of D, bytes
  static constexpr int kST = kBlockQ + 16;  // transposed row of 64 queries / keys
  // One stage (a query block): Q^ rows, Q^ᵀ, dO^ᵀ, dO rows, L', D, then the two scales.
  static constexpr int kQhat = 0;
  static constexpr int kQhatT = kQhat + kBlockQ * kS8;
  static constexpr int kDohatT = kQhatT + D * kST;
  static constexpr int kDo = kDohatT + D * kST;
  static constexpr int kLse = kDo + kBlockQ * kS16;
  static constexpr int kDelta = kLse + kBlockQ * 4;
  static constexpr int kStage = kDelta + kBlockQ * 4;
  // The CTA's own: K^ rows, K^ᵀ, V rows, dS^ [query][key], per-query partial maxima [warp][64].
  static constexpr int kKhat = 2 * kStage;
  static constexpr int kKhatT = kKhat + kBlockK * kS8;
  static constexpr int kV = kKhatT + D * kST;
  static constexpr int kDs = kV + kBlockK * kS16;
  static constexpr int kQmax = kDs + kBlockQ * kST;
  static constexpr int kBytes = kQmax + kWarps * kBlockQ * 4;
};

__device__ __forceinline__ uint32_t lds32(const uint8_t* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}
// Four INT8 values (quantize_bits results: the low byte) in one register, a in byte 0.
__device__ __forceinline__ uint32_t pack4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  return __byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c, d, 0x0040), 0x5410);
}

// cp.async of one query block (head bh, block qb) into a stage.
template <int D>
__device__ __forceinline__ void load_stage(uint8_t* st, const MainParams& p, int64_t bh,
                                           int64_t qb) {
  using S = Smem<D>;
  const int64_t i0 = qb * kBlockQ;
  const uint8_t* qhat = reinterpret_cast<const uint8_t*>(p.qhat) + (bh * p.nq_pad + i0) * D;
  const uint8_t* dorow = reinterpret_cast<const uint8_t*>(p.do_ws) + (bh * p.nq_pad + i0) * D * 2;
  const uint8_t* qt = reinterpret_cast<const uint8_t*>(p.qhat_t) + bh * D * p.nq_pad + i0;
  const uint8_t* dt = reinterpret_cast<const uint8_t*>(p.dohat_t) + bh * D * p.nq_pad + i0;
  for (int i = threadIdx.x; i < kBlockQ * D / 16; i += kThreads) {
    const int r = i / (D / 16), c = i % (D / 16);
    ptx::cp_async_16(st + S::kQhat + r * S::kS8 + c * 16, qhat + r * D + c * 16);
  }
  for (int i = threadIdx.x; i < kBlockQ * D * 2 / 16; i += kThreads) {
    const int r = i / (D / 8), c = i % (D / 8);
    ptx::cp_async_16(st + S::kDo + r * S::kS16 + c * 16, dorow + r * D * 2 + c * 16);
  }
  for (int i = threadIdx.x; i < D * kBlockQ / 16; i += kThreads) {
    const int d = i / 4, c = i % 4;
    ptx::cp_async_16(st + S::kQhatT + d * S::kST + c * 16, qt + d * p.nq_pad + c * 16);
    ptx::cp_async_16(st + S::kDohatT + d * S::kST + c * 16, dt + d * p.nq_pad + c * 16);
  }
  if (threadIdx.x < kBlockQ / 4) {
    ptx::cp_async_16(st + S::kLse + threadIdx.x * 16,
                     p.lse2 + bh * p.nq_pad + i0 + threadIdx.x * 4);
  } else if (threadIdx.x < kBlockQ / 2) {
    const int x = threadIdx.x - kBlockQ / 4;
    ptx::cp_async_16(st + S::kDelta + x * 16, p.delta + bh * p.nq_pad + i0 + x * 4);
  }
}

// A 64-key x 64-query fragment (Pᵀ, dSᵀ) as the INT8 A operand of the two k32 steps of a product
// over the queries: q8(n, e) is value (n, e)'s ψ-quantized bits (the low byte).
template <typename Q8>
__device__ __forceinline__ void pack_a8(uint32_t (&f)[2][4], Q8 q8) {
  Frag::to_a8(f, [&](int n0, int h) {
    return pack4(q8(n0, 2 * h), q8(n0, 2 * h + 1), q8(n0 + 1, 2 * h), q8(n0 + 1, 2 * h + 1));
  });
}

// dK += q̄ ⊗ Σ_i dS_i for one query head (dSᵀ·Q = dSᵀ·(Q - q̄) + (Σ_i dS_i)ᵀ·q̄) on the
// accumulator fragment of this thread's two keys (dk(n, e): value (n, e)); cs: the thread's
// partial sums of their dS, zeroed. Every lane of the warp calls it (quad sums).
template <int D, typename Acc>
__device__ __forceinline__ void add_q_term(Acc dk, float (&cs)[2], const float* q_mean, int t) {
  const float ca = Frag::quad_sum(cs[0]), cb = Frag::quad_sum(cs[1]);
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const float2 m = *reinterpret_cast<const float2*>(q_mean + Frag::pair(n, t));
    dk(n, 0) += ca * m.x;
    dk(n, 1) += ca * m.y;
    dk(n, 2) += cb * m.x;
    dk(n, 3) += cb * m.y;
  }
  cs[0] = cs[1] = 0.0f;
}

template <typename T, int D, bool kCausal>
__global__ void __launch_bounds__(kThreads, 1) backward_kernel(const MainParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using S = Smem<D>;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  constexpr int kDT = D / 8;  // 8-channel tiles of dK, dV, dQ
  extern __shared__ __align__(16) uint8_t smem[];

  const int64_t kb = blockIdx.x, bkv = cta_outer_index(), k0 = kb * kBlockK;
  // (the whole CTA, before any barrier; a call the verdict refused is NaN whatever this computes)
  if (bkv >= p.batch * p.heads_kv || refused(p)) return;
  const int64_t b = bkv / p.heads_kv, hkv = bkv % p.heads_kv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int ka = warp * 16 + g;  // this thread's keys (local): ka and ka + 8

  // The CTA's keys: K^ rows, K^ᵀ, V rows.
  {
    const uint8_t* khat = reinterpret_cast<const uint8_t*>(p.khat) + (bkv * p.nk_pad + k0) * D;
    const uint8_t* kt = reinterpret_cast<const uint8_t*>(p.khat_t) + bkv * D * p.nk_pad + k0;
    const uint8_t* vrow = reinterpret_cast<const uint8_t*>(p.v_ws) + (bkv * p.nk_pad + k0) * D * 2;
    for (int i = threadIdx.x; i < kBlockK * D / 16; i += kThreads) {
      const int r = i / (D / 16), c = i % (D / 16);
      ptx::cp_async_16(smem + S::kKhat + r * S::kS8 + c * 16, khat + r * D + c * 16);
      const int d = i / 4, c4 = i % 4;
      ptx::cp_async_16(smem + S::kKhatT + d * S::kST + c4 * 16, kt + d * p.nk_pad + c4 * 16);
    }
    for (int i = threadIdx.x; i < kBlockK * D * 2 / 16; i += kThreads) {
      const int r = i / (D / 8), c = i % (D / 8);
      ptx::cp_async_16(smem + S::kV + r * S::kS16 + c * 16, vrow + r * D * 2 + c * 16);
    }
  }

  // Query blocks that see any of these keys: query i sees key j when j <= i + causal_offset.
  const QueryStream qs = query_stream<kCausal>(p, b, hkv, k0);
  const int64_t iters = qs.iters;
  BlockWalk cur = qs.first, nxt = cur;
  if (iters > 0) load_stage<D>(smem, p, nxt.bh, nxt.qb);
  ptx::cp_async_commit();

  const float k_scale = p.k_scale[bkv * p.k_blocks + kb];
  float dk[kDT][4], dv[kDT][4];
  for (int n = 0; n < kDT; ++n)
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.0f;
  const int64_t key_a = k0 + ka, key_b = key_a + 8;  // absolute keys of this thread's rows
  float cs[2] = {0.0f, 0.0f};  // Σ dS of each key over the head's queries this thread holds
  float* qmax_s = reinterpret_cast<float*>(smem + S::kQmax);
  uint8_t* ds_s = smem + S::kDs;

  for (int64_t it = 0; it < iters; ++it) {
    uint8_t* st = smem + (it & 1) * S::kStage;
    nxt.next();
    if (it + 1 < iters) {
      load_stage<D>(smem + ((it + 1) & 1) * S::kStage, p, nxt.bh, nxt.qb);
      ptx::cp_async_commit();
      ptx::cp_async_wait<1>();
    } else {
      ptx::cp_async_wait<0>();
    }
    __syncthreads();
    const int64_t bh = cur.bh, qb = cur.qb, i0 = qb * kBlockQ;
    cur.next();
    const float q_scale = p.q_scale[bh * p.q_blocks + qb];
    const float do_scale = p.do_scale[bh * p.q_blocks + qb];
    const float kt_a = p.key_term[bh * p.nk_pad + key_a], kt_b = p.key_term[bh * p.nk_pad + key_b];

    // Sᵀ = K^·Q^ᵀ: 16 keys x 64 queries a warp.
    int s[8][4];
    for (int n = 0; n < 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0;
    for (int ks = 0; ks < D / 32; ++ks) {
      const uint8_t* ar = smem + S::kKhat + ka * S::kS8 + ks * 32 + 4 * t;
      const uint32_t a[4] = {lds32(ar), lds32(ar + 8 * S::kS8), lds32(ar + 16),
                             lds32(ar + 8 * S::kS8 + 16)};
      for (int n = 0; n < 8; ++n) {
        const uint8_t* br = st + S::kQhat + (n * 8 + g) * S::kS8 + ks * 32 + 4 * t;
        const uint32_t bf[2] = {lds32(br), lds32(br + 16)};
        ptx::mma_m16n8k32_s8(s[n], a, bf, s[n]);
      }
    }
    // Pᵀ = 2^(Sᵀ·s_Q·s_K·scale·log2 e + t - L'), masked (x as the stats pass forms it); the max
    // of each key's row.
    const float* lse_s = reinterpret_cast<const float*>(st + S::kLse);
    const float* delta_s = reinterpret_cast<const float*>(st + S::kDelta);
    const float c = q_scale * k_scale * p.scale_log2;
    float P[8][4];
    float pmax[2] = {0.0f, 0.0f};
    for (int n = 0; n < 8; ++n)
      for (int e = 0; e < 4; ++e) {
        const int qi = Frag::col(n, e, t);
        const int64_t key = e < 2 ? key_a : key_b, query = i0 + qi;
        const bool visible = key < p.seq_kv && (!kCausal || key <= query + p.causal_offset);
        const float x =
            visible ? ptx::ex2(__fmaf_rn(float(s[n][e]), c, e < 2 ? kt_a : kt_b) - lse_s[qi])
                    : 0.0f;
        P[n][e] = x;
        pmax[Frag::half(e)] = ptx::max_nan(pmax[Frag::half(e)], x);
      }
    // dV += P^ᵀ·dO^: P^ᵀ per key (ψ over the key's 64 queries).
    {
      const Psi pa = psi_scale(Frag::quad_max(pmax[0])), pb = psi_scale(Frag::quad_max(pmax[1]));
      uint32_t pf[2][4];
      pack_a8(pf, [&](int n, int e) {
        return quant::quantize_bits(P[n][e], Frag::half(e) ? pb.inv : pa.inv, 127.0f);
      });
      const float sa = pa.scale * do_scale, sb = pb.scale * do_scale;
      for (int n = 0; n < kDT; ++n) {
        int acc[4] = {0, 0, 0, 0};
        for (int kq = 0; kq < 2; ++kq) {
          const uint8_t* br = st + S::kDohatT + (n * 8 + g) * S::kST + kq * 32 + 4 * t;
          const uint32_t bf[2] = {lds32(br), lds32(br + 16)};
          ptx::mma_m16n8k32_s8(acc, pf[kq], bf, acc);
        }
        dv[n][0] += float(acc[0]) * sa;
        dv[n][1] += float(acc[1]) * sa;
        dv[n][2] += float(acc[2]) * sb;
        dv[n][3] += float(acc[3]) * sb;
      }
    }
    // dPᵀ = V·dOᵀ in fp16/bf16, then dSᵀ = Pᵀ∘(dPᵀ - D) in place of Pᵀ.
    {
      float dp[8][4];
      for (int n = 0; n < 8; ++n) dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.0f;
      for (int kd = 0; kd < D / 16; ++kd) {
        const uint8_t* ar = smem + S::kV + ka * S::kS16 + kd * 32 + 4 * t;
        const uint32_t a[4] = {lds32(ar), lds32(ar + 8 * S::kS16), lds32(ar + 16),
                               lds32(ar + 8 * S::kS16 + 16)};
        for (int n = 0; n < 8; ++n) {
          const uint8_t* br = st + S::kDo + (n * 8 + g) * S::kS16 + kd * 32 + 4 * t;
          const uint32_t bf[2] = {lds32(br), lds32(br + 16)};
          ptx::mma_m16n8k16_f16<kBf16>(dp[n], a, bf, dp[n]);
        }
      }
      for (int n = 0; n < 8; ++n)
        for (int e = 0; e < 4; ++e) {
          P[n][e] *= dp[n][e] - delta_s[Frag::col(n, e, t)];
          cs[Frag::half(e)] += P[n][e];
        }
    }
    float(&dS)[8][4] = P;
    // Per-key maxima (dK's ψ) and this warp's per-query maxima (dQ's ψ, over 4 warps).
    float kmax[2] = {0.0f, 0.0f};
    for (int n = 0; n < 8; ++n)
      for (int e = 0; e < 4; ++e)
        kmax[Frag::half(e)] = ptx::max_nan(kmax[Frag::half(e)], fabsf(dS[n][e]));
    for (int n = 0; n < 8; ++n)
      for (int e = 0; e < 2; ++e) {
        float m = ptx::max_nan(fabsf(dS[n][e]), fabsf(dS[n][e + 2]));
        for (int o = 4; o < 32; o *= 2) m = ptx::max_nan(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
        if (g == 0) qmax_s[warp * kBlockQ + Frag::col(n, e, t)] = m;
      }
    // dK += dS^ᵀ·Q^ (per-key ψ).
    {
      const Psi da = psi_scale(Frag::quad_max(kmax[0])), db = psi_scale(Frag::quad_max(kmax[1]));
      uint32_t af[2][4];
      pack_a8(af, [&](int n, int e) {
        return quant::quantize_bits(dS[n][e], Frag::half(e) ? db.inv : da.inv, 127.0f);
      });
      const float sa = da.scale * q_scale, sb = db.scale * q_scale;
      for (int n = 0; n < kDT; ++n) {
        int acc[4] = {0, 0, 0, 0};
        for (int kq = 0; kq < 2; ++kq) {
          const uint8_t* br = st + S::kQhatT + (n * 8 + g) * S::kST + kq * 32 + 4 * t;
          const uint32_t bf[2] = {lds32(br), lds32(br + 16)};
          ptx::mma_m16n8k32_s8(acc, af[kq], bf, acc);
        }
        dk[n][0] += float(acc[0]) * sa;
        dk[n][1] += float(acc[1]) * sa;
        dk[n][2] += float(acc[2]) * sb;
        dk[n][3] += float(acc[3]) * sb;
      }
    }
    __syncthreads();  // every warp's per-query maxima are in
    // dS^ per query into shared memory, [query][key].
    for (int n = 0; n < 8; ++n)
      for (int e = 0; e < 2; ++e) {
        const int qi = Frag::col(n, e, t);
        float m = qmax_s[qi];
        for (int w = 1; w < kWarps; ++w) m = ptx::max_nan(m, qmax_s[w * kBlockQ + qi]);
        const float inv = psi_scale(m).inv;
        ds_s[qi * S::kST + ka] = uint8_t(quant::quantize_bits(dS[n][e], inv, 127.0f));
        ds_s[qi * S::kST + ka + 8] = uint8_t(quant::quantize_bits(dS[n][e + 2], inv, 127.0f));
      }
    // dS^ is in; in deterministic mode this CTA also waits for its turn at the dQ tile.
    const TileTurn turn{p.deterministic ? p.dq_turn : nullptr, int(bh * p.q_blocks + qb), int(kb)};
    turn.wait(/*leader=*/threadIdx.x == 0);
    // dQ += dS^·K^ for this warp's 16 queries, into the fp32 accumulator.
    {
      const int qa = warp * 16 + g;
      float ra = qmax_s[qa], rb = qmax_s[qa + 8];
      for (int w = 1; w < kWarps; ++w) {
        ra = ptx::max_nan(ra, qmax_s[w * kBlockQ + qa]);
        rb = ptx::max_nan(rb, qmax_s[w * kBlockQ + qa + 8]);
      }
      const float sa = psi_scale(ra).scale * k_scale, sb = psi_scale(rb).scale * k_scale;
      uint32_t af[2][4];
      for (int kk = 0; kk < 2; ++kk) {
        const uint8_t* ar = ds_s + qa * S::kST + kk * 32 + 4 * t;
        af[kk][0] = lds32(ar);
        af[kk][1] = lds32(ar + 8 * S::kST);
        af[kk][2] = lds32(ar + 16);
        af[kk][3] = lds32(ar + 8 * S::kST + 16);
      }
      float* dqh = p.dq_acc + bh * p.nq_pad * D;
      const bool row_a = i0 + qa < p.seq_q, row_b = i0 + qa + 8 < p.seq_q;
      for (int n = 0; n < kDT; ++n) {
        int acc[4] = {0, 0, 0, 0};
        for (int kk = 0; kk < 2; ++kk) {
          const uint8_t* br = smem + S::kKhatT + (n * 8 + g) * S::kST + kk * 32 + 4 * t;
          const uint32_t bf[2] = {lds32(br), lds32(br + 16)};
          ptx::mma_m16n8k32_s8(acc, af[kk], bf, acc);
        }
        const int d = Frag::pair(n, t);
        if (row_a)
          turn.add2(dqh + dq_offset(i0 + qa, d, D), float(acc[0]) * sa, float(acc[1]) * sa);
        if (row_b)
          turn.add2(dqh + dq_offset(i0 + qa + 8, d, D), float(acc[2]) * sb, float(acc[3]) * sb);
      }
    }
    turn.pass(/*leader=*/threadIdx.x == 0);  // and the stage, dS^, the maxima are free again
    if (p.smooth_q && (it + 1 == iters || cur.bh != bh))  // the head's last block
      add_q_term<D>([&](int n, int e) -> float& { return dk[n][e]; }, cs, p.q_mean + bh * D, t);
  }

  // dK (times the softmax scale) and dV in the caller's dtype.
  T* dkp = static_cast<T*>(p.dk) + b * p.dk_st.batch + hkv * p.dk_st.head;
  T* dvp = static_cast<T*>(p.dv) + b * p.dv_st.batch + hkv * p.dv_st.head;
  for (int half = 0; half < 2; ++half) {
    const int64_t key = half == 0 ? key_a : key_b;
    if (key >= p.seq_kv) continue;
    for (int n = 0; n < kDT; ++n) {
      const int d = Frag::pair(n, t);
      dkp[key * p.dk_st.token + d] = T(dk[n][2 * half] * p.scale);
      dkp[key * p.dk_st.token + d + 1] = T(dk[n][2 * half + 1] * p.scale);
      dvp[key * p.dv_st.token + d] = T(dv[n][2 * half]);
      dvp[key * p.dv_st.token + d + 1] = T(dv[n][2 * half + 1]);
    }
  }
#endif
}

}  // namespace sage::bwd
