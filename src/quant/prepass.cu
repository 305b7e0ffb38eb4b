// Pre-pass kernels of the mma.sync path (sm_89+), each the GPU twin of a step of the CPU
// emulation (src/ref/attention_quant.cpp), with the same float operations in the same order where
// the result is quantized. Bytes moved (B·H·N·D elements of 2 bytes each for Q, K, V):
//   kv_stats     reads V (2 B/elem) and every k_mean_stride-th row of K (the smoothing mean
//                of K from a sample: ~256 rows a head with the presets), writes 24 B per (head,
//                256-token chunk, channel)
//   kv_finalize  reads those statistics, writes 16 B per (head, channel)
//   quant_kv     reads K and V (2+2 B/elem, kept in registers), writes INT8 (1 B) or INT4
//                (0.5 B) K + 4 scales per 64 keys, and E4M3 Vᵀ (1 B)
//   quant_q      reads Q (2 B/elem; again from L2 for the mean with Q smoothing), writes
//                INT8/INT4 Q + scales + the LSE correction (4 B/row); skipped when the sm90
//                kernel quantizes Q itself (PrepassPlan::quantize_q false: attn/sm90 producer)
//   delta_s      (Q smoothing only) reads K (2 B/elem), writes 4 B per (Q block, key)
// Per call: Q 2 B read, K 2 B and V 4 B read, ~1 + 1 + 1 (+0.5) B written per element. V is
// read twice (its exact channel mean and range, then quantize): the sm90 kernel's wgmma
// accumulator needs V - v_mean to sum to zero (docs/sm90-kernel.md, Tried and rejected).
//
// Throughput notes (the kernels are memory-bound only if nothing else is slower):
// - A thread issues every load of its rows before it uses any (kv_stats: the next batch of tokens
//   before the sums of the current one), as 16-byte non-coherent loads when every row of the
//   tensor is 16-byte aligned, decided once on the host: kVec.
// - No fp32→fp64 conversion instruction on the hot paths (F2F.F64 issues at a small fraction of
//   the FP64 rate). The sums of kv_stats and the LSE dot product of quant_q need each fp16/bf16
//   value x as a double: its sign, exponent and mantissa bits placed in a double's fields give
//   exactly x·2^-kScaleExp (subnormals included), a power-of-two multiply (or, for sums, the
//   scale invariance of the rounding) gives x itself. Inf/NaN inputs break that and take the
//   original converting path (detected per chunk or per thread).
// - Integer quantization rounds with the 1.5·2^23 addition instead of FRND + F2I, and drops the
//   clamp and NaN test where they cannot act (no NaN, finite group amax and inv); no per-element
//   branches (rows past the sequence are zeroed by a mask on the packed word).
// - Max/min that need no float rounding run on the packed 16-bit inputs (kv_stats' V range,
//   quant_q's max |q| without smoothing).
// - Grids are (blocks, heads, batch): no integer division for the batch and head.
// - Every kernel is PDL-launched (launch_pdl) and waits in its prologue (pdl_enter).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "common/formats.h"
#include "common/launch.h"
#include "ptx/async.cuh"
#include "ptx/cvt.cuh"
#include "quant/elements.cuh"
#include "quant/prepass.h"

namespace sage::quant {
namespace {

using Plan = PrepassPlan;

// Programmatic dependent launch (sm_90+; nothing below): every pre-pass kernel is launched with
// programmatic stream serialization (launch_pdl, common/launch.h), so it may start while the
// previous kernel of the stream (a pre-pass kernel, or the caller's kernel that wrote Q/K/V) is
// still running. It therefore waits for that kernel's completion and memory before its first
// global access (griddepcontrol.wait), and then at once lets the next kernel's CTAs be scheduled
// as SMs free up (griddepcontrol.launch_dependents), which in turn wait in their own prologue.
// Every kernel of the chain waits before it touches memory, so each sees all the kernels before
// it complete.
__device__ __forceinline__ void pdl_enter() {
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
}

struct KvStat {
  double sum_k, sum_v;
  float max_v, min_v;
};
static_assert(sizeof(KvStat) == 24, "the plan reserves 24 bytes per statistic");

template <typename T>
__device__ __forceinline__ const T* row_ptr(const T* base, const sage_strides& s, int64_t b,
                                            int64_t h, int64_t n) {
  return base + b * s.batch + h * s.head + n * s.token;
}

// Elements p[0..7] as raw bits: one 16-byte read-only load (not kept in L1: every input byte is
// read once per kernel) when kVec, else eight 2-byte loads (rows need only 2-byte alignment).
template <bool kVec, typename T>
__device__ __forceinline__ uint4 load_raw8(const T* p) {
  uint4 w;
  if constexpr (kVec) {
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
        : "l"(p));
  } else {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(p);
    w.x = s[0] | (uint32_t(s[1]) << 16);
    w.y = s[2] | (uint32_t(s[3]) << 16);
    w.z = s[4] | (uint32_t(s[5]) << 16);
    w.w = s[6] | (uint32_t(s[7]) << 16);
  }
  return w;
}

// Elements p[0..N-1] (N = 4 or 8) as raw bits, two a word: load_raw8, or one 8-byte load.
template <bool kVec, int N, typename T>
__device__ __forceinline__ void load_raw(const T* p, uint32_t (&w)[N / 2]) {
  static_assert(N == 4 || N == 8, "4 or 8 elements");
  if constexpr (N == 8) {
    const uint4 x = load_raw8<kVec>(p);
    w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
  } else if constexpr (kVec) {
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
  } else {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(p);
    w[0] = s[0] | (uint32_t(s[1]) << 16);
    w[1] = s[2] | (uint32_t(s[3]) << 16);
  }
}

// Elements d0..d0+7 of a row as float: one 16-byte load when the row allows it, else eight.
template <typename T>
__device__ __forceinline__ void load8(const T* row, int64_t d0, float (&x)[8]) {
  const T* p = row + d0;
  if ((reinterpret_cast<uintptr_t>(p) & 15u) == 0) {
    const uint4 w = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&w);
    for (int i = 0; i < 8; ++i) x[i] = to_float(e[i]);
  } else {
    for (int i = 0; i < 8; ++i) x[i] = to_float(p[i]);
  }
}

