// Pre-pass kernels of the mma.sync path (sm_89+), each the GPU twin of a step of the CPU
// emulation (src/ref/attention_quant.cpp), with the same float operations in the same order where
// the result is quantized. Bytes moved (B·H·N·D elements of 2 bytes each for Q, K, V):
//   kv_stats     reads K and V (2+2 B/elem), writes 24 B per (head, 256-token chunk, channel)
//   kv_finalize  reads those statistics, writes 16 B per (head, channel)
//   quant_kv     reads K and V (2+2 B/elem, kept in registers), writes INT8 (1 B) or INT4
//                (0.5 B) K + 4 scales per 64 keys, and E4M3 Vᵀ (1 B)
//   quant_q      reads Q (2 B/elem; again from L2 for the mean with Q smoothing), writes
//                INT8/INT4 Q + scales + the LSE correction (4 B/row)
//   delta_s      (Q smoothing only) reads K (2 B/elem), writes 4 B per (Q block, key)
// Per call: Q 2 B read, K and V 4 B each read, ~1 + 1 + 1 (+0.5) B written per element.
// K and V are thus read twice from DRAM (stats, then quantize); issue "GPU kernels II" fuses.
//
// Throughput notes (the kernels are memory-bound only if nothing else is slower):
// - A thread issues every load of its rows before it uses any (16-byte non-coherent loads when
//   every row of the tensor is 16-byte aligned, decided once on the host: kVec).
// - No fp32→fp64 conversion instruction on the hot paths (F2F.F64 issues at a small fraction of
//   the FP64 rate). The sums of kv_stats and the LSE dot product of quant_q need each fp16/bf16
//   value x as a double: its sign, exponent and mantissa bits placed in a double's fields give
//   exactly x·2^-kScaleExp (subnormals included), a power-of-two multiply (or, for sums, the
//   scale invariance of the rounding) gives x itself. Inf/NaN inputs break that and take the
//   original converting path (detected per chunk or per thread).
// - Integer quantization rounds with the 1.5·2^23 addition instead of FRND + F2I.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "common/formats.h"
#include "ptx/cvt.cuh"
#include "quant/prepass.h"

namespace sage::quant {
namespace {

using mma::Plan;

// Programmatic dependent launch (sm_90+; nothing below): every pre-pass kernel is launched with
// programmatic stream serialization (launch_pdl), so it may start while the previous kernel of the
// stream (a pre-pass kernel, or the caller's kernel that wrote Q/K/V) is still running. It
// therefore waits for that kernel's completion and memory before its first global access
// (griddepcontrol.wait), and then at once lets the next kernel's CTAs be scheduled as SMs free up
// (griddepcontrol.launch_dependents), which in turn wait in their own prologue. Every kernel of
// the chain waits before it touches memory, so each sees all the kernels before it complete.
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// kernel<<<grid, block, 0, stream>>>(args...) with the programmatic-stream-serialization
// attribute (ignored where the device does not support it).
template <typename... Params, typename... Args>
cudaError_t launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
                       Args... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...);
}

struct KvStat {
  double sum_k, sum_v;
  float max_v, min_v;
};
static_assert(sizeof(KvStat) == 24, "the plan reserves 24 bytes per statistic");

__device__ __forceinline__ float to_float(__half x) {
  return __half2float(x);
}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

