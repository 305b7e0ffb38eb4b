// Host entry of the Hopper (sm_90a) SageAttn2-8b kernel: one launcher per head dim.
#pragma once

#include <cuda_runtime.h>

#include "attn/mma/params.h"

namespace sage::sm90 {

// True when this kernel takes the plan: 8-bit Q·K, no Q smoothing (ΔS stays on mma.sync).
inline bool supports(const mma::Plan& plan) {
  return plan.bits == 8 && !plan.smooth_q && (plan.head_dim == 64 || plan.head_dim == 128);
}

template <int D>
cudaError_t launch_attention(const mma::AttnParams& p, bool bf16_out, bool causal,
                             cudaStream_t stream);
extern template cudaError_t launch_attention<64>(const mma::AttnParams&, bool, bool, cudaStream_t);
extern template cudaError_t launch_attention<128>(const mma::AttnParams&, bool, bool, cudaStream_t);

}  // namespace sage::sm90
