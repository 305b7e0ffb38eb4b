// Opt-in phase trace of the Hopper kernel (a development build: -DSAGE_SM90_TRACE; otherwise
// every function here is empty). Lane 0 of every consumer warp of the first kTraceCtas CTAs writes
// the SM clock at seven points of each of its first kTraceBlocks key blocks (block events) and of
// its first kTraceTiles tiles (tile events) into a buffer the launcher allocates; the launcher
// prints per-phase means on the third launch of each (D, mask, Nk), caches and clocks warm. The
// stores perturb the schedule by a few per cent.
#pragma once

#include <cstdint>
#include <cstdio>

#include "ptx/barrier.cuh"

#ifdef SAGE_SM90_TRACE
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <tuple>
#endif

namespace sage::sm90 {

#ifdef SAGE_SM90_TRACE
constexpr int kTraceCtas = 4, kTraceBlocks = 48, kTraceEvents = 7;
// Tile events: loop top, tile read, Q ready, block 0 done, loop done, last P·V landed, epilogue
// done. The buffer holds the block events first, then the tile events.
constexpr int kTraceTiles = 16, kTileEvents = 7;
constexpr int kTraceWarps = 12;  // consumer warps of up to three warpgroups
constexpr int kTraceWords =
    kTraceCtas * kTraceWarps * (kTraceBlocks * kTraceEvents + kTraceTiles * kTileEvents);
#endif

// Block event ev (0..6) of key block kb.
__device__ __forceinline__ void trace_event(uint32_t* trace, int kb, int ev) {
#ifdef SAGE_SM90_TRACE
  if (blockIdx.x < kTraceCtas && threadIdx.x % 32 == 0 && kb < kTraceBlocks) {
    const int w = blockIdx.x * kTraceWarps + threadIdx.x / 32 - 4;
    trace[(w * kTraceBlocks + kb) * kTraceEvents + ev] = ptx::sm_clock();
  }
#else
  (void)trace, (void)kb, (void)ev;
#endif
}

// Tile event ev (0..6) of this CTA's tile number it.
__device__ __forceinline__ void tile_event(uint32_t* trace, int it, int ev) {
#ifdef SAGE_SM90_TRACE
  if (blockIdx.x < kTraceCtas && threadIdx.x % 32 == 0 && it < kTraceTiles) {
    const int w = blockIdx.x * kTraceWarps + threadIdx.x / 32 - 4;
    trace[kTraceCtas * kTraceWarps * kTraceBlocks * kTraceEvents +
          (w * kTraceTiles + it) * kTileEvents + ev] = ptx::sm_clock();
  }
#else
  (void)trace, (void)it, (void)ev;
#endif
}

#ifdef SAGE_SM90_TRACE
// The trace buffer, zeroed before each launch.
inline uint32_t* trace_buffer() {
  static uint32_t* buf = [] {
    void* ptr = nullptr;
    return cudaMalloc(&ptr, kTraceWords * 4) == cudaSuccess ? static_cast<uint32_t*>(ptr) : nullptr;
  }();
  if (buf) cudaMemset(buf, 0, kTraceWords * 4);
  return buf;
}

// Per-phase mean cycles of the traced warps (blocks 4 .. the last traced; tiles 1 ..
// kTraceTiles-2), printed to stderr on the third launch of each (D, mask, Nk).
inline void print_trace(const uint32_t* dev, int d, bool causal, int64_t seq_kv, int block_k) {
  static std::map<std::tuple<int, bool, int64_t>, int> calls;
  if (++calls[{d, causal, seq_kv}] != 3) return;
  static uint32_t all[kTraceWords];
  const cudaError_t se = cudaDeviceSynchronize();
  const cudaError_t ce =
      dev ? cudaMemcpy(all, dev, sizeof all, cudaMemcpyDeviceToHost) : cudaErrorMemoryAllocation;
  if (se != cudaSuccess || ce != cudaSuccess) {
    std::fprintf(stderr, "[trace] read failed: %s / %s\n", cudaGetErrorString(se),
                 cudaGetErrorString(ce));
    return;
  }
  auto ev = [&](int c, int w, int kb) {
    return all + ((c * kTraceWarps + w) * kTraceBlocks + kb) * kTraceEvents;
  };
  auto tev = [&](int c, int w, int it) {
    return all + kTraceCtas * kTraceWarps * kTraceBlocks * kTraceEvents +
           ((c * kTraceWarps + w) * kTraceTiles + it) * kTileEvents;
  };
  const int nb = int(std::min<int64_t>(kTraceBlocks, (seq_kv + block_k - 1) / block_k - 1));
  const char* names[7] = {"seed+wait K+QK issue", "wait V+PV issue", "wait QK", "softmax",
                          "wait PV",              "rescale+pack",    "step"};
  double sum[7] = {};
  int n = 0;
  for (int c = 0; c < kTraceCtas; ++c)
    for (int w = 0; w < kTraceWarps; ++w)
      for (int kb = 4; kb < nb; ++kb) {
        const uint32_t* e = ev(c, w, kb);
        if (e[6] == 0) continue;
        for (int i = 0; i < 6; ++i) sum[i] += double(e[i + 1] - e[i]);
        sum[6] += double(e[6] - e[0]);
        ++n;
      }
  std::fprintf(stderr, "[trace] D=%d causal=%d Nk=%lld, mean cycles over %d warp-blocks:", d,
               int(causal), (long long)seq_kv, n);
  for (int i = 0; i < 7; ++i) std::fprintf(stderr, " %s %.0f;", names[i], n ? sum[i] / n : 0.0);
  std::fprintf(stderr, "\n");
  const char* tnames[7] = {"gap from last epilogue", "read tile", "wait Q",  "block 0",
                           "blocks 1..n-1",          "last PV",   "epilogue"};
  double ts[7] = {};
  int tn = 0;
  for (int c = 0; c < kTraceCtas; ++c)
    for (int w = 0; w < kTraceWarps; ++w)
      for (int it = 1; it < kTraceTiles - 1; ++it) {
        const uint32_t *e = tev(c, w, it), *prev = tev(c, w, it - 1);
        if (e[6] == 0 || prev[6] == 0) continue;
        ts[0] += double(e[0] - prev[6]);
        for (int i = 1; i < 7; ++i) ts[i] += double(e[i] - e[i - 1]);
        ++tn;
      }
  std::fprintf(stderr, "[trace] tiles, mean cycles over %d warp-tiles:", tn);
  for (int i = 0; i < 7; ++i) std::fprintf(stderr, " %s %.0f;", tnames[i], tn ? ts[i] / tn : 0.0);
  for (int w : {0, 4}) {
    std::fprintf(stderr, "\n[trace] tile 0, CTA 0 warp %d:", w);
    const uint32_t* e = tev(0, w, 0);
    for (int i = 1; i < 7; ++i) std::fprintf(stderr, " %s %d;", tnames[i], int(e[i] - e[i - 1]));
  }
  std::fprintf(stderr, "\n");
}
#endif

}  // namespace sage::sm90