// Bit-level facts of the 16-bit input formats. scaled_double(x) is the double whose fields hold
// x's sign, exponent and mantissa: exactly x·2^-kScaleExp for every finite x (a subnormal x lands
// on a double subnormal of the same value times 2^-kScaleExp), never for Inf/NaN. kExp2 masks
// the exponent of both halves of a 32-bit word, kExpOne2 is the exponent's lowest bit in both.
template <typename T>
struct Bits;
template <>
struct Bits<__half> {
  static constexpr int kShift = 10;        // fp16 bits 14..0 -> double hi-word bits 24..10
  static constexpr double kUnscale = 0x1p1008;  // 2^(1023-15)
  static constexpr uint32_t kExp2 = 0x7C007C00u, kExpOne2 = 0x04000400u;
  __device__ static float to_float(uint32_t h) { return __half2float(__ushort_as_half(uint16_t(h))); }
};
template <>
struct Bits<__nv_bfloat16> {
  static constexpr int kShift = 13;        // bf16 bits 14..0 -> double hi-word bits 27..13
  static constexpr double kUnscale = 0x1p896;   // 2^(1023-127)
  static constexpr uint32_t kExp2 = 0x7F807F80u, kExpOne2 = 0x00800080u;
  __device__ static float to_float(uint32_t h) { return __uint_as_float(h << 16); }
};

template <typename T>
__device__ __forceinline__ double scaled_double(uint32_t h) {
  return __hiloint2double(int(((h & 0x8000u) << 16) | ((h & 0x7FFFu) << Bits<T>::kShift)), 0);
}

// Non-zero when either element of a word of two has an all-ones exponent (Inf or NaN): adding
// the exponent's lowest bit to the masked exponent carries into the element's sign position.
template <typename T>
__device__ __forceinline__ uint32_t special2(uint32_t w) {
  return ((w & Bits<T>::kExp2) + Bits<T>::kExpOne2) & 0x80008000u;
}

// Element i (0..7) of 8 raw elements, as its 16 bits (element 0 in the low half of w.x).
__device__ __forceinline__ uint32_t elem_bits(const uint4& w, int i) {
  const uint32_t word = i < 2 ? w.x : i < 4 ? w.y : i < 6 ? w.z : w.w;
  return (i % 2) ? word >> 16 : word & 0xFFFFu;
}
template <typename T>
__device__ __forceinline__ float elem_float(const uint4& w, int i) {
  return Bits<T>::to_float(elem_bits(w, i));
}

template <typename T>
__device__ __forceinline__ const T* row_ptr(const T* base, const sage_strides& s, int64_t b,
                                            int64_t h, int64_t n) {
  return base + b * s.batch + h * s.head + n * s.token;
}

