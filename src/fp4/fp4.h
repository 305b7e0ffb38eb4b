// SageAttention3's FP4 attention (SageAttention3 paper, Algorithm 1) computed on Hopper/Ada: NVFP4
// values dequantized exactly to fp16 (every E2M1 x E4M3 product is an fp16 value) and both matmuls
// on fp16 tensor cores (mma.sync m16n8k16, fp32 accumulators), the two-level P~ quantization in the
// kernel. It is what a native sm_100/sm_120 kernel computes, not a fast path (docs/fp4-blackwell.md).
// Host interface (the workspace layout: layout.h); the kernels are in fp4.cu (sm_89+).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "fp4/layout.h"
#include "sage/sage.h"

namespace sage::fp4 {

struct Params {
  const void* q;  // the caller's fp16/bf16 tensors, strides in elements
  const void* k;
  const void* v;
  sage_strides qs, ks, vs;
  void* o;
  int64_t o_batch, o_head, o_token;
  float* lse;  // or null
  int64_t lse_batch, lse_head, lse_token;
  int64_t batch, heads_q, heads_kv, seq_q, seq_kv, head_dim;
  int64_t k_mean_stride;  // K's mean over tokens 0, s, 2s, ... (sage_quant_config::k_mean_tokens)
  bool smooth_q, smooth_k;
  bool causal;
  int64_t causal_offset;  // causal: query i sees keys j <= i + causal_offset
  double scale;           // softmax scale
  bool bf16;
  uint8_t* workspace;
  Layout layout;
};

// Runs the pre-pass and the attention kernel on `stream`.
cudaError_t run(const Params& p, cudaStream_t stream);

}  // namespace sage::fp4
