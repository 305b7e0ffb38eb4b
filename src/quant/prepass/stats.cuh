// K/V statistics: a chunk's sums and V range from staged rows (ChunkStats), and the reduction
// of a head's chunk statistics to k_mean, v_mean and V's E4M3 scale (finalize_channel), shared
// by the three-launch path (kv_stats, kv_finalize) and the one-launch kv_prepass.
// (Included only by quant/prepass.cu, the pre-pass's one translation unit: the code sits in
// that file's anonymous namespace, so the kernels stay internal to it.)
#pragma once

#include <type_traits>

#include "common/formats.h"
#include "quant/elements.cuh"
#include "quant/prepass/common.cuh"
#include "quant/prepass/stage.cuh"

namespace sage::quant {
namespace {

// Per (kv head, chunk of kStatTokens tokens, channel): Σk over the chunk's tokens n with
// n % k_stride == 0 (K's mean sample), Σv (double), max v, min v. 256 threads: a thread takes a
// channel pair (one 32-bit word of a staged row) and one of kSlices = 512/D token slices (rows
// r ≡ slice mod kSlices of the chunk, in order; K: the sampled rows i ≡ slice mod kSlices); the
// slices are then added in order (fixed order: deterministic, no atomics). The sums run on
// scaled_double values (x·2^-kScaleExp exactly for finite x: no fp32→fp64 conversion; the final
// multiply by 2^kScaleExp gives the converting sum's bits). Max and min run on packed pairs in the
// input format (exact). An Inf/NaN element counts as a zero everywhere (docs/c-api.md,
// "Non-finite inputs"), so the statistics of a head stay finite and the rows it poisons are marked instead.
template <typename T, int D>
struct ChunkStats {
  using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
  static constexpr int kWords = D / 2, kSlices = 256 / kWords;
  double sk[2] = {0, 0}, sv[2] = {0, 0};
  T2 mx = T2(T(-INFINITY), T(-INFINITY)), mn = T2(T(INFINITY), T(INFINITY));

  // Adds the staged rows [0, rows) into this thread's slice: scaled_double sums first; a slice
  // whose rows held an Inf or NaN redoes their sums converting every value (times 2^-kScaleExp,
  // so the final multiply gives the converting sum's bits).
  __device__ void accumulate(const uint8_t* smem, int rows, int64_t n0, uint32_t k_stride) {
    const int word = threadIdx.x % kWords, slice = threadIdx.x / kWords;
    const uint8_t* kcol = smem + word * 4;
    const uint8_t* vcol = kcol + Stage<D>::kV;
    // K: the sampled rows of the chunk are r = first + i·k_stride; this slice takes i ≡ slice.
    const int64_t first = (int64_t(k_stride) - n0 % k_stride) % k_stride;
    const int64_t k_first = first + int64_t(slice) * k_stride;
    const int64_t k_step = int64_t(kSlices) * k_stride;
    // The sums so far (D = 256 stages a chunk in two parts, one call each): a part that holds an
    // Inf or NaN redoes its own rows from them, not the earlier part's.
    const double sk0[2] = {sk[0], sk[1]}, sv0[2] = {sv[0], sv[1]};
    const T2 mx0 = mx, mn0 = mn;
    uint32_t bad = 0u;
#pragma unroll 4
    for (int r = slice; r < rows; r += kSlices) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(vcol + r * Stage<D>::kPitch);
      bad |= special2<T>(w);
      sv[0] += scaled_double_lo<T>(w);
      sv[1] += scaled_double_hi<T>(w);
      const T2 x = *reinterpret_cast<const T2*>(&w);
      mx = __hmax2(mx, x), mn = __hmin2(mn, x);
    }
    for (int64_t r = k_first; r < rows; r += k_step) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(kcol + r * Stage<D>::kPitch);
      bad |= special2<T>(w);
      sk[0] += scaled_double_lo<T>(w);
      sk[1] += scaled_double_hi<T>(w);
    }
    if (bad == 0u) return;
    // A slice that held an Inf or NaN redoes its sums and range with those elements as zeros
    // (zero_special2), as the quantizers take them.
    sv[0] = sv0[0], sv[1] = sv0[1], sk[0] = sk0[0], sk[1] = sk0[1];
    mx = mx0, mn = mn0;
    for (int r = slice; r < rows; r += kSlices) {
      const uint32_t w = zero_special2<T>(*reinterpret_cast<const uint32_t*>(vcol + r * Stage<D>::kPitch));
      sv[0] += scaled_double_lo<T>(w);
      sv[1] += scaled_double_hi<T>(w);
      const T2 x = *reinterpret_cast<const T2*>(&w);
      mx = __hmax2(mx, x), mn = __hmin2(mn, x);
    }
    for (int64_t r = k_first; r < rows; r += k_step) {
      const uint32_t w = zero_special2<T>(*reinterpret_cast<const uint32_t*>(kcol + r * Stage<D>::kPitch));
      sk[0] += scaled_double_lo<T>(w);
      sk[1] += scaled_double_hi<T>(w);
    }
  }
  // Adds the slices in order and writes the chunk's statistics (D of them, at dst.at(chunk, c)).
  // `red`: kStatRed doubles of shared memory; ends with a __syncthreads.
  __device__ void write(double* red, const StatView& dst, int64_t chunk) const {
    const int word = threadIdx.x % kWords, slice = threadIdx.x / kWords;
    static_assert(kSlices * D == 512, "kStatRed's layout");
    double* rk = red;                                  // Σk [slice][channel]
    double* rv = red + 512;                            // Σv [slice][channel]
    float* rm = reinterpret_cast<float*>(red + 1024);  // [2][slice][channel]: max, min
    const float2 a = to_float2(mx), z = to_float2(mn);
    const int c = 2 * word, at = slice * D + c;
    rk[at] = __dmul_rn(sk[0], Bits<T>::kUnscale), rk[at + 1] = __dmul_rn(sk[1], Bits<T>::kUnscale);
    rv[at] = __dmul_rn(sv[0], Bits<T>::kUnscale), rv[at + 1] = __dmul_rn(sv[1], Bits<T>::kUnscale);
    rm[at] = a.x, rm[at + 1] = a.y;
    rm[kSlices * D + at] = z.x, rm[kSlices * D + at + 1] = z.y;
    __syncthreads();
    for (int ch = threadIdx.x; ch < D; ch += blockDim.x) {
      KvStat s{rk[ch], rv[ch], rm[ch], rm[kSlices * D + ch]};
      for (int t = 1; t < kSlices; ++t) {
        s.sum_k += rk[t * D + ch];
        s.sum_v += rv[t * D + ch];
        s.max_v = fmaxf(s.max_v, rm[t * D + ch]);
        s.min_v = fminf(s.min_v, rm[kSlices * D + t * D + ch]);
      }
      *dst.at(chunk, ch) = s;
    }
    __syncthreads();
  }
};
// Shared memory of ChunkStats::write, in doubles: Σk and Σv [kSlices][D] (512 each), then max
// and min as floats [2][kSlices][D] (512 doubles' room).
constexpr int kStatRed = 1536;

