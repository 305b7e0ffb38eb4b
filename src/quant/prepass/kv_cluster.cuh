// The one-launch K/V pre-pass (sm_90+, PrepassPlan::kv_cluster): a cluster per KV head does
// the statistics, their reduction and the quantization with K and V read once.
// (Included only by quant/prepass.cu, the pre-pass's one translation unit: the code sits in
// that file's anonymous namespace, so the kernels stay internal to it.)
#pragma once

#include "common/grid.h"
#include "ptx/barrier.cuh"
#include "quant/prepass/kv_block.cuh"
#include "quant/prepass/params.h"
#include "quant/prepass/stage.cuh"
#include "quant/prepass/stats.cuh"

namespace sage::quant {
namespace {

// K/V in one launch (PrepassPlan::kv_cluster): one CTA per chunk of kStatTokens tokens, one
// cluster per KV head (grid (chunks, batch·heads over y and z), cluster (chunks, 1, 1)). Each CTA
// stages its chunk's K and V rows (every byte read from memory once), writes the chunk's
// statistics, meets the rest of its cluster at the cluster barrier, reduces the head's statistics
// itself (the kv_finalize step: k_mean, v_mean, V's scale; the cluster's first CTA also stores
// them for the attention kernel and quant_q), and quantizes its staged rows. (Its __global__,
// kernels.cuh, only enters the PDL chain and calls it.)
// `stage`: Stage<D>::kBytes of dynamic shared memory.
template <typename T, int D, int kBits, bool kVec>
__device__ __forceinline__ void kv_prepass(const KvPrepassParams& p, uint8_t* stage) {
  static_assert(Stage<D>::kRows == kStatTokens, "a whole chunk staged (D <= 128)");
  __shared__ double red[kStatRed];
  __shared__ float group_max[2][8][4];
  __shared__ __align__(16) float km[D];
  __shared__ __align__(16) float vm[D];
  __shared__ __align__(16) float vi[D];
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const SeqRows& kv_rows = p.kv_rows;
  unsigned long long* kv_bad = p.kv_bad;
  // (A cluster shares its outer index: one past bk returns whole, before either barrier.)
  const int64_t bh = cta_outer_index();
  if (bh >= p.bk) return;
  const BatchHead bhd = batch_head(bh, p.heads_kv);
  const int b = int(bhd.b), h = int(bhd.h);
  // The sequence's keys (a packed batch's sequence b; the grid covers the longest, and a CTA past
  // this one's end has no rows but still meets its cluster at both barriers).
  const SeqSpan sp = kv_rows.span(b);
  const int64_t seq_kv = sp.len, chunks = (seq_kv + kStatTokens - 1) / kStatTokens;
  const int64_t k_blocks = (seq_kv + kBlockK - 1) / kBlockK;
  const uint32_t k_stride = uint32_t(k_mean_stride_of(seq_kv, p.k_mean_tokens));
  const int64_t k_samples = (seq_kv + k_stride - 1) / k_stride;
  const int64_t chunk = blockIdx.x, n0 = chunk * kStatTokens;
  const int rows = int(max(int64_t(0), min(int64_t(kStatTokens), seq_kv - n0)));
  stage_rows<T, D, kVec>(k, v, p.ks, p.vs, p.dim, b, h, sp.tok0, n0, rows, k_stride, true, stage);
  ChunkStats<T, D> st;
  st.accumulate(stage, rows, n0, k_stride);
  const StatView hs = stat_view(p.stats, kv_rows, b, h, sp, D);
  if (chunk < chunks) st.write(red, hs, chunk);  // (CTA-uniform)
  if (chunk == 0 && threadIdx.x == 0) kv_bad[bh] = kKvBadNone;  // lowered after the barrier
  __threadfence();
  ptx::cluster_sync();  // every chunk's statistics of the head are written
  if (threadIdx.x < D) {
    const int c = threadIdx.x;
    const ChannelFinal f =
        finalize_channel(hs, chunks, c, seq_kv, k_samples, p.smooth_k, p.smooth_v);
    km[c] = f.k_mean, vm[c] = f.v_mean, vi[c] = f.v_inv;
    if (chunk == 0) {
      const int64_t at = int64_t(bh) * D + c;
      p.k_mean[at] = f.k_mean, p.v_mean[at] = f.v_mean;
      p.v_scale[at] = f.v_scale, p.v_inv[at] = f.v_inv;
    }
  }
  if (bh == 0 && chunk == 0) zero_counters(p);
  __syncthreads();
  // The statistics live in the head's Vᵀ rows, which the quantization below overwrites: every
  // CTA of the cluster has read them first.
  ptx::cluster_sync();
  constexpr int kBlocks = kStatTokens / kBlockK;
  const int64_t krow0 = kv_rows.row0(b, h, sp), vcol0 = v_base(kv_rows, b, h, sp, D);
  for (int i = 0; i < kBlocks; ++i) {
    const int64_t kb = chunk * kBlocks + i;
    if (kb >= k_blocks) break;
    KvBlock<D> x = load_block_staged<D>(stage, i * kBlockK, kb * kBlockK, seq_kv);
    x.template zero_special_keys<T>(kb * kBlockK, kv_bad + bh);
    quant_kv_block<T, D, kBits>(x, kb, krow0, vcol0, kv_rows.pitch, km, vm, vi, group_max[i % 2],
                                seq_kv, p.kq, p.k_scale, p.vq);
    zero_v_tail<D>(kv_rows, kb, k_blocks, vcol0, p.vq);
  }
}

}  // namespace
}  // namespace sage::quant
