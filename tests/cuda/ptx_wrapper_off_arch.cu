// A kernel that calls sm_90 / sm_90a wrappers without guarding its body: compiled for an
// architecture without the instruction (tests/CMakeLists.txt: sm_89), the build must stop with
// SAGE_PTX_REQUIRE's message (ptx/arch.cuh) instead of compiling the wrappers to nothing. For
// sm_90a it compiles. Which wrapper is called is chosen by -DSAGE_TEST_WRAPPER=n.
#include <cstdint>

#include "ptx/atomic.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"

#ifndef SAGE_TEST_WRAPPER
#define SAGE_TEST_WRAPPER 0
#endif

__global__ void unguarded(float* out, uint64_t desc) {
  float d[32] = {};
  const uint32_t a[4] = {1, 2, 3, 4};
#if SAGE_TEST_WRAPPER == 0
  sage::ptx::wgmma_fence();
  sage::ptx::wgmma_m64n64k32_e4m3(d, a, desc, true);
  sage::ptx::wgmma_commit();
  sage::ptx::wgmma_wait<0>();
#elif SAGE_TEST_WRAPPER == 1
  sage::ptx::fence_proxy_async_smem();
#elif SAGE_TEST_WRAPPER == 2
  sage::ptx::bulk_commit();
#endif
  out[threadIdx.x] = d[threadIdx.x % 32] + float(a[0]);
}
