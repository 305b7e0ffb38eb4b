// The sampled K/V pre-pass (PrepassPlan::kv_sampled: no V smoothing, any sequence length):
// kv_sample takes each head's K mean and V's bounds from K's mean sample of the tokens, quant_kv
// quantizes every 64-key block with them and checks V against its bounds, and fix_v
// re-quantizes the V of a head where a value lay past one (v_sample_bound, common/formats.h).
// Against the three launches (kv_stats over all of V, kv_finalize, quant_kv) the first two
// become a pass over a few hundred rows a head, so the quantization starts almost at once.
// (Included only by quant/prepass.cu, the pre-pass's one translation unit: the code sits in
// that file's anonymous namespace, so the kernels stay internal to it.)
#pragma once

#include <type_traits>

#include "common/formats.h"
#include "common/grid.h"
#include "quant/elements.cuh"
#include "quant/prepass/common.cuh"
#include "quant/prepass/kv_block.cuh"
#include "quant/prepass/params.h"

namespace sage::quant {
namespace {

constexpr int kSampleThreads = 512;

// One CTA per (sequence, KV head). A thread takes 8 channels (one 16-byte piece of a row) of
// every G-th sampled token (G = 512 / (D/8) row groups; with the presets' 256 samples, 4 to 16
// rows a thread, their loads issued together: the call waits on this kernel's latency. With
// k_mean_tokens 0, every token, the CTA reads all of the head's K and V: slow at long lengths).
// K is summed exactly (scaled_double, as kv_stats: fp16 and bf16 values of moderate range sum
// exactly in double, so the order is the emulation's in effect), |V| maxed on packed pairs;
// Inf/NaN elements count as zeros. Then a
// thread a channel adds the groups: k_mean (over the samples, as kv_finalize), v_mean 0, the
// bound and the E4M3 scale it gives. It also does kv_finalize's resets: the sm90 kernel's
// counters (CTA 0), the head's first bad key, its mark and its channels' exact maxima.
template <typename T, int D, bool kVec>
__device__ __forceinline__ void kv_sample(const KvSampleParams& p) {
  using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
  constexpr int kC = D / 8, kG = kSampleThreads / kC;
  __shared__ double sum_k[kG][D];
  __shared__ float max_v[kG][D];
  if (blockIdx.x == 0) zero_counters(p);
  const int64_t bh = blockIdx.x;
  const BatchHead bhd = batch_head(bh, p.heads_kv);
  const int b = int(bhd.b), h = int(bhd.h);
  const SeqSpan sp = p.kv_rows.span(b);
  const int64_t seq_kv = sp.len, stride = k_mean_stride_of(seq_kv, p.k_mean_tokens);
  const int64_t samples = (seq_kv + stride - 1) / stride;
  const int c = threadIdx.x % kC, g = threadIdx.x / kC;
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  double sk[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  T2 mv[4];
  for (int w = 0; w < 4; ++w) mv[w] = T2(T(0.0f), T(0.0f));
  if (c * 8 < p.dim) {
    // kBatch rows' loads are issued before any is used (a row past the samples reads as zeros,
    // which change neither sum nor max): the rows' sums stay in the same order.
    constexpr int kBatch = 8;
    for (int64_t i0 = g; i0 < samples; i0 += int64_t(kBatch) * kG) {
      uint4 kw[kBatch], vw[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int64_t i = i0 + int64_t(j) * kG;
        kw[j] = vw[j] = make_uint4(0u, 0u, 0u, 0u);
        if (i < samples) {
          const int64_t n = sp.tok0 + i * stride;
          kw[j] = load_raw8<kVec>(row_ptr(k, p.ks, b, h, n) + c * 8);
          vw[j] = load_raw8<kVec>(row_ptr(v, p.vs, b, h, n) + c * 8);
        }
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        zero_special<T>(reinterpret_cast<uint4(&)[1]>(kw[j]));
        zero_special<T>(reinterpret_cast<uint4(&)[1]>(vw[j]));
        const uint32_t kk[4] = {kw[j].x, kw[j].y, kw[j].z, kw[j].w};
        const uint32_t vv[4] = {vw[j].x, vw[j].y, vw[j].z, vw[j].w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          sk[2 * w] += scaled_double_lo<T>(kk[w]);
          sk[2 * w + 1] += scaled_double_hi<T>(kk[w]);
          mv[w] = __hmax2(mv[w], __habs2(*reinterpret_cast<const T2*>(&vv[w])));
        }
      }
    }
  }
  for (int w = 0; w < 4; ++w) {
    const float2 m = to_float2(mv[w]);
    sum_k[g][c * 8 + 2 * w] = __dmul_rn(sk[2 * w], Bits<T>::kUnscale);
    sum_k[g][c * 8 + 2 * w + 1] = __dmul_rn(sk[2 * w + 1], Bits<T>::kUnscale);
    max_v[g][c * 8 + 2 * w] = m.x;
    max_v[g][c * 8 + 2 * w + 1] = m.y;
  }
  if (threadIdx.x == 0) {
    p.kv_bad[bh] = kKvBadNone;  // quant_kv lowers it
    p.v_over[bh] = 0u;
  }
  __syncthreads();
  for (int ch = threadIdx.x; ch < D; ch += blockDim.x) {
    double s = sum_k[0][ch];
    float m = max_v[0][ch];
    for (int i = 1; i < kG; ++i) s += sum_k[i][ch], m = fmaxf(m, max_v[i][ch]);
    const int64_t at = bh * D + ch;
    const float bound = v_sample_bound(m);
    const QuantScale q = make_quant_scale(bound, kE4M3Max);
    p.k_mean[at] = p.smooth_k && samples > 0 ? float(s / double(samples)) : 0.0f;
    p.v_mean[at] = 0.0f;
    p.v_scale[at] = q.scale;
    p.v_inv[at] = q.inv;
    p.v_bound[at] = bound;
    p.v_amax[at] = 0u;
  }
}

// kFixCtas CTAs per (sequence, KV head) (fewer for fewer blocks: the launcher's grid x); all but
// a marked head's return at once. A marked head's channels take amax = max(bound, exact max)
// (the exact max is in v_amax for a channel past its bound, and below the bound for every
// other), its scale is rewritten (by its first CTA; each computes the same), and its V is
// quantized again over what quant_kv wrote with the bound, each CTA taking every gridDim.x-th
// 64-key block.
constexpr int kFixCtas = 8;
template <typename T, int D, bool kVec>
__device__ __forceinline__ void fix_v(const VFixParams& p) {
  __shared__ __align__(16) float vm[D];
  __shared__ __align__(16) float vi[D];
  const int64_t bh = cta_outer_index();
  if (bh >= p.bk || p.v_over[bh] == 0u) return;
  const BatchHead bhd = batch_head(bh, p.heads_kv);
  const int b = int(bhd.b), h = int(bhd.h);
  const SeqSpan sp = p.kv_rows.span(b);
  for (int ch = threadIdx.x; ch < D; ch += blockDim.x) {
    const int64_t at = bh * D + ch;
    const float amax = fmaxf(p.v_bound[at], __uint_as_float(p.v_amax[at]));
    const QuantScale q = make_quant_scale(amax, kE4M3Max);
    if (blockIdx.x == 0) p.v_scale[at] = q.scale, p.v_inv[at] = q.inv;
    vm[ch] = 0.0f;
    vi[ch] = q.inv;
  }
  __syncthreads();
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const int64_t vcol0 = v_base(p.kv_rows, b, h, sp, D);
  for (int64_t kb = blockIdx.x; kb * kBlockK < sp.len; kb += gridDim.x) {
    KvBlock<D> x =
        load_block_global<T, D, kVec>(k, v, p.ks, p.vs, p.dim, b, h, sp.tok0, kb, sp.len);
    x.template zero_special_keys<T>(kb * kBlockK, p.kv_bad + bh);
    quant_v_block<T, D>(x, kb, vcol0, p.kv_rows.pitch, vm, vi, p.vq);
  }
}

}  // namespace
}  // namespace sage::quant
