// SageBwd's pre-pass (sm_80+): K's and Q's channel means (per chunk, then summed in a fixed
// order), ψ of K - k_mean per 64-key block (rows and transposed) with each key's ‖K_j - k_mean‖²
// and, per query head of the group, its q_mean·(K_j - k_mean) (the score term Q smoothing takes
// out of Q^), V copied zero-padded; per 64-query block ψ of Q - q_mean and dO (rows and
// transposed with queries permuted, bwd::query_at), dO copied, each query's ‖Q_i - q_mean‖², and
// dQ's accumulator and turn counters zeroed.
// L' and D come from the stats pass (stats.cuh); the norms feed its error estimate.
// ψ and the scales are the CPU emulation's (ref::bwd_scale, quant::quantize_bits); a NaN
// anywhere in a block makes its scale NaN, so the gradients it reaches come out NaN.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "bwd/params.h"
#include "common/grid.h"
#include "ptx/math.cuh"
#include "quant/elements.cuh"

namespace sage::bwd {

template <typename T>
__device__ __forceinline__ float load_f(const void* base, int64_t off) {
  return quant::to_float(static_cast<const T*>(base)[off]);
}
template <typename T>
__device__ __forceinline__ uint16_t load_bits(const void* base, int64_t off) {
  return static_cast<const uint16_t*>(base)[off];
}

struct Psi {
  float scale, inv;
};
// ref::bwd_scale on the device (IEEE divisions, so host and device agree bit for bit).
__device__ __forceinline__ Psi psi_scale(float amax) {
  if (amax != amax) return {amax, 0.0f};
  if (!(amax > 0.0f)) return {0.0f, 0.0f};
  return {__fdiv_rn(amax, 127.0f), __fdiv_rn(127.0f, amax)};
}
__device__ __forceinline__ int8_t psi_quantize(float x, float inv) {
  return int8_t(quant::quantize_bits(x, inv, 127.0f) & 0xFF);
}

// The NaN-keeping max of every thread's value (kThreads threads; scratch: kWarps floats).
__device__ __forceinline__ float block_max_nan(float x, float* scratch) {
  for (int o = 16; o > 0; o /= 2) x = ptx::max_nan(x, __shfl_xor_sync(0xFFFFFFFFu, x, o));
  __syncthreads();  // scratch may still be read by a previous call
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  float m = scratch[0];
  for (int w = 1; w < kWarps; ++w) m = ptx::max_nan(m, scratch[w]);
  return m;
}

// The squared norm of row threadIdx.x / 2 of a [64][D + 1] staging tile: two threads a row, each
// half of the channels; both get the sum.
template <int D>
__device__ __forceinline__ float row_norm2(const float* tile) {
  const float* row = tile + (threadIdx.x / 2) * (D + 1);
  const int half = threadIdx.x % 2;
  float n2 = 0.0f;
  for (int d = half * (D / 2); d < (half + 1) * (D / 2); ++d) n2 += row[d] * row[d];
  return n2 + __shfl_xor_sync(0xFFFFFFFFu, n2, 1);
}

// K's (kQ: Q's) channel sums over rows [256·chunk, 256·chunk + 256) (ref::kBwdSumChunk), in row
// order: grid (chunks, B·heads over y and z: common/grid.h), D threads. The emulation forms k̄ and
// q̄ in this same order (ref/backward.cpp): keep the two together.
template <typename T, int D, bool kQ>
__global__ void sum_kernel(const SumParams p) {
  const int64_t bh = cta_outer_index(), chunk = blockIdx.x;
  const int64_t heads = kQ ? p.heads_q : p.heads_kv, rows = kQ ? p.seq_q : p.seq_kv;
  if (bh >= p.batch * heads) return;
  const void* x = kQ ? p.q : p.k;
  const sage_strides& st = kQ ? p.q_st : p.k_st;
  const int d = threadIdx.x;
  const int64_t base = (bh / heads) * st.batch + (bh % heads) * st.head + d;
  constexpr int64_t kChunk = ref::kBwdSumChunk;
  const int64_t r1 = min(rows, (chunk + 1) * kChunk);
  float s = 0.0f;
  for (int64_t r = chunk * kChunk; r < r1; ++r) s += load_f<T>(x, base + r * st.token);
  (kQ ? p.q_part : p.k_part)[(bh * (kQ ? p.q_chunks : p.k_chunks) + chunk) * D + d] = s;
}

// k_mean = Σ chunks / Nk (kQ: q_mean = Σ chunks / Nq) in chunk order (deterministic), zero
// without its smoothing: grid B·heads over y and z (common/grid.h), D threads.
template <int D, bool kQ>
__global__ void mean_kernel(const MeanParams p) {
  const int64_t bh = cta_outer_index();
  if (bh >= p.batch * (kQ ? p.heads_q : p.heads_kv)) return;
  const int64_t chunks = kQ ? p.q_chunks : p.k_chunks;
  const float* part = kQ ? p.q_part : p.k_part;
  const int d = threadIdx.x;
  float s = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) s += part[(bh * chunks + c) * D + d];
  if (kQ)
    p.q_mean[bh * D + d] = p.smooth_q ? s / float(p.seq_q) : 0.0f;
  else
    p.k_mean[bh * D + d] = p.smooth_k ? s / float(p.seq_kv) : 0.0f;
  if (!kQ && bh == 0 && d == 0) *p.verdict = 0;  // (a reused workspace holds the last call's)
}

