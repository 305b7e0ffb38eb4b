// The streamed K/V pre-pass (sm_90+, PrepassPlan::kv_stream): a few clusters that prepare the KV
// heads in order while the sm90 attention kernel already runs on the rest of the GPU, each head
// released to it by a flag (kv_ready) once its K̂, Vᵀ, means and scales are written.
// (Included only by quant/prepass.cu, the pre-pass's one translation unit: the code sits in
// that file's anonymous namespace, so the kernels stay internal to it.)
//
// Why: the pre-pass is memory-bound and the attention kernel compute-bound, yet in a stream the
// whole pre-pass ran before the first tile (14-40 % of a call up to 4k tokens). Here the attention
// kernel is launched as a programmatic dependent as soon as every CTA of this grid has reset its
// flags, and each of its tiles waits for its own KV head only (attn/sm90/producer.cuh).
//
// No deadlock: the dependent grid launches only once every CTA of this one has executed
// launch_dependents, i.e. is resident, and nothing here waits on the attention kernel. Without
// programmatic launch the attention kernel simply starts after this grid, every flag set.
#pragma once

#include "common/grid.h"
#include "ptx/barrier.cuh"
#include "quant/prepass/kv_block.cuh"
#include "quant/prepass/params.h"
#include "quant/prepass/stage.cuh"
#include "quant/prepass/stats.cuh"

namespace sage::quant {
namespace {

constexpr int kStreamCluster = 8;  // CTAs a cluster: one KV head at a time

// Grid (kStreamCluster · clusters), cluster (kStreamCluster, 1, 1). Cluster c takes KV heads c,
// c + clusters, ... (in order: the attention kernel numbers its tiles head-major). For each: its
// CTAs sum the head's chunks r, r + 8, ... (V's rows and the rows K's mean samples, as kv_stats),
// meet at the cluster barrier, each reduces the head's statistics itself (kv_finalize's step;
// rank 0 also stores them), meet again (the statistics live in the head's Vᵀ rows, which the
// quantization overwrites), quantize the head's 64-key blocks r, r + 8, ... from the caller's
// rows (quant_kv's step; the second read mostly hits L2: a head is 1-2.4 MB at 4k tokens), meet
// a third time, and rank 0 releases the head. The same statistics and quantization as the other
// two paths, so the attention kernel's inputs are bit for bit theirs.
// `stage`: Stage<D>::kBytes of dynamic shared memory.
template <typename T, int D, int kBits, bool kVec>
__device__ __forceinline__ void kv_stream(const KvStreamParams& p, uint8_t* stage) {
  static_assert(Stage<D>::kRows == kStatTokens, "a whole chunk staged (D <= 128)");
  __shared__ double red[kStatRed];
  __shared__ float group_max[2][8][4];
  __shared__ __align__(16) float km[D];
  __shared__ __align__(16) float vm[D];
  __shared__ __align__(16) float vi[D];
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const SeqRows& kv_rows = p.kv_rows;
  const int rank = int(blockIdx.x) % kStreamCluster;
  const int64_t cluster = blockIdx.x / kStreamCluster, clusters = gridDim.x / kStreamCluster;

  // Before the attention kernel may launch: this cluster's heads unreleased, the tile counters
  // zeroed (the kernel draws every tile from them when streamed). Only this cluster ever writes
  // its heads' flags, so no release below can precede this reset.
  ptx::grid_dependency_wait();
  if (rank == 0)
    for (int64_t bh = cluster + int64_t(threadIdx.x) * clusters; bh < p.bk;
         bh += int64_t(blockDim.x) * clusters)
      p.kv_ready[bh] = 0u;
  if (cluster == 0 && rank == 0 && threadIdx.x < 2) p.tile_counter[threadIdx.x] = 0u;
  __threadfence();
  __syncthreads();
  ptx::launch_dependents();

  for (int64_t bh = cluster; bh < p.bk; bh += clusters) {
    const BatchHead bhd = batch_head(bh, p.heads_kv);
    const int b = int(bhd.b), h = int(bhd.h);
    const SeqSpan sp = kv_rows.span(b);
    const int64_t seq_kv = sp.len, chunks = (seq_kv + kStatTokens - 1) / kStatTokens;
    const int64_t k_blocks = (seq_kv + kBlockK - 1) / kBlockK;
    const uint32_t k_stride = uint32_t(k_mean_stride_of(seq_kv, p.k_mean_tokens));
    const int64_t k_samples = (seq_kv + k_stride - 1) / k_stride;
    const StatView hs = stat_view(p.stats, kv_rows, b, h, sp, D);
    for (int64_t chunk = rank; chunk < chunks; chunk += kStreamCluster) {
      const int64_t n0 = chunk * kStatTokens;
      const int rows = int(min(int64_t(kStatTokens), seq_kv - n0));
      stage_rows<T, D, kVec>(k, v, p.ks, p.vs, p.dim, b, h, sp.tok0, n0, rows, k_stride, false,
                             stage);
      ChunkStats<T, D> st;
      st.accumulate(stage, rows, n0, k_stride);
      st.write(red, hs, chunk);  // (ends with a barrier: the stage is free again)
    }
    if (rank == 0 && threadIdx.x == 0) p.kv_bad[bh] = kKvBadNone;  // lowered after the barrier
    __threadfence();
    ptx::cluster_sync();  // every chunk's statistics of the head are written
    if (threadIdx.x < D) {
      const int c = threadIdx.x;
      const ChannelFinal f =
          finalize_channel(hs, chunks, c, seq_kv, k_samples, p.smooth_k, p.smooth_v);
      km[c] = f.k_mean, vm[c] = f.v_mean, vi[c] = f.v_inv;
      if (rank == 0) {
        const int64_t at = bh * D + c;
        p.k_mean[at] = f.k_mean, p.v_mean[at] = f.v_mean;
        p.v_scale[at] = f.v_scale, p.v_inv[at] = f.v_inv;
      }
    }
    __syncthreads();
    ptx::cluster_sync();  // every CTA has read the statistics the Vᵀ stores overwrite
    const int64_t krow0 = kv_rows.row0(b, h, sp), vcol0 = v_base(kv_rows, b, h, sp, D);
    int i = 0;
    for (int64_t kb = rank; kb < k_blocks; kb += kStreamCluster, ++i) {
      KvBlock<D> x =
          load_block_global<T, D, kVec>(k, v, p.ks, p.vs, p.dim, b, h, sp.tok0, kb, seq_kv);
      x.template zero_special_keys<T>(kb * kBlockK, p.kv_bad + bh);
      quant_kv_block<T, D, kBits>(x, kb, krow0, vcol0, kv_rows.pitch, km, vm, vi,
                                  group_max[i % 2], seq_kv, p.kq, p.k_scale, p.vq);
      zero_v_tail<D>(kv_rows, kb, k_blocks, vcol0, p.vq);
    }
    __threadfence();
    ptx::cluster_sync();  // the head's every product written (and km, vm, vi free again)
    if (rank == 0 && threadIdx.x == 0) ptx::st_release_gpu(p.kv_ready + bh, 1u);
  }
}

}  // namespace
}  // namespace sage::quant
