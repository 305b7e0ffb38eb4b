// Kernel launches with programmatic dependent launch (PDL, sm_90+; the attribute is ignored where
// the device does not support it): the launched grid may start while the previous kernel of the
// stream drains, and must therefore wait (ptx::grid_dependency_wait) before it reads anything that
// kernel wrote. Shared by the pre-pass (quant/prepass.cu) and the Hopper kernel (attn/sm90).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace sage {

struct LaunchShape {
  dim3 grid, block;
  size_t smem = 0;           // dynamic shared memory bytes
  bool programmatic = true;  // false: an ordinary stream-ordered launch
  unsigned cluster = 1;      // CTAs a thread-block cluster along x (sm_90+; 1: no cluster)
};

// The launch configuration of `shape` on `stream`: the programmatic-stream-serialization
// attribute, and the cluster dimension when shape.cluster > 1 (attr: storage for both).
inline cudaLaunchConfig_t launch_config(const LaunchShape& shape, cudaStream_t stream,
                                        cudaLaunchAttribute (&attr)[2]) {
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = shape.programmatic ? 1 : 0;
  attr[1].id = cudaLaunchAttributeClusterDimension;
  attr[1].val.clusterDim.x = shape.cluster;
  attr[1].val.clusterDim.y = 1;
  attr[1].val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = shape.grid;
  cfg.blockDim = shape.block;
  cfg.dynamicSmemBytes = shape.smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = shape.cluster > 1 ? 2 : 1;
  return cfg;
}

// kernel<<<shape.grid, shape.block, shape.smem, stream>>>(args...) as launch_config describes.
template <typename... Params, typename... Args>
cudaError_t launch_pdl(void (*kernel)(Params...), const LaunchShape& shape, cudaStream_t stream,
                       Args... args) {
  cudaLaunchAttribute attr[2];
  const cudaLaunchConfig_t cfg = launch_config(shape, stream, attr);
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...);
}

// cudaFuncSetAttribute(kKernel, MaxDynamicSharedMemorySize, bytes) once per device (the attribute
// belongs to the kernel in the device's context; setting it on every call cost host time).
template <auto kKernel>
cudaError_t set_max_dynamic_smem_once(int device, int bytes) {
  static std::atomic<uint64_t> done{0};  // bit d: set on device d (devices 0..63)
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t(1) << device : 0;
  if (bit && (done.load(std::memory_order_acquire) & bit)) return cudaSuccess;
  const cudaError_t e =
      cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess && bit) done.fetch_or(bit, std::memory_order_release);
  return e;
}

}  // namespace sage
