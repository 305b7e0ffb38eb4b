// The quantization pre-pass of the mma.sync SageAttention2 path: K/V statistics (K channel mean
// over a sample of the tokens, V channel mean and range over all), per-thread INT8/INT4 K with
// smoothing, E4M3 Vᵀ with per-channel scales in the key order the P·V MMA wants, per-thread Q
// with optional per-block smoothing, the LSE correction, and ΔS. Host interface; the kernels are
// in prepass.cu (sm_89+).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attn/mma/params.h"
#include "sage/sage.h"

namespace sage::quant {

struct PrepassInputs {
  const void* q;
  const void* k;
  const void* v;
  sage_dtype dtype;  // fp16 or bf16
  sage_strides q_strides, k_strides, v_strides;
  float scale;  // softmax scale (for the LSE correction)
};

// True when every row of a 16-bit tensor starts 16-byte aligned (base and strides in elements),
// so every 8-element chunk of a row is one 16-byte load (and a TMA map can describe it).
inline bool rows_aligned16(const void* base, const sage_strides& s) {
  const uint64_t bytes = uint64_t(s.batch) | uint64_t(s.head) | uint64_t(s.token);  // ×2 below
  return ((reinterpret_cast<uintptr_t>(base) | (bytes << 1)) & 15u) == 0;
}

// Runs every pre-pass kernel on `stream`, writing the workspace laid out by `plan`.
cudaError_t run_prepass(const mma::Plan& plan, const PrepassInputs& in, uint8_t* workspace,
                        cudaStream_t stream);

}  // namespace sage::quant
