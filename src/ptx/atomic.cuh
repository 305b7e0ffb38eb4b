// Reductions into global memory: the bulk (copy-engine) reduction of a shared-memory range
// into global memory, with its group fences.
#pragma once

#include <cstdint>

namespace sage::ptx {

// cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 (sm_90+): dst[i] += src[i] for
// bytes / 4 floats (bytes a multiple of 16, both 16-byte aligned), by the copy engine. The
// writes to src must be made visible to the async proxy first (fence_proxy_async_smem).
__device__ __forceinline__ void bulk_reduce_add(float* dst, const void* src, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(src));
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst),
      "r"(s), "r"(bytes)
      : "memory");
#endif
}
// cp.async.bulk.commit_group (sm_90+): closes this thread's group of bulk operations.
__device__ __forceinline__ void bulk_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#endif
}
// cp.async.bulk.wait_group.read N (sm_90+): this thread's older groups have read their source.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
#endif
}
// cp.async.bulk.wait_group N (sm_90+): this thread's older groups are complete.
template <int N>
__device__ __forceinline__ void bulk_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
#endif
}

}  // namespace sage::ptx
