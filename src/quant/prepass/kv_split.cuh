// The three-launch K/V pre-pass (sm_89+, any sequence length): kv_stats, kv_finalize and
// quant_kv, each one step of the one-launch kv_prepass on its own.
// (Included only by quant/prepass.cu, the pre-pass's one translation unit: the code sits in
// that file's anonymous namespace, so the kernels stay internal to it.)
#pragma once

#include "common/grid.h"
#include "quant/prepass/kv_block.cuh"
#include "quant/prepass/stage.cuh"
#include "quant/prepass/stats.cuh"

namespace sage::quant {
namespace {

// The three-launch path's statistics: kv_prepass_kernel's first step alone (V's rows and the
// rows K's mean samples staged).
template <typename T, int D, bool kVec>
__global__ void __launch_bounds__(256, 2)
    kv_stats_kernel(const T* k, const T* v, sage_strides ks, sage_strides vs, int dim,
                    int64_t heads_kv, int64_t bk, SeqRows kv_rows, int32_t k_mean_tokens,
                    KvStat* stats) {
  pdl_enter();
  extern __shared__ __align__(16) uint8_t stage[];
  __shared__ double red[kStatRed];
  const int64_t bh = cta_outer_index();
  if (bh >= bk) return;
  const BatchHead bhd = batch_head(bh, heads_kv);
  const int b = int(bhd.b), h = int(bhd.h);
  const SeqSpan sp = kv_rows.span(b);
  const int64_t chunk = blockIdx.x, n0 = chunk * kStatTokens;
  if (n0 >= sp.len) return;  // past this sequence's keys (a packed batch)
  const int rows = int(min(int64_t(kStatTokens), sp.len - n0));
  const uint32_t k_stride = uint32_t(k_mean_stride_of(sp.len, k_mean_tokens));
  ChunkStats<T, D> st;
  constexpr int kRows = Stage<D>::kRows;
  if constexpr (kRows == kStatTokens) {
    stage_rows<T, D, kVec>(k, v, ks, vs, dim, b, h, sp.tok0, n0, rows, k_stride, false, stage);
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
      stage_rows<T, D, kVec>(k, v, ks, vs, dim, b, h, sp.tok0, n0 + r0, part_rows, k_stride,
                             false, stage);
      st.accumulate(stage, part_rows, n0 + r0, k_stride);
    }
  }
  st.write(red, stat_view(stats, kv_rows, b, h, sp, D), chunk);
}

// The three-launch path's finalize: one CTA per (sequence, KV head), a thread per channel.
template <int D>
__global__ void __launch_bounds__(128)
    kv_finalize_kernel(KvStat* stats, SeqRows kv_rows, int64_t heads_kv, int32_t k_mean_tokens,
                       bool smooth_k, bool smooth_v, float* k_mean, float* v_mean,
                       float* v_scale, float* v_inv, unsigned* tile_counter,
                       unsigned long long* kv_bad) {
  pdl_enter();
  // The attention kernel's tile counters start at zero (it leaves them so; this covers a fresh
  // workspace).
  if (blockIdx.x == 0 && threadIdx.x < 2) tile_counter[threadIdx.x] = 0u;
  const int64_t bh = blockIdx.x, b = bh / heads_kv, h = bh % heads_kv;
  const SeqSpan sp = kv_rows.span(b);
  const int64_t seq_kv = sp.len, chunks = (seq_kv + kStatTokens - 1) / kStatTokens;
  const int64_t k_stride = k_mean_stride_of(seq_kv, k_mean_tokens);
  const int64_t k_samples = (seq_kv + k_stride - 1) / k_stride;
  const StatView hs = stat_view(stats, kv_rows, b, h, sp, D);
  if (threadIdx.x == 0) kv_bad[bh] = kKvBadNone;  // quant_kv lowers it
  for (int64_t c = threadIdx.x; c < D; c += blockDim.x) {
    const ChannelFinal f =
        finalize_channel(hs, chunks, c, seq_kv, k_samples, smooth_k, smooth_v);
    k_mean[bh * D + c] = f.k_mean;
    v_mean[bh * D + c] = f.v_mean;
    v_scale[bh * D + c] = f.v_scale;
    v_inv[bh * D + c] = f.v_inv;
  }
}

// The three-launch path's quantization: one CTA (256 threads) per 64-key block, K and V loaded
// together (the loads of both in flight at once) before the head's means and scales.
// At D = 256 a thread holds twice the K and V words: two CTAs an SM (128 registers; at three,
// ptxas spilled ~0.5 KB a thread).
template <typename T, int D, int kBits, bool kVec>
__global__ void __launch_bounds__(256, D <= 64 ? 4 : D <= 128 ? 3 : 2)
    quant_kv_kernel(const T* k, const T* v, sage_strides ks, sage_strides vs, int dim,
                    int64_t heads_kv, int64_t bk, SeqRows kv_rows, const float* k_mean,
                    const float* v_mean, const float* v_inv, unsigned long long* kv_bad,
                    uint8_t* kq, float* k_scale, uint8_t* vq) {
  pdl_enter();
  __shared__ float group_max[8][4];
  __shared__ __align__(16) float km[D];
  __shared__ __align__(16) float vm[D];
  __shared__ __align__(16) float vi[D];
  const int64_t bh = cta_outer_index();
  if (bh >= bk) return;
  const BatchHead bhd = batch_head(bh, heads_kv);
  const int b = int(bhd.b), h = int(bhd.h);
  const SeqSpan sp = kv_rows.span(b);
  const int64_t kb = blockIdx.x, seq_kv = sp.len;
  if (kb * kBlockK >= seq_kv) return;  // past this sequence's keys (a packed batch)
  KvBlock<D> x = load_block_global<T, D, kVec>(k, v, ks, vs, dim, b, h, sp.tok0, kb, seq_kv);
  x.template zero_special_keys<T>(kb * kBlockK, kv_bad + bh);
  if (threadIdx.x < D) {
    const int c = threadIdx.x;
    km[c] = k_mean[int64_t(bh) * D + c];
    vm[c] = v_mean[int64_t(bh) * D + c];
    vi[c] = v_inv[int64_t(bh) * D + c];
  }
  __syncthreads();
  const int64_t vcol0 = v_base(kv_rows, b, h, sp, D);
  quant_kv_block<T, D, kBits>(x, kb, kv_rows.row0(b, h, sp), vcol0, kv_rows.pitch, km, vm, vi,
                              group_max, seq_kv, kq, k_scale, vq);
  zero_v_tail<D>(kv_rows, kb, (seq_kv + kBlockK - 1) / kBlockK, vcol0, vq);
}

}  // namespace
}  // namespace sage::quant