// Per (kv head, chunk of kStatTokens tokens, channel): Σk over the chunk's tokens n with
// n % k_stride == 0 (the K mean's sample: the other K rows are not read), Σv (double), max v,
// min v. 256 threads: D/8 lanes cover a token's channels 8 at a time, the rest split the tokens
// (token lane tl takes tokens tl, tl + 256/(D/8), ... of the chunk, summed in that order);
// partial results are combined in a fixed order (deterministic). The loads are
// software-pipelined: those of the next kBatch tokens are issued before the sums of the current
// ones. The sums run on
// scaled_double values: every partial sum is x·2^-kScaleExp of the converting sum's value (fp16
// sums of a chunk are exact either way; for bf16 a result is either exact in both or a normal
// double in both, and rounding commutes with a power of two), so one exact multiply per sum at
// the end gives the same bits. Max and min run on packed pairs in the input format (exact, NaN
// skipped as fmaxf/fminf do). A chunk holding Inf/NaN redoes its sums with conversions (any
// thread seeing one sends the whole CTA there). The partials go through shared memory with
// channel c of a token lane at (c % 8)·(D/8) + c / 8 (no bank conflicts on either side).
template <typename T, int D, bool kVec>
__global__ void __launch_bounds__(256, 2)
    kv_stats_kernel(const T* k, const T* v, sage_strides ks, sage_strides vs, int64_t seq_kv,
                    int64_t chunks, uint32_t k_stride, KvStat* out) {
  pdl_enter();
  using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
  constexpr int kLanes = D / 8, kTokenLanes = 256 / kLanes;
  constexpr int kPerLane = kStatTokens / kTokenLanes, kBatch = 2;
  constexpr int kSteps = kPerLane / kBatch;
  static_assert(kPerLane % kBatch == 0, "whole batches per token lane");
  // Σk and Σv partials of every token lane, then (reused) their max and min.
  __shared__ double red[2][kTokenLanes][D];
  const int b = blockIdx.z, h = blockIdx.y, bh = b * gridDim.y + h;
  const int64_t chunk = blockIdx.x;
  const int lane = threadIdx.x % kLanes, tl = threadIdx.x / kLanes, d0 = lane * 8;
  double sk[8] = {}, sv[8] = {};
  T2 mx[4], mn[4];
  for (int i = 0; i < 4; ++i) {
    mx[i] = T2(T(-INFINITY), T(-INFINITY));
    mn[i] = T2(T(INFINITY), T(INFINITY));
  }
  uint32_t bad = 0u;
  const int64_t n0 = chunk * kStatTokens + tl;
  const int64_t n1 = min(seq_kv, (chunk + 1) * kStatTokens);
  // This token lane's tokens n0, n0 + kTokenLanes, ...: their count, their rows (a pointer that
  // steps by kTokenLanes rows) and whether K's mean samples them (n % k_stride == 0, kept as a
  // running residue): per token an add and a compare, not row_ptr's 64-bit products and a
  // division, which were most of the instructions between the loads.
  const int count = n1 > n0 ? int((n1 - n0 + kTokenLanes - 1) / kTokenLanes) : 0;
  const T* k_row = row_ptr(k, ks, b, h, n0) + d0;
  const T* v_row = row_ptr(v, vs, b, h, n0) + d0;
  const int64_t k_step = int64_t(kTokenLanes) * ks.token, v_step = int64_t(kTokenLanes) * vs.token;
  // 32-bit: a head of 2^32 tokens cannot be in memory.
  uint32_t residue = uint32_t(n0) % k_stride;
  const uint32_t residue_step = uint32_t(kTokenLanes) % k_stride;
  uint4 kr[2][kBatch], vr[2][kBatch];
  auto load = [&](int step, uint4 (&kb)[kBatch], uint4 (&vb)[kBatch]) {
    for (int u = 0; u < kBatch; ++u) {
      kb[u] = vb[u] = make_uint4(0u, 0u, 0u, 0u);  // zeros add nothing to Σk
      if (step * kBatch + u < count) {
        if (residue == 0u) kb[u] = load_raw8<kVec>(k_row);
        vb[u] = load_raw8<kVec>(v_row);
      }
      k_row += k_step, v_row += v_step;
      residue += residue_step;
      if (residue >= k_stride) residue -= k_stride;
    }
  };
  auto accumulate = [&](int step, const uint4 (&kb)[kBatch], const uint4 (&vb)[kBatch]) {
    for (int u = 0; u < kBatch; ++u) {
      if (step * kBatch + u >= count) continue;
      bad |= special2<T>(kb[u].x) | special2<T>(kb[u].y) | special2<T>(kb[u].z) |
             special2<T>(kb[u].w) | special2<T>(vb[u].x) | special2<T>(vb[u].y) |
             special2<T>(vb[u].z) | special2<T>(vb[u].w);
      const uint32_t kw[4] = {kb[u].x, kb[u].y, kb[u].z, kb[u].w};
      const uint32_t vw[4] = {vb[u].x, vb[u].y, vb[u].z, vb[u].w};
      for (int i = 0; i < 4; ++i) {
        sk[2 * i] += scaled_double_lo<T>(kw[i]);
        sk[2 * i + 1] += scaled_double_hi<T>(kw[i]);
        sv[2 * i] += scaled_double_lo<T>(vw[i]);
        sv[2 * i + 1] += scaled_double_hi<T>(vw[i]);
        const T2 x = *reinterpret_cast<const T2*>(&vw[i]);
        mx[i] = __hmax2(mx[i], x), mn[i] = __hmin2(mn[i], x);
      }
    }
  };
  load(0, kr[0], vr[0]);
#pragma unroll 1
  for (int step = 0; step < kSteps; step += 2) {
    if (step + 1 < kSteps) load(step + 1, kr[1], vr[1]);
    accumulate(step, kr[0], vr[0]);
    if (step + 1 < kSteps) {
      if (step + 2 < kSteps) load(step + 2, kr[0], vr[0]);
      accumulate(step + 1, kr[1], vr[1]);
    }
  }
  if (__syncthreads_or(bad != 0u)) {
    // Inf or NaN in the chunk: the sums as the emulation writes them, converting each value.
    for (int i = 0; i < 8; ++i) sk[i] = 0.0, sv[i] = 0.0;
    for (int64_t n = n0; n < n1; n += kTokenLanes) {
      float kx[8], vx[8];
      const bool sampled = uint32_t(n) % k_stride == 0u;
      if (sampled) load8(row_ptr(k, ks, b, h, n), d0, kx);
      load8(row_ptr(v, vs, b, h, n), d0, vx);
      for (int i = 0; i < 8; ++i) {
        if (sampled) sk[i] += double(kx[i]);
        sv[i] += double(vx[i]);
      }
    }
  } else {
    for (int i = 0; i < 8; ++i)
      sk[i] = __dmul_rn(sk[i], Bits<T>::kUnscale), sv[i] = __dmul_rn(sv[i], Bits<T>::kUnscale);
  }
  KvStat* dst = out + (int64_t(bh) * chunks + chunk) * D;
  // Two rounds through shared memory (sums, then max/min), each reduced over the token lanes in
  // order by 2·D threads (one per channel and quantity).
  for (int i = 0; i < 8; ++i)
    red[0][tl][i * kLanes + lane] = sk[i], red[1][tl][i * kLanes + lane] = sv[i];
  __syncthreads();
  for (int c2 = threadIdx.x; c2 < 2 * D; c2 += 256) {
    const int q = c2 / D, pos = c2 % D, c = (pos % kLanes) * 8 + pos / kLanes;
    double s = 0;
    for (int t = 0; t < kTokenLanes; ++t) s += red[q][t][pos];
    if (q == 0)
      dst[c].sum_k = s;
    else
      dst[c].sum_v = s;
  }
  __syncthreads();
  float(*red_f)[kTokenLanes][D] = reinterpret_cast<float(*)[kTokenLanes][D]>(&red[0][0][0]);
  for (int i = 0; i < 4; ++i) {
    const float2 a = to_float2(mx[i]), z = to_float2(mn[i]);
    red_f[0][tl][(2 * i) * kLanes + lane] = a.x, red_f[0][tl][(2 * i + 1) * kLanes + lane] = a.y;
    red_f[1][tl][(2 * i) * kLanes + lane] = z.x, red_f[1][tl][(2 * i + 1) * kLanes + lane] = z.y;
  }
  __syncthreads();
  for (int c2 = threadIdx.x; c2 < 2 * D; c2 += 256) {
    const int q = c2 / D, pos = c2 % D, c = (pos % kLanes) * 8 + pos / kLanes;
    float m = red_f[q][0][pos];
    for (int t = 1; t < kTokenLanes; ++t)
      m = q == 0 ? fmaxf(m, red_f[0][t][pos]) : fminf(m, red_f[1][t][pos]);
    if (q == 0)
      dst[c].max_v = m;
    else
      dst[c].min_v = m;
  }
}

