// Named barriers (bar.sync / bar.arrive) and the SM clock, for warp-specialized kernels.
#pragma once

#include <cstdint>

namespace sage::ptx {

// bar.sync id, threads: wait until `threads` threads (a multiple of 32) have arrived at barrier
// `id` (0 is __syncthreads').
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// A turn between two groups of 128 threads, threads 128..255 (group 0) and 256..383 (group 1):
// group g waits on barrier kBase + g and signals the other group's, each barrier counting 256.
// The barrier id is computed from %tid.x inside the asm each time: a kernel that kept it in a
// register across its main loop had ptxas spill it.
template <int kBase>
__device__ __forceinline__ void turn_wait() {
  asm volatile(
      "{\n.reg .u32 t;\nmov.u32 t, %%tid.x;\nshr.u32 t, t, 8;\nadd.u32 t, t, %0;\n"
      "bar.sync t, 256;\n}" ::"n"(kBase)
      : "memory");
}
template <int kBase>
__device__ __forceinline__ void turn_pass() {
  asm volatile(
      "{\n.reg .u32 t;\nmov.u32 t, %%tid.x;\nshr.u32 t, t, 8;\nsub.u32 t, %0, t;\n"
      "bar.arrive t, 256;\n}" ::"n"(kBase + 1)
      : "memory");
}

// The SM's 32-bit cycle counter (%clock), ordered with the surrounding memory operations.
__device__ __forceinline__ uint32_t sm_clock() {
  uint32_t c;
  asm volatile("mov.u32 %0, %%clock;" : "=r"(c)::"memory");
  return c;
}

}  // namespace sage::ptx
