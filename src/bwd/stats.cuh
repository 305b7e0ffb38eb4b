// SageBwd's stats pass (mma.sync, sm_80+: it serves both main-kernel families) and, after the main
// kernel, its verdict.
//
// The main kernels recompute the scores with the backward's own ψ blocks (Q per 64 queries, K - k̄
// per 64 keys). The forward's LSE and O come from differently quantized scores, so with them a row
// of P = 2^(x - L') need not sum to 1 and rowsum(dS) need not be g: on outlier channels or peaked
// rows that error dominates the gradients. The stats pass therefore takes every row's statistics
// from the scores the main kernels use, x_ij = float(s_ij)·c + t_j (one fma) with s = Q^·K^ᵀ
// (exact int32), c = s_Q·s_K·scale·log2 e formed in their order and t_j = q̄·(K_j - k̄)·scale·log2 e
// (the key's term that Q smoothing takes out of Q^; the pre-pass's key_term), over the keys row i
// sees (online, as the forward):
//   L'_i = m_i + log2 Σ_j 2^(x_ij - m_i),  m_i = max_j x_ij (NaN-keeping)
//   D_i  = Σ_j P_ij·dP_ij - g_i,  dP = dO·Vᵀ (the workspace's 16-bit operands, fp32 accumulation)
//   σ_i² = scale²/12 · Σ_j P_ij·(s_Q²·‖K_j - k̄‖² + ‖Q_i - q̄‖²·s_K(j)²)
// σ_i² is the variance of the INT8 scores' error (natural-log units), each element of Q - q̄ and
// of K - k̄ taken as rounded uniformly within its ψ step, weighted by the row's own P. The stats
// pass sums it over each query block (err2); judge_kernel marks the call untrusted when a head's
// rms error over its rows that see a key exceeds max_score_err (or is NaN); the main kernels of
// such a call return at once (refused), and poison_kernel writes NaN over dQ, dK and dV, so a
// caller that ignores the verdict cannot train on them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "bwd/kernel.cuh"
#include "bwd/params.h"
#include "common/fragment.cuh"
#include "common/grid.h"
#include "ptx/async.cuh"
#include "ptx/math.cuh"
#include "ptx/mma.cuh"

namespace sage::bwd {

// Offset of byte b of row r in a tile of kW-byte rows (64, 128 or 256), unpadded: the 16-byte
// chunk index XORed with row bits, so that a fragment's 4-byte loads (rows g = 0..7 of an 8-row
// group, words t = 0..3 of one chunk) hit 32 distinct banks.
template <int kW>
__device__ __forceinline__ int swz_row(int r, int b) {
  static_assert(kW == 64 || kW == 128 || kW == 256, "64-, 128- or 256-byte rows");
  if constexpr (kW == 64)
    return r * 64 + ((((b >> 4) ^ (r >> 1)) & 3) << 4) + (b & 15);
  else
    return r * kW + (((b >> 4) ^ (r & 7)) << 4) + (b & 15);
}

// One stage (a key block): K^ rows, V rows (both swz_row), ‖K_j - k̄‖², the keys' score terms;
// two stages. Unpadded rows keep both stages within 49 KB at D = 128: two CTAs an sm_89 / sm_120
// SM (100 KB, 1 KB of it reserved a CTA).
template <int D>
struct StatsSmem {
  static constexpr int kKhat = 0;                     // s8 [64 keys][D]
  static constexpr int kV = kKhat + kBlockK * D;      // 16-bit [64 keys][D]
  static constexpr int kNorm = kV + kBlockK * D * 2;  // f32 [64 keys]
  static constexpr int kTerm = kNorm + kBlockK * 4;   // f32 [64 keys]
  static constexpr int kStage = kTerm + kBlockK * 4;
  static constexpr int kBytes = 2 * kStage;
  static_assert(kBytes <= 49 * 1024, "two CTAs an sm_89 / sm_120 SM");
};

// cp.async of key block kb of KV head bkv (with query head bh's score terms) into a stage.
template <int D>
__device__ __forceinline__ void load_keys(uint8_t* st, const StatsParams& p, int64_t bkv,
                                          int64_t bh, int64_t kb) {
  using S = StatsSmem<D>;
  const int64_t j0 = kb * kBlockK;
  const uint8_t* khat = reinterpret_cast<const uint8_t*>(p.khat) + (bkv * p.nk_pad + j0) * D;
  const uint8_t* vrow = reinterpret_cast<const uint8_t*>(p.v_ws) + (bkv * p.nk_pad + j0) * D * 2;
  for (int i = threadIdx.x; i < kBlockK * D / 16; i += kThreads) {
    const int r = i / (D / 16), c = i % (D / 16);
    ptx::cp_async_16(st + S::kKhat + swz_row<D>(r, c * 16), khat + r * D + c * 16);
  }
  for (int i = threadIdx.x; i < kBlockK * D * 2 / 16; i += kThreads) {
    const int r = i / (D / 8), c = i % (D / 8);
    ptx::cp_async_16(st + S::kV + swz_row<2 * D>(r, c * 16), vrow + r * D * 2 + c * 16);
  }
  if (threadIdx.x < kBlockK / 4)
    ptx::cp_async_16(st + S::kNorm + threadIdx.x * 16,
                     p.knorm2 + bkv * p.nk_pad + j0 + threadIdx.x * 4);
  else if (threadIdx.x < kBlockK / 2)
    ptx::cp_async_16(st + S::kTerm + (threadIdx.x - kBlockK / 4) * 16,
                     p.key_term + bh * p.nk_pad + j0 + (threadIdx.x - kBlockK / 4) * 4);
}

__device__ __forceinline__ uint32_t ldg32(const uint8_t* p) {
  return __ldg(reinterpret_cast<const unsigned int*>(p));
}
// The sum over the 4 lanes of a quad (the threads sharing accumulator rows g, g+8).
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xFFFFFFFFu, x, 1);
  return x + __shfl_xor_sync(0xFFFFFFFFu, x, 2);
}