// k_mean (over the k_samples sampled tokens), v_mean (zero without smoothing), and the E4M3 scale
// of V - v_mean per channel. The chunks are summed in order; the statistics of kBatch chunks are
// loaded before their sums.
__global__ void __launch_bounds__(128)
    kv_finalize_kernel(const KvStat* stats, int64_t seq_kv, int64_t k_samples, int64_t dim,
                       int64_t chunks,
                       bool smooth_k, bool smooth_v, float* k_mean, float* v_mean, float* v_scale,
                       float* v_inv, unsigned* tile_counter) {
  pdl_enter();
  // The attention kernel's tile counters start at zero (it leaves them so; this covers a fresh
  // workspace).
  if (blockIdx.x == 0 && threadIdx.x < 2) tile_counter[threadIdx.x] = 0u;
  constexpr int kBatch = 8;
  const int64_t bh = blockIdx.x;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
    double sk = 0, sv = 0;
    float mx = -INFINITY, mn = INFINITY;
    for (int64_t i0 = 0; i0 < chunks; i0 += kBatch) {
      KvStat s[kBatch];
      for (int u = 0; u < kBatch; ++u)
        if (i0 + u < chunks) s[u] = stats[(bh * chunks + i0 + u) * dim + c];
      for (int u = 0; u < kBatch; ++u) {
        if (i0 + u >= chunks) break;
        sk += s[u].sum_k;
        sv += s[u].sum_v;
        mx = fmaxf(mx, s[u].max_v);
        mn = fminf(mn, s[u].min_v);
      }
    }
    const float km = smooth_k ? float(sk / double(k_samples)) : 0.0f;
    const float vm = smooth_v ? float(sv / double(seq_kv)) : 0.0f;
    // max |fl(v - vm)| over the channel: subtraction is monotonic, so the extremes decide.
    const float amax = fmaxf(__fsub_rn(mx, vm), __fsub_rn(vm, mn));
    const QuantScale q = make_quant_scale(amax, kE4M3Max);
    k_mean[bh * dim + c] = km;
    v_mean[bh * dim + c] = vm;
    v_scale[bh * dim + c] = q.scale;
    v_inv[bh * dim + c] = q.inv;
  }
}

