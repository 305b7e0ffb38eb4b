// Reading rows of the caller's fp16/bf16 tensors as floats: shared by the pre-pass kernels and
// the Hopper kernel's in-kernel Q quantization, so both see the same values.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace sage::quant {

__device__ __forceinline__ float to_float(__half x) {
  return __half2float(x);
}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
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

}  // namespace sage::quant