// True when every row of the tensor starts 16-byte aligned (base and strides), so every 8-element
// chunk of a row is one 16-byte load.
bool rows_aligned16(const void* base, const sage_strides& s) {
  const uint64_t bytes = uint64_t(s.batch) | uint64_t(s.head) | uint64_t(s.token);  // ×2 below
  return ((reinterpret_cast<uintptr_t>(base) | (bytes << 1)) & 15u) == 0;
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

// quantize_int (formats.h) without FRND/F2I: the product clamped to [-qmax, qmax] plus 1.5·2^23
// is rounded to the nearest integer, ties to even (the ulp there is 1), which then sits in the
// low mantissa bits in two's complement: the low byte (nibble) of the returned bits is the
// INT8 (INT4) value. A NaN product gives 0, as cvt.rni does.
__device__ __forceinline__ uint32_t quantize_bits(float x, float inv, float qmax) {
  const float y = __fmul_rn(x, inv);
  const float c = fminf(fmaxf(y, -qmax), qmax);
  const uint32_t r = __float_as_uint(__fadd_rn(c, 12582912.0f));
  return y != y ? 0u : r;
}

// Stores 8 quantized values (quantize_bits results) of a row starting at element d0: INT8 one per
// byte, INT4 two per byte with the lower element in the low nibble (the MMA operand order).
template <int kBits>
__device__ __forceinline__ void store8(uint8_t* row, int64_t d0, const uint32_t (&q)[8]) {
  if constexpr (kBits == 8) {
    uint32_t w[2] = {0u, 0u};
    for (int i = 0; i < 8; ++i) w[i / 4] |= (q[i] & 0xFFu) << (8 * (i % 4));
    *reinterpret_cast<uint2*>(row + d0) = make_uint2(w[0], w[1]);
  } else {
    uint32_t w = 0u;
    for (int i = 0; i < 8; ++i) w |= (q[i] & 0xFu) << (4 * i);
    *reinterpret_cast<uint32_t*>(row + d0 / 2) = w;
  }
}

// A row part held by one of the 4 threads of a row (8-channel chunks ci·4 + part, raw 16-byte
// words), smoothed by `mean`, quantized with the group's inverse scale and stored: zeros when the
// row is past the sequence. quant_kv (K) and quant_q share it.
template <typename T, int D, int kBits>
__device__ __forceinline__ void quantize_store_row_part(uint8_t* dst, const uint4 (&raw)[D / 32],
                                                        const float* mean, int part, float inv,
                                                        float qmax, bool valid) {
  for (int ci = 0; ci < D / 32; ++ci) {
    const int d0 = (ci * 4 + part) * 8;
    uint32_t qv[8];
    for (int e = 0; e < 8; ++e)
      qv[e] = valid ? quantize_bits(__fsub_rn(elem_float<T>(raw[ci], e), mean[d0 + e]), inv, qmax)
                    : 0u;
    store8<kBits>(dst, d0, qv);
  }
}

// Per (kv head, chunk of kStatTokens tokens, channel): Σk, Σv (double), max v, min v. 256
// threads: D/8 lanes cover a token's channels 8 at a time, the rest split the tokens (token lane
// tl takes tokens tl, tl + 256/(D/8), ... of the chunk, summed in that order); partial results
// are combined in a fixed order (deterministic). The loads of kBatch tokens are issued before
// their sums. The sums run on scaled_double values: every partial sum is x·2^-kScaleExp of the
// converting sum's value (fp16 sums of a chunk are exact either way; for bf16 a result is either
// exact in both or a normal double in both, and rounding commutes with a power of two), so one
// exact multiply per sum at the end gives the same bits. A chunk holding Inf/NaN redoes its sums
// with conversions (any thread seeing one sends the whole CTA there).
template <typename T, int D, bool kVec>
__global__ void __launch_bounds__(256, 2)
    kv_stats_kernel(const T* k, const T* v, sage_strides ks, sage_strides vs, int heads_kv,
                    int64_t seq_kv, int64_t chunks, KvStat* out) {
  pdl_enter();
  constexpr int kLanes = D / 8, kTokenLanes = 256 / kLanes;
  constexpr int kPerLane = mma::kStatTokens / kTokenLanes, kBatch = 4;
  static_assert(kPerLane % kBatch == 0, "whole batches per token lane");
  // Σk and Σv partials of every token lane, then (reused) their max and min.
  __shared__ double red[2][kTokenLanes][D];
  const int bh = blockIdx.y, b = bh / heads_kv, h = bh % heads_kv;
  const int64_t chunk = blockIdx.x;
  const int lane = threadIdx.x % kLanes, tl = threadIdx.x / kLanes, d0 = lane * 8;
  double sk[8] = {}, sv[8] = {};
  float mx[8], mn[8];
  for (int i = 0; i < 8; ++i) mx[i] = -INFINITY, mn[i] = INFINITY;
  uint32_t bad = 0u;
  const int64_t n0 = chunk * mma::kStatTokens + tl;
  const int64_t n1 = min(seq_kv, (chunk + 1) * mma::kStatTokens);
#pragma unroll 1
  for (int t0 = 0; t0 < kPerLane; t0 += kBatch) {
    uint4 kr[kBatch], vr[kBatch];
    for (int u = 0; u < kBatch; ++u) {
      const int64_t n = n0 + int64_t(t0 + u) * kTokenLanes;
      kr[u] = vr[u] = make_uint4(0u, 0u, 0u, 0u);
      if (n < n1) {
        kr[u] = load_raw8<kVec>(row_ptr(k, ks, b, h, n) + d0);
        vr[u] = load_raw8<kVec>(row_ptr(v, vs, b, h, n) + d0);
      }
    }
    for (int u = 0; u < kBatch; ++u) {
      if (n0 + int64_t(t0 + u) * kTokenLanes >= n1) continue;
      bad |= special2<T>(kr[u].x) | special2<T>(kr[u].y) | special2<T>(kr[u].z) |
             special2<T>(kr[u].w) | special2<T>(vr[u].x) | special2<T>(vr[u].y) |
             special2<T>(vr[u].z) | special2<T>(vr[u].w);
      for (int i = 0; i < 8; ++i) {
        sk[i] += scaled_double<T>(elem_bits(kr[u], i));
        sv[i] += scaled_double<T>(elem_bits(vr[u], i));
        const float x = elem_float<T>(vr[u], i);
        mx[i] = fmaxf(mx[i], x), mn[i] = fminf(mn[i], x);
      }
    }
  }
  if (__syncthreads_or(bad != 0u)) {
    // Inf or NaN in the chunk: the sums as the emulation writes them, converting each value.
    for (int i = 0; i < 8; ++i) sk[i] = 0.0, sv[i] = 0.0;
    for (int64_t n = n0; n < n1; n += kTokenLanes) {
      float kx[8], vx[8];
      load8(row_ptr(k, ks, b, h, n), d0, kx);
      load8(row_ptr(v, vs, b, h, n), d0, vx);
      for (int i = 0; i < 8; ++i) sk[i] += double(kx[i]), sv[i] += double(vx[i]);
    }
  } else {
    for (int i = 0; i < 8; ++i)
      sk[i] = __dmul_rn(sk[i], Bits<T>::kUnscale), sv[i] = __dmul_rn(sv[i], Bits<T>::kUnscale);
  }
  KvStat* dst = out + (int64_t(bh) * chunks + chunk) * D;
  // Two rounds through shared memory (sums, then max/min), each reduced over the token lanes in
  // order by 2·D threads (one per channel and quantity).
  for (int i = 0; i < 8; ++i) red[0][tl][d0 + i] = sk[i], red[1][tl][d0 + i] = sv[i];
  __syncthreads();
  for (int c2 = threadIdx.x; c2 < 2 * D; c2 += 256) {
    const int q = c2 / D, c = c2 % D;
    double s = 0;
    for (int t = 0; t < kTokenLanes; ++t) s += red[q][t][c];
    if (q == 0)
      dst[c].sum_k = s;
    else
      dst[c].sum_v = s;
  }
  __syncthreads();
  float(*red_f)[kTokenLanes][D] = reinterpret_cast<float(*)[kTokenLanes][D]>(&red[0][0][0]);
  for (int i = 0; i < 8; ++i) red_f[0][tl][d0 + i] = mx[i], red_f[1][tl][d0 + i] = mn[i];
  __syncthreads();
  for (int c2 = threadIdx.x; c2 < 2 * D; c2 += 256) {
    const int q = c2 / D, c = c2 % D;
    float m = red_f[q][0][c];
    for (int t = 1; t < kTokenLanes; ++t)
      m = q == 0 ? fmaxf(m, red_f[0][t][c]) : fminf(m, red_f[1][t][c]);
    if (q == 0)
      dst[c].max_v = m;
    else
      dst[c].min_v = m;
  }
}

// k_mean, v_mean (zero without smoothing), and the E4M3 scale of V - v_mean per channel. The
// chunks are summed in order; the statistics of kBatch chunks are loaded before their sums.
__global__ void __launch_bounds__(128)
    kv_finalize_kernel(const KvStat* stats, int64_t seq_kv, int64_t dim, int64_t chunks,
                       bool smooth_k, bool smooth_v, float* k_mean, float* v_mean, float* v_scale,
                       float* v_inv) {
  pdl_enter();
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
    const float km = smooth_k ? float(sk / double(seq_kv)) : 0.0f;
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
// max pass and the quantize pass; the 4 groups are keys {8i+2t, 8i+2t+1}. V: E4M3 of
// (V - v_mean) / v_scale, written transposed ([channel][key]) with the keys of each 32-chunk in
// MMA operand order (v_position_of_key); a thread takes the same (key, 8-channel slice) items as
// a loop i = tid, tid + 256, ... over the block's 64·D/8 slices.
template <typename T, int D, int kBits, bool kVec>
__global__ void __launch_bounds__(256, 3)
    quant_kv_kernel(const T* k, const T* v, sage_strides ks, sage_strides vs, int heads_kv,
                    int64_t seq_kv, const float* k_mean, const float* v_mean, const float* v_inv,
                    int64_t nk_pad, int64_t k_blocks, uint8_t* kq, float* k_scale, uint8_t* vq) {
  pdl_enter();
  constexpr float qmax = kBits == 8 ? float(kInt8Max) : float(kInt4Max);
  constexpr int kChunks = D / 32, kVItems = mma::kBlockK * D / 8 / 256;
  __shared__ float group_max[8][4];
  __shared__ float km[D], vm[D], vi[D];
  __shared__ __align__(16) uint8_t tile[D * mma::kBlockK];  // Vᵀ: [channel][position]
  const int bh = blockIdx.y, b = bh / heads_kv, h = bh % heads_kv;
  const int64_t kb = blockIdx.x;
  const int j = threadIdx.x / 4, part = threadIdx.x % 4, warp = threadIdx.x / 32;
  const int64_t key = kb * mma::kBlockK + j;
  const bool valid = key < seq_kv;
  // Every load of the thread first: its K row part, then its V slices.
  uint4 kr[kChunks], vr[kVItems];
  for (int ci = 0; ci < kChunks; ++ci) {
    kr[ci] = make_uint4(0u, 0u, 0u, 0u);
    if (valid) kr[ci] = load_raw8<kVec>(row_ptr(k, ks, b, h, key) + (ci * 4 + part) * 8);
  }
  for (int it = 0; it < kVItems; ++it) {
    const int i = threadIdx.x + 256 * it, vkey = i % mma::kBlockK, d0 = (i / mma::kBlockK) * 8;
    const int64_t n = kb * mma::kBlockK + vkey;
    vr[it] = make_uint4(0u, 0u, 0u, 0u);
    if (n < seq_kv) vr[it] = load_raw8<kVec>(row_ptr(v, vs, b, h, n) + d0);
  }
  for (int c = threadIdx.x; c < D; c += 256) {
    km[c] = k_mean[int64_t(bh) * D + c];
    vm[c] = v_mean[int64_t(bh) * D + c];
    vi[c] = v_inv[int64_t(bh) * D + c];
  }
  __syncthreads();

  // K: max |k - k_mean| of the part, then over the 4 parts of a key and its pair key (j ^ 1 is
  // 4 lanes away): one group in this warp.
  float amax = 0.0f;
  if (valid)
    for (int ci = 0; ci < kChunks; ++ci)
      for (int e = 0; e < 8; ++e) {
        const int c = (ci * 4 + part) * 8 + e;
        amax = fmaxf(amax, fabsf(__fsub_rn(elem_float<T>(kr[ci], e), km[c])));
      }
  for (int m : {1, 2, 4}) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  const int t = (j % 8) / 2;
  if (threadIdx.x % 8 == 0) group_max[warp][t] = amax;

  // V: a warp takes 32 consecutive keys of one 8-channel slice: its byte stores into a tile row
  // then land in 8 words (4 bytes each), not 16 rows of one bank.
  for (int it = 0; it < kVItems; ++it) {
    const int i = threadIdx.x + 256 * it, vkey = i % mma::kBlockK, d0 = (i / mma::kBlockK) * 8;
    const bool vvalid = kb * mma::kBlockK + vkey < seq_kv;
    const int pos = (vkey / 32) * 32 + mma::v_position_of_key(vkey % 32);
    for (int e = 0; e < 8; e += 2) {
      const int c = d0 + e;
      const uint16_t pair =
          vvalid ? ptx::cvt_e4m3x2(__fmul_rn(__fsub_rn(elem_float<T>(vr[it], e), vm[c]), vi[c]),
                                   __fmul_rn(__fsub_rn(elem_float<T>(vr[it], e + 1), vm[c + 1]),
                                             vi[c + 1]))
                 : uint16_t(0);
      tile[c * mma::kBlockK + pos] = uint8_t(pair & 0xFFu);
      tile[(c + 1) * mma::kBlockK + pos] = uint8_t(pair >> 8);
    }
  }
  __syncthreads();

  amax = 0.0f;
  for (int w = 0; w < 8; ++w) amax = fmaxf(amax, group_max[w][t]);
  const QuantScale s = make_quant_scale(amax, qmax);
  if (threadIdx.x < 32 && threadIdx.x % 8 == 0)
    k_scale[(int64_t(bh) * k_blocks + kb) * mma::kKGroups + t] = s.scale;
  quantize_store_row_part<T, D, kBits>(kq + (int64_t(bh) * nk_pad + key) * (D * kBits / 8), kr,
                                       km, part, s.inv, qmax, valid);
  for (int i = threadIdx.x; i < D * 4; i += 256) {  // rows of 64 bytes, 16 bytes a thread
    const int c = i / 4, p = i % 4;
    *reinterpret_cast<uint4*>(vq + (int64_t(bh) * D + c) * nk_pad + kb * mma::kBlockK + p * 16) =
        *reinterpret_cast<const uint4*>(tile + c * mma::kBlockK + p * 16);
  }
}

// One CTA (512 threads, 4 a row) per 128-row Q block: optional block mean, the LSE correction
// scale·q·k_mean, then per-thread groups (rows {g, g+8} of each 16-row warp slice). A thread's
// row loads are issued first (in flight during the mean); q·k_mean is summed in double in
// channel order of the part, with each q value from scaled_double (one exact multiply by 2^s)
// and k_mean from a double copy in shared memory; a part holding Inf/NaN converts instead.
template <typename T, int D, int kBits, bool kVec>
__global__ void __launch_bounds__(512, 2)
    quant_q_kernel(const T* q, sage_strides qs, int heads_q, int heads_kv, int64_t seq_q,
                   bool smooth_q, float scale, const float* k_mean, int64_t nq_pad,
                   int64_t q_blocks, uint8_t* qq, float* q_scale, float* q_mean, float* lse_shift) {
  pdl_enter();
  constexpr float qmax = kBits == 8 ? float(kInt8Max) : float(kInt4Max);
  constexpr int kChunks = D / 32;
  __shared__ float mean[D];
  __shared__ double km_d[D];
  __shared__ float row_max[mma::kBlockQ];
  const int bh = blockIdx.y, b = bh / heads_q, h = bh % heads_q;
  const int64_t qb = blockIdx.x;
  const int64_t r0 = qb * mma::kBlockQ, r1 = min(seq_q, r0 + mma::kBlockQ);
  const float* km = k_mean + (int64_t(b) * heads_kv + h / (heads_q / heads_kv)) * D;
  const int r = threadIdx.x / 4, part = threadIdx.x % 4;
  const int64_t row = r0 + r;
  const bool valid = row < seq_q;
  uint4 raw[kChunks];
  for (int ci = 0; ci < kChunks; ++ci) {
    raw[ci] = make_uint4(0u, 0u, 0u, 0u);
    if (valid) raw[ci] = load_raw8<kVec>(row_ptr(q, qs, b, h, row) + (ci * 4 + part) * 8);
  }
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    float m = 0.0f;
    if (smooth_q) {
      double s = 0;
      for (int64_t rr = r0; rr < r1; ++rr) s += double(to_float(row_ptr(q, qs, b, h, rr)[c]));
      m = float(s / double(r1 - r0));
      q_mean[(int64_t(bh) * q_blocks + qb) * D + c] = m;
    }
    mean[c] = m;
    km_d[c] = double(km[c]);
  }
  __syncthreads();
  float amax = 0.0f;
  double shift = 0;
  if (valid) {
    uint32_t bad = 0u;
    for (int ci = 0; ci < kChunks; ++ci) {
      const int d0 = (ci * 4 + part) * 8;
      bad |= special2<T>(raw[ci].x) | special2<T>(raw[ci].y) | special2<T>(raw[ci].z) |
             special2<T>(raw[ci].w);
      for (int e = 0; e < 8; ++e)
        amax = fmaxf(amax, fabsf(__fsub_rn(elem_float<T>(raw[ci], e), mean[d0 + e])));
    }
    if (bad == 0u) {
      for (int ci = 0; ci < kChunks; ++ci)
        for (int e = 0; e < 8; ++e) {
          const double x = __dmul_rn(scaled_double<T>(elem_bits(raw[ci], e)), Bits<T>::kUnscale);
          shift = __fma_rn(x, km_d[(ci * 4 + part) * 8 + e], shift);  // x·k_mean is exact
        }
    } else {
      for (int ci = 0; ci < kChunks; ++ci)
        for (int e = 0; e < 8; ++e)
          shift += double(elem_float<T>(raw[ci], e)) * double(km[(ci * 4 + part) * 8 + e]);
    }
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
    q_scale[(int64_t(bh) * q_blocks + qb) * mma::kQGroups + (r / 16) * 8 + r % 8] = s.scale;
  quantize_store_row_part<T, D, kBits>(qq + (int64_t(bh) * nq_pad + row) * (D * kBits / 8), raw,
                                       mean, part, s.inv, qmax, valid);
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
  const unsigned bk = unsigned(p.batch * p.heads_kv), bq = unsigned(p.batch * p.heads_q);
  const int heads_q = int(p.heads_q), heads_kv = int(p.heads_kv);  // ≤ 65535 (grid y)
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
    check(launch_pdl(kv_stats_kernel<T, D, kVec>, dim3(unsigned(p.stat_chunks), bk), dim3(256), st,
                     k, v, in.k_strides, in.v_strides, heads_kv, p.seq_kv, p.stat_chunks, stats));
  };
  if (vec_kv)
    stats_kernel(std::true_type{});
  else
    stats_kernel(std::false_type{});
  if (err != cudaSuccess) return err;
  check(launch_pdl(kv_finalize_kernel, dim3(bk), dim3(D), st, stats, p.seq_kv, int64_t(D),
                   p.stat_chunks, p.smooth_k, p.smooth_v, f32(p.k_mean), f32(p.v_mean),
                   f32(p.v_scale), f32(p.v_inv)));
  if (err != cudaSuccess) return err;
  auto quant = [&](auto bits, auto vkv, auto vq) {
    constexpr int kBits = decltype(bits)::value;
    check(launch_pdl(quant_kv_kernel<T, D, kBits, decltype(vkv)::value>,
                     dim3(unsigned(p.k_blocks), bk), dim3(256), st, k, v, in.k_strides,
                     in.v_strides, heads_kv, p.seq_kv, f32(p.k_mean), f32(p.v_mean), f32(p.v_inv),
                     p.nk_pad, p.k_blocks, ws + p.k, f32(p.k_scale), ws + p.v));
    if (err != cudaSuccess) return;
    check(launch_pdl(quant_q_kernel<T, D, kBits, decltype(vq)::value>,
                     dim3(unsigned(p.q_blocks), bq), dim3(512), st, q, in.q_strides, heads_q,
                     heads_kv, p.seq_q, p.smooth_q, in.scale, f32(p.k_mean), p.nq_pad, p.q_blocks,
                     ws + p.q, f32(p.q_scale), p.smooth_q ? f32(p.q_mean) : nullptr,
                     f32(p.lse_shift)));
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
    check(launch_pdl(delta_s_kernel<T, D>, dim3(unsigned(p.nk_pad / 64), bk), dim3(64), st, k,
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