// One CTA (256 threads) per 64-key block, K and V together (the loads of both in flight at once).
// K: 4 threads a key (part p holds 8-channel chunks p, p+4, ...), kept in registers between the
// max pass and the quantize pass; the 4 groups are keys {8i+2t, 8i+2t+1}. Its max is taken on
// the bits of |k - k_mean| (non-negative floats order as their bits; NaN orders above Inf, so a
// NaN is seen and sends the thread to the float max, which skips it, and to quantize_bits). With
// no NaN and a finite group amax and inv, quantize_bits' clamp and NaN test cannot act (see
// quant_q) and are skipped. V: E4M3 of (V - v_mean) / v_scale, written transposed
// ([channel][key]) with the keys of each 32-chunk in MMA operand order (v_position_of_key):
// positions 4g..4g+3 of a block hold keys 16(g/4) + 2(g%4) + {0, 1, 8, 9}, so a thread takes
// such a 4-key group for a slice of W = D/16 channels and stores one 4-byte word per channel;
// the 16 groups of a slice are 16 lanes of a warp, whose words make the channel's 64-byte row.
template <typename T, int D, int kBits, bool kVec>
__global__ void __launch_bounds__(256, 3)
    quant_kv_kernel(const T* k, const T* v, sage_strides ks, sage_strides vs, int64_t seq_kv,
                    const float* k_mean, const float* v_mean, const float* v_inv, int64_t nk_pad,
                    int64_t k_blocks, uint8_t* kq, float* k_scale, uint8_t* vq) {
  pdl_enter();
  constexpr float qmax = kBits == 8 ? float(kInt8Max) : float(kInt4Max);
  constexpr int kChunks = D / 32, kW = D / 16;
  static_assert(kBlockK == 64, "16 four-key groups a block");
  __shared__ float group_max[8][4];
  __shared__ __align__(16) float km[D];
  __shared__ __align__(16) float vm[D];
  __shared__ __align__(16) float vi[D];
  const int b = blockIdx.z, h = blockIdx.y, bh = b * gridDim.y + h;
  const int64_t kb = blockIdx.x;
  const int j = threadIdx.x / 4, part = threadIdx.x % 4, warp = threadIdx.x / 32;
  const int64_t key = kb * kBlockK + j;
  const bool valid = key < seq_kv;
  // V item: 4-key group g (lane % 16), channel slice sl (two a warp).
  const int g = threadIdx.x % 16, sl = warp * 2 + (threadIdx.x % 32) / 16;
  const int vkey0 = 16 * (g / 4) + 2 * (g % 4);
  // Every load of the thread first: its K row part, then its V rows.
  uint4 kr[kChunks];
  for (int ci = 0; ci < kChunks; ++ci) {
    kr[ci] = make_uint4(0u, 0u, 0u, 0u);
    if (valid) kr[ci] = load_raw8<kVec>(row_ptr(k, ks, b, h, key) + (ci * 4 + part) * 8);
  }
  uint32_t vr[4][kW / 2];  // rows vkey0 + {0, 1, 8, 9}, kW elements each
  uint32_t vkeep = 0u;     // byte u: 0xFF when key vkey0 + {0, 1, 8, 9}[u] exists
  for (int u = 0; u < 4; ++u) {
    const int64_t n = kb * kBlockK + vkey0 + (u % 2) + 8 * (u / 2);
    for (int i = 0; i < kW / 2; ++i) vr[u][i] = 0u;
    if (n < seq_kv) {
      load_raw<kVec, kW>(row_ptr(v, vs, b, h, n) + sl * kW, vr[u]);
      vkeep |= 0xFFu << (8 * u);
    }
  }
  if (threadIdx.x < D) {
    const int c = threadIdx.x;
    km[c] = k_mean[int64_t(bh) * D + c];
    vm[c] = v_mean[int64_t(bh) * D + c];
    vi[c] = v_inv[int64_t(bh) * D + c];
  }
  __syncthreads();

  // K: max |k - k_mean| of the part, then over the 4 parts of a key and its pair key (j ^ 1 is
  // 4 lanes away): one group in this warp.
  uint32_t abits = 0u;
  for (int ci = 0; ci < kChunks; ++ci) {
    const float4 m0 = *reinterpret_cast<const float4*>(&km[(ci * 4 + part) * 8]);
    const float4 m1 = *reinterpret_cast<const float4*>(&km[(ci * 4 + part) * 8 + 4]);
    const float mk[8] = {m0.x, m0.y, m0.z, m0.w, m1.x, m1.y, m1.z, m1.w};
    for (int e = 0; e < 8; ++e)
      abits = max(abits, __float_as_uint(fabsf(__fsub_rn(elem_float<T>(kr[ci], e), mk[e]))));
  }
  const bool k_nan = abits > 0x7F800000u;
  float amax = 0.0f;
  if (valid) {
    if (!k_nan) {
      amax = __uint_as_float(abits);
    } else {
      for (int ci = 0; ci < kChunks; ++ci)
        for (int e = 0; e < 8; ++e) {
          const int c = (ci * 4 + part) * 8 + e;
          amax = fmaxf(amax, fabsf(__fsub_rn(elem_float<T>(kr[ci], e), km[c])));
        }
    }
  }
  for (int m : {1, 2, 4}) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  const int t = (j % 8) / 2;
  if (threadIdx.x % 8 == 0) group_max[warp][t] = amax;

  // V: E4M3 pairs (keys vkey0, vkey0 + 1) and (vkey0 + 8, vkey0 + 9) of each channel, one word.
  {
    uint8_t* vdst = vq + (int64_t(bh) * D + sl * kW) * nk_pad + kb * kBlockK + 4 * g;
    for (int e = 0; e < kW; ++e) {
      const int c = sl * kW + e;
      const float m = vm[c], s = vi[c];
      auto val = [&](int u) {
        const uint32_t bits = (e % 2) ? vr[u][e / 2] >> 16 : vr[u][e / 2] & 0xFFFFu;
        return __fmul_rn(__fsub_rn(Bits<T>::to_float(bits), m), s);
      };
      const uint32_t lo = ptx::cvt_e4m3x2(val(0), val(1)), hi = ptx::cvt_e4m3x2(val(2), val(3));
      *reinterpret_cast<uint32_t*>(vdst + int64_t(e) * nk_pad) = __byte_perm(lo, hi, 0x5410) & vkeep;
    }
  }
  __syncthreads();

  amax = 0.0f;
  for (int w = 0; w < 8; ++w) amax = fmaxf(amax, group_max[w][t]);
  const QuantScale s = make_quant_scale(amax, qmax);
  if (threadIdx.x < 32 && threadIdx.x % 8 == 0)
    k_scale[(int64_t(bh) * k_blocks + kb) * kKGroups + t] = s.scale;
  const bool fast = !k_nan && finite_scale(amax, s.inv);
  const uint32_t keep = valid ? 0xFFFFFFFFu : 0u;
  quantize_store_row_part<T, D, kBits>(
      kq + (int64_t(bh) * nk_pad + key) * (D * kBits / 8), kr,
      [&](float x, int c) { return __fsub_rn(x, km[c]); }, part, s.inv, qmax, fast, keep);
}

