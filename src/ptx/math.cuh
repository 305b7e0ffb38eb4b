// Fast math instructions used by the softmax: each wrapper names its PTX.
#pragma once

namespace sage::ptx {

// ex2.approx.ftz.f32 (all archs): 2^x, max relative error 2^-22; ex2(-inf) = +0.
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace sage::ptx
