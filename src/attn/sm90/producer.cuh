// The Hopper kernel's producer warpgroup (sm_90a): thread 0 schedules the tiles and issues the
// TMA loads of K and Vᵀ (and of Q when the pre-pass quantized it); warps 1-3 quantize Q from the
// caller's fp16/bf16 (fused Q), a tile ahead of the consumers.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "attn/sm90/params.h"
#include "attn/sm90/pipeline.cuh"
#include "attn/sm90/scheduler.cuh"
#include "attn/sm90/traits.h"
#include "common/formats.h"
#include "ptx/barrier.cuh"
#include "ptx/tma.cuh"
#include "quant/elements.cuh"
#include "quant/layout.h"

namespace sage::sm90 {

// The TMA descriptors of the pre-pass's Q, K and Vᵀ and of the caller's Q.
struct TmaMaps {
  CUtensorMap q;     // 3-D: {D bytes, nq_pad rows, B*Hq}, box {kRowBytes, 128, 1} (a panel)
  CUtensorMap k;     // 3-D: {D bytes, nk_pad keys, B*Hkv}, box {kRowBytes, kBlockK, 1}
  CUtensorMap v;     // 3-D: {nk_pad keys, D channels, B*Hkv}, box {kBlockK, D, 1}
  CUtensorMap q_in;  // fused Q: the caller's Q, 4-D {head_dim, Nq, Hq, B} 16-bit, box
                     // {D, kBlockQ, 1, 1} (channels past a padded head_dim read as zeros)
#ifdef SAGE_SM90_TRACE
  uint32_t* trace;   // the phase trace's buffer (trace.cuh)
#endif
};

// Quantizes the staged Q tile (2·kQGroups rows x D fp16/bf16, row-major; rows past the tensor
// and channels past a padded head_dim zero: TMA's out-of-bounds fill; rows past seq_q that a
// packed batch's next sequence filled count as zeros here) as the pre-pass's quant_q
// does: INT8 per thread group (rows g, g+8 of each 16-row slab: the rows one consumer thread's
// accumulator holds), scale max|q| / 127, into the INT8 tile in the layout the Q·Kᵀ wgmma reads
// (TMA's 128-byte swizzle for 128-byte rows, 64-byte for 64-byte rows; at D = 256 two panels of
// 128-byte columns, Traits::kRowBytes), and the group scales into
// q_sc. With km (this KV head's K mean; LSE asked for) also each row's LSE shift
// scale · q·k_mean (exact products summed in double, as quant_q).
// Inf/NaN elements count as zeros; a row that is poisoned (sight, kv_first_bad: quant::RowSight)
// gets a NaN shift, as quant_q gives it, and a NaN in `poison` (every row's, for the consumers:
// attn::row_poison's shared-memory twin).
// qt: the thread's index among the n_warps·32 quantizing threads. Eight lanes take a group
// (four a row, D/32 16-byte chunks each: a three-step max), a warp four groups at a time: the
// latency of a pass (shared loads, shuffles, two divisions) is paid 6 times a tile, not 22.
template <typename T, int D>
__device__ __noinline__ void zero_staged_part(uint8_t* row, int part) {
  for (int c = 0; c < D / 32; ++c) {
    uint4 x[1] = {*reinterpret_cast<const uint4*>(row + (c * 4 + part) * 16)};
    quant::zero_special<T>(x);
    *reinterpret_cast<uint4*>(row + (c * 4 + part) * 16) = x[0];
  }
}

template <int D, typename T, int kQGroups, bool kPacked>
__device__ __forceinline__ void quantize_q_tile(uint8_t* staged, uint8_t* q_tile, float* q_sc,
                                                float* poison, int qt, int n_warps, const float* km,
                                                float* shift, int64_t row0, int64_t seq_q,
                                                float scale, quant::RowSight sight,
                                                unsigned long long kv_first_bad) {
  constexpr int kLanesPerGroup = 8, kGroupsPerPass = 32 / kLanesPerGroup;
  constexpr int kChunks = D / 32;                    // 16-byte chunks per lane: c·4 + part
  constexpr int kRowBytes = D > 128 ? 128 : D;       // a row's bytes in one panel
  constexpr uint32_t kPanel = uint32_t(2 * kQGroups * kRowBytes);
  // 16-byte chunk ^= (byte offset >> 7) & kSwizzle (the panel's swizzle)
  constexpr uint32_t kSwizzle = kRowBytes == 128 ? 7u : 3u;
  const int lane = qt % 32, li = lane % kLanesPerGroup;
  const int hi = li / 4, part = li % 4;
#pragma unroll 1
  for (int g0 = (qt / 32) * kGroupsPerPass; g0 < kQGroups; g0 += n_warps * kGroupsPerPass) {
    const int grp = g0 + lane / kLanesPerGroup;
    const int r = 16 * (grp / 8) + grp % 8 + 8 * hi;
    bool part_bad, row_bad = false;
    // A row past the sequence stays out of its group's scale (a packed batch's staged tile holds
    // the next sequence's rows there; a dense one's are zero already).
    const bool live = !kPacked || row0 + r < seq_q;
    QuantScale sc;
    float amax = 0.0f;
    if constexpr (D <= 128) {
      uint4 w[kChunks];
      for (int c = 0; c < kChunks; ++c)
        w[c] = live ? *reinterpret_cast<const uint4*>(staged + (r * D + (c * 4 + part) * 8) * 2)
                    : make_uint4(0u, 0u, 0u, 0u);
      // Inf/NaN are rare: a test of the lane's words, and the zeroing only where one is.
      part_bad = quant::special_any<T>(w) != 0u;
      if (part_bad) {  // rare: the Inf/NaN zeroed in the staged row itself (the shift reads it)
        zero_staged_part<T, D>(staged + r * D * 2, part);
        for (int c = 0; c < kChunks; ++c)
          w[c] = *reinterpret_cast<const uint4*>(staged + (r * D + (c * 4 + part) * 8) * 2);
      }
      if (__any_sync(0xffffffffu, part_bad)) {
        int x = part_bad;
        for (int m = 1; m < 4; m *= 2) x |= __shfl_xor_sync(0xffffffffu, x, m);
        row_bad = x != 0;
      }
      for (int c = 0; c < kChunks; ++c)
        for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(quant::elem_float<T>(w[c], e)));
      for (int m = 1; m < kLanesPerGroup; m *= 2)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
      sc = make_quant_scale(amax, float(kInt8Max));
      // As quant_q: with finite elements and a finite scale, no product can leave [-127, 127]
      // and none is NaN, so the clamp and the NaN test are skipped.
      const bool fast = quant::finite_scale(amax, sc.inv);
      quant::quantize_store_row_part<T, D, 8>(
          q_tile, w, [](float x, int) { return x; }, part, sc.inv, float(kInt8Max), fast,
          0xFFFFFFFFu, [r](int d0) {
            const uint32_t off = uint32_t(r * D + d0);
            return int(off ^ (((off >> 7) & kSwizzle) << 4));
          });
    } else {
      // D = 256: the lane's 8 chunks (32 registers) held from the loads to the stores spilled
      // the quantizing warps' 40 registers, so each pass reads them from the staged row again,
      // the stores a half (128 channels, one Q panel) at a time. Same operations as above.
      constexpr int kHalf = kChunks / 2;
      const uint8_t* const srow = staged + r * D * 2;
      auto chunk = [&](int c) {  // the lane's c-th 16-byte chunk of the row (channels (c·4+part)·8)
        return live ? *reinterpret_cast<const uint4*>(srow + (c * 4 + part) * 16)
                    : make_uint4(0u, 0u, 0u, 0u);
      };
      uint32_t bad = 0u;
      for (int c = 0; c < kChunks; ++c) {
        const uint4 x[1] = {chunk(c)};
        bad |= quant::special_any<T>(x);
      }
      part_bad = bad != 0u;
      if (part_bad) zero_staged_part<T, D>(staged + r * D * 2, part);
      if (__any_sync(0xffffffffu, part_bad)) {
        int x = part_bad;
        for (int m = 1; m < 4; m *= 2) x |= __shfl_xor_sync(0xffffffffu, x, m);
        row_bad = x != 0;
      }
      for (int c = 0; c < kChunks; ++c) {
        const uint4 x = chunk(c);
        for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(quant::elem_float<T>(x, e)));
      }
      for (int m = 1; m < kLanesPerGroup; m *= 2)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
      sc = make_quant_scale(amax, float(kInt8Max));
      const bool fast = quant::finite_scale(amax, sc.inv);
      for (int h = 0; h < 2; ++h) {
        uint4 w[kHalf];
        for (int c = 0; c < kHalf; ++c) w[c] = chunk(h * kHalf + c);
        // Chunk c of half h is channel 128·h + (c·4 + part)·8: the half's panel.
        quant::quantize_store_row_part<T, 128, 8>(
            q_tile, w, [](float x, int) { return x; }, part, sc.inv, float(kInt8Max), fast,
            0xFFFFFFFFu, [r, h](int d0) {
              const uint32_t off = uint32_t(h) * kPanel + uint32_t(r * kRowBytes + d0);
              return int(off ^ (((off >> 7) & kSwizzle) << 4));
            });
      }
    }
    if (li == 0) q_sc[grp] = sc.scale;
    const int64_t row = row0 + r;
    const bool poisoned = sight.poisoned(row, row_bad, kv_first_bad);
    if (part == 0) poison[r] = poisoned ? __int_as_float(0x7FC00000) : 0.0f;
    if (km) {  // the staged row again (still in place), so w need not live this long
      double sh = 0;
      for (int c = 0; c < kChunks; ++c) {
        const uint4 x = *reinterpret_cast<const uint4*>(staged + (r * D + (c * 4 + part) * 8) * 2);
        for (int e = 0; e < 8; ++e)
          sh = __fma_rn(double(quant::elem_float<T>(x, e)), double(km[(c * 4 + part) * 8 + e]), sh);
      }
      for (int m = 1; m < 4; m *= 2) sh += __shfl_xor_sync(0xffffffffu, sh, m);
      if (part == 0 && row < seq_q)
        shift[row] = poisoned ? __int_as_float(0x7FC00000) : float(double(scale) * sh);
    }
  }
}