// L' and D of one 64-query block (every row, padding included), and its rows' σ² added to err2.
// Grid (q_blocks, B·Hq over y and z), kThreads threads (4 warps x 16 queries: the M rows),
// dynamic smem StatsSmem<D>::kBytes. Key blocks stream through two cp.async stages.
template <typename T, int D, bool kCausal>
__global__ void __launch_bounds__(kThreads) stats_kernel(const StatsParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using S = StatsSmem<D>;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  extern __shared__ __align__(16) uint8_t smem[];
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
  for (int r = 0; r < 2; ++r)
    limit[r] = kCausal ? min(p.seq_kv, row[r] + p.causal_offset + 1) : p.seq_kv;

  // The key blocks up to the last key a real row of this block sees.
  int64_t n_kb = p.k_blocks;
  if (kCausal) {
    const int64_t last = min(i0 + kBlockQ, p.seq_q) - 1 + p.causal_offset;
    n_kb = last < 0 ? 0 : min(p.k_blocks, last / kBlockK + 1);
  }
  if (n_kb > 0) load_keys<D>(smem, p, bkv, bh, 0);
  ptx::cp_async_commit();

  // This warp's 16 rows of Q^ and dO as A fragments, kept for every key block.
  uint32_t qf[D / 32][4], df[D / 16][4];
  {
    const uint8_t* qr =
        reinterpret_cast<const uint8_t*>(p.qhat) + (bh * p.nq_pad + i0 + qa) * D + 4 * t;
    const uint8_t* dr =
        reinterpret_cast<const uint8_t*>(p.do_ws) + (bh * p.nq_pad + i0 + qa) * D * 2 + 4 * t;
    for (int ks = 0; ks < D / 32; ++ks) {
      qf[ks][0] = ldg32(qr + ks * 32);
      qf[ks][1] = ldg32(qr + 8 * D + ks * 32);
      qf[ks][2] = ldg32(qr + ks * 32 + 16);
      qf[ks][3] = ldg32(qr + 8 * D + ks * 32 + 16);
    }
    for (int kd = 0; kd < D / 16; ++kd) {
      df[kd][0] = ldg32(dr + kd * 32);
      df[kd][1] = ldg32(dr + 16 * D + kd * 32);
      df[kd][2] = ldg32(dr + kd * 32 + 16);
      df[kd][3] = ldg32(dr + 16 * D + kd * 32 + 16);
    }
  }
  const float q_scale = p.q_scale[bh * p.q_blocks + qb];

  // Per row, over this thread's 16 keys of each block (scaled to the row's running max): Σ P,
  // Σ P·dP, Σ P·‖K_j - k̄‖², Σ P·s_K².
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.0f, 0.0f}, pdp[2] = {0.0f, 0.0f}, pk[2] = {0.0f, 0.0f}, ps[2] = {0.0f, 0.0f};
  for (int64_t kb = 0; kb < n_kb; ++kb) {
    const uint8_t* st = smem + (kb & 1) * S::kStage;
    if (kb + 1 < n_kb) {
      load_keys<D>(smem + ((kb + 1) & 1) * S::kStage, p, bkv, bh, kb + 1);
      ptx::cp_async_commit();
      ptx::cp_async_wait<1>();
    } else {
      ptx::cp_async_wait<0>();
    }
    __syncthreads();

    // S = Q^·K^ᵀ (B[k][n] = K^[key n][k]: K^ rows are the col layout) and dP = dO·Vᵀ.
    int s[8][4];
    float dp[8][4];
    for (int n = 0; n < 8; ++n)
      for (int e = 0; e < 4; ++e) s[n][e] = 0, dp[n][e] = 0.0f;
    for (int ks = 0; ks < D / 32; ++ks)
      for (int n = 0; n < 8; ++n) {
        const uint8_t* br = st + S::kKhat;
        const uint32_t bf[2] = {lds32(br + swz_row<D>(n * 8 + g, ks * 32 + 4 * t)),
                                lds32(br + swz_row<D>(n * 8 + g, ks * 32 + 16 + 4 * t))};
        ptx::mma_m16n8k32_s8(s[n], qf[ks], bf, s[n]);
      }
    for (int kd = 0; kd < D / 16; ++kd)
      for (int n = 0; n < 8; ++n) {
        const uint8_t* br = st + S::kV;
        const uint32_t bf[2] = {lds32(br + swz_row<2 * D>(n * 8 + g, kd * 32 + 4 * t)),
                                lds32(br + swz_row<2 * D>(n * 8 + g, kd * 32 + 16 + 4 * t))};
        ptx::mma_m16n8k16_f16<kBf16>(dp[n], df[kd], bf, dp[n]);
      }

    // x = float(s)·c + t_j, c in the main kernels' order, one rounding (their fma) so that the
    // max and the sums see one x; keys a row does not see (padding keys too, though K^ is zero
    // there) count as -inf in the max and not at all in the sums.
    const int64_t j0 = kb * kBlockK;
    const float k_scale = p.k_scale[bkv * p.k_blocks + kb];
    const float c = q_scale * k_scale * p.scale_log2;
    int lim[2];  // keys (local) [0, lim[r]) of this block are visible to row r
    for (int r = 0; r < 2; ++r) lim[r] = int(max(int64_t(0), min(int64_t(kBlockK), limit[r] - j0)));
    const float* kt = reinterpret_cast<const float*>(st + S::kTerm);
    float x[8][4];
    float mx[2] = {m[0], m[1]};
    for (int n = 0; n < 8; ++n) {
      const float2 t2 = *reinterpret_cast<const float2*>(kt + Frag::pair(n, t));
      for (int e = 0; e < 4; ++e) {
        const bool seen = Frag::col(n, e, t) < lim[Frag::half(e)];
        x[n][e] = seen ? __fmaf_rn(float(s[n][e]), c, (e & 1) ? t2.y : t2.x) : -INFINITY;
        mx[Frag::half(e)] = ptx::max_nan(mx[Frag::half(e)], x[n][e]);
      }
    }
    float alpha[2];  // the old sums' rescale (the first block: nothing to rescale)
    for (int r = 0; r < 2; ++r) {
      mx[r] = Frag::quad_max(mx[r]);
      alpha[r] = m[r] == -INFINITY ? 0.0f : ptx::ex2(m[r] - mx[r]);
      m[r] = mx[r];
    }
    const float* kn = reinterpret_cast<const float*>(st + S::kNorm);
    float bl[2] = {0.0f, 0.0f}, bdp[2] = {0.0f, 0.0f}, bk[2] = {0.0f, 0.0f};
    for (int n = 0; n < 8; ++n) {
      const float2 k2 = *reinterpret_cast<const float2*>(kn + Frag::pair(n, t));
      for (int e = 0; e < 4; ++e) {
        const int r = Frag::half(e);
        if (Frag::col(n, e, t) >= lim[r]) continue;
        const float pe = ptx::ex2(x[n][e] - mx[r]);
        bl[r] += pe;
        bdp[r] += pe * dp[n][e];
        bk[r] += pe * ((e & 1) ? k2.y : k2.x);
      }
    }
    const float ks2 = k_scale * k_scale;
    for (int r = 0; r < 2; ++r) {
      l[r] = l[r] * alpha[r] + bl[r];
      pdp[r] = pdp[r] * alpha[r] + bdp[r];
      pk[r] = pk[r] * alpha[r] + bk[r];
      ps[r] = ps[r] * alpha[r] + ks2 * bl[r];
    }
    __syncthreads();  // this stage is free for block kb + 2
  }

  // The rows' outputs (one lane a quad writes), and the CTA's Σ σ² into the head's err2.
  const float c_err = p.scale * p.scale / 12.0f;
  float err = 0.0f;
  for (int r = 0; r < 2; ++r) {
    const float lr = quad_sum(l[r]), dr = quad_sum(pdp[r]), kr = quad_sum(pk[r]),
                sr = quad_sum(ps[r]);
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
    for (int w = 1; w < kWarps; ++w) sum += scratch[w];
    p.err2[bh * p.q_blocks + qb] = sum;  // (judge_kernel sums a head's blocks in order)
  }
