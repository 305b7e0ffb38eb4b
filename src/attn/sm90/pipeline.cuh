// The Hopper kernel's pipelines (sm_90a): the mbarriers between the producer (TMA, the
// Q-quantizing warps) and the consumers, and the phase bookkeeping of the K/Vᵀ ring across tiles.
#pragma once

#include <cstdint>

#include "attn/sm90/scheduler.cuh"
#include "attn/sm90/traits.h"
#include "ptx/tma.cuh"

namespace sage::sm90 {

// Q: two buffers (tile i of a CTA uses buffer i & 1); full when the Q tile is in place (TMA's
// bytes, or every quantizing thread's arrival with fused Q), empty once every consumer warp's
// Q·Kᵀ of the tile has landed. staged: the caller's fp16/bf16 Q tile loaded for fused Q.
// K and Vᵀ: a ring of kStages stages, full on TMA bytes, empty when every consumer warp is done.
struct Barriers {
  uint64_t full_q[2], empty_q[2], staged;
  uint64_t full_k[kStages], full_v[kStages], empty_k[kStages], empty_v[kStages];

  __device__ __forceinline__ void init(uint32_t q_producers, uint32_t consumer_warps) {
    for (int i = 0; i < 2; ++i) {
      ptx::mbar_init(&full_q[i], q_producers);
      ptx::mbar_init(&empty_q[i], consumer_warps);
    }
    ptx::mbar_init(&staged, 1);
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(&full_k[s], 1);
      ptx::mbar_init(&full_v[s], 1);
      ptx::mbar_init(&empty_k[s], consumer_warps);
      ptx::mbar_init(&empty_v[s], consumer_warps);
    }
  }
};

// The phases of the K/Vᵀ ring. Every tile's blocks start at stage 0 (0, 1, 0, ...), so block kb
// of a tile sits in stage kb % 2 — a compile-time constant in the consumers' loop, unrolled by
// two — and its use of that stage is the (kb / 2)-th of the tile. A tile of n blocks uses stage 0
// ceil(n / 2) times and stage 1 floor(n / 2) times; the phase each stage starts the next tile
// with flips with that count's parity. Producer and consumers keep one each, in step.
class RingPhase {
 public:
  // The parity of block kb's full barriers on stage s (kb % 2 == s).
  __device__ __forceinline__ uint32_t full(int kb, int s) const {
    return uint32_t((kb >> 1) ^ (start_ >> s)) & 1;
  }
  // The parity the producer waits on block kb's empty barriers with: the one before the full
  // phase (the first lap passes at once).
  __device__ __forceinline__ uint32_t empty(int kb, int s) const { return full(kb, s) ^ 1; }
  // After a tile of n_blocks blocks.
  __device__ __forceinline__ void next_tile(int n_blocks) {
    start_ ^= uint32_t(((n_blocks + 1) >> 1) & 1) ^ (uint32_t((n_blocks >> 1) & 1) << 1);
  }

 private:
  uint32_t start_ = 0;  // bit s: stage s's phase at the tile's first use of it
};

// The CTA's shared memory besides the tiles: the S seed, the epilogue's V statistics, fused Q's
// group scales, the barriers and the scheduler ring.
template <int D, int kCons>
struct SharedStorage {
  alignas(16) int seed[4];       // kMagic four times: the S seed, loaded 16 bytes at a time
  float v_stat[2][kCons][2][D];  // [tile parity][consumer warpgroup]: V scales, V means
  float q_sc[2][Traits<D, kCons>::kQGroups];  // fused Q: the Q group scales of each Q buffer
  float poison[2][Traits<D, kCons>::kBlockQ];  // fused Q: per row 0, or NaN (attn::row_poison)
  Barriers bar;
  SchedRing sched;
};

// The swizzled tiles in dynamic shared memory (aligned to 1024 bytes, the 128-byte swizzle's
// period): two Q buffers, kStages K and Vᵀ stages, the row sums' tile of ones, and fused Q's
// staged 16-bit tile.
template <class Tr>
struct Tiles {
  uint8_t* q;
  uint8_t* k;
  uint8_t* v;
  uint8_t* ones;
  uint8_t* q_staged;

  __device__ __forceinline__ explicit Tiles(uint8_t* smem_raw) {
    q = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
    k = q + 2 * Tr::kQTile;
    v = k + kStages * Tr::kKTile;
    ones = v + kStages * Tr::kVTile;
    q_staged = ones + Tr::kOnesTile;
  }
};

}  // namespace sage::sm90
