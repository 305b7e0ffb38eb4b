// SageBwd's stats pass on Hopper (sm_90a): each row's L' and D and each query block's Σ σ², the
// statistics and arithmetic of bwd/stats.cuh's stats_kernel (which says why they exist), with its
// two products as warpgroup MMAs from shared memory. The mma.sync pass issues about 34
// instructions a score, most of them B-fragment loads, their addresses and the MMAs; here the
// operands never pass through registers, and what a thread issues is each score's own work.
//
// One CTA is one warpgroup over 64 queries (thread (warp, g, t) holds rows 16·warp + g and + 8 of
// S = Q^·K^ᵀ and dP = dO·Vᵀ, the accumulators' layout); Q^ and dO stay in shared memory, the key
// blocks (K^, V, ‖K_j - k̄‖², the keys' score terms) stream through two cp.async stages.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "bwd/params.h"
#include "bwd/sm90/loads.cuh"  // load_tile, load_tile16
#include "bwd/sm90/smem.h"
#include "common/fragment.cuh"
#include "common/grid.h"
#include "ptx/async.cuh"
#include "ptx/math.cuh"
#include "ptx/wgmma.cuh"

namespace sage::bwd::sm90 {

// One CTA's tiles (byte offsets, each 1024-byte aligned: the swizzle atoms' alignment). 73.5 KB
// at D = 128: three CTAs an SM.
template <int D>
struct StatsSmem {
  static constexpr int kQ = 0;                      // Q^ [64 queries][D], D-byte swizzle
  static constexpr int kDo = kQ + 64 * D;           // dO [64][D] 16-bit, D / 64 panels
  static constexpr int kStage0 = kDo + 64 * D * 2;  // two stages of one key block:
  static constexpr int kK = 0;                      //   K^ [64 keys][D]
  static constexpr int kV = kK + 64 * D;            //   V [64 keys][D] 16-bit panels
  static constexpr int kStage = kV + 64 * D * 2;
  static constexpr int kNorm = kStage0 + 2 * kStage;        // ‖K_j - k̄‖² [2 stages][64]
  static constexpr int kTerm = kNorm + 2 * 64 * 4;          // key_term [2 stages][64]
  static constexpr int kBytes = kTerm + 2 * 64 * 4 + 1024;  // + the base's alignment
  static_assert(kBytes <= 75 * 1024, "three CTAs an SM at D = 128");
};

// L', D and the block's Σ σ² of one 64-query block (every row, padding included): stats_kernel's
// outputs. Grid (q_blocks, B·Hq over y and z), kThreads threads, dynamic smem StatsSmem<D>::kBytes.
template <typename T, int D, bool kCausal>
__global__ void __launch_bounds__(kThreads) stats_kernel(const StatsParams p) {
#ifdef SAGE_PTX_HAS_WGMMA
  using S = StatsSmem<D>;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // (aligned by an offset, not an integer cast, so that accesses stay in the shared space)
  uint8_t* smem = smem_raw + ((1024 - (__cvta_generic_to_shared(smem_raw) & 1023)) & 1023);
  __shared__ float scratch[kWarps];

  const int64_t qb = blockIdx.x, bh = cta_outer_index(), i0 = qb * kBlockQ;
  if (bh >= p.batch * p.heads_q) return;  // (the whole CTA, before any barrier)
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
  const int64_t bkv = b * p.heads_kv + h / p.group();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int qa = warp * 16 + g;  // this thread's rows (local): qa and qa + 8
  const int64_t row[2] = {i0 + qa, i0 + qa + 8};
  // Row r sees keys [0, limit[r]) (none: limit <= 0).
  int64_t limit[2];
#pragma unroll
  for (int r = 0; r < 2; ++r)
    limit[r] = kCausal ? min(p.seq_kv, row[r] + p.causal_offset + 1) : p.seq_kv;
  // The key blocks up to the last key a real row of this block sees.
  int64_t n_kb = p.k_blocks;
  if (kCausal) {
    const int64_t last = min(i0 + kBlockQ, p.seq_q) - 1 + p.causal_offset;
    n_kb = last < 0 ? 0 : min(p.k_blocks, last / kBlockK + 1);
  }

  // Q^ and dO of the block join key block 0's group.
  const int64_t q_row = bh * p.nq_pad + i0;
  load_tile<D, 64>(smem + S::kQ, reinterpret_cast<const uint8_t*>(p.qhat) + q_row * D, D);
  load_tile16<D>(smem + S::kDo, reinterpret_cast<const uint8_t*>(p.do_ws) + q_row * D * 2);
  auto load_keys = [&](int64_t kb) {
    uint8_t* st = smem + S::kStage0 + (kb & 1) * S::kStage;
    const int64_t k_row = bkv * p.nk_pad + kb * kBlockK;
    load_tile<D, 64>(st + S::kK, reinterpret_cast<const uint8_t*>(p.khat) + k_row * D, D);
    load_tile16<D>(st + S::kV, reinterpret_cast<const uint8_t*>(p.v_ws) + k_row * D * 2);
    if (threadIdx.x < kBlockK / 4)
      ptx::cp_async_16(smem + S::kNorm + (kb & 1) * kBlockK * 4 + threadIdx.x * 16,
                       p.knorm2 + k_row + threadIdx.x * 4);
    else if (threadIdx.x < kBlockK / 2)
      ptx::cp_async_16(smem + S::kTerm + (kb & 1) * kBlockK * 4 + (threadIdx.x - kBlockK / 4) * 16,
                       p.key_term + bh * p.nk_pad + kb * kBlockK + (threadIdx.x - kBlockK / 4) * 4);
  };
  if (n_kb > 0) load_keys(0);
  ptx::cp_async_commit();
  const float q_scale = p.q_scale[bh * p.q_blocks + qb];

  // Per row, over this thread's 16 keys of each block (scaled to the row's running max): Σ P,
  // Σ P·dP, Σ P·‖K_j - k̄‖², Σ P·s_K².
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.0f, 0.0f}, pdp[2] = {0.0f, 0.0f}, pk[2] = {0.0f, 0.0f}, ps[2] = {0.0f, 0.0f};
  for (int64_t kb = 0; kb < n_kb; ++kb) {
    const uint8_t* st = smem + S::kStage0 + (kb & 1) * S::kStage;
    if (kb + 1 < n_kb) {
      load_keys(kb + 1);
      ptx::cp_async_commit();
      ptx::cp_async_wait<1>();
    } else {
      ptx::cp_async_wait<0>();
    }
    ptx::fence_proxy_async_smem();  // (the tiles are read by the wgmmas' async proxy)
    __syncthreads();

    // S = Q^·K^ᵀ (s8) and dP = dO·Vᵀ (fp16/bf16): 64 queries x 64 keys each, one batch.
    int s[32];
    float dp[32];
    s_and_dp<kBf16, D>(s, dp, smem + S::kQ, st + S::kK, smem + S::kDo, st + S::kV);

    // x = float(s)·c + t_j, c in the main kernels' order, one rounding (their fma) so that the
    // max and the sums see one x; keys a row does not see (padding keys too, though K^ is zero
    // there) count as -inf in the max and not at all in the sums.
    const int64_t j0 = kb * kBlockK;
    const float k_scale = p.k_scale[bkv * p.k_blocks + kb];
    const float c = q_scale * k_scale * p.scale_log2;
    int lim[2];  // keys (local) [0, lim[r]) of this block are visible to row r
#pragma unroll
    for (int r = 0; r < 2; ++r)
      lim[r] = int(max(int64_t(0), min(int64_t(kBlockK), limit[r] - j0)));
    const float* kt = reinterpret_cast<const float*>(smem + S::kTerm) + (kb & 1) * kBlockK;
    float x[32];
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      const float2 t2 = *reinterpret_cast<const float2*>(kt + Frag::pair(n, t));
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = Frag::reg(n, e);
        const bool seen = Frag::col(i, t) < lim[Frag::half(i)];
        x[i] = seen ? __fmaf_rn(float(s[i]), c, (e & 1) ? t2.y : t2.x) : -INFINITY;
        mx[Frag::half(i)] = ptx::max_nan(mx[Frag::half(i)], x[i]);
      }
    }
    float alpha[2];  // the old sums' rescale (the first block: nothing to rescale)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = Frag::quad_max(mx[r]);
      alpha[r] = m[r] == -INFINITY ? 0.0f : ptx::ex2(m[r] - mx[r]);
      m[r] = mx[r];
    }
    const float* kn = reinterpret_cast<const float*>(smem + S::kNorm) + (kb & 1) * kBlockK;
    float bl[2] = {0.0f, 0.0f}, bdp[2] = {0.0f, 0.0f}, bk[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      const float2 k2 = *reinterpret_cast<const float2*>(kn + Frag::pair(n, t));
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = Frag::reg(n, e), r = Frag::half(i);
        if (Frag::col(i, t) >= lim[r]) continue;
        const float pe = ptx::ex2(x[i] - mx[r]);
        bl[r] += pe;
        bdp[r] += pe * dp[i];
        bk[r] += pe * ((e & 1) ? k2.y : k2.x);
      }
    }
    const float ks2 = k_scale * k_scale;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[r] = l[r] * alpha[r] + bl[r];
      pdp[r] = pdp[r] * alpha[r] + bdp[r];
      pk[r] = pk[r] * alpha[r] + bk[r];
      ps[r] = ps[r] * alpha[r] + ks2 * bl[r];
    }
    __syncthreads();  // this stage is free for block kb + 2
  }

  ptx::cp_async_wait<0>();  // (no key block: Q^ and dO were still landing)

  // The rows' outputs (one lane a quad writes), and the CTA's Σ σ² into the head's err2.
  const float c_err = p.scale * p.scale / 12.0f;
  float err = 0.0f;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float lr = Frag::quad_sum(l[r]), dr = Frag::quad_sum(pdp[r]),
                kr = Frag::quad_sum(pk[r]), sr = Frag::quad_sum(ps[r]);
    const int64_t i = row[r];
    if (t != 0) continue;
    float l2 = INFINITY, d = 0.0f;  // padding rows and rows that see no key: every P = 0
    // A row that sees a key has l >= 1 (its max's own term) or NaN, which must reach L' and D.
    if (i < p.seq_q && limit[r] > 0) {
      const float gi =  // a gradient reaching the LSE: dS = P∘(dP - D + g)
          p.d_lse ? p.d_lse[b * p.dlse_st.batch + h * p.dlse_st.head + i * p.dlse_st.token] : 0.0f;
      l2 = m[r] + log2f(lr);
      d = dr / lr - gi;
      err += c_err * (q_scale * q_scale * (kr / lr) + p.qnorm2[bh * p.nq_pad + i] * (sr / lr));
    }
    p.lse2[bh * p.nq_pad + i] = l2;
    p.delta[bh * p.nq_pad + i] = d;
  }
  for (int o = 16; o > 0; o /= 2) err += __shfl_xor_sync(0xFFFFFFFFu, err, o);
  if (lane == 0) scratch[warp] = err;
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum = scratch[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) sum += scratch[w];
    p.err2[bh * p.q_blocks + qb] = sum;  // (judge_kernel sums a head's blocks in order)
  }
#endif
}

}  // namespace sage::bwd::sm90