// One CTA (512 threads, 4 a row) per 128-row Q block: optional block mean (kSmooth), the LSE
// correction scale·q·k_mean, then per-thread groups (rows {g, g+8} of each 16-row warp slice).
// A thread's row loads are issued first (in flight during the mean); q·k_mean is summed in double
// in channel order of the part, with each q value from scaled_double (one exact multiply by 2^s)
// and k_mean from a double copy in shared memory; a part holding Inf/NaN converts instead.
// Without smoothing the row's max |q| is taken on the raw bits (|x| orders as its bits do; a
// part holding Inf/NaN takes the float path). The quantization skips quantize_bits' clamp and NaN
// test where neither can act: every |x - mean| of the group is at most its finite amax, so with a
// finite inv |y| <= qmax·(1+2^-24)^2 rounds into [-qmax, qmax], and no operand is NaN.
template <typename T, int D, int kBits, bool kVec, bool kSmooth>
__global__ void __launch_bounds__(512, 2)
    quant_q_kernel(const T* q, sage_strides qs, int heads_kv, int group_ratio, int64_t seq_q,
                   float scale, const float* k_mean, int64_t nq_pad, int64_t q_blocks,
                   uint8_t* qq, float* q_scale, float* q_mean, float* lse_shift) {
  pdl_enter();
  constexpr float qmax = kBits == 8 ? float(kInt8Max) : float(kInt4Max);
  constexpr int kChunks = D / 32;
  __shared__ float mean[kSmooth ? D : 1];
  __shared__ __align__(16) double km_d[D];
  __shared__ float row_max[kBlockQ];
  const int b = blockIdx.z, h = blockIdx.y, bh = b * gridDim.y + h;
  const int64_t qb = blockIdx.x;
  const int64_t r0 = qb * kBlockQ;
  const float* km = k_mean + (int64_t(b) * heads_kv + h / group_ratio) * D;
  const int r = threadIdx.x / 4, part = threadIdx.x % 4;
  const int64_t row = r0 + r;
  const bool valid = row < seq_q;
  uint4 raw[kChunks];
  for (int ci = 0; ci < kChunks; ++ci) {
    raw[ci] = make_uint4(0u, 0u, 0u, 0u);
    if (valid) raw[ci] = load_raw8<kVec>(row_ptr(q, qs, b, h, row) + (ci * 4 + part) * 8);
  }
  bool mean_special = false;  // a block mean is Inf or NaN (Inf/NaN in the block's Q)
  if (threadIdx.x < D) {
    const int c = threadIdx.x;
    km_d[c] = double(km[c]);
    if constexpr (kSmooth) {
      const int64_t r1 = min(seq_q, r0 + kBlockQ);
      double s = 0;
      for (int64_t rr = r0; rr < r1; ++rr) s += double(to_float(row_ptr(q, qs, b, h, rr)[c]));
      const float m = float(s / double(r1 - r0));
      q_mean[(int64_t(bh) * q_blocks + qb) * D + c] = m;
      mean[c] = m;
      mean_special = !(fabsf(m) <= 3.402823466e38f);
    }
  }
  if constexpr (kSmooth)
    mean_special = __syncthreads_or(mean_special);
  else
    __syncthreads();
  // x - mean, or x itself without smoothing (x - 0 is x, -0 included).
  auto centered = [&](float x, int c) { return kSmooth ? __fsub_rn(x, mean[c]) : x; };

  const uint32_t bad = special_any<T>(raw);
  float amax = 0.0f;
  if (!kSmooth && bad == 0u) {
    // max |x| on the bits: both halves of a word at once (unsigned 16-bit lanes).
    uint32_t m2 = 0u;
    for (int ci = 0; ci < kChunks; ++ci) {
      m2 = __vmaxu2(m2, raw[ci].x & 0x7FFF7FFFu);
      m2 = __vmaxu2(m2, raw[ci].y & 0x7FFF7FFFu);
      m2 = __vmaxu2(m2, raw[ci].z & 0x7FFF7FFFu);
      m2 = __vmaxu2(m2, raw[ci].w & 0x7FFF7FFFu);
    }
    amax = Bits<T>::to_float(max(m2 & 0xFFFFu, m2 >> 16));
  } else if (valid) {
    // Rows past seq_q stay out of the group max: their zeroed raw words centre to -mean, which
    // would otherwise set the scale of a group {g, g+8} shared with a valid row (the emulation
    // groups only rows < seq_q). The bit path above sees 0 for them.
    for (int ci = 0; ci < kChunks; ++ci)
      for (int e = 0; e < 8; ++e) {
        const float x = elem_float<T>(raw[ci], e);
        amax = fmaxf(amax, fabsf(centered(x, (ci * 4 + part) * 8 + e)));
      }
  }
  double shift = 0;
  if (bad == 0u) {
    for (int ci = 0; ci < kChunks; ++ci) {
      const double2* kd = reinterpret_cast<const double2*>(&km_d[(ci * 4 + part) * 8]);
      for (int e2 = 0; e2 < 4; ++e2) {
        const double2 k2 = kd[e2];
        const uint32_t w = e2 == 0 ? raw[ci].x : e2 == 1 ? raw[ci].y : e2 == 2 ? raw[ci].z : raw[ci].w;
        const double lo = __dmul_rn(scaled_double_lo<T>(w), Bits<T>::kUnscale);
        const double hi = __dmul_rn(scaled_double_hi<T>(w), Bits<T>::kUnscale);
        shift = __fma_rn(lo, k2.x, shift);  // x·k_mean is exact
        shift = __fma_rn(hi, k2.y, shift);
      }
    }
  } else {
    for (int ci = 0; ci < kChunks; ++ci)
      for (int e = 0; e < 8; ++e)
        shift += double(elem_float<T>(raw[ci], e)) * double(km[(ci * 4 + part) * 8 + e]);
  }
  for (int m : {1, 2}) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
    shift += __shfl_xor_sync(0xffffffffu, shift, m);
  }
  if (part == 0) {
    row_max[r] = amax;
    if (valid) lse_shift[int64_t(bh) * seq_q + row] = float(double(scale) * shift);
  }
  __syncthreads();
  amax = fmaxf(row_max[r], row_max[r ^ 8]);  // the group: rows {g, g+8} of a 16-row slice
  const QuantScale s = make_quant_scale(amax, qmax);
  if (part == 0 && r % 16 < 8)
    q_scale[(int64_t(bh) * q_blocks + qb) * kQGroups + (r / 16) * 8 + r % 8] = s.scale;
  const bool fast = bad == 0u && !mean_special && finite_scale(amax, s.inv);
  const uint32_t keep = valid ? 0xFFFFFFFFu : 0u;
  quantize_store_row_part<T, D, kBits>(qq + (int64_t(bh) * nq_pad + row) * (D * kBits / 8), raw,
                                       centered, part, s.inv, qmax, fast, keep);
}

