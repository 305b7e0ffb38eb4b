// Probe: does issuing wgmma block the issuing warp (sm_90a)? The attention kernel's schedule
// depends on it: an async GEMM overlaps the issuing warpgroup's own softmax only if issuing it
// returns before the tensor cores have done the work. One or two warpgroups per CTA, one CTA per
// SM; each warpgroup issues a sequence of m64n128k32 wgmmas (the kernel's shapes: s8·s8 with A
// and B from shared memory = "SS", as Q·Kᵀ; e4m3 with A from registers = "RS", as P̃·V), one
// commit group, then waits for it. Cycles from clock64 in lane 0 of each warpgroup: issue (the
// first wgmma.fence to after the commit) and total (to after the wait), averaged over 16 rounds
// after 4 warm-up rounds. Operands are zeros: the tensor cores' time does not depend on them.
#include <cuda_runtime.h>

#include <cstdio>

#include "probe_util.h"
#include "ptx/wgmma.cuh"

namespace {

// Sequences: 0 = 4 SS; 1 = 4 RS; 2 = 4 SS then 4 RS (the kernel's step); 3 = 4 RS then 4 SS;
// 4 = 8 SS; 5 = 16 SS.
constexpr int kSeqs = 6;
const char* kSeqNames[kSeqs] = {"4 SS (Q.K^T)", "4 RS (P.V)", "4 SS + 4 RS", "4 RS + 4 SS",
                                "8 SS", "16 SS"};

template <int kSeq>
__global__ void __launch_bounds__(256, 1) issue_kernel(long long* out) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // Here, not at namespace scope: the passes that compile this body out would warn of them unused.
  constexpr int kRounds = 20, kWarm = 4;
  __shared__ __align__(1024) uint8_t tiles[3 * 16384];  // A 8 KB, B 16 KB, Vᵀ 16 KB
  for (int i = threadIdx.x; i < int(sizeof tiles); i += blockDim.x) tiles[i] = 0;
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const uint64_t a_desc = sage::ptx::wgmma_desc<128>(tiles);
  const uint64_t b_desc = sage::ptx::wgmma_desc<128>(tiles + 16384);
  const uint64_t v_desc = sage::ptx::wgmma_desc<128>(tiles + 32768);
  int s[64];
  float o[64];
  for (int i = 0; i < 64; ++i) s[i] = 0, o[i] = 0.0f;
  const uint32_t a[4] = {0u, 0u, 0u, 0u};
  auto ss = [&](int n) {
    for (int k = 0; k < n; ++k)
      sage::ptx::wgmma_m64n128k32_s8_ss(s, a_desc + uint64_t(k * 2), b_desc + uint64_t(k * 2),
                                        true);
  };
  auto rs = [&](int n) {
    for (int k = 0; k < n; ++k)
      sage::ptx::wgmma_m64n128k32_e4m3(o, a, v_desc + uint64_t(k * 2), true);
  };
  long long issue = 0, total = 0;
  for (int r = 0; r < kRounds; ++r) {
    __syncthreads();
    const long long t0 = clock64();
    sage::ptx::wgmma_fence_regs(s);
    sage::ptx::wgmma_fence_regs(o);
    sage::ptx::wgmma_fence();
    if constexpr (kSeq == 0) ss(4);
    if constexpr (kSeq == 1) rs(4);
    if constexpr (kSeq == 2) ss(4), rs(4);
    if constexpr (kSeq == 3) rs(4), ss(4);
    if constexpr (kSeq == 4) ss(8);
    if constexpr (kSeq == 5) ss(16);
    sage::ptx::wgmma_commit();
    const long long t1 = clock64();
    sage::ptx::wgmma_wait<0>();
    sage::ptx::wgmma_fence_regs(s);
    sage::ptx::wgmma_fence_regs(o);
    const long long t2 = clock64();
    if (r >= kWarm) issue += t1 - t0, total += t2 - t0;
  }
  int sink = 0;
  for (int i = 0; i < 64; ++i) sink += s[i] + int(o[i]);
  if (threadIdx.x % 128 == 0) {
    const int wg = threadIdx.x / 128;
    out[(blockIdx.x * 2 + wg) * 2 + 0] = issue / (kRounds - kWarm) + (sink == 12345 ? 1 : 0);
    out[(blockIdx.x * 2 + wg) * 2 + 1] = total / (kRounds - kWarm);
  }
#else
  (void)out;
#endif
}

template <int kSeq>
void run(int sms, long long* d_out, long long* h_out) {
  for (int wgs = 1; wgs <= 2; ++wgs) {
    CUDA_OK(cudaMemset(d_out, 0, sizeof(long long) * sms * 4));
    issue_kernel<kSeq><<<sms, 128 * wgs>>>(d_out);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(h_out, d_out, sizeof(long long) * sms * 4, cudaMemcpyDeviceToHost));
    double issue = 0, total = 0;
    for (int b = 0; b < sms; ++b)
      for (int w = 0; w < wgs; ++w) issue += double(h_out[(b * 2 + w) * 2]), total += double(h_out[(b * 2 + w) * 2 + 1]);
    std::printf("%-14s %d warpgroup(s)/SM: issue %6.0f cycles, issue+wait %6.0f cycles\n",
                kSeqNames[kSeq], wgs, issue / (sms * wgs), total / (sms * wgs));
  }
}

}  // namespace

int main() {
  int sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  long long *d_out = nullptr, *h_out = new long long[size_t(sms) * 4];
  CUDA_OK(cudaMalloc(&d_out, sizeof(long long) * sms * 4));
  std::printf("m64n128k32 wgmma issue vs completion, cycles per warpgroup (mean of %d SMs)\n", sms);
  run<0>(sms, d_out, h_out);
  run<1>(sms, d_out, h_out);
  run<2>(sms, d_out, h_out);
  run<3>(sms, d_out, h_out);
  run<4>(sms, d_out, h_out);
  run<5>(sms, d_out, h_out);
  CUDA_OK(cudaFree(d_out));
  delete[] h_out;
  return 0;
}