// One 64-key block: ψ(K - k_mean) rows and transposed, its scale, ‖K_j - k_mean‖², V copied,
// and for each query head of the group q_mean·(K_j - k_mean)·scale·log2 e (one fma chain over the
// channels in order, as the emulation; 0 without Q smoothing).
// Grid (k_blocks, B·Hkv), kThreads threads, dynamic smem 64·(D+1) floats.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) k_prep_kernel(const KPrepParams p) {
  extern __shared__ float xs[];  // [64][D + 1]
  __shared__ float scratch[kWarps];
  const int64_t kb = blockIdx.x, bkv = cta_outer_index(), j0 = kb * kBlockK;
  if (bkv >= p.batch * p.heads_kv) return;
  const int64_t b = bkv / p.heads_kv, h = bkv % p.heads_kv;
  const int64_t kbase = b * p.k_st.batch + h * p.k_st.head;
  const int64_t vbase = b * p.v_st.batch + h * p.v_st.head;
  float amax = 0.0f;
  for (int idx = threadIdx.x; idx < kBlockK * D; idx += kThreads) {
    const int r = idx / D, d = idx % D;
    const int64_t j = j0 + r;
    float x = 0.0f;
    uint16_t vb = 0;
    if (j < p.seq_kv) {
      x = load_f<T>(p.k, kbase + j * p.k_st.token + d) - p.k_mean[bkv * D + d];
      vb = load_bits<T>(p.v, vbase + j * p.v_st.token + d);
    }
    xs[r * (D + 1) + d] = x;
    amax = ptx::max_nan(amax, fabsf(x));
    p.v_ws[(bkv * p.nk_pad + j) * D + d] = vb;
  }
  amax = block_max_nan(amax, scratch);
  const Psi s = psi_scale(amax);
  if (threadIdx.x == 0) p.k_scale[bkv * p.k_blocks + kb] = s.scale;
  for (int idx = threadIdx.x; idx < kBlockK * D; idx += kThreads) {
    const int r = idx / D, d = idx % D;
    p.khat[(bkv * p.nk_pad + j0 + r) * D + d] = psi_quantize(xs[r * (D + 1) + d], s.inv);
  }
  for (int idx = threadIdx.x; idx < kBlockK * D; idx += kThreads) {
    const int r = idx % kBlockK, d = idx / kBlockK;
    p.khat_t[(bkv * D + d) * p.nk_pad + j0 + r] = psi_quantize(xs[r * (D + 1) + d], s.inv);
  }
  const float n2 = row_norm2<D>(xs);  // (padding keys are zero)
  if (threadIdx.x % 2 == 0) p.knorm2[bkv * p.nk_pad + j0 + threadIdx.x / 2] = n2;
  const int64_t G = p.group();
  for (int64_t idx = threadIdx.x; idx < kBlockK * G; idx += kThreads) {
    const int r = int(idx % kBlockK);
    const int64_t bh = b * p.heads_q + h * G + idx / kBlockK;
    float acc = 0.0f;
    if (p.smooth_q) {
      const float* qm = p.q_mean + bh * D;  // (a warp's 32 rows share one head: broadcast)
      const float* row = xs + r * (D + 1);
#pragma unroll 8
      for (int d = 0; d < D; ++d) acc = __fmaf_rn(qm[d], row[d], acc);
      acc = __fmul_rn(acc, p.scale_log2);
    }
    p.key_term[bh * p.nk_pad + j0 + r] = acc;
  }
}

