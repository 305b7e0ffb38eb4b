// Asynchronous global->shared copies (cp.async, sm_80+) and their group fences; the wait of a
// programmatic dependent launch (sm_90+).
#pragma once

#include <cstdint>

namespace sage::ptx {

// cp.async.cg.shared.global [dst], [src], 16 (sm_80+): 16 bytes, cached in L2 only.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem_src));
}
// cp.async.ca.shared.global [dst], [src], 4 (sm_80+): one 4-byte word.
__device__ __forceinline__ void cp_async_4(void* smem_dst, const void* gmem_src) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(gmem_src));
}
// cp.async.commit_group (sm_80+).
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;");
}
// cp.async.wait_group N (sm_80+): wait until at most N committed groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// griddepcontrol.wait (sm_90+): wait until the grids this one depends on (programmatic dependent
// launch) have completed and their memory is visible; returns at once in a grid launched without
// the attribute. Compiles to nothing below sm_90.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// griddepcontrol.launch_dependents (sm_90+): lets the grid launched after this one as a
// programmatic dependent be scheduled now (it still waits in grid_dependency_wait for this
// grid's completion). Compiles to nothing below sm_90.
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace sage::ptx
