// Element-level helpers of the quantizers, shared by the pre-pass kernels (prepass.cu) and the
// Hopper attention kernel's in-kernel Q quantization (attn/sm90): fp16/bf16 bit facts, exact
// conversions to double, Inf/NaN tests on packed pairs, integer quantization without FRND/F2I,
// the INT8/INT4 store of eight values, and the quantize-and-store of a row part.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace sage::quant {

__device__ __forceinline__ float to_float(__half x) {
  return __half2float(x);
}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

__device__ __forceinline__ float2 to_float2(__half2 x) {
  return __half22float2(x);
}
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 x) {
  return __bfloat1622float2(x);
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

// scaled_double of the low (high) element of a word of two: the element's 16 bits at the top of a
// word, shifted right arithmetically so the exponent and mantissa land in the double's fields
// (the sign copies spread over the bits the mask clears): two or three integer instructions.
template <typename T>
__device__ __forceinline__ double scaled_double_hi(uint32_t w) {
  constexpr uint32_t kMask = 0x80000000u | (0x7FFFu << Bits<T>::kShift);
  return __hiloint2double(int((uint32_t(int(w) >> (16 - Bits<T>::kShift))) & kMask), 0);
}
template <typename T>
__device__ __forceinline__ double scaled_double_lo(uint32_t w) {
  return scaled_double_hi<T>(w << 16);
}

// Non-zero when either element of a word of two has an all-ones exponent (Inf or NaN): adding
// the exponent's lowest bit to the masked exponent carries into the element's sign position.
template <typename T>
__device__ __forceinline__ uint32_t special2(uint32_t w) {
  return ((w & Bits<T>::kExp2) + Bits<T>::kExpOne2) & 0x80008000u;
}

// The word with each Inf/NaN element of the two replaced by +0 (non-finite inputs count as zeros
// in every statistic and quantization; the rows they touch are marked separately).
template <typename T>
__device__ __forceinline__ uint32_t zero_special2(uint32_t w) {
  const uint32_t s = special2<T>(w);  // bit 15 / 31 set for a special element
  const uint32_t keep = ~((s >> 15) * 0xFFFFu);  // bit 15 -> low half's mask, bit 31 -> high's
  return w & keep;
}

// Folds a word of two elements into acc's Inf/NaN test: x·0 is ±0 for a finite x and NaN for an
// Inf or NaN, so one packed FMA a word (acc = x·0 + acc) leaves acc NaN exactly when some folded
// element was special; special2 of acc then tells (acc starts at 0). One instruction a word where
// special2 on every word takes two or three. (The pre-pass's K/V test uses it; the sm90 kernel's
// Q quantization keeps special_any, whose fold measured slower there under a causal mask.)
template <typename T>
__device__ __forceinline__ uint32_t special_fold(uint32_t acc, uint32_t w) {
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 r = __hfma2(*reinterpret_cast<const __half2*>(&w), __half2(0.0f, 0.0f),
                              *reinterpret_cast<const __half2*>(&acc));
    return *reinterpret_cast<const uint32_t*>(&r);
  } else {
    const __nv_bfloat162 r =
        __hfma2(*reinterpret_cast<const __nv_bfloat162*>(&w), __nv_bfloat162(0.0f, 0.0f),
                *reinterpret_cast<const __nv_bfloat162*>(&acc));
    return *reinterpret_cast<const uint32_t*>(&r);
  }
}

// Non-zero when an element of the chunks is Inf or NaN (special2 over every word).
template <typename T, int N>
__device__ __forceinline__ uint32_t special_any(const uint4 (&raw)[N]) {
  uint32_t bad = 0u;
  #pragma unroll
  for (int c = 0; c < N; ++c)
    bad |= special2<T>(raw[c].x) | special2<T>(raw[c].y) | special2<T>(raw[c].z) |
           special2<T>(raw[c].w);
  return bad;
}

// Zeroes every Inf/NaN element of the chunks (a test of every word; the zeroing only where the
// rare Inf/NaN is); returns non-zero when there was one.
template <typename T, int N>
__device__ __forceinline__ uint32_t zero_special(uint4 (&raw)[N]) {
  const uint32_t bad = special_any<T>(raw);
  if (bad != 0u)
    #pragma unroll
    for (int c = 0; c < N; ++c)
      raw[c] = make_uint4(zero_special2<T>(raw[c].x), zero_special2<T>(raw[c].y),
                          zero_special2<T>(raw[c].z), zero_special2<T>(raw[c].w));
  return bad;
}

