// tools/nvcc_guard's own test (tests/CMakeLists.txt): with -DSAGE_TEST_SERIALIZED=1 the loop reads
// a wgmma's accumulator while the wgmma is in flight, which makes ptxas serialize every wgmma of
// the kernel and say so only as information (C7514); the guard must fail that compile. With 0
// the same loop waits first, and the compile must pass.
#include <cstdint>

#include "ptx/wgmma.cuh"

#ifndef SAGE_TEST_SERIALIZED
#define SAGE_TEST_SERIALIZED 0
#endif

__global__ void loop(int* out, uint64_t a_desc, uint64_t b_desc, int n) {
  int s[64];
  for (int i = 0; i < 64; ++i) s[i] = 0;
  for (int it = 0; it < n; ++it) {
    sage::ptx::wgmma_fence();
    sage::ptx::wgmma_m64n128k32_s8_ss(s, a_desc, b_desc, true);
    sage::ptx::wgmma_commit();
#if SAGE_TEST_SERIALIZED
    for (int i = 0; i < 64; ++i) s[i] += it;  // the accumulator, read in flight
    sage::ptx::wgmma_wait<0>();
#else
    sage::ptx::wgmma_wait<0>();
    for (int i = 0; i < 64; ++i) s[i] += it;
#endif
  }
  for (int i = 0; i < 64; ++i) out[threadIdx.x * 64 + i] = s[i];
}
