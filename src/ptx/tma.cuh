// mbarrier and TMA (cp.async.bulk.tensor) wrappers, sm_90a. A full barrier completes when the
// TMA bytes it expects have landed; an empty barrier when every consumer warp has arrived.
// The TMA and fence wrappers are templates that a device pass below sm_90 may not instantiate
// (ptx/arch.cuh); the mbarrier ones need no guard: ptxas itself rejects an instruction the
// target lacks (expect_tx and try_wait below sm_90).
#pragma once

#include <cstdint>

#include "ptx/arch.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define SAGE_PTX_HAS_TMA 1
#endif

namespace sage::ptx {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}
// Makes the barrier inits visible to the async (TMA) proxy.
template <int kInst = 0>
__device__ __forceinline__ void fence_barrier_init() {
#ifdef SAGE_PTX_HAS_TMA
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#elif defined(__CUDA_ARCH__)
  SAGE_PTX_REQUIRE(kInst, "fence.mbarrier_init (sm_90)");
#endif
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// Blocks until the barrier's phase with this parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// cp.async.bulk.tensor.3d: the box at coordinates (c0 innermost, c1, c2) of the tensor map into
// shared memory, completing `bar`'s transaction bytes.
template <int kInst = 0>
__device__ __forceinline__ void tma_load_3d(void* smem_dst, const void* tensor_map, uint64_t* bar,
                                            int c0, int c1, int c2) {
#ifdef SAGE_PTX_HAS_TMA
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(smem_u32(smem_dst)),
      "l"(tensor_map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar))
      : "memory");
#elif defined(__CUDA_ARCH__)
  SAGE_PTX_REQUIRE(kInst, "cp.async.bulk.tensor (sm_90)");
#endif
}

// cp.async.bulk.tensor.4d: as tma_load_3d with four coordinates.
template <int kInst = 0>
__device__ __forceinline__ void tma_load_4d(void* smem_dst, const void* tensor_map, uint64_t* bar,
                                            int c0, int c1, int c2, int c3) {
#ifdef SAGE_PTX_HAS_TMA
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];" ::"r"(smem_u32(smem_dst)),
      "l"(tensor_map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(bar))
      : "memory");
#elif defined(__CUDA_ARCH__)
  SAGE_PTX_REQUIRE(kInst, "cp.async.bulk.tensor (sm_90)");
#endif
}

// cp.async.bulk (1-D): `bytes` (a multiple of 16, both addresses 16-byte aligned) from global
// memory into shared memory, completing `bar`'s transaction bytes.
template <int kInst = 0>
__device__ __forceinline__ void bulk_load(void* smem_dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
#ifdef SAGE_PTX_HAS_TMA
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_u32(smem_dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
#elif defined(__CUDA_ARCH__)
  SAGE_PTX_REQUIRE(kInst, "cp.async.bulk (sm_90)");
#endif
}

// Orders this thread's generic-proxy writes to shared memory before later async-proxy reads
// (wgmma operands, TMA stores) that another thread starts after synchronizing with this one.
template <int kInst = 0>
__device__ __forceinline__ void fence_proxy_async_smem() {
#ifdef SAGE_PTX_HAS_TMA
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#elif defined(__CUDA_ARCH__)
  SAGE_PTX_REQUIRE(kInst, "fence.proxy.async (sm_90)");
#endif
}

}  // namespace sage::ptx
