// Reductions into global memory: the bulk (copy-engine) reduction of a shared-memory range
// into global memory, with its group fences (sm_90+: templates that a device pass below sm_90
// may not instantiate, ptx/arch.cuh).
#pragma once

#include <cstdint>

#include "ptx/arch.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define SAGE_PTX_HAS_BULK_ASYNC 1
#endif

namespace sage::ptx {

// cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 (sm_90+): dst[i] += src[i] for
// bytes / 4 floats (bytes a multiple of 16, both 16-byte aligned), by the copy engine. The
// writes to src must be made visible to the async proxy first (fence_proxy_async_smem).
template <int kInst = 0>
__device__ __forceinline__ void bulk_reduce_add(float* dst, const void* src, uint32_t bytes) {
#ifdef SAGE_PTX_HAS_BULK_ASYNC
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(src));
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst),
      "r"(s), "r"(bytes)
      : "memory");
#elif defined(__CUDA_ARCH__)
  SAGE_PTX_REQUIRE(kInst, "cp.reduce.async.bulk (sm_90)");
#endif
}
// cp.async.bulk.commit_group (sm_90+): closes this thread's group of bulk operations.
template <int kInst = 0>
__device__ __forceinline__ void bulk_commit() {
#ifdef SAGE_PTX_HAS_BULK_ASYNC
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#elif defined(__CUDA_ARCH__)
  SAGE_PTX_REQUIRE(kInst, "cp.async.bulk.commit_group (sm_90)");
#endif
}
// cp.async.bulk.wait_group.read N (sm_90+): this thread's older groups have read their source.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
#ifdef SAGE_PTX_HAS_BULK_ASYNC
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
#elif defined(__CUDA_ARCH__)
  SAGE_PTX_REQUIRE(N, "cp.async.bulk.wait_group.read (sm_90)");
#endif
}
// cp.async.bulk.wait_group N (sm_90+): this thread's older groups are complete.
template <int N>
__device__ __forceinline__ void bulk_wait() {
#ifdef SAGE_PTX_HAS_BULK_ASYNC
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
#elif defined(__CUDA_ARCH__)
  SAGE_PTX_REQUIRE(N, "cp.async.bulk.wait_group (sm_90)");
#endif
}

}  // namespace sage::ptx
