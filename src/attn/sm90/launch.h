// Host entry of the Hopper (sm_90a) SageAttn2-8b kernel: one launcher per head dim (64, 128, 256)
// (attention_d*.cu). The plan (src/api) has chosen everything; the launcher builds the TMA
// descriptors and launches the instantiation it names.
#pragma once

#include <cuda_runtime.h>

#include "attn/sm90/params.h"

namespace sage::sm90 {

struct LaunchConfig {
  int consumers = 2;  // consumer warpgroups (2, or 3 at D = 64 with fused Q): tiles of 64·consumers rows
  bool bf16 = false;  // output (and fused Q's input) dtype: bf16, else fp16
  bool causal = false;
  int device = 0;     // the current device and its SM count (the persistent grid's size)
  int sms = 1;
};

template <int D>
cudaError_t launch_attention(const Params& p, const LaunchConfig& cfg, cudaStream_t stream);
extern template cudaError_t launch_attention<64>(const Params&, const LaunchConfig&, cudaStream_t);
extern template cudaError_t launch_attention<128>(const Params&, const LaunchConfig&, cudaStream_t);
extern template cudaError_t launch_attention<256>(const Params&, const LaunchConfig&, cudaStream_t);

}  // namespace sage::sm90
