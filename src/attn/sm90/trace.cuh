// Opt-in phase trace of the Hopper kernel (a development build: -DSAGE_SM90_TRACE; otherwise
// every function here is empty). Lane 0 of every consumer warp of the first kTraceCtas CTAs writes
// the SM clock at seven points of each of its first kTraceBlocks key blocks of its first two tiles
// (block events: a CTA's first tile runs cold, the second as the rest) and, with the global timer
// beside it, of its first kTraceTiles tiles (tile events), into a buffer the launcher allocates;
// the launcher prints per-phase means on the third launch of each (D, mask, Nk), caches and clocks
// warm. The stores perturb the schedule by a few per cent.
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
constexpr int kTraceCtas = 4, kTraceBlockTiles = 2, kTraceBlocks = 48, kTraceEvents = 7;
// Tile events: loop top, tile read, Q ready, block 0 done, loop done, last P·V landed, epilogue
// done; each as the SM clock and as the global timer's low word (ns). The buffer holds the block
// events, then the tile events' clocks, then their times.
constexpr int kTraceTiles = 16, kTileEvents = 7;
constexpr int kTraceWarps = 12;  // consumer warps of up to three warpgroups
constexpr int kBlockWords = kTraceCtas * kTraceWarps * kTraceBlockTiles * kTraceBlocks * kTraceEvents;
constexpr int kTileWords = kTraceCtas * kTraceWarps * kTraceTiles * kTileEvents;
constexpr int kTraceWords = kBlockWords + 2 * kTileWords;

__device__ __forceinline__ uint32_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return uint32_t(t);
}
#endif

// Block event ev (0..6) of key block kb of this CTA's tile number it.
__device__ __forceinline__ void trace_event(uint32_t* trace, int it, int kb, int ev) {
#ifdef SAGE_SM90_TRACE
  if (blockIdx.x < kTraceCtas && threadIdx.x % 32 == 0 && it < kTraceBlockTiles &&
      kb < kTraceBlocks) {
    const int w = blockIdx.x * kTraceWarps + threadIdx.x / 32 - 4;
    trace[((w * kTraceBlockTiles + it) * kTraceBlocks + kb) * kTraceEvents + ev] = ptx::sm_clock();
  }
#else
  (void)trace, (void)it, (void)kb, (void)ev;
#endif
}

// Tile event ev (0..6) of this CTA's tile number it.
__device__ __forceinline__ void tile_event(uint32_t* trace, int it, int ev) {
#ifdef SAGE_SM90_TRACE
  if (blockIdx.x < kTraceCtas && threadIdx.x % 32 == 0 && it < kTraceTiles) {
    const int w = blockIdx.x * kTraceWarps + threadIdx.x / 32 - 4;
    const int at = kBlockWords + (w * kTraceTiles + it) * kTileEvents + ev;
    trace[at] = ptx::sm_clock();
    trace[at + kTileWords] = global_ns();
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

// Per-phase mean cycles of the traced warps, printed to stderr on the third launch of each
// (D, mask, Nk): the steps of each warp's first and second tile (blocks 1 .. the last traced), the
// tiles after the first (1 .. kTraceTiles-2) together, then tiles 0-3 one by one with their
// global-timer span and the clock it implies.
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
  auto ev = [&](int c, int w, int it, int kb) {
    return all + (((c * kTraceWarps + w) * kTraceBlockTiles + it) * kTraceBlocks + kb) * kTraceEvents;
  };
  auto tev = [&](int c, int w, int it) {
    return all + kBlockWords + ((c * kTraceWarps + w) * kTraceTiles + it) * kTileEvents;
  };
  const int nb = int(std::min<int64_t>(kTraceBlocks, (seq_kv + block_k - 1) / block_k));
  const char* names[7] = {"seed+wait K+QK issue", "wait V+PV issue", "wait QK", "softmax",
                          "wait PV",              "rescale+pack",    "step"};
  std::fprintf(stderr, "[trace] D=%d causal=%d Nk=%lld", d, int(causal), (long long)seq_kv);
  for (int it = 0; it < kTraceBlockTiles; ++it) {
    double sum[7] = {};
    int n = 0;
    for (int c = 0; c < kTraceCtas; ++c)
      for (int w = 0; w < kTraceWarps; ++w)
        for (int kb = 1; kb < nb; ++kb) {
          const uint32_t* e = ev(c, w, it, kb);
          if (e[6] == 0) continue;
          for (int i = 0; i < 6; ++i) sum[i] += double(e[i + 1] - e[i]);
          sum[6] += double(e[6] - e[0]);
          ++n;
        }
    std::fprintf(stderr, "\n[trace] steps of tile %d, mean cycles over %d warp-blocks:", it, n);
    for (int i = 0; i < 7; ++i) std::fprintf(stderr, " %s %.0f;", names[i], n ? sum[i] / n : 0.0);
  }
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
  std::fprintf(stderr, "\n[trace] tiles 1.., mean cycles over %d warp-tiles:", tn);
  for (int i = 0; i < 7; ++i) std::fprintf(stderr, " %s %.0f;", tnames[i], tn ? ts[i] / tn : 0.0);
  for (int it = 0; it < 4; ++it) {
    double cyc[7] = {}, ns = 0.0;
    int n = 0;
    for (int c = 0; c < kTraceCtas; ++c)
      for (int w = 0; w < kTraceWarps; ++w) {
        const uint32_t* e = tev(c, w, it);
        if (e[6] == 0) continue;
        for (int i = 1; i < 7; ++i) cyc[i] += double(e[i] - e[i - 1]);
        cyc[0] += double(e[6] - e[0]);
        ns += double(e[6 + kTileWords] - e[kTileWords]);
        ++n;
      }
    if (n == 0) continue;
    std::fprintf(stderr, "\n[trace] tile %d, mean over %d warps: %.0f cycles in %.0f ns (%.0f MHz);",
                 it, n, cyc[0] / n, ns / n, ns > 0 ? cyc[0] / ns * 1e3 : 0.0);
    for (int i = 1; i < 7; ++i) std::fprintf(stderr, " %s %.0f;", tnames[i], cyc[i] / n);
  }
  std::fprintf(stderr, "\n");
}
#endif

}  // namespace sage::sm90
