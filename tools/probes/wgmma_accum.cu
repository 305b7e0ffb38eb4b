// Probe: how many bits does the fp32 accumulator of wgmma with E4M3 operands keep (sm_90a)?
// One warpgroup runs wgmma.m64n64k32.f32.e4m3.e4m3 with every A byte = a and every byte of a
// 128-byte-swizzled B tile = b (so the swizzle does not matter), starting from D = c = 2^m, and
// adds `steps` times the same product P = 32·a·b into it. An accumulator that keeps M mantissa
// bits keeps P while P >= one unit of the last place of c (2^(m-M)) — truncating — or P >= half a
// unit when it rounds; fp32 (M = 23) keeps P = 2^-7 up to m = 16. Three ways of chaining: steps
// issued back to back in one commit group (as the attention kernel's k-steps), one group per step
// with a wait between, and a fresh accumulator per step added into c by an fp32 FADD (two-level).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>

#include "ptx/wgmma.cuh"

namespace {

// mode 0: all steps in one group; 1: wait after each step; 2: fresh accumulator per step + FADD.
__global__ void __launch_bounds__(128)
    probe_kernel(uint8_t a_code, uint8_t b_code, float c0, int steps, int mode, float* out,
                 bool single = false) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __shared__ __align__(1024) uint8_t tile[64 * 128];
  // single: only byte k = 0 of each B row (logical column 0 of the K-major tile) holds b, so a
  // step adds one product a·b; the 128-byte swizzle puts that byte at chunk (row % 8).
  for (int i = threadIdx.x; i < 64 * 128; i += 128) {
    const int row = i / 128, byte = i % 128;
    tile[i] = !single ? b_code : (byte == ((row % 8) * 16) ? b_code : uint8_t(0));
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic writes -> wgmma reads
  __syncthreads();
  const uint32_t a4 = uint32_t(a_code) * 0x01010101u;
  const uint32_t a[4] = {a4, a4, a4, a4};
  const uint64_t desc = sage::ptx::wgmma_desc<128>(tile);
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = c0;
  // `n` wgmmas into acc in one commit group, then wait for them.
  auto group = [&](float(&acc)[32], int n) {
    sage::ptx::wgmma_fence_regs(acc);
    sage::ptx::wgmma_fence();
    for (int s = 0; s < n; ++s) sage::ptx::wgmma_m64n64k32_e4m3(acc, a, desc, true);
    sage::ptx::wgmma_commit();
    sage::ptx::wgmma_wait<0>();
    sage::ptx::wgmma_fence_regs(acc);
  };
  if (mode == 0) {
    group(d, steps);
  } else {
    for (int s = 0; s < steps; ++s) {
      if (mode == 1) {
        group(d, 1);
      } else {
        float r[32];
        for (int i = 0; i < 32; ++i) r[i] = 0.0f;
        group(r, 1);
        for (int i = 0; i < 32; ++i) d[i] += r[i];
      }
    }
  }
  // Every element should be equal; report thread 0's first and flag any disagreement.
  float mismatch = 0.0f;
  for (int i = 1; i < 32; ++i) mismatch += d[i] != d[0] ? 1.0f : 0.0f;
  if (threadIdx.x == 0) out[0] = d[0];
  if (mismatch > 0.0f) out[1] = 1.0f;
#endif
}

// E4M3 code of 2^e for e in [-9, 8] (subnormals below 2^-6).
uint8_t e4m3_pow2(int e) {
  if (e >= -6) return uint8_t((e + 7) << 3);
  return uint8_t(1 << (e + 9));  // subnormal: mantissa bit (e + 9) of 2^-9 units
}

}  // namespace

int main(int argc, char** argv) {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess ||
      major * 10 + minor != 90) {
    std::printf("wgmma_accum: needs an sm_90 GPU\n");
    return 0;
  }
  FILE* json = argc > 1 ? std::fopen(argv[1], "w") : nullptr;
  float* out = nullptr;
  cudaMalloc(&out, 2 * sizeof(float));
  // P = 32 · 2^-6 · 2^-6 = 2^-7 per step; c = 2^m.
  const uint8_t a = e4m3_pow2(-6), b = e4m3_pow2(-6);
  const double p = 32.0 * std::ldexp(1.0, -12);
  const char* modes[3] = {"one group", "wait each step", "fresh accumulator + fp32 add"};
  if (json) std::fprintf(json, "{\"product\": %.10g, \"rows\": [\n", p);
  bool first = true;
  for (int mode = 0; mode < 3; ++mode) {
    std::printf("%s: steps of P = 2^-7 added to c = 2^m; kept = (D - c) / (steps·P)\n",
                modes[mode]);
    for (int steps : {4, 16}) {
      std::printf("  steps %2d  m:", steps);
      for (int m = 0; m <= 20; ++m) {
        const float c0 = std::ldexp(1.0f, m);
        float h[2] = {0.0f, 0.0f};
        cudaMemcpy(out, h, sizeof(h), cudaMemcpyHostToDevice);
        probe_kernel<<<1, 128>>>(a, b, c0, steps, mode, out);
        if (cudaMemcpy(h, out, sizeof(h), cudaMemcpyDeviceToHost) != cudaSuccess) {
          std::printf(" launch failed\n");
          return 1;
        }
        const double kept = (double(h[0]) - double(c0)) / (steps * p);
        std::printf(" %d:%.3g%s", m, kept, h[1] != 0.0f ? "!" : "");
        if (json)
          std::fprintf(
              json,
              "%s  {\"mode\": \"%s\", \"steps\": %d, \"m\": %d, \"d\": %.10g, \"kept\": %.6g}",
              first ? "" : ",\n", modes[mode], steps, m, double(h[0]), kept);
        first = false;
      }
      std::printf("\n");
    }
  }
  // The window: one product 2^e (a = 2^-6, b = 2^(e+6)) added to c = 1 four times; kept while
  // the product is on the grid of c's leading bit minus the window (13 bits: down to 2^-13).
  std::printf("window: one product 2^e added to c = 1 (4 steps, one group); kept =");
  for (int e = -10; e >= -15; --e) {
    float h[2] = {0.0f, 0.0f};
    cudaMemcpy(out, h, sizeof(h), cudaMemcpyHostToDevice);
    probe_kernel<<<1, 128>>>(a, e4m3_pow2(e + 6), 1.0f, 4, 0, out, true);
    cudaMemcpy(h, out, sizeof(h), cudaMemcpyDeviceToHost);
    const double kept = (double(h[0]) - 1.0) / (4 * std::ldexp(1.0, e));
    std::printf(" 2^%d:%.3g%s", e, kept, h[1] != 0.0f ? "!" : "");
    if (json)
      std::fprintf(json, ",\n  {\"mode\": \"window\", \"e\": %d, \"d\": %.10g, \"kept\": %.6g}", e,
                   double(h[0]), kept);
  }
  std::printf("\n");
  if (json) {
    std::fprintf(json, "\n]}\n");
    std::fclose(json);
  }
  std::printf("(fp32: kept = 1 up to m = 16; a 13-bit truncating accumulator: up to m = 6)\n");
  cudaFree(out);
  return 0;
}
