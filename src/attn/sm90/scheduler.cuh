// The Hopper kernel's persistent tile scheduler (sm_90a): which tile (query block, batch·head)
// each CTA takes in each round, decoded once by the producer thread and published to the rest of
// the CTA through a ring in shared memory.
#pragma once

#include <cstdint>

#include "attn/sm90/params.h"
#include "attn/sm90/split.h"
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
  // The split tail (kSplit; else 0): the unit's first key block (n_blocks from there), its part
  // (SplitTail::Unit: 0 whole, k > 0 merges k more, -1 a later part) and its split tile's index.
  int32_t kb0, part, split_tile;
};

// The sequence of a tile of batch entry b (KV head bhk): the call's own for a dense call (the
// params' constants, no registers held), a packed batch's sequence b read from cu_seqlens where a
// role needs it (kept out of TileInfo: the producer warpgroup holds two tiles in 40 registers).
// Its lengths and causal offset, its first query token in the caller's tensors, its K/Vᵀ maps'
// slab and first row there (quant/layout.h, SeqRows), and the LSE-shift row of query head h's
// row 0.
// kPacked is a template flag (the kernel's instantiations for packed batches): a runtime test
// put the packed path's 64-bit arithmetic beside the dense one in the producer warpgroup's 40
// registers, and ptxas spilled over 100 bytes more in every dense instantiation.
struct TileSeq {
  int64_t seq_q, seq_kv, causal_offset, tok0_q, k_row;
  int32_t k_slab;
};
template <bool kPacked>
__device__ __forceinline__ TileSeq tile_seq(const Params& p, int32_t b, int32_t bhk) {
  if constexpr (!kPacked) {
    return {p.seq_q, p.seq_kv, p.causal_offset, 0, 0, bhk};
  } else {
    const quant::SeqSpan sq = p.q_rows.span(b), sk = p.kv_rows.span(b);
    return {sq.len, sk.len, p.bottom_right ? sk.len - sq.len : 0, sq.tok0, sk.ws0,
            bhk - b * int32_t(p.heads_kv)};
  }
}
template <bool kPacked>
__device__ __forceinline__ int64_t shift_row0(const Params& p, int64_t tok0_q, int64_t b,
                                              int64_t h, int64_t bh) {
  if constexpr (kPacked)
    return h * p.shift_rows.pitch + quant::packed_start(tok0_q, b);
  else
    return bh * p.seq_q;
}

// A packed batch numbers the tiles of batch × ⌈max_seqlen_q / kBlockQ⌉ × Hq as a dense one;
// those past their sequence's queries are empty and skipped (next()), every CTA drawing from the
// counter as causal does, so no tile count depends on cu_seqlens' contents.
// Tiles are numbered head-major, so a head's K and V stay in L2 while the grid works on it
// (numbered across heads, the causal tiles put over a hundred heads' K and V in flight at once,
// more than L2 holds); causal: each head's heaviest query blocks (most keys) first.
// Non-causal (equal tiles): CTA c takes one tile per round of gridDim.x, c in even rounds and
// gridDim.x - 1 - c in odd ones (a snake). Causal (tiles of 1 .. Nk/128 blocks): tile c first,
// then the next untaken tile from a global counter whenever the CTA starts a round, the order in
// which the hardware dispatched one CTA per tile; a static snake that balanced the tiles' block
// counts measured slower (docs/sm90-kernel.md, "Tile scheduler", has the figures).
// kSplit (non-causal, dense): the whole tiles' rounds, then this CTA's units of the split tail
// (split.h).
template <bool kCausal, int kBlockQ, bool kPacked, int kBlockKeys = kBlockK, bool kSplit = false>
struct TileScheduler {
  static_assert(!kSplit || (!kCausal && !kPacked), "the split tail is for dense non-causal calls");
  const Params& p;
  int64_t q_tiles_n, tiles;

  __device__ __forceinline__ explicit TileScheduler(const Params& params)
      : p(params),
        q_tiles_n((params.seq_q + kBlockQ - 1) / kBlockQ),
        tiles(q_tiles_n * params.batch * params.heads_q) {}

  // Unit u of this CTA's share of the split tail (done when it has none).
  __device__ __forceinline__ TileInfo split_unit(int u) const {
    const SplitTail split{p.split_tiles, (p.seq_kv + kBlockKeys - 1) / kBlockKeys, p.split_ctas};
    const SplitTail::Unit x = split.unit(blockIdx.x, u);
    if (u > 1 || x.n == 0) return decode(tiles);
    TileInfo ti = decode(tiles - split.tiles + x.tile);
    ti.kb0 = x.kb0, ti.n_blocks = x.n, ti.part = x.part, ti.split_tile = int32_t(x.tile);
    return ti;
  }

  // The tile of this CTA's round (the producer thread only: the causal counter is drawn here).
  static constexpr bool kDynamic = kCausal || kPacked;

  __device__ __forceinline__ int64_t tile_of(int round) const {
    if (kDynamic)
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
    ti.b = int32_t(ti.bh / p.heads_q);
    ti.h = int32_t(ti.bh % p.heads_q);
    ti.bhk = int32_t(p.kv_head(ti.b, ti.h));
    const TileSeq s = tile_seq<kPacked>(p, ti.b, ti.bhk);
    const int64_t last_row = min(s.seq_q, (qb + 1) * kBlockQ) - 1;
    const int64_t kv_end = kCausal ? min(s.seq_kv, last_row + s.causal_offset + 1) : s.seq_kv;
    ti.n_blocks = kv_end > 0 ? int32_t((kv_end + kBlockKeys - 1) / kBlockKeys) : 0;
    return ti;
  }

  // The tile of this CTA's round: tile_of's, or (a packed batch) the next non-empty one drawn
  // from the counter.
  __device__ __forceinline__ TileInfo next(int round) const {
    if constexpr (kSplit) {
      const int full = int((tiles - p.split_tiles) / gridDim.x);  // rounds of whole tiles
      if (round >= full) return split_unit(round - full);
    }
    TileInfo ti = decode(tile_of(round));
    if constexpr (kPacked)
      while (!ti.done && int64_t(ti.qb) * kBlockQ >= tile_seq<kPacked>(p, ti.b, ti.bhk).seq_q)
        ti = decode(int64_t(gridDim.x) + atomicAdd(p.tile_counter, 1u));
    return ti;
  }

  // Causal (or packed): once every CTA has drawn past the last tile, the last one out zeroes the
  // counters for the next launch (a kernel-only relaunch on the same workspace).
  __device__ __forceinline__ void finish() const {
    if (kDynamic && atomicAdd(p.tile_counter + 1, 1u) == gridDim.x - 1) {
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
