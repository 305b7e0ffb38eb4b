// SageBwd's kernels for head dim 64 (sm_80+; built for the architectures in SAGE_CUDA_ARCHS).
#include "bwd/fn/launch.cuh"
#include "bwd/launch.cuh"

namespace sage::bwd {
template cudaError_t run<64>(const Params&, bool, bool, int, cudaStream_t);
template cudaError_t fn::run<64>(const fn::Params&, bool, int, cudaStream_t);
}  // namespace sage::bwd
