// SageAttention2 on mma.sync (sm_89, sm_90a, sm_120a): INT8 (m16n8k32) or INT4 (m16n8k64) Q·Kᵀ
// dequantized with one Q and one K scale per thread, base-2 online softmax, P~ to E4M3 in
// registers, E4M3 P^·V^ (m16n8k32) into a fresh accumulator per key block added into fp32
// (two-level), finalize with the V scales. One CTA = 8 warps = 128 query rows of one head.
//
// Why the shapes: a warp owns 16 rows, so a thread holds rows g and g+8 (one Q group) and, per
// 8-key tile, keys 2t, 2t+1 (one K group) — per-thread quantization costs nothing. With 16 rows a
// warp the accumulators fit: S 8 tiles x 4, R and O D/8 tiles x 4 each (D=128: 32+64+64 regs).
// At D = 256 O alone is 128 registers and INT8 Q's fragments 32: the 255 a thread may have hold
// the 8-bit loop with a few words spilled; with Q smoothing, ΔS's K words (32 a thread, in flight
// across Q·Kᵀ) spill ~0.2 KB a thread (ptxas -v), which the portable kernel accepts.
// Vᵀ arrives with the keys of each 32-chunk permuted (v_position_of_key) so the E4M3 pairs a
// thread converts from its S registers are exactly its A-operand bytes: no shuffles.
// Q smoothing's ΔS (a value per key and Q block) is formed here, a key block ahead, from the
// caller's K (DeltaS): a pre-pass product of it would take Nq·Nk/32 bytes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "attn/epilogue.cuh"
#include "attn/mma/launch.h"
#include "attn/mma/params.h"
#include "common/fragment.cuh"
#include "common/grid.h"
#include "common/launch.h"
#include "ptx/async.cuh"
#include "ptx/cvt.cuh"
#include "ptx/ldmatrix.cuh"
#include "ptx/math.cuh"
#include "ptx/mma.cuh"
#include "quant/elements.cuh"