// The chunk statistics of one KV head reduced in chunk order: k_mean (over the k_samples sampled
// tokens), v_mean (zero without smoothing), and the E4M3 scale of V - v_mean, for channel c.
// kv_finalize_kernel and kv_prepass_kernel both call it.
struct ChannelFinal {
  float k_mean, v_mean, v_scale, v_inv;
};
__device__ __forceinline__ ChannelFinal finalize_channel(const StatView& stats, int64_t chunks,
                                                         int64_t c, int64_t seq_kv,
                                                         int64_t k_samples, bool smooth_k,
                                                         bool smooth_v) {
  constexpr int kBatch = 8;  // the statistics of kBatch chunks are loaded before their sums
  double sk = 0, sv = 0;
  float mx = -INFINITY, mn = INFINITY;
  for (int64_t i0 = 0; i0 < chunks; i0 += kBatch) {
    KvStat s[kBatch];
    for (int u = 0; u < kBatch; ++u)
      if (i0 + u < chunks) s[u] = *stats.at(i0 + u, c);
    for (int u = 0; u < kBatch; ++u) {
      if (i0 + u >= chunks) break;
      sk += s[u].sum_k;
      sv += s[u].sum_v;
      mx = fmaxf(mx, s[u].max_v);
      mn = fminf(mn, s[u].min_v);
    }
  }
  // A packed batch's sequence may have no keys: zero means and a zero channel's scale (nothing
  // reads them; they stay finite).
  const float km = smooth_k && k_samples > 0 ? float(sk / double(k_samples)) : 0.0f;
  const float vm = smooth_v && seq_kv > 0 ? float(sv / double(seq_kv)) : 0.0f;
  // max |fl(v - vm)| over the channel: subtraction is monotonic, so the extremes decide.
  const float amax = seq_kv > 0 ? fmaxf(__fsub_rn(mx, vm), __fsub_rn(vm, mn)) : 0.0f;
  const QuantScale q = make_quant_scale(amax, kE4M3Max);
  return {km, vm, q.scale, q.inv};
}

}  // namespace
}  // namespace sage::quant