#endif
}

// The verdict: untrusted when any query head's rms score error, sqrt(Σ err2 / rows) over its rows
// that see a key, is not <= max_score_err (NaN included); each head's blocks summed in order, so
// the verdict is the same on every run. One thread a head (a 1-D grid of kThreads-thread CTAs),
// ORed into the workspace's verdict, which mean_kernel zeroed; poison_kernel passes it on to the
// caller. (<D>: an instance a backward_d*.cu, as every kernel here.)
template <int D>
__global__ void __launch_bounds__(kThreads) judge_kernel(const JudgeParams p) {
  const int64_t bh = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t rows = p.rows_seeing_keys();
  bool bad = false;
  if (bh < p.batch * p.heads_q && rows > 0) {
    float sum = 0.0f;
    for (int64_t qb = 0; qb < p.q_blocks; ++qb) sum += p.err2[bh * p.q_blocks + qb];
    bad = !(sqrtf(sum / float(rows)) <= p.max_score_err);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(p.verdict, 1);
}

// NaN over one gradient [B][heads][n][D] in the caller's strides, by the whole grid.
template <typename T, int D>
__device__ __forceinline__ void fill_nan(void* base, const sage_strides& st, int64_t batch,
                                         int64_t heads, int64_t n) {
  const T nan = T(__int_as_float(0x7FC00000));
  const int64_t step = int64_t(gridDim.x) * kThreads, total = batch * heads * n * D;
  for (int64_t idx = blockIdx.x * int64_t(kThreads) + threadIdx.x; idx < total; idx += step) {
    const int64_t r = idx / D, token = r % n, bh = r / n;
    const int64_t at = (bh / heads) * st.batch + (bh % heads) * st.head + token * st.token;
    static_cast<T*>(base)[at + idx % D] = nan;
  }
}

// On an untrusted verdict, NaN over dQ, dK and dV; otherwise every CTA returns at once. A
// one-dimensional grid of kThreads-thread CTAs, striding (any size).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) poison_kernel(const PoisonParams p) {
  const int32_t verdict = *p.verdict;
  if (blockIdx.x == 0 && threadIdx.x == 0 && p.untrusted) *p.untrusted = verdict;
  if (verdict == 0) return;
  fill_nan<T, D>(p.dq, p.dq_st, p.batch, p.heads_q, p.seq_q);
  fill_nan<T, D>(p.dk, p.dk_st, p.batch, p.heads_kv, p.seq_kv);
  fill_nan<T, D>(p.dv, p.dv_st, p.batch, p.heads_kv, p.seq_kv);
}

}  // namespace sage::bwd