namespace sage::mma {

template <int D, int kBits>
struct Tile {
  static constexpr int kRowBytes = D * kBits / 8;  // one quantized Q/K row
  static constexpr int kQkSteps = kRowBytes / 32;  // MMAs along head_dim (32 bytes each)
  // Shared-memory row strides padded by 16 bytes: the 32 lanes' 4-byte fragment loads (8 rows x
  // 4 consecutive words) then fall in 32 distinct banks.
  static constexpr int kKStride = kRowBytes + 16;
  static constexpr int kVStride = kBlockK + 16;
  static constexpr int kKBytes = kBlockK * kKStride;
  static constexpr int kVBytes = D * kVStride;
  static constexpr int kStageBytes = kKBytes + kVBytes;
};

__device__ __forceinline__ uint32_t lds32(const uint8_t* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

template <int kBits>
__device__ __forceinline__ void qk_mma(int (&acc)[4], const uint32_t (&a)[4],
                                       const uint32_t (&b)[2]) {
  if constexpr (kBits == 8)
    ptx::mma_m16n8k32_s8(acc, a, b, acc);
  else
    ptx::mma_m16n8k64_s4(acc, a, b, acc);
}

// Issues the cp.async copies of key block `kb` (K rows and Vᵀ columns, `pitch` bytes from one
// channel's keys to the next) into one stage.
template <int D, int kBits>
__device__ __forceinline__ void load_kv_block(uint8_t* stage, const uint8_t* k, const uint8_t* v,
                                              int64_t kb, int64_t pitch) {
  using T = Tile<D, kBits>;
  constexpr int kKChunks = kBlockK * T::kRowBytes / 16, kVChunks = D * kBlockK / 16;
  const uint8_t* ksrc = k + kb * kBlockK * T::kRowBytes;
  for (int i = threadIdx.x; i < kKChunks; i += kThreads) {
    const int row = i / (T::kRowBytes / 16), col = i % (T::kRowBytes / 16);
    ptx::cp_async_16(stage + row * T::kKStride + col * 16, ksrc + row * T::kRowBytes + col * 16);
  }
  uint8_t* vdst = stage + T::kKBytes;
  for (int i = threadIdx.x; i < kVChunks; i += kThreads) {
    const int c = i / 4, part = i % 4;
    ptx::cp_async_16(vdst + c * T::kVStride + part * 16, v + c * pitch + kb * kBlockK + part * 16);
  }
}

// ΔS of Q smoothing (Q·Kᵀ = (Q - q_mean)·Kᵀ + ΔS, the term the quantized product leaves out) for
// a block of 64 keys: q_mean·(k - k_mean), q_mean this
// CTA's Q block's, k the caller's fp16/bf16 K. Thread i takes key i/4 of the block and the
// 8-channel chunks ci·4 + i%4 (the quantizers' row parts, so a key's 4 threads read 64
// consecutive bytes a chunk step); its part is an fp32 FMA chain over its channels in increasing
// order, fma(q_mean, k - k_mean, acc) with k - k_mean rounded first, and the 4 parts are added as
// (p0 + p1) + (p2 + p3). The CPU emulation (ref/prepass.cpp, delta_s) sums in exactly this order,
// so the two agree bit for bit; against the exact dot product of the same fp32 factors the error
// is at most (D/4 + 2)·2^-24 of Σ|q_mean·(k - k_mean)| (to first order: 2e-6 at D = 128), far
// below the INT8/INT4 error of the scores it corrects. An Inf/NaN in K (which the pre-pass counts
// as a zero) is left in: it makes its key's ΔS non-finite, and only the rows that see that key
// read it, which are poisoned (NaN) anyway (quant::RowSight); the others mask it.
template <int D, typename T, bool kPadded>
struct DeltaS {
  static constexpr int kChunks = D / 32;
  uint4 raw[kChunks];  // the thread's channels of its key, as loaded

  // Issues the loads of key block kb (keys past seq_kv read as zeros; their scores are masked).
  // kPadded (a head_dim zero-padded to D): the chunks past head_dim (whole 8-channel chunks) are
  // not read either and stay zero; their q_mean and k_mean are 0, so they add exact zeros after
  // the part's real channels, as the emulation at head_dim sums. A template flag, not a runtime
  // test: the test in the native head dims' loop changed their register allocation (ptxas moved
  // their spills by up to 40 bytes).
  __device__ __forceinline__ void load(const AttnParams& p, const T* k_head, int64_t kb) {
    const int64_t key = kb * kBlockK + threadIdx.x / 4;
    const T* row = k_head + key * p.k_in_token + (threadIdx.x % 4) * 8;
    for (int ci = 0; ci < kChunks; ++ci) {
      raw[ci] = make_uint4(0u, 0u, 0u, 0u);
      if (key >= p.seq_kv) continue;
      if constexpr (kPadded) {
        if ((ci * 4 + int(threadIdx.x % 4)) * 8 >= p.head_dim) continue;
      }
      const T* src = row + ci * 32;
      if (p.k_in_vec) {
        raw[ci] = __ldg(reinterpret_cast<const uint4*>(src));
      } else {  // rows 2-byte aligned only
        const unsigned short* e = reinterpret_cast<const unsigned short*>(src);
        uint32_t w[4];
        for (int i = 0; i < 4; ++i) w[i] = __ldg(e + 2 * i) | uint32_t(__ldg(e + 2 * i + 1)) << 16;
        raw[ci] = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
  }

  // ΔS of the loaded keys into ds[64] (shared memory). qm, km: the Q block's and the KV head's
  // means (D floats each, shared memory). Every thread of the CTA calls it (shuffles).
  __device__ __forceinline__ void store(const float* qm, const float* km, float* ds) const {
    const int part = threadIdx.x % 4;
    float acc = 0.0f;
    for (int ci = 0; ci < kChunks; ++ci) {
      const int c0 = (ci * 4 + part) * 8;
      for (int e = 0; e < 8; ++e)
        acc = __fmaf_rn(qm[c0 + e], __fsub_rn(quant::elem_float<T>(raw[ci], e), km[c0 + e]), acc);
    }
    acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, 1));
    acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, 2));
    if (part == 0) ds[threadIdx.x / 4] = acc;
  }
};