// Tile ti's staged Q quantized into Q buffer qbuf by quantizing thread qt of n_warps warps (warps
// 1-3 every tile; with every consumer warp for a causal CTA's first) and made visible to the wgmma
// (the async proxy). The caller then syncs its quantizing threads. kv_first_bad: p.kv_bad of the
// tile's KV head, loaded by the caller before its waits.
template <int D, typename InT, bool kCausal, bool kPacked, int kCons>
__device__ __forceinline__ void quantize_q(const Params& p, SharedStorage<D, kCons>& sh,
                                           const Tiles<Traits<D, kCons>>& tiles,
                                           const TileInfo& ti, int qbuf, int qt, int n_warps,
                                           unsigned long long kv_first_bad) {
  using Tr = Traits<D, kCons>;
  const TileSeq s = tile_seq<kPacked>(p, ti.b, ti.bhk);
  quantize_q_tile<D, InT, Tr::kQGroups, kPacked>(
      tiles.q_staged, tiles.q + qbuf * Tr::kQTile, sh.q_sc[qbuf], sh.poison[qbuf], qt, n_warps,
      p.lse ? p.k_mean + int64_t(ti.bhk) * D : nullptr,
      p.lse_shift + shift_row0<kPacked>(p, s.tok0_q, ti.b, ti.h, ti.bh),
      int64_t(ti.qb) * Tr::kBlockQ, s.seq_q, p.scale,
      quant::RowSight{s.seq_kv, s.causal_offset, kCausal}, kv_first_bad);
  ptx::fence_proxy_async_smem();
}