// With finite elements, a finite group max and a finite scale, no product x·inv leaves
// [-qmax, qmax] and none is NaN: quantize_store_row_part may take its fast path (no clamp, no
// NaN test).
__device__ __forceinline__ bool finite_scale(float amax, float inv) {
  return amax <= 3.402823466e38f && inv <= 3.402823466e38f;
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
__device__ __forceinline__ void store8(uint8_t* row, int64_t d0, const uint32_t (&q)[8],
                                       uint32_t keep = 0xFFFFFFFFu) {
  if constexpr (kBits == 8) {
    uint32_t w[2];
    for (int i = 0; i < 2; ++i)
      w[i] = __byte_perm(__byte_perm(q[4 * i], q[4 * i + 1], 0x0040),
                         __byte_perm(q[4 * i + 2], q[4 * i + 3], 0x0040), 0x5410);
    *reinterpret_cast<uint2*>(row + d0) = make_uint2(w[0] & keep, w[1] & keep);
  } else {
    uint32_t w = 0u;
    for (int i = 0; i < 8; ++i) w |= (q[i] & 0xFu) << (4 * i);
    *reinterpret_cast<uint32_t*>(row + d0 / 2) = w & keep;
  }
}

// A row part held by one of the 4 threads of a row (8-channel chunks ci·4 + part, raw 16-byte
// words), smoothed by center(x, channel), quantized with the group's inverse scale and stored,
// masked by `keep` (0 for a row past the sequence). fast: no element can leave [-qmax, qmax] nor
// be NaN, so the clamp and the NaN test of quantize_bits are skipped. place(d0): where the chunk
// starting at element d0 goes in dst (the row itself for the pre-pass; the sm90 kernel's Q tile
// is swizzled). quant_kv (K), quant_q and the sm90 kernel's quantize_q_tile share it.
struct RowPlace {
  __device__ int operator()(int d0) const { return d0; }
};
// Eight centered values y of the chunk at element d0, quantized with inv and stored at place(d0)
// (the pre-pass's K, centered once for its group max and its quantization: kv_block.cuh).
template <int kBits, typename Place>
__device__ __forceinline__ void quantize_store8(uint8_t* dst, int d0, const float (&y)[8],
                                                float inv, float qmax, bool fast, uint32_t keep,
                                                Place place) {
  uint32_t qv[8];
  if (fast) {
    for (int e = 0; e < 8; ++e)
      qv[e] = __float_as_uint(__fadd_rn(__fmul_rn(y[e], inv), 12582912.0f));
  } else {
    for (int e = 0; e < 8; ++e) qv[e] = quantize_bits(y[e], inv, qmax);
  }
  store8<kBits>(dst, place(d0), qv, keep);
}
template <typename T, int D, int kBits, typename Center, typename Place = RowPlace>
__device__ __forceinline__ void quantize_store_row_part(uint8_t* dst, const uint4 (&raw)[D / 32],
                                                        Center center, int part, float inv,
                                                        float qmax, bool fast, uint32_t keep,
                                                        Place place = {}) {
  // (Its own loop rather than quantize_store8's: the sm90 kernel, which inlines it, measured
  // slower under a causal mask with the shared form, its code laid out otherwise.)
  #pragma unroll
  for (int ci = 0; ci < D / 32; ++ci) {
    const int d0 = (ci * 4 + part) * 8;
    uint32_t qv[8];
    if (fast) {
      for (int e = 0; e < 8; ++e)
        qv[e] = __float_as_uint(
            __fadd_rn(__fmul_rn(center(elem_float<T>(raw[ci], e), d0 + e), inv), 12582912.0f));
    } else {
      for (int e = 0; e < 8; ++e)
        qv[e] = quantize_bits(center(elem_float<T>(raw[ci], e), d0 + e), inv, qmax);
    }
    store8<kBits>(dst, place(d0), qv, keep);
  }
}

}  // namespace sage::quant
