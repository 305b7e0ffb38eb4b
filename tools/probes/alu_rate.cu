// Probe: issue rates, per SM per clock, of the instructions the softmax of an attention block is
// made of (int32 -> fp32 conversion, 2^x, f32 pairs -> packed E4M3, fp32 FMA, the add-a-magic
// int -> fp32 conversion, 2^x on f16x2). The softmax costs as much as the two GEMMs of a block on
// Hopper only if these rates are as low as the guide's "special functions" class, so the kernel's
// design follows from them. One CTA of 1024 threads per SM, 8 independent chains per thread;
// cycles from clock64 inside each CTA; results per op kind as ops / SM / clock.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "ptx/cvt.cuh"
#include "ptx/math.cuh"
#include "probe_util.h"

namespace {

constexpr int kIters = 2048, kChains = 8;

enum Op { kI2F, kEx2, kCvtE4m3, kFfma, kMagicI2F, kEx2F16x2, kIadd, kOps };
const char* kNames[kOps] = {"i2f (cvt.rn.f32.s32)",   "ex2.approx.ftz.f32",
                            "cvt e4m3x2.f32 (+lop)",  "ffma",
                            "magic i2f (iadd+fadd)",  "ex2.approx.f16x2 (2 results)",
                            "iadd (lop-free baseline)"};
const int kResultsPerOp[kOps] = {1, 1, 1, 1, 1, 2, 1};

template <int kOp>
__global__ void rate_kernel(float seed, float* out, long long* cycles) {
  float f[kChains];
  for (int c = 0; c < kChains; ++c) f[c] = seed + threadIdx.x * 1e-3f + c;
  __syncthreads();
  const long long t0 = clock64();
#pragma unroll 4
  for (int it = 0; it < kIters; ++it) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      if constexpr (kOp == kI2F) {
        f[c] = __int2float_rn(__float_as_int(f[c]));
      } else if constexpr (kOp == kEx2) {
        f[c] = sage::ptx::ex2(f[c]);
      } else if constexpr (kOp == kCvtE4m3) {
#ifdef SAGE_PTX_HAS_CVT_FP8
        const uint32_t r = sage::ptx::cvt_e4m3x2(f[c], f[c]);
        f[c] = __int_as_float(__float_as_int(f[c]) ^ r);
#endif
      } else if constexpr (kOp == kFfma) {
        f[c] = fmaf(f[c], 0.999f, 0.25f);
      } else if constexpr (kOp == kMagicI2F) {
        f[c] = __int_as_float(__float_as_int(f[c]) + 0x4B400000) - 12582912.0f;
      } else if constexpr (kOp == kEx2F16x2) {
        uint32_t h = __float_as_uint(f[c]), r;
        asm volatile("ex2.approx.f16x2 %0, %1;" : "=r"(r) : "r"(h));
        f[c] = __uint_as_float(r);
      } else {
        f[c] = __int_as_float(__float_as_int(f[c]) + 0x1234567);
      }
    }
  }
  const long long t1 = clock64();
  __syncthreads();
  float s = 0.0f;
  for (int c = 0; c < kChains; ++c) s += f[c];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

template <int kOp>
double measure(int sms, int threads, float* out, long long* cycles) {
  std::vector<long long> c(sms);
  double best = 0.0;
  for (int rep = 0; rep < 3; ++rep) {
    rate_kernel<kOp><<<sms, threads>>>(0.5f, out, cycles);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaMemcpy(c.data(), cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost));
    long long worst = 0;
    for (long long x : c) worst = x > worst ? x : worst;
    const double rate = double(threads) * kChains * kIters * kResultsPerOp[kOp] / double(worst);
    best = rate > best ? rate : best;
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  int sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int threads = 1024;
  float* out;
  long long* cycles;
  CUDA_OK(cudaMalloc(&out, sizeof(float) * sms * threads));
  CUDA_OK(cudaMalloc(&cycles, sizeof(long long) * sms));
  double rate[kOps];
  rate[kI2F] = measure<kI2F>(sms, threads, out, cycles);
  rate[kEx2] = measure<kEx2>(sms, threads, out, cycles);
  rate[kCvtE4m3] = measure<kCvtE4m3>(sms, threads, out, cycles);
  rate[kFfma] = measure<kFfma>(sms, threads, out, cycles);
  rate[kMagicI2F] = measure<kMagicI2F>(sms, threads, out, cycles);
  rate[kEx2F16x2] = measure<kEx2F16x2>(sms, threads, out, cycles);
  rate[kIadd] = measure<kIadd>(sms, threads, out, cycles);
  FILE* json = argc > 1 ? std::fopen(argv[1], "w") : nullptr;
  if (json) std::fprintf(json, "{\"results_per_sm_per_clock\": {");
  for (int op = 0; op < kOps; ++op) {
    std::printf("%-32s %7.1f results / SM / clock\n", kNames[op], rate[op]);
    if (json) std::fprintf(json, "%s\"%s\": %.2f", op ? ", " : "", kNames[op], rate[op]);
  }
  if (json) {
    std::fprintf(json, "}}\n");
    std::fclose(json);
  }
  return 0;
}
