// Host entry of the mma.sync attention kernels: one launcher per head dim (attention_d*.cu).
#pragma once

#include <cuda_runtime.h>

#include "attn/mma/params.h"

namespace sage::mma {

template <int D>
cudaError_t launch_attention(const AttnParams& p, int bits, bool bf16_out, bool causal,
                             bool two_level, cudaStream_t stream);
extern template cudaError_t launch_attention<64>(const AttnParams&, int, bool, bool, bool,
                                                   cudaStream_t);
extern template cudaError_t launch_attention<128>(const AttnParams&, int, bool, bool, bool,
                                                   cudaStream_t);

}  // namespace sage::mma
