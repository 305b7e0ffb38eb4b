// Host entry of SageBwd's kernels: one launcher per head dim (backward_d*.cu); sm90 picks the
// wgmma main kernel (sm_90a) over the mma.sync one. fn::run: the forward-normalized 16-bit
// backward.
#pragma once

#include <cuda_runtime.h>

#include "bwd/fn/params.h"
#include "bwd/params.h"

namespace sage::bwd {

template <int D>
cudaError_t run(const Params& p, bool bf16, bool sm90, int device, cudaStream_t stream);
extern template cudaError_t run<64>(const Params&, bool, bool, int, cudaStream_t);
extern template cudaError_t run<128>(const Params&, bool, bool, int, cudaStream_t);

namespace fn {
// The forward-normalized 16-bit backward (bwd/fn): rows, main kernel, dQ store.
template <int D>
cudaError_t run(const Params& p, bool bf16, int device, cudaStream_t stream);
extern template cudaError_t run<64>(const Params&, bool, int, cudaStream_t);
extern template cudaError_t run<128>(const Params&, bool, int, cudaStream_t);
}  // namespace fn

}  // namespace sage::bwd
