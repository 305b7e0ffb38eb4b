// The Hopper kernel's persistent tile scheduler (sm_90a): which tile (query block, batch·head)
// each CTA takes in each round, decoded once by the producer thread and published to the rest of
// the CTA through a ring in shared memory.
#pragma once

#include <cstdint>

#include "attn/sm90/params.h"
#include "attn/sm90/traits.h"
#include "ptx/tma.cuh"

namespace sage::sm90 {

// A tile as the producer thread decodes it, once, for the whole CTA (per thread, the decoding
// cost four 64-bit divisions, a software routine each).
struct TileInfo {
  int64_t bh;        // batch · heads_q + query head
  int32_t qb;        // query block (kBlockQ rows)
  int32_t n_blocks;  // key blocks (kBlockKeys) the tile sees (0 only when causal hides every key)
  int32_t b, h;      // batch, query head
  int32_t bhk;       // batch · heads_kv + its KV head
  int32_t done;      // past the last tile: the loops end here
};

// Tiles are numbered head-major, so a head's K and V stay in L2 while the grid works on it
// (numbered across heads, the causal tiles put ~130 heads' K and V in flight: 16k causal fell
// from 795 to 650 TOPS); causal: each head's heaviest query blocks (most keys) first.
// Non-causal (equal tiles): CTA c takes one tile per round of gridDim.x, c in even rounds and
// gridDim.x - 1 - c in odd ones (a snake). Causal (tiles of 1 .. Nk/128 blocks): tile c first,
// then the next untaken tile from a global counter whenever the CTA starts a round, the order in
// which the hardware dispatched one CTA per tile (a static snake balanced the work to 1.03x but
// lost to that dispatch: 16k 742 vs 795 TOPS).
template <bool kCausal, int kBlockQ, int kBlockKeys = kBlockK>
struct TileScheduler {
  const Params& p;
  int64_t q_tiles_n, tiles;

  __device__ __forceinline__ explicit TileScheduler(const Params& params)
      : p(params),
        q_tiles_n((params.seq_q + kBlockQ - 1) / kBlockQ),
        tiles(q_tiles_n * params.batch * params.heads_q) {}

  // The tile of this CTA's round (the producer thread only: the causal counter is drawn here).
  __device__ __forceinline__ int64_t tile_of(int round) const {
    if (kCausal)
      return round == 0 ? int64_t(blockIdx.x) : int64_t(gridDim.x) + atomicAdd(p.tile_counter, 1u);
    return int64_t(round) * gridDim.x + ((round & 1) ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
  }

  __device__ __forceinline__ TileInfo decode(int64_t tile) const {
    TileInfo ti{};
    ti.done = tile >= tiles;
    if (ti.done) return ti;
    ti.bh = tile / q_tiles_n;
    const int64_t qb = kCausal ? q_tiles_n - 1 - tile % q_tiles_n : tile % q_tiles_n;
    ti.qb = int32_t(qb);
    const int64_t last_row = min(p.seq_q, (qb + 1) * kBlockQ) - 1;
    const int64_t kv_end = kCausal ? min(p.seq_kv, last_row + p.causal_offset + 1) : p.seq_kv;
    ti.n_blocks = kv_end > 0 ? int32_t((kv_end + kBlockKeys - 1) / kBlockKeys) : 0;
    ti.b = int32_t(ti.bh / p.heads_q);
    ti.h = int32_t(ti.bh % p.heads_q);
    ti.bhk = int32_t(p.kv_head(ti.b, ti.h));
    return ti;
  }

  // Causal: once every CTA has drawn past the last tile, the last one out zeroes the counters
  // for the next launch (a kernel-only relaunch on the same workspace).
  __device__ __forceinline__ void finish() const {
    if (kCausal && atomicAdd(p.tile_counter + 1, 1u) == gridDim.x - 1) {
      p.tile_counter[0] = 0u;
      p.tile_counter[1] = 0u;
    }
  }
};

// The ring through which the producer thread publishes each round's tile one round ahead:
// slot round % kSchedSlots; full when published, empty once every reader has taken it.
struct SchedRing {
  TileInfo slot[kSchedSlots];
  uint64_t full[kSchedSlots], empty[kSchedSlots];

  __device__ __forceinline__ void init(uint32_t readers) {
    for (int i = 0; i < kSchedSlots; ++i) {
      ptx::mbar_init(&full[i], 1);
      ptx::mbar_init(&empty[i], readers);
    }
  }
  __device__ __forceinline__ void publish(int round, const TileInfo& ti) {
    const int s = round % kSchedSlots;
    ptx::mbar_wait(&empty[s], ((round / kSchedSlots) & 1) ^ 1);  // the first lap passes at once
    slot[s] = ti;
    ptx::mbar_arrive(&full[s]);  // releases the write
  }
  __device__ __forceinline__ TileInfo read(int round) {
    const int s = round % kSchedSlots;
    ptx::mbar_wait(&full[s], (round / kSchedSlots) & 1);
    const TileInfo ti = slot[s];
    ptx::mbar_arrive(&empty[s]);
    return ti;
  }
};

}  // namespace sage::sm90
