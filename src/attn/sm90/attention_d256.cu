// Hopper SageAttn2-8b kernel, head_dim 256 (sm_90a; other archs compile an empty body).
#include "attn/sm90/launch.cuh"

namespace sage::sm90 {
template cudaError_t launch_attention<256>(const Params&, const LaunchConfig&, cudaStream_t);
}  // namespace sage::sm90