// Sequence b's span: a packed batch's from cu_seqlens; a dense call's from the params alone (a
// template flag, kPacked: with a runtime test the dense kernels held the lengths in registers
// through the key loop instead of reading them as constants, and ptxas spilled more at D = 64).
template <bool kPacked>
__device__ __forceinline__ quant::SeqSpan seq_span(const quant::SeqRows& rows, int64_t b) {
  if constexpr (kPacked)
    return rows.span(b);
  else
    return {0, rows.len, 0};
}

// The params as the epilogue of (sequence b, query head h) sees them: its length, its o, lse and
// LSE-shift rows from row 0 (finalize then takes bh = 0). cu_seqlens are read again here rather
// than kept from the kernel's start: the three pointers and the length would otherwise stay live
// through the key loop, beside its accumulators.
template <typename OutT, bool kPacked>
__device__ __forceinline__ AttnParams out_view(const AttnParams& params, int64_t b, int64_t h) {
  const quant::SeqSpan sq = seq_span<kPacked>(params.q_rows, b);
  AttnParams v = params;
  v.seq_q = sq.len;
  v.o = static_cast<OutT*>(params.o) + sq.tok0 * params.o_token;
  if (params.lse) v.lse = params.lse + sq.tok0 * params.lse_token;
  v.lse_shift = params.lse_shift + params.shift_rows.row0(b, h, sq);
  return v;
}

