// cvt wrappers: f32 pairs to packed FP8 (E4M3/E5M2, sm_89+), FP4 (E2M1) and E8M0 scales
// (sm_100a/sm_120a families), packed FP8 back to f16x2, and f32 to fp16/bf16 (single and packed). Every result is
// returned with the element named `lo` in the low bits, so storing it little-endian puts `lo` at
// the lower address. PTX writes its FIRST source operand to the HIGH half, hence the swapped
// operands in each asm below. The host codec for the same bits is sage::encode_float (formats.h).
#pragma once

#include <cstdint>

// SAGE_PTX_HAS_CVT_FP8: cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 and cvt.rn.f16x2.{e4m3x2,e5m2x2}
// (PTX ISA 7.8+, sm_89 and later). The wrappers are also declared in the host pass, so kernels
// that call them parse there; a device pass for an older arch leaves them out.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define SAGE_PTX_HAS_CVT_FP8 1
#endif

// SAGE_PTX_HAS_CVT_E2M1: cvt.rn.satfinite.e2m1x2.f32 (PTX ISA 8.6+). ptxas takes it only for the
// arch-specific and family-specific targets of sm_100 and later (sm_100a/f, sm_103a/f, sm_110a/f,
// sm_120a/f, sm_121a/f), never for plain sm_100/sm_120 nor for sm_90a. Defined only in such a
// device pass: code that calls cvt_e2m1x2 must sit under `#if SAGE_PTX_HAS_CVT_E2M1`.
#if defined(__CUDA_ARCH__) &&                                                             \
    ((defined(__CUDA_ARCH_FAMILY_SPECIFIC__) && __CUDA_ARCH_FAMILY_SPECIFIC__ >= 1000) || \
     (defined(__CUDA_ARCH_SPECIFIC__) && __CUDA_ARCH_SPECIFIC__ >= 1000) ||               \
     defined(__CUDA_ARCH_FEAT_SM100_ALL) || defined(__CUDA_ARCH_FEAT_SM101_ALL) ||        \
     defined(__CUDA_ARCH_FEAT_SM120_ALL))
#define SAGE_PTX_HAS_CVT_E2M1 1
#endif

namespace sage::ptx {

#if !defined(__CUDA_ARCH__) || defined(SAGE_PTX_HAS_CVT_FP8)

// cvt.rn.satfinite.e4m3x2.f32 (sm_89+). Round to nearest even; NaN -> 0x7F; |x| > 448 and
// +-inf -> +-448 (0x7E/0xFE). Result: lo in bits [7:0], hi in bits [15:8].
__device__ __forceinline__ uint16_t cvt_e4m3x2(float lo, float hi) {
  uint16_t packed;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
  return packed;
}

// cvt.rn.satfinite.e5m2x2.f32 (sm_89+). NaN -> 0x7F; |x| > 57344 and +-inf -> +-57344
// (0x7B/0xFB), never infinity. Result: lo in bits [7:0], hi in bits [15:8].
__device__ __forceinline__ uint16_t cvt_e5m2x2(float lo, float hi) {
  uint16_t packed;
  asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
  return packed;
}

// cvt.rn.f16x2.e4m3x2 (sm_89+): bits [7:0] -> fp16 in bits [15:0], bits [15:8] -> bits [31:16].
// Exact (every E4M3 value is an fp16 value); NaN (0x7F/0xFF) -> 0x7FFF.
__device__ __forceinline__ uint32_t cvt_f16x2_from_e4m3x2(uint16_t packed) {
  uint32_t halves;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(packed));
  return halves;
}

// cvt.rn.f16x2.e5m2x2 (sm_89+): as above for E5M2 (exact; infinities kept, NaN -> 0x7FFF).
__device__ __forceinline__ uint32_t cvt_f16x2_from_e5m2x2(uint16_t packed) {
  uint32_t halves;
  asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(halves) : "h"(packed));
  return halves;
}

#endif  // fp8

#if defined(SAGE_PTX_HAS_CVT_E2M1)

// cvt.rn.satfinite.e2m1x2.f32 (sm_100a/sm_120a families, see above). Round to nearest even;
// |x| > 6 and +-inf -> +-6; NaN -> +6 (E2M1 has no NaN). Result: lo in bits [3:0], hi in
// bits [7:4]; bits [15:8] are zero. The PTX destination is a .b8 register, widened here.
__device__ __forceinline__ uint16_t cvt_e2m1x2(float lo, float hi) {
  uint16_t packed;
  asm("{\n\t.reg .b8 nibbles;\n\t"
      "cvt.rn.satfinite.e2m1x2.f32 nibbles, %1, %2;\n\t"
      "cvt.u16.u8 %0, nibbles;\n\t}"
      : "=h"(packed)
      : "f"(hi), "f"(lo));
  return packed;
}

// cvt.rz.satfinite.ue8m0x2.f32 and cvt.rp.satfinite.ue8m0x2.f32 (PTX ISA 8.6+; taken here under
// the E2M1 guard, the same Blackwell targets): each input as an E8M0 code, the power of two at or
// below it (rz) or at or above it (rp), saturated to [2^-127, 2^127]; NaN -> 0xFF. The MXFP4
// block scale is the rz form of amax / 4 (formats.h, fp4_scale_code). Result: lo in bits [7:0],
// hi in bits [15:8].
__device__ __forceinline__ uint16_t cvt_ue8m0x2_rz(float lo, float hi) {
  uint16_t packed;
  asm("cvt.rz.satfinite.ue8m0x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
  return packed;
}
__device__ __forceinline__ uint16_t cvt_ue8m0x2_rp(float lo, float hi) {
  uint16_t packed;
  asm("cvt.rp.satfinite.ue8m0x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
  return packed;
}

#endif  // e2m1

// cvt.rn.f16.f32 (any arch with fp16 storage). Round to nearest even, overflow -> +-inf (from
// |x| >= 65520), NaN -> 0x7FFF.
__device__ __forceinline__ uint16_t cvt_f16(float x) {
  uint16_t bits;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(x));
  return bits;
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800

// cvt.rn.bf16.f32 (sm_80+). Round to nearest even, overflow -> +-inf, NaN -> 0x7FFF.
__device__ __forceinline__ uint16_t cvt_bf16(float x) {
  uint16_t bits;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(x));
  return bits;
}

// cvt.rn.f16x2.f32 (sm_80+): lo in bits [15:0], hi in bits [31:16].
__device__ __forceinline__ uint32_t cvt_f16x2(float lo, float hi) {
  uint32_t packed;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
  return packed;
}

// cvt.rn.bf16x2.f32 (sm_80+): lo in bits [15:0], hi in bits [31:16].
__device__ __forceinline__ uint32_t cvt_bf16x2(float lo, float hi) {
  uint32_t packed;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
  return packed;
}

#endif  // sm_80+

}  // namespace sage::ptx
