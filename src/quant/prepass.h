// The quantization pre-pass of the mma.sync SageAttention2 path: K/V statistics (K channel mean
// over a sample of the tokens, V channel mean and range over all), per-thread INT8/INT4 K with
// smoothing, E4M3 Vᵀ with per-channel scales in the key order the P·V MMA wants, per-thread Q
// with optional per-block smoothing (and its block means, from which the mma kernel forms ΔS),
// and the LSE correction. Host interface; the launcher is prepass.cu, the kernels (sm_89+) are
// in prepass/, one Params each (prepass/params.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "quant/layout.h"
#include "sage/sage.h"

namespace sage::quant {

struct PrepassInputs {
  const void* q;
  const void* k;
  const void* v;
  sage_dtype dtype;  // fp16 or bf16
  sage_strides q_strides, k_strides, v_strides;
  float scale;  // softmax scale (for the LSE correction)
  RowSight sight;  // the mask, for the rows an Inf/NaN input poisons
  // A packed batch: causal aligned bottom-right (each sequence's RowSight is made on the device
  // from its own lengths).
  bool bottom_right = false;
};

// Runs every pre-pass kernel on `stream` (device `device`, the current one), writing the
// workspace laid out by `plan`.
cudaError_t run_prepass(const PrepassPlan& plan, const PrepassInputs& in, uint8_t* workspace,
                        int device, cudaStream_t stream);

// The largest thread-block cluster (8, or 0: none) with which K/V's one-launch pre-pass
// (PrepassPlan::kv_cluster) can be resident on device `device` (sm_90+; queried once a device).
int max_kv_cluster(int device);

// The CTAs of the staged quant_kv (PrepassPlan::kv_grid, head dim 64) one SM of device `device`
// holds at once, 0 where none fits (queried once a device).
int staged_quant_kv_ctas(int device);

}  // namespace sage::quant