// One 64-query block: ψ(Q - q_mean), ψ(dO) (rows / transposed and permuted), dO copied,
// ‖Q_i - q_mean‖², dQ's accumulator and turn counter zeroed (in both modes: a reused workspace
// holds the last call's), and by the head's first block its error sum, which the stats pass adds
// to.
// Grid (q_blocks, B·Hq), kThreads threads, dynamic smem 2·64·(D+1) floats.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) q_prep_kernel(const QPrepParams p) {
  extern __shared__ float qs[];  // [64][D + 1] Q, then [64][D + 1] dO
  float* dos = qs + kBlockQ * (D + 1);
  __shared__ float scratch[kWarps];
  const int64_t qb = blockIdx.x, bh = cta_outer_index(), i0 = qb * kBlockQ;
  if (bh >= p.batch * p.heads_q) return;
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
  const int64_t qbase = b * p.q_st.batch + h * p.q_st.head;
  const int64_t dobase = b * p.do_st.batch + h * p.do_st.head;
  float qmax = 0.0f, domax = 0.0f;
  for (int idx = threadIdx.x; idx < kBlockQ * D; idx += kThreads) {
    const int r = idx / D, d = idx % D;
    const int64_t i = i0 + r;
    float x = 0.0f, y = 0.0f;
    uint16_t yb = 0;
    if (i < p.seq_q) {
      x = load_f<T>(p.q, qbase + i * p.q_st.token + d) - p.q_mean[bh * D + d];
      yb = load_bits<T>(p.d_o, dobase + i * p.do_st.token + d);
      y = load_f<T>(p.d_o, dobase + i * p.do_st.token + d);
    }
    qs[r * (D + 1) + d] = x;
    dos[r * (D + 1) + d] = y;
    qmax = ptx::max_nan(qmax, fabsf(x));
    domax = ptx::max_nan(domax, fabsf(y));
    p.do_ws[(bh * p.nq_pad + i) * D + d] = yb;
    p.dq_acc[(bh * p.nq_pad + i) * D + d] = 0.0f;
  }
  qmax = block_max_nan(qmax, scratch);
  domax = block_max_nan(domax, scratch);
  const Psi sq = psi_scale(qmax), sd = psi_scale(domax);
  if (threadIdx.x == 0) {
    p.dq_turn[bh * p.q_blocks + qb] = 0;
    p.q_scale[bh * p.q_blocks + qb] = sq.scale;
    p.do_scale[bh * p.q_blocks + qb] = sd.scale;
  }
  for (int idx = threadIdx.x; idx < kBlockQ * D; idx += kThreads) {
    const int r = idx / D, d = idx % D;
    p.qhat[(bh * p.nq_pad + i0 + r) * D + d] = psi_quantize(qs[r * (D + 1) + d], sq.inv);
  }
  for (int idx = threadIdx.x; idx < kBlockQ * D; idx += kThreads) {
    const int c = idx % kBlockQ, d = idx / kBlockQ;
    const int r = (c / 32) * 32 + query_at(c % 32);
    const int64_t at = (bh * D + d) * p.nq_pad + i0 + c;
    p.qhat_t[at] = psi_quantize(qs[r * (D + 1) + d], sq.inv);
    p.dohat_t[at] = psi_quantize(dos[r * (D + 1) + d], sd.inv);
  }
  const float n2 = row_norm2<D>(qs);  // (padding rows are zero)
  if (threadIdx.x % 2 == 0) p.qnorm2[bh * p.nq_pad + i0 + threadIdx.x / 2] = n2;
}

// dQ = scale · dq_acc in the caller's dtype and strides: grid (q_blocks, B·Hq), kThreads.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) dq_store_kernel(const DqStoreParams p) {
  const int64_t qb = blockIdx.x, bh = cta_outer_index(), i0 = qb * kBlockQ;
  if (bh >= p.batch * p.heads_q || refused(p)) return;
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
  T* dq = static_cast<T*>(p.dq) + b * p.dq_st.batch + h * p.dq_st.head;
  const int64_t bkv = b * p.heads_kv + h / p.group();
  for (int idx = threadIdx.x; idx < kBlockQ * D; idx += kThreads) {
    const int r = idx / D, d = idx % D;
    const int64_t i = i0 + r;
    if (i >= p.seq_q) continue;
    // K^ holds K - k_mean: with a gradient g on the LSE, rowsum(dS_i) = g_i and dQ_i gets
    // g_i·k_mean back (zero without one, and for a row that sees no key: its LSE is a constant).
    const float g = p.d_lse && p.sees_key(i)
                        ? p.d_lse[b * p.dlse_st.batch + h * p.dlse_st.head + i * p.dlse_st.token]
                        : 0.0f;
    dq[i * p.dq_st.token + d] =
        T((p.dq_acc[bh * p.nq_pad * D + dq_offset(i, d, D)] + g * p.k_mean[bkv * D + d]) * p.scale);
  }
}

}  // namespace sage::bwd