template <int D, typename InT, bool kCausal, int kCons, bool kPacked, bool kSplit>
struct Producer {
  using Tr = Traits<D, kCons>;
  const Params& p;
  const TmaMaps& maps;
  SharedStorage<D, kCons>& sh;
  const Tiles<Tr>& tiles;

  // The caller's Q of tile ti staged by TMA (16-bit, rows past Nq zero; a packed batch's map is
  // [total_q] rows of one batch entry, its sequences located by tok0_q).
  __device__ __forceinline__ void stage_q(const TileInfo& ti) const {
    ptx::mbar_arrive_expect_tx(&sh.bar.staged, Tr::kQStaged);
    const int tok0 = int(tile_seq<kPacked>(p, ti.b, ti.bhk).tok0_q);
    ptx::tma_load_4d(tiles.q_staged, &maps.q_in, &sh.bar.staged, 0, tok0 + ti.qb * Tr::kBlockQ,
                     ti.h, kPacked ? 0 : ti.b);
  }

  // Warps 1-3 (fused Q): each tile's Q, staged by TMA, quantized into the Q buffer once the
  // consumers have released it (the buffer frees when the tile before last is done); the next
  // tile's staging load goes out as soon as every quantizing thread has read this one. The CTA's
  // first tile is staged by the scheduling thread (and under a causal mask quantized with every
  // consumer warp: Traits::first_q_help).
  __device__ __forceinline__ void quantize_tiles() const {
    const int qt = threadIdx.x - 32;
    TileInfo ti = sh.sched.read(0);
    for (int it = 0; !ti.done; ++it) {
      const int qbuf = it & 1;
      const unsigned long long kv_first_bad = p.kv_bad[ti.bhk];  // in flight during the waits
      ptx::mbar_wait(&sh.bar.staged, it & 1);
      ptx::mbar_wait(&sh.bar.empty_q[qbuf], ((it >> 1) & 1) ^ 1);  // the first lap passes at once
      const bool helped = Tr::first_q_help(kCausal) && it == 0;  // the consumers quantize too
      quantize_q<D, InT, kCausal, kPacked>(p, sh, tiles, ti, qbuf, qt,
                                           helped ? Tr::kFirstQWarps : kQuantWarps, kv_first_bad);
      if (helped)  // every quantizing thread, the consumers' too: the staged tile is free
        ptx::named_bar_sync(Tr::kBarFirstQ, Tr::kFirstQWarps * 32);
      else
        ptx::named_bar_sync(Tr::kBarQuant, kQuantWarps * 32);
      ptx::mbar_arrive(&sh.bar.full_q[qbuf]);
      ti = sh.sched.read(it + 1);
      if (qt == 0 && !ti.done) stage_q(ti);
    }
  }

