// Named barriers (bar.sync / bar.arrive) and the SM clock, for warp-specialized kernels; the
// acquire load (gpu scope) through which a CTA waits on a flag another CTA of the grid sets.
#pragma once

#include <cstdint>

namespace sage::ptx {

// bar.sync id, threads: wait until `threads` threads (a multiple of 32) have arrived at barrier
// `id` (0 is __syncthreads').
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// A turn passed around kGroups groups of 128 threads (threads 128·(g+1) .. 128·(g+2) - 1 form
// group g: the warpgroups after the first): group g waits on barrier kBase + g and passes the turn
// by arriving on the next group's, kBase + (g + 1) % kGroups; each barrier counts 256 (the waiter
// and the passer). The barrier id is computed from %tid.x inside the asm each time: a kernel
// that kept it in a register across its main loop had ptxas spill it.
template <int kBase, int kGroups = 2>
__device__ __forceinline__ void turn_wait() {
  static_assert(kGroups == 2 || kGroups == 3, "two or three groups");
  if constexpr (kGroups == 2) {  // tid >> 8: 0 for threads 128..255, 1 for 256..383
    asm volatile(
        "{\n.reg .u32 t;\nmov.u32 t, %%tid.x;\nshr.u32 t, t, 8;\nadd.u32 t, t, %0;\n"
        "bar.sync t, 256;\n}" ::"n"(kBase)
        : "memory");
  } else {  // (tid >> 7) - 1 = g
    asm volatile(
        "{\n.reg .u32 t;\nmov.u32 t, %%tid.x;\nshr.u32 t, t, 7;\nadd.u32 t, t, %0;\n"
        "bar.sync t, 256;\n}" ::"n"(kBase - 1)
        : "memory");
  }
}
template <int kBase, int kGroups = 2>
__device__ __forceinline__ void turn_pass() {
  if constexpr (kGroups == 2) {  // the other group's: kBase + 1 - g
    asm volatile(
        "{\n.reg .u32 t;\nmov.u32 t, %%tid.x;\nshr.u32 t, t, 8;\nsub.u32 t, %0, t;\n"
        "bar.arrive t, 256;\n}" ::"n"(kBase + 1)
        : "memory");
  } else {  // (g + 1) % 3 = (tid >> 7) % 3 for tid >> 7 = g + 1 in 1..3
    asm volatile(
        "{\n.reg .u32 t;\n.reg .pred q;\nmov.u32 t, %%tid.x;\nshr.u32 t, t, 7;\n"
        "setp.eq.u32 q, t, 3;\nselp.u32 t, 0, t, q;\nadd.u32 t, t, %0;\n"
        "bar.arrive t, 256;\n}" ::"n"(kBase)
        : "memory");
  }
}

// barrier.cluster.arrive.release + barrier.cluster.wait.acquire (sm_90+): every thread of the
// thread-block cluster waits for all of them; memory written before the barrier by any thread of
// the cluster (global included) is visible after it to every other. Traps below sm_90, where
// nothing launches a cluster.
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
  __trap();
#endif
}

// ld.acquire.gpu.b32 (sm_70+): a load of a flag another CTA of the grid sets with a release (or a
// fence and then an atomic); once it reads that value, what the setter wrote before is visible to
// this thread and, after a barrier, to its CTA.
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  asm volatile("ld.acquire.gpu.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#else
  __trap();
#endif
  return v;
}

// The SM's 32-bit cycle counter (%clock), ordered with the surrounding memory operations.
__device__ __forceinline__ uint32_t sm_clock() {
  uint32_t c;
  asm volatile("mov.u32 %0, %%clock;" : "=r"(c)::"memory");
  return c;
}

}  // namespace sage::ptx
