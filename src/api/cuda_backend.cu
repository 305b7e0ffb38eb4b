// The CUDA backend: pointer classification, device description, and (from the GPU-kernel issue
// on) dispatch to the kernels. Until kernels exist every CUDA request is refused with a clear
// status, never an unwritten output. Host code compiled by nvcc; the kernels are sm_89 / sm_90a.
#include <cuda_runtime.h>

#include <cstdio>

#include "api/backend.h"
#include "common/error.h"

namespace sage::cuda {

PointerKind pointer_kind(const void* ptr) {
  if (!ptr) return PointerKind::kHost;
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: clear the sticky-free error, it is host memory
    return PointerKind::kHost;
  }
  return (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged)
             ? PointerKind::kDevice
             : PointerKind::kHost;
}

std::string describe_devices(bool* has_gpu) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  *has_gpu = false;
  if (err != cudaSuccess) {
    cudaGetLastError();
    return std::string("no GPU: ") + cudaGetErrorString(err);
  }
  if (count == 0) return "no GPU: no CUDA device is visible";
  std::string s;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    char line[256];
    std::snprintf(line, sizeof(line), "GPU %d: %s, sm_%d%d, %d SMs, %.1f GiB%s", i, prop.name,
                  prop.major, prop.minor, prop.multiProcessorCount,
                  double(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0),
                  i + 1 < count ? "\n" : "");
    s += line;
    *has_gpu = true;
  }
  return s;
}

sage_status workspace_size(const api::Resolved&, const sage_attention_args&, size_t*) {
  return set_error(SAGE_ERROR_UNSUPPORTED,
                   "backend = CUDA: this version of libsage has no GPU kernels yet (CPU reference "
                   "only); pass host pointers");
}

sage_status attention(const api::Resolved&, const sage_attention_args&) {
  return set_error(SAGE_ERROR_UNSUPPORTED,
                   "backend = CUDA: this version of libsage has no GPU kernels yet (CPU reference "
                   "only); pass host pointers");
}

}  // namespace sage::cuda