  // A tile of INT8 rows (Q or K) into dst: one TMA box per panel of kRowBytes columns.
  __device__ __forceinline__ static void load_rows(uint8_t* dst, int panel_bytes,
                                                   const CUtensorMap* map, uint64_t* bar, int row,
                                                   int head) {
    for (int c = 0; c < Tr::kPanels; ++c)
      ptx::tma_load_3d(dst + c * panel_bytes, map, bar, c * Tr::kRowBytes, row, head);
  }

  // Thread 0: draws each round's tile one round ahead, publishes it, and issues its loads: Q
  // (pre-pass Q) and the K/Vᵀ blocks into the ring as stages free up.
  __device__ __forceinline__ void load_tiles(bool fused_q) const {
    const TileScheduler<kCausal, Tr::kBlockQ, kPacked, Tr::kBlockK, kSplit> sched(p);
    RingPhase phase;
    TileInfo ti = sched.next(0);
    // The first tile's Q before any K/V load: every CTA starts at once, and queued behind the
    // whole grid's K/V stages each CTA's first Q tile would arrive last, while nothing can start
    // without it (docs/sm90-kernel.md, "Fused Q quantization").
    if (fused_q && !ti.done) stage_q(ti);
    sh.sched.publish(0, ti);
    for (int it = 0; !ti.done; ++it) {
      const TileInfo next = sched.next(it + 1);
      sh.sched.publish(it + 1, next);  // the quantizing warps prepare its Q during this tile
      const int qbuf = it & 1;
      if (!fused_q) {
        ptx::mbar_wait(&sh.bar.empty_q[qbuf], ((it >> 1) & 1) ^ 1);  // the first lap at once
        ptx::mbar_arrive_expect_tx(&sh.bar.full_q[qbuf], Tr::kQTile);
        load_rows(tiles.q + qbuf * Tr::kQTile, Tr::kQPanel, &maps.q, &sh.bar.full_q[qbuf],
                  ti.qb * Tr::kBlockQ, int(ti.bh));
      }
      const TileSeq seq = tile_seq<kPacked>(p, ti.b, ti.bhk);
      // (A split tail's part starts at its key block kb0.)
      const int k_row = int(seq.k_row) + (kSplit ? ti.kb0 * Tr::kBlockK : 0);
      for (int kb = 0; kb < ti.n_blocks; ++kb) {
        const int s = kb % kStages;
        const uint32_t parity = phase.empty(kb, s);
        ptx::mbar_wait(&sh.bar.empty_k[s], parity);
        ptx::mbar_arrive_expect_tx(&sh.bar.full_k[s], Tr::kKTile);
        load_rows(tiles.k + s * Tr::kKTile, Tr::kKPanel, &maps.k, &sh.bar.full_k[s],
                  k_row + kb * Tr::kBlockK, seq.k_slab);
        ptx::mbar_wait(&sh.bar.empty_v[s], parity);
        ptx::mbar_arrive_expect_tx(&sh.bar.full_v[s], Tr::kVTile);
        ptx::tma_load_3d(tiles.v + s * Tr::kVTile, &maps.v, &sh.bar.full_v[s],
                         k_row + kb * Tr::kBlockK, 0, seq.k_slab);
      }
      phase.next_tile(ti.n_blocks);
      ti = next;
    }
    sched.finish();
  }
};

}  // namespace sage::sm90
