// Fast math instructions used by the softmax: each wrapper names its PTX.
#pragma once

namespace sage::ptx {

// ex2.approx.ftz.f32 (all archs): 2^x, max relative error 2^-22; ex2(-inf) = +0.
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
// max.NaN.f32 (sm_80+): the larger of a and b, NaN if either is NaN (fmaxf drops a NaN).
__device__ __forceinline__ float max_nan(float a, float b) {
  float y;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}
#endif

}  // namespace sage::ptx
