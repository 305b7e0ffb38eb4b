// The three-launch K/V pre-pass (sm_89+, any sequence length): kv_stats, kv_finalize and
// quant_kv, each one step of the one-launch kv_prepass on its own; each reads its Params
// (params.h), and its __global__ (kernels.cuh) only enters the PDL chain and calls it.
// (Included only by quant/prepass.cu, the pre-pass's one translation unit: the code sits in
// that file's anonymous namespace, so the kernels stay internal to it.)
#pragma once

#include "common/grid.h"
#include "quant/prepass/kv_block.cuh"
#include "quant/prepass/params.h"
#include "quant/prepass/stage.cuh"
#include "quant/prepass/stats.cuh"

namespace sage::quant {
namespace {

// The three-launch path's statistics: kv_prepass's first step alone (V's rows and the rows K's
// mean samples staged in `stage`, Stage<D>::kBytes of dynamic shared memory).
template <typename T, int D, bool kVec>
__device__ __forceinline__ void kv_stats(const KvStatsParams& p, uint8_t* stage) {
  __shared__ double red[kStatRed];
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const int64_t bh = cta_outer_index();
  if (bh >= p.bk) return;
  const BatchHead bhd = batch_head(bh, p.heads_kv);
  const int b = int(bhd.b), h = int(bhd.h);
  const SeqSpan sp = p.kv_rows.span(b);
  const int64_t chunk = blockIdx.x, n0 = chunk * kStatTokens;
  if (n0 >= sp.len) return;  // past this sequence's keys (a packed batch)
  const int rows = int(min(int64_t(kStatTokens), sp.len - n0));
  const uint32_t k_stride = uint32_t(k_mean_stride_of(sp.len, p.k_mean_tokens));
  ChunkStats<T, D> st;
  constexpr int kRows = Stage<D>::kRows;
  if constexpr (kRows == kStatTokens) {
    stage_rows<T, D, kVec>(k, v, p.ks, p.vs, p.dim, b, h, sp.tok0, n0, rows, k_stride, false,
                           stage);
    st.accumulate(stage, rows, n0, k_stride);
  } else {
    // D = 256: the chunk in parts of kRows. A thread's slice sums the same V rows in the same
    // order as in one part (kRows is a multiple of kSlices); K's sampled rows are dealt to the
    // slices from each part's first, so a slice may take other ones, and the chunk's Σk adds the
    // same rows grouped otherwise (exact in double for fp16/bf16 values of moderate range, as
    // the emulation's sum assumes).
    static_assert(kRows % ChunkStats<T, D>::kSlices == 0, "slices keep their rows across parts");
    for (int r0 = 0; r0 < rows; r0 += kRows) {
      if (r0 > 0) __syncthreads();  // every thread has summed the previous part
      const int part_rows = min(kRows, rows - r0);
      stage_rows<T, D, kVec>(k, v, p.ks, p.vs, p.dim, b, h, sp.tok0, n0 + r0, part_rows,
                             k_stride, false, stage);
      st.accumulate(stage, part_rows, n0 + r0, k_stride);
    }
  }
  st.write(red, stat_view(p.stats, p.kv_rows, b, h, sp, D), chunk);
}

// The three-launch path's finalize: one CTA per (sequence, KV head), a thread per channel (at
// most kFinalizeThreads: D = 256 loops twice).
constexpr int kFinalizeThreads = 128;
template <int D>
__device__ __forceinline__ void kv_finalize(const KvFinalizeParams& p) {
  if (blockIdx.x == 0) zero_counters(p);
  const int64_t bh = blockIdx.x, b = bh / p.heads_kv, h = bh % p.heads_kv;
  const SeqSpan sp = p.kv_rows.span(b);
  const int64_t seq_kv = sp.len, chunks = (seq_kv + kStatTokens - 1) / kStatTokens;
  const int64_t k_stride = k_mean_stride_of(seq_kv, p.k_mean_tokens);
  const int64_t k_samples = (seq_kv + k_stride - 1) / k_stride;
  const StatView hs = stat_view(p.stats, p.kv_rows, b, h, sp, D);
  if (threadIdx.x == 0) p.kv_bad[bh] = kKvBadNone;  // quant_kv lowers it
  for (int64_t c = threadIdx.x; c < D; c += blockDim.x) {
    const ChannelFinal f =
        finalize_channel(hs, chunks, c, seq_kv, k_samples, p.smooth_k, p.smooth_v);
    p.k_mean[bh * D + c] = f.k_mean;
    p.v_mean[bh * D + c] = f.v_mean;
    p.v_scale[bh * D + c] = f.v_scale;
    p.v_inv[bh * D + c] = f.v_inv;
  }
}

// Head bh's part of V's sampled bounds (none where kCheck is off).
template <bool kCheck>
__device__ __forceinline__ VCheck v_check(const QuantKvParams& p, int64_t bh, int D) {
  if constexpr (!kCheck) return {};
  return {p.v_bound + bh * D, p.v_amax + bh * D, p.v_over + bh};
}

// The three-launch path's quantization: one CTA (256 threads) per 64-key block, K and V loaded
// together (the loads of both in flight at once) before the head's means and scales.
// (The kernel's bounds: kernels.cuh.)
// kCheck (the sampled path): V is checked against the head's bounds (quant_kv_block).
template <typename T, int D, int kBits, bool kVec, bool kCheck>
__device__ __forceinline__ void quant_kv(const QuantKvParams& p) {
  __shared__ float group_max[8][4];
  __shared__ __align__(16) float km[D];
  __shared__ __align__(16) float vm[D];
  __shared__ __align__(16) float vi[D];
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  // The blocks in the reverse of kv_stats' order (it reads V head by head, chunk by chunk): the
  // V rows it read last are the likeliest to be still in L2, so they are read first here.
  const int64_t outer = cta_outer_index();
  if (outer >= p.bk) return;
  const int64_t bh = p.bk - 1 - outer;
  const BatchHead bhd = batch_head(bh, p.heads_kv);
  const int b = int(bhd.b), h = int(bhd.h);
  const SeqRows& kv_rows = p.kv_rows;
  const SeqSpan sp = kv_rows.span(b);
  const int64_t kb = int64_t(gridDim.x) - 1 - blockIdx.x, seq_kv = sp.len;
  if (kb * kBlockK >= seq_kv) return;  // past this sequence's keys (a packed batch)
  KvBlock<D> x =
      load_block_global<T, D, kVec>(k, v, p.ks, p.vs, p.dim, b, h, sp.tok0, kb, seq_kv);
  // The sampled path (kCheck) enters the PDL chain only here: its block's loads, of the caller's
  // K and V, are in flight while kv_sample runs. (They are safe before the wait: this grid starts
  // only once every kv_sample CTA has passed its own wait for the caller's kernels.)
  if constexpr (kCheck) pdl_enter();
  x.template zero_special_keys<T>(kb * kBlockK, p.kv_bad + bh);
  if (threadIdx.x < D) {
    const int c = threadIdx.x;
    km[c] = p.k_mean[int64_t(bh) * D + c];
    vm[c] = p.v_mean[int64_t(bh) * D + c];
    vi[c] = p.v_inv[int64_t(bh) * D + c];
  }
  __syncthreads();
  const int64_t vcol0 = v_base(kv_rows, b, h, sp, D);
  quant_kv_block<T, D, kBits, kCheck>(x, kb, kv_rows.row0(b, h, sp), vcol0, kv_rows.pitch, km,
                                      vm, vi, group_max, seq_kv, p.kq, p.k_scale, p.vq,
                                      v_check<kCheck>(p, bh, D));
  zero_v_tail<D>(kv_rows, kb, (seq_kv + kBlockK - 1) / kBlockK, vcol0, p.vq);
}

// The staged quantization (PrepassPlan::kv_grid > 0; D <= 128, planned at 64, where it measured
// faster than a CTA a block: docs/sm90-kernel.md, Tried 51): the blocks of quant_kv, dealt
// to a grid of about the CTAs the SMs hold at once, each CTA taking every gridDim.x-th block (in
// quant_kv's order: the last head's last block first) through a two-stage pipeline. A block's K
// and V rows and its head's k_mean, v_mean and 1/v_scale are copied (cp.async) into one stage
// while the CTA quantizes the block in the other, so a CTA's loads stay in flight through its
// arithmetic instead of each block waiting for its own. The arithmetic is quant_kv's.
// `smem`: kStagedQuantKvBytes<D> of dynamic shared memory.
template <int D>
struct QuantKvStage {
  using Rows = Stage<D, kBlockK>;
  static constexpr int kMeans = Rows::kBytes;          // k_mean, v_mean, 1/v_scale: [3][D] floats
  static constexpr int kBytes = kMeans + 3 * D * 4;    // one stage
};
template <int D>
constexpr int kStagedQuantKvBytes = 2 * QuantKvStage<D>::kBytes;

template <typename T, int D, int kBits, bool kVec, bool kCheck>
__device__ __forceinline__ void quant_kv_staged(const QuantKvParams& p, uint8_t* smem) {
  static_assert(D <= 128, "a 64-key stage of D = 256 rows is planned with the direct quant_kv");
  using St = QuantKvStage<D>;
  __shared__ float group_max[2][8][4];
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const SeqRows& kv_rows = p.kv_rows;
  // Unit u: outer index o = u / k_blocks (KV head bk - 1 - o), block k_blocks - 1 - u % k_blocks;
  // a CTA steps u by gridDim.x, kept as a quotient and a remainder (no division a block).
  const int64_t k_blocks = (kv_rows.len + kBlockK - 1) / kBlockK;
  const int64_t units = p.bk * k_blocks, step = gridDim.x;
  const int64_t step_q = step / k_blocks, step_r = step % k_blocks;
  struct Unit {
    int64_t u, o, r;  // u = o·k_blocks + r
    int b, h;
    SeqSpan sp;
    int64_t kb;
    bool live;  // a block of this sequence's keys (a packed batch's shorter ones have fewer)
  };
  auto locate = [&](Unit& w) {
    w.live = w.u < units;
    if (!w.live) return;
    const uint32_t bh = uint32_t(p.bk - 1 - w.o);  // bk < 2^31 (check_batch_heads)
    w.b = int(bh / uint32_t(p.heads_kv)), w.h = int(bh % uint32_t(p.heads_kv));
    w.sp = kv_rows.span(w.b);
    w.kb = k_blocks - 1 - w.r;
    w.live = w.kb * kBlockK < w.sp.len;
  };
  // Copies unit w's rows and its head's means into stage `st`, one committed group (empty for a
  // unit that is not live, so the group count stays one a unit).
  auto issue = [&](const Unit& w, uint8_t* st) {
    if (w.live) {
      const int64_t n0 = w.kb * kBlockK;
      const int rows = int(min(int64_t(kBlockK), w.sp.len - n0));
      issue_rows<T, D, kVec, typename St::Rows>(k, v, p.ks, p.vs, p.dim, w.b, w.h, w.sp.tok0, n0,
                                                rows, 1u, true, st);
      const int64_t bh = p.bk - 1 - w.o;
      if (threadIdx.x < 3 * D / 4) {  // 16 bytes each: D / 4 a vector
        const int vec = threadIdx.x / (D / 4), at = threadIdx.x % (D / 4) * 4;
        const float* src = (vec == 0 ? p.k_mean : vec == 1 ? p.v_mean : p.v_inv) + bh * D + at;
        ptx::cp_async_16(st + St::kMeans + (vec * D + at) * 4, src);
      }
    }
    ptx::cp_async_commit();
  };
  Unit cur{int64_t(blockIdx.x), int64_t(blockIdx.x) / k_blocks, int64_t(blockIdx.x) % k_blocks};
  locate(cur);
  issue(cur, smem);
  for (int i = 0; cur.u < units; ++i) {
    Unit next{cur.u + step, cur.o + step_q, cur.r + step_r};
    if (next.r >= k_blocks) next.r -= k_blocks, ++next.o;
    locate(next);
    uint8_t* const here = smem + (i % 2) * St::kBytes;
    issue(next, smem + ((i + 1) % 2) * St::kBytes);
    ptx::cp_async_wait<1>();  // this unit's group; the next one's stays in flight
    __syncthreads();
    if (cur.live) {
      const int64_t bh = p.bk - 1 - cur.o, seq_kv = cur.sp.len;
      KvBlock<D> x = load_block_staged<D, typename St::Rows>(here, 0, cur.kb * kBlockK, seq_kv);
      x.template zero_special_keys<T>(cur.kb * kBlockK, p.kv_bad + bh);
      const float* means = reinterpret_cast<const float*>(here + St::kMeans);
      const int64_t vcol0 = v_base(kv_rows, cur.b, cur.h, cur.sp, D);
      quant_kv_block<T, D, kBits, kCheck>(x, cur.kb, kv_rows.row0(cur.b, cur.h, cur.sp), vcol0,
                                          kv_rows.pitch, means, means + D, means + 2 * D,
                                          group_max[i % 2], seq_kv, p.kq, p.k_scale, p.vq,
                                          v_check<kCheck>(p, bh, D));
      zero_v_tail<D>(kv_rows, cur.kb, (seq_kv + kBlockK - 1) / kBlockK, vcol0, p.vq);
    }
    // (No barrier here: quant_kv_block reads the stage only before its own barrier, so every
    // thread is done with it before any issues the copies that refill it, the next unit's; the
    // barrier above, one a unit, orders group_max's two buffers.)
    cur = next;
  }
  ptx::cp_async_wait<0>();  // (the last, empty group)
}

}  // namespace
}  // namespace sage::quant
