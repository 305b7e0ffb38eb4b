// Host entry of SageBwd's kernels: one launcher per head dim (backward_d*.cu).
#pragma once

#include <cuda_runtime.h>

#include "bwd/params.h"

namespace sage::bwd {

template <int D>
cudaError_t run(const Params& p, bool bf16, int device, cudaStream_t stream);
extern template cudaError_t run<64>(const Params&, bool, int, cudaStream_t);
extern template cudaError_t run<128>(const Params&, bool, int, cudaStream_t);

}  // namespace sage::bwd
