// Instantiations of the mma.sync SageAttention2 kernel for head_dim 256 (sm_89, sm_90a, sm_120a).
#include "attn/mma/attention.cuh"

namespace sage::mma {
template cudaError_t launch_attention<256>(const AttnParams&, const LaunchConfig&, cudaStream_t);
}  // namespace sage::mma
