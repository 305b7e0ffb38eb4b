// What every pre-pass kernel shares: the PDL prologue, where the chunk statistics (KvStat,
// params.h) live in the workspace, the caller's row addressing, and the raw 16-bit element loads.
// (Included only by quant/prepass.cu, the pre-pass's one translation unit: the code sits in
// that file's anonymous namespace, so the kernels stay internal to it.)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include "common/formats.h"
#include "ptx/async.cuh"
#include "quant/layout.h"
#include "quant/prepass.h"
#include "quant/prepass/params.h"

namespace sage::quant {
namespace {

// Programmatic dependent launch (sm_90+; nothing below): every pre-pass kernel is launched with
// programmatic stream serialization (launch_pdl, common/launch.h), so it may start while the
// previous kernel of the stream (a pre-pass kernel, or the caller's kernel that wrote Q/K/V) is
// still running. It therefore waits for that kernel's completion and memory before its first
// global access (griddepcontrol.wait), and then at once lets the next kernel's CTAs be scheduled
// as SMs free up (griddepcontrol.launch_dependents), which in turn wait in their own prologue.
// Every kernel of the chain waits before it touches memory, so each sees all the kernels before
// it complete.
__device__ __forceinline__ void pdl_enter() {
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
}

// The attention kernel's counters (HeadFinalOut::tile_counter) start at zero: it leaves them so,
// and the one pre-pass CTA that calls this zeroes them for a fresh workspace.
__device__ __forceinline__ void zero_counters(const HeadFinalOut& p) {
  for (int i = threadIdx.x; i < p.counters; i += blockDim.x) p.tile_counter[i] = 0u;
}

// The byte offset of (b, h)'s Vᵀ in the workspace's Vᵀ region: channel c's keys start c·pitch
// bytes later (quant/layout.h, SeqRows).
__device__ __forceinline__ int64_t v_base(const SeqRows& rows, int64_t b, int64_t h,
                                          const SeqSpan& s, int D) {
  return (b * rows.batch_rows + h * rows.pitch) * D + s.ws0;
}

// A (sequence, KV head)'s chunk statistics, in the bytes its Vᵀ later takes (PrepassPlan::
// kv_stats): dense [chunk][channel] from the start of the head's Vᵀ; packed, statistic (chunk,
// channel) at the first 24 bytes of that chunk's 128 columns in that channel's Vᵀ row (a packed
// head's Vᵀ bytes are not contiguous; these are the sequence's own columns all the same).
struct StatView {
  uint8_t* base;
  int64_t chunk_step, channel_step;
  __device__ KvStat* at(int64_t chunk, int64_t c) const {
    return reinterpret_cast<KvStat*>(base + chunk * chunk_step + c * channel_step);
  }
};
__device__ __forceinline__ StatView stat_view(KvStat* stats, const SeqRows& rows, int64_t b,
                                              int64_t h, const SeqSpan& s, int D) {
  uint8_t* base = reinterpret_cast<uint8_t*>(stats) + v_base(rows, b, h, s, D);
  return rows.packed() ? StatView{base, kStatTokens, rows.pitch}
                       : StatView{base, D * kKvStatBytes, kKvStatBytes};
}

template <typename T>
__device__ __forceinline__ const T* row_ptr(const T* base, const sage_strides& s, int64_t b,
                                            int64_t h, int64_t n) {
  return base + b * s.batch + h * s.head + n * s.token;
}

// Elements p[0..7] as raw bits: one 16-byte read-only load (not kept in L1: every input byte is
// read once per kernel) when kVec, else eight 2-byte loads (rows need only 2-byte alignment).
template <bool kVec, typename T>
__device__ __forceinline__ uint4 load_raw8(const T* p) {
  uint4 w;
  if constexpr (kVec) {
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
        : "l"(p));
  } else {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(p);
    w.x = s[0] | (uint32_t(s[1]) << 16);
    w.y = s[2] | (uint32_t(s[3]) << 16);
    w.z = s[4] | (uint32_t(s[5]) << 16);
    w.w = s[6] | (uint32_t(s[7]) << 16);
  }
  return w;
}

// Elements p[0..N-1] (N = 4 or 8) as raw bits, two a word: load_raw8, or one 8-byte load. (No
// 16: a head dim that is a multiple of 8 may end half-way through 16 elements, so wider reads
// are pieces of 8, each tested against it: load_block_global.)
template <bool kVec, int N, typename T>
__device__ __forceinline__ void load_raw(const T* p, uint32_t (&w)[N / 2]) {
  static_assert(N == 4 || N == 8, "4 or 8 elements");
  if constexpr (N == 8) {
    const uint4 x = load_raw8<kVec>(p);
    w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
  } else if constexpr (kVec) {
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
  } else {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(p);
    w[0] = s[0] | (uint32_t(s[1]) << 16);
    w[1] = s[2] | (uint32_t(s[3]) << 16);
  }
}

}  // namespace
}  // namespace sage::quant