// D=64 fits two CTAs an SM in 128 registers a thread (the occupancy that hides the MMA latency).
// kDeltaS: 0 no Q smoothing; 1 Q smoothing (ΔS from the caller's K); 2 the same for a head_dim
// zero-padded to D (ΔS reads only the caller's channels). kPacked: a packed batch (cu_seqlens).
template <int D, int kBits, typename OutT, bool kCausal, bool kTwoLevel, int kDeltaS, bool kPacked>
__global__ void __launch_bounds__(kThreads, D == 64 ? 2 : 1)
    attention_kernel(const AttnParams params) {
  constexpr bool kSmoothQ = kDeltaS != 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  using T = Tile<D, kBits>;
  constexpr int kDTiles = D / 8;
  extern __shared__ __align__(16) uint8_t smem[];
  // Q smoothing: the Q block's and the KV head's means, and ΔS of two key blocks (this one, and
  // the next, whose K rows are loaded while this one is processed).
  constexpr int kMeans = kSmoothQ ? D : 4, kDs = kSmoothQ ? kBlockK : 1;
  __shared__ __align__(16) float q_mean_s[kMeans], k_mean_s[kMeans];
  __shared__ float delta_s[2][kDs];

  // (batch·heads_q over the grid's y and z: common/grid.h; a CTA past it returns at once.)
  const int64_t qb = blockIdx.x, bh = cta_outer_index();
  if (bh >= params.batch * params.heads_q) return;
  const int64_t b = bh / params.heads_q, h = bh % params.heads_q;
  const int64_t bhk = params.kv_head(b, h), hk = bhk - b * params.heads_kv;
  // This CTA's problem: sequence b's rows (a packed batch: a sequence of its own lengths and
  // causal alignment, whose caller rows start at token tok0; the grid covers the longest, and a
  // block past this sequence's end has nothing to do). p is the params seen from this (sequence,
  // head): its lengths and its LSE-shift rows from row 0 (the helpers of attn/epilogue then take
  // it with bh = 0); the output's view is made again for the epilogue (out_view).
  const quant::SeqSpan sq = seq_span<kPacked>(params.q_rows, b);
  const quant::SeqSpan sk = seq_span<kPacked>(params.kv_rows, b);
  if (qb * kBlockQ >= sq.len) return;
  AttnParams p = params;
  p.seq_q = sq.len, p.seq_kv = sk.len;
  if constexpr (kPacked) p.causal_offset = params.bottom_right ? sk.len - sq.len : 0;
  p.lse_shift = params.lse_shift + params.shift_rows.row0(b, h, sq);
  const int64_t q_row0 = params.q_rows.row0(b, h, sq), k_row0 = params.kv_rows.row0(b, hk, sk);
  const int64_t pitch = params.kv_rows.pitch;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t row_a = qb * kBlockQ + warp * 16 + g;

  // Keys this CTA must visit: all, or up to the diagonal of its last row.
  const int64_t last_row = min(p.seq_q, (qb + 1) * kBlockQ) - 1;
  const int64_t kv_end = kCausal ? min(p.seq_kv, last_row + p.causal_offset + 1) : p.seq_kv;
  const int64_t n_blocks = kv_end > 0 ? (kv_end + kBlockK - 1) / kBlockK : 0;
  // Blocks before this one are visible to every row of the CTA: no mask to apply there.
  const int64_t first_row = qb * kBlockQ;
  const int64_t min_end = kCausal ? min(p.seq_kv, first_row + p.causal_offset + 1) : p.seq_kv;
  const int64_t first_masked_block = min_end > 0 ? min_end / kBlockK : 0;

  const uint8_t* kbase = p.k + k_row0 * T::kRowBytes;
  const uint8_t* vbase = p.v + (k_row0 - sk.ws0) * D + sk.ws0;  // quant/layout.h, SeqRows
  const float* k_scales = p.k_scale + k_row0 / kBlockK * kKGroups;
  if (n_blocks > 0) load_kv_block<D, kBits>(smem, kbase, vbase, 0, pitch);
  ptx::cp_async_commit();

  // Q fragments of this warp's 16 rows, straight from global (read once).
  uint32_t qf[T::kQkSteps][4];
  {
    const uint8_t* qa = p.q + (q_row0 + row_a) * T::kRowBytes + 4 * t;
    const uint8_t* qbp = qa + 8 * T::kRowBytes;
    for (int s = 0; s < T::kQkSteps; ++s) {
      qf[s][0] = *reinterpret_cast<const uint32_t*>(qa + s * 32);
      qf[s][1] = *reinterpret_cast<const uint32_t*>(qbp + s * 32);
      qf[s][2] = *reinterpret_cast<const uint32_t*>(qa + s * 32 + 16);
      qf[s][3] = *reinterpret_cast<const uint32_t*>(qbp + s * 32 + 16);
    }
  }
  const float q_scale_log2 =
      p.q_scale[(q_row0 / kBlockQ + qb) * kQGroups + warp * 8 + g] * p.scale_log2;

  DeltaS<D, OutT, kDeltaS == 2> ds_next;
  const OutT* k_head = nullptr;
  if constexpr (kSmoothQ) {
    k_head = static_cast<const OutT*>(p.k_in) + b * p.k_in_batch + hk * p.k_in_head +
             sk.tok0 * p.k_in_token;
    if (threadIdx.x < D) {
      q_mean_s[threadIdx.x] = p.q_mean[(q_row0 / kBlockQ + qb) * D + threadIdx.x];
      k_mean_s[threadIdx.x] = p.k_mean[bhk * D + threadIdx.x];
    }
    if (n_blocks > 0) ds_next.load(p, k_head, 0);
    __syncthreads();
    if (n_blocks > 0) ds_next.store(q_mean_s, k_mean_s, delta_s[0]);  // the loop's sync publishes
  }

  // Rows a, b (l: this thread's part, from 0 or NaN: attn::row_poison).
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {attn::row_poison(p, 0, row_a), attn::row_poison(p, 0, row_a + 8)};
  float o[kDTiles][4];
  for (int i = 0; i < kDTiles; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;

  for (int64_t kb = 0; kb < n_blocks; ++kb) {
    ptx::cp_async_wait<0>();
    __syncthreads();  // block kb landed; everyone is done with the other stage
    if (kb + 1 < n_blocks)
      load_kv_block<D, kBits>(smem + ((kb + 1) % 2) * T::kStageBytes, kbase, vbase, kb + 1,
                              pitch);
    ptx::cp_async_commit();
    const uint8_t* ks = smem + (kb % 2) * T::kStageBytes;
    const uint8_t* vs = ks + T::kKBytes;
    // The next block's K rows for its ΔS, in flight during this block's work (CTA-uniform).
    const bool ds_ahead = kSmoothQ && kb + 1 < n_blocks;
    if (ds_ahead) ds_next.load(p, k_head, kb + 1);

    // S = Q^·K^ᵀ (exact int32), 8 tiles of 8 keys; K fragments by ldmatrix, two k-steps a load
    // (lane l addresses key row l%8 of the tile at byte column 16·(l/8) of the step pair).
    int acc[8][4];
    for (int nt = 0; nt < 8; ++nt) {
      acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0;
      const uint8_t* krow = ks + (nt * 8 + lane % 8) * T::kKStride + (lane / 8) * 16;
      for (int s = 0; s + 1 < T::kQkSteps; s += 2) {
        uint32_t kf4[4];
        ptx::ldmatrix_x4(kf4, krow + s * 32);
        const uint32_t k0[2] = {kf4[0], kf4[1]}, k1[2] = {kf4[2], kf4[3]};
        qk_mma<kBits>(acc[nt], qf[s], k0);
        qk_mma<kBits>(acc[nt], qf[s + 1], k1);
      }
      if constexpr (T::kQkSteps % 2 == 1) {
        uint32_t k0[2];
        ptx::ldmatrix_x2(k0, krow + (T::kQkSteps - 1) * 32);
        qk_mma<kBits>(acc[nt], qf[T::kQkSteps - 1], k0);
      }
    }

    // Dequantize (one Q and one K scale per thread), add ΔS, mask; base-2 scores. The mask is
    // a per-row count of visible keys in this block (the Nk edge and the causal diagonal), so
    // the per-element test is a 32-bit compare.
    const float f = q_scale_log2 * k_scales[kb * kKGroups + t];
    const int64_t j0 = kb * kBlockK;
    int visible[2];
    attn::visible_keys<kCausal, kBlockK>(p, row_a, j0, visible);
    float sc[8][4];
    float row_max[2] = {-INFINITY, -INFINITY};
    for (int nt = 0; nt < 8; ++nt)
      for (int e = 0; e < 4; ++e) {
        float x = float(acc[nt][e]) * f;
        if constexpr (kSmoothQ)
          x = fmaf(delta_s[kb % 2][Frag::col(nt, e, t)], p.scale_log2, x);
        sc[nt][e] = x;
      }
    if (kb >= first_masked_block)  // CTA-uniform: only the diagonal and Nk-edge blocks
      for (int nt = 0; nt < 8; ++nt)
        for (int e = 0; e < 4; ++e)
          if (Frag::col(nt, e, t) >= visible[Frag::half(e)]) sc[nt][e] = -INFINITY;
    for (int nt = 0; nt < 8; ++nt)
      for (int e = 0; e < 4; ++e)
        row_max[Frag::half(e)] = fmaxf(row_max[Frag::half(e)], sc[nt][e]);

    // Online softmax: the 4 threads of a row agree on its max.
    float alpha[2], m_use[2];
    attn::online_max(row_max, m, l, alpha, m_use);
    for (int nt = 0; nt < 8; ++nt)
      for (int e = 0; e < 4; ++e) {
        sc[nt][e] = ptx::ex2(sc[nt][e] - m_use[Frag::half(e)]);
        l[Frag::half(e)] += sc[nt][e];
      }
    for (int i = 0; i < kDTiles; ++i) {
      o[i][0] *= alpha[0], o[i][1] *= alpha[0], o[i][2] *= alpha[1], o[i][3] *= alpha[1];
    }

    // P^ = E4M3(P~ · 448) as the A operand of two m16n8k32 MMAs (keys 0-31, 32-63). Two-level
    // (kTwoLevel): R = P^·V^ in a fresh accumulator added into the fp32 O, for GPUs whose FP8
    // MMA accumulator is narrower than fp32 (the paper's FP22, sm_89); where it is a true fp32
    // (measured on sm_90, docs/fp8-accumulator.md) the MMA accumulates into O directly.
    uint32_t pf[2][4];
    attn::pack_p_e4m3(pf, [&](int n, int e) { return sc[n][e] * 448.0f; });
    // ΔS of the next block, here where S's registers are free (ptxas spilled less here than after
    // Q·Kᵀ or after P·V). Its buffer was last read in the previous iteration, before this one's
    // __syncthreads; the next one's publishes it.
    if (ds_ahead) ds_next.store(q_mean_s, k_mean_s, delta_s[(kb + 1) % 2]);
    for (int i = 0; i < kDTiles; ++i) {
      // V fragments of channel tile i for both key chunks in one ldmatrix.x4.
      uint32_t vf4[4];
      ptx::ldmatrix_x4(vf4, vs + (i * 8 + lane % 8) * T::kVStride + (lane / 8) * 16);
      const uint32_t v0[2] = {vf4[0], vf4[1]}, v1[2] = {vf4[2], vf4[3]};
      if constexpr (kTwoLevel) {
        float r_acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        ptx::mma_m16n8k32_e4m3(r_acc, pf[0], v0, r_acc);
        ptx::mma_m16n8k32_e4m3(r_acc, pf[1], v1, r_acc);
        for (int e = 0; e < 4; ++e) o[i][e] += r_acc[e];
      } else {
        ptx::mma_m16n8k32_e4m3(o[i], pf[0], v0, o[i]);
        ptx::mma_m16n8k32_e4m3(o[i], pf[1], v1, o[i]);
      }
    }
  }
  ptx::cp_async_wait<0>();

  attn::finalize<D, OutT, 1>(
      out_view<OutT, kPacked>(params, b, h), [&](int i, int e) { return o[i][e]; }, m, l, b, h,
      0, row_a, t, p.v_scale + bhk * D, p.v_mean + bhk * D);
#endif
}

}  // namespace sage::mma

