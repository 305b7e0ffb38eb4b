// Host entry of the mma.sync attention kernels: one launcher per head dim (attention_d*.cu). The
// plan (src/api) has chosen everything; the launcher picks the instantiation it names.
#pragma once

#include <cuda_runtime.h>

#include "attn/mma/params.h"

namespace sage::mma {

struct LaunchConfig {
  int bits = 8;            // Q·K: INT8 or INT4
  bool bf16 = false;       // output dtype: bf16, else fp16
  bool causal = false;
  bool two_level = true;   // P·V in a fresh accumulator per key block, then fp32
  bool smooth_q = false;   // Q smoothing: ΔS added to the scores
  int device = 0;          // the current device
  bool padded = false;     // head_dim < D (zero-padded): ΔS reads only the caller's channels
};

template <int D>
cudaError_t launch_attention(const AttnParams& p, const LaunchConfig& c, cudaStream_t stream);
extern template cudaError_t launch_attention<64>(const AttnParams&, const LaunchConfig&,
                                                 cudaStream_t);
extern template cudaError_t launch_attention<128>(const AttnParams&, const LaunchConfig&,
                                                  cudaStream_t);
extern template cudaError_t launch_attention<256>(const AttnParams&, const LaunchConfig&,
                                                  cudaStream_t);

}  // namespace sage::mma