// ΔS[Q block][key] = q_mean · (k - k_mean) for every Q block of the query heads of a KV head;
// a thread keeps its key's smoothed row (in shared memory, padded against bank conflicts) and
// walks the Q blocks, whose means every thread reads at the same address (a broadcast).
template <typename T, int D>
__global__ void __launch_bounds__(64)
    delta_s_kernel(const T* k, sage_strides ks, int64_t heads_q, int64_t heads_kv, int64_t seq_kv,
                   const float* k_mean, const float* q_mean, int64_t q_blocks, int64_t nk_pad,
                   float* delta_s) {
  pdl_enter();
  __shared__ float rows[64][D + 1];
  const int64_t bhk = blockIdx.y, b = bhk / heads_kv, hk = bhk % heads_kv;
  const int64_t key = blockIdx.x * 64 + threadIdx.x;  // nk_pad is a multiple of 64
  float* x = rows[threadIdx.x];
  for (int d0 = 0; d0 < D; d0 += 8) {
    float raw[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (key < seq_kv) load8(row_ptr(k, ks, b, hk, key), d0, raw);
    for (int i = 0; i < 8; ++i)
      x[d0 + i] = key < seq_kv ? __fsub_rn(raw[i], k_mean[bhk * D + d0 + i]) : 0.0f;
  }
  const int64_t ratio = heads_q / heads_kv;
  for (int64_t hq = hk * ratio; hq < (hk + 1) * ratio; ++hq) {
    const int64_t bh = b * heads_q + hq;
    for (int64_t qb = 0; qb < q_blocks; ++qb) {
      const float* qm = q_mean + (bh * q_blocks + qb) * D;
      double acc = 0;
      for (int d = 0; d < D; ++d) acc += double(qm[d]) * double(x[d]);
      delta_s[(bh * q_blocks + qb) * nk_pad + key] = float(acc);
    }
  }
}

template <typename T, int D>
cudaError_t launch_dim(const Plan& p, const PrepassInputs& in, uint8_t* ws, cudaStream_t st) {
  const T* q = static_cast<const T*>(in.q);
  const T* k = static_cast<const T*>(in.k);
  const T* v = static_cast<const T*>(in.v);
  const unsigned bk = unsigned(p.batch * p.heads_kv);
  const int heads_q = int(p.heads_q), heads_kv = int(p.heads_kv);
  // (blocks, heads, batch): no division for the batch and head in the kernels.
  auto kv_grid = [&](int64_t blocks) {
    return dim3(unsigned(blocks), unsigned(p.heads_kv), unsigned(p.batch));
  };
  auto f32 = [&](size_t off) { return reinterpret_cast<float*>(ws + off); };
  KvStat* stats = reinterpret_cast<KvStat*>(ws + p.kv_stats);
  const bool vec_kv = rows_aligned16(k, in.k_strides) && rows_aligned16(v, in.v_strides);
  const bool vec_q = rows_aligned16(q, in.q_strides);

  cudaError_t err = cudaSuccess;
  auto check = [&](cudaError_t e) {
    if (err == cudaSuccess) err = e;
  };
  auto stats_kernel = [&](auto vec) {
    constexpr bool kVec = decltype(vec)::value;
    check(launch_pdl(kv_stats_kernel<T, D, kVec>, {kv_grid(p.stat_chunks), dim3(256)}, st, k, v,
                     in.k_strides, in.v_strides, p.seq_kv, p.stat_chunks,
                     uint32_t(p.k_mean_stride), stats));
  };
  if (vec_kv)
    stats_kernel(std::true_type{});
  else
    stats_kernel(std::false_type{});
  if (err != cudaSuccess) return err;
  check(launch_pdl(kv_finalize_kernel, {dim3(bk), dim3(D)}, st, stats, p.seq_kv,
                   p.k_mean_samples, int64_t(D),
                   p.stat_chunks, p.smooth_k, p.smooth_v, f32(p.k_mean), f32(p.v_mean),
                   f32(p.v_scale), f32(p.v_inv),
                   reinterpret_cast<unsigned*>(ws + p.tile_counter)));
  if (err != cudaSuccess) return err;
  auto quant = [&](auto bits, auto vkv, auto vq) {
    constexpr int kBits = decltype(bits)::value;
    check(launch_pdl(quant_kv_kernel<T, D, kBits, decltype(vkv)::value>, {kv_grid(p.k_blocks),
                     dim3(256)}, st, k, v, in.k_strides, in.v_strides, p.seq_kv, f32(p.k_mean),
                     f32(p.v_mean), f32(p.v_inv), p.nk_pad, p.k_blocks, ws + p.k, f32(p.k_scale),
                     ws + p.v));
    if (err != cudaSuccess || !p.quantize_q) return;  // the sm90 kernel quantizes Q itself
    auto qk = p.smooth_q ? quant_q_kernel<T, D, kBits, decltype(vq)::value, true>
                         : quant_q_kernel<T, D, kBits, decltype(vq)::value, false>;
    check(launch_pdl(qk, {dim3(unsigned(p.q_blocks), unsigned(p.heads_q), unsigned(p.batch)),
                     dim3(512)}, st, q, in.q_strides, heads_kv, heads_q / heads_kv, p.seq_q,
                     in.scale, f32(p.k_mean), p.nq_pad, p.q_blocks, ws + p.q, f32(p.q_scale),
                     p.smooth_q ? f32(p.q_mean) : nullptr, f32(p.lse_shift)));
  };
  auto with_vec = [&](auto bits) {
    if (vec_kv && vec_q)
      quant(bits, std::true_type{}, std::true_type{});
    else if (vec_kv)
      quant(bits, std::true_type{}, std::false_type{});
    else if (vec_q)
      quant(bits, std::false_type{}, std::true_type{});
    else
      quant(bits, std::false_type{}, std::false_type{});
  };
  if (p.bits == 8)
    with_vec(std::integral_constant<int, 8>{});
  else
    with_vec(std::integral_constant<int, 4>{});
  if (err != cudaSuccess) return err;
  if (p.smooth_q)
    check(launch_pdl(delta_s_kernel<T, D>, {dim3(unsigned(p.nk_pad / 64), bk), dim3(64)}, st, k,
                     in.k_strides, p.heads_q, p.heads_kv, p.seq_kv, f32(p.k_mean), f32(p.q_mean),
                     p.q_blocks, p.nk_pad, f32(p.delta_s)));
  return err;
}

template <typename T>
cudaError_t launch_all(const Plan& p, const PrepassInputs& in, uint8_t* ws, cudaStream_t st) {
  const cudaError_t e =
      p.head_dim == 64 ? launch_dim<T, 64>(p, in, ws, st) : launch_dim<T, 128>(p, in, ws, st);
  const cudaError_t last = cudaGetLastError();  // also clears a launch error just returned
  return e != cudaSuccess ? e : last;
}

}  // namespace

cudaError_t run_prepass(const Plan& plan, const PrepassInputs& in, uint8_t* workspace,
                        cudaStream_t stream) {
  return in.dtype == SAGE_DTYPE_BF16 ? launch_all<__nv_bfloat16>(plan, in, workspace, stream)
                                     : launch_all<__half>(plan, in, workspace, stream);
}

}  // namespace sage::quant