namespace sage::mma {

// Picks the instantiation for (INT8/INT4, output dtype, mask, accumulation, Q smoothing) of one
// head dim.
template <int D, int kBits, typename OutT, bool kCausal, bool kTwoLevel, int kDeltaS,
          bool kPacked>
cudaError_t launch_one(const AttnParams& p, int device, cudaStream_t stream) {
  constexpr int kSmem = 2 * Tile<D, kBits>::kStageBytes;
  constexpr auto kernel = attention_kernel<D, kBits, OutT, kCausal, kTwoLevel, kDeltaS, kPacked>;
  if (kSmem > 48 * 1024) {
    const cudaError_t e = set_max_dynamic_smem_once<kernel>(device, kSmem);
    if (e != cudaSuccess) return e;
  }
  // A packed batch: q_blocks of its longest sequence (blocks past a sequence's end exit).
  const dim3 grid = outer_dims(p.q_blocks, p.batch * p.heads_q);
  kernel<<<grid, kThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

template <int D, int kBits, typename OutT, int kDeltaS, bool kPacked>
cudaError_t launch_mask(const AttnParams& p, const LaunchConfig& c, cudaStream_t stream) {
  constexpr int kD = kDeltaS;
  constexpr bool kP = kPacked;
  if (c.two_level)
    return c.causal ? launch_one<D, kBits, OutT, true, true, kD, kP>(p, c.device, stream)
                    : launch_one<D, kBits, OutT, false, true, kD, kP>(p, c.device, stream);
  return c.causal ? launch_one<D, kBits, OutT, true, false, kD, kP>(p, c.device, stream)
                  : launch_one<D, kBits, OutT, false, false, kD, kP>(p, c.device, stream);
}

template <int D, int kBits, typename OutT, int kDeltaS>
cudaError_t launch_packed(const AttnParams& p, const LaunchConfig& c, cudaStream_t stream) {
  return p.q_rows.packed() ? launch_mask<D, kBits, OutT, kDeltaS, true>(p, c, stream)
                           : launch_mask<D, kBits, OutT, kDeltaS, false>(p, c, stream);
}

template <int D, int kBits, typename OutT>
cudaError_t launch_smooth(const AttnParams& p, const LaunchConfig& c, cudaStream_t stream) {
  if (!c.smooth_q) return launch_packed<D, kBits, OutT, 0>(p, c, stream);
  return c.padded ? launch_packed<D, kBits, OutT, 2>(p, c, stream)
                  : launch_packed<D, kBits, OutT, 1>(p, c, stream);
}

template <int D>
cudaError_t launch_attention(const AttnParams& p, const LaunchConfig& c, cudaStream_t stream) {
  if (c.bits == 8)
    return c.bf16 ? launch_smooth<D, 8, __nv_bfloat16>(p, c, stream)
                  : launch_smooth<D, 8, __half>(p, c, stream);
  return c.bf16 ? launch_smooth<D, 4, __nv_bfloat16>(p, c, stream)
                : launch_smooth<D, 4, __half>(p, c, stream);
}

}  // namespace sage::mma
