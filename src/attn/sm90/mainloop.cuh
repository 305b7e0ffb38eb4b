// The Hopper kernel's consumers (sm_90a): consumer warpgroup c owns rows 64c .. 64c+63 of each
// tile; a warp 16 of them, a thread rows g and g+8. Per tile: Q·Kᵀ (wgmma s8, A and B from
// shared memory) and the online softmax of each key block (128 keys; 64 at D = 256), P̃·V (wgmma
// E4M3, A = P^ from registers, B = the Vᵀ tile) one block late so that it runs under the next
// block's softmax. The rows' sums of P^ come from the tensor cores too: beside each P̃·V step s an
// m64n8k32 wgmma takes the same A against a tile whose channels 2s and 2s + 1 are ones (the rest
// zeros), so the softmax adds nothing and thread t of a quad receives step t's sum of its rows,
// which joins the thread's part of l in fp32 (the finalize adds the quad's parts, as before).
// Each step's sum starts from zero: the wgmma's accumulator cuts every addend to the grid of the
// largest (docs/fp8-accumulator.md), and a step's own E4M3 products are kept exactly unless they
// are 2^10 below the step's largest, where a sum chained over the block's steps would cut each
// later step to the grid of the sum so far.
#pragma once

#include <cstdint>
#include <type_traits>

#include "attn/epilogue.cuh"
#include "attn/sm90/epilogue.cuh"
#include "attn/sm90/params.h"
#include "attn/sm90/pipeline.cuh"
#include "attn/sm90/producer.cuh"
#include "attn/sm90/softmax.cuh"
#include "attn/sm90/split.h"
#include "attn/sm90/trace.cuh"
#include "attn/sm90/traits.h"
#include "common/fragment.cuh"
#include "ptx/barrier.cuh"
#include "ptx/ldmatrix.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"
#include "quant/layout.h"

namespace sage::sm90 {

using Stage0 = std::integral_constant<int, 0>;
using Stage1 = std::integral_constant<int, 1>;

template <int D>
__device__ __forceinline__ void pv_wgmma(float (&o)[D / 2], const uint32_t (&p)[4], uint64_t desc) {
  if constexpr (D == 256)
    ptx::wgmma_m64n256k32_e4m3(o, p, desc, /*accumulate=*/true);
  else if constexpr (D == 128)
    ptx::wgmma_m64n128k32_e4m3(o, p, desc, /*accumulate=*/true);
  else
    ptx::wgmma_m64n64k32_e4m3(o, p, desc, /*accumulate=*/true);
}

// One k32 step of Q·Kᵀ over a block of kN keys.
template <int kN>
__device__ __forceinline__ void qk_wgmma(int (&s)[kN / 2], uint64_t q_desc, uint64_t k_desc) {
  if constexpr (kN == 128)
    ptx::wgmma_m64n128k32_s8_ss(s, q_desc, k_desc, /*accumulate=*/true);
  else
    ptx::wgmma_m64n64k32_s8_ss(s, q_desc, k_desc, /*accumulate=*/true);
}

// What attn::visible_keys reads of a tile's sequence.
struct KeySight {
  int64_t seq_kv, causal_offset;
};

// Every wgmma of the loop is issued unconditionally: a conditional GEMM in the loop, or a wgmma
// in flight across the merge of an if/else, made ptxas serialize every wgmma of the kernel
// (C7514, C7512). Hence block 0 alone before the loop (first_block), two blocks a turn of the
// loop (the ring's stage is then a compile-time constant: descriptors, barriers and offsets fold
// into immediates), an odd count leaving the turn after its first step (between steps no wgmma is
// in flight), and the last P̃·V alone (last_pv).
// kSplit: the split tail's units (split.h): a part of a tile starts at its key block kb0; a later
// part saves its softmax state for the tile's first part, which merges them before its epilogue.
template <int D, typename OutT, bool kCausal, int kCons, bool kPacked, bool kSplit>
struct Consumer {
  using Tr = Traits<D, kCons>;
  static constexpr bool kTurnAfterMax = Tr::turn_after_max(kCausal);
  static constexpr int kBlockK = Tr::kBlockK, kScores = Tr::kScores;
  static_assert(kStages == 2, "the loop is unrolled over a two-stage ring");

  const Params& p;
  SharedStorage<D, kCons>& sh;
  const Tiles<Tr>& tiles;
  uint32_t* trace;
  const bool fused_q;
  const int warp = threadIdx.x / 32 - 4;  // the 16-row slab of the tile (0 .. kConsumerWarps-1)
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int consumer = warp / 4;
  RingPhase phase;  // the K/Vᵀ ring's phases, in step with the producer's

  // The tile in hand, and its sequence (a packed batch's, else the call's: scheduler.cuh).
  int it, qbuf, n_blocks, first_masked_block, k_blocks;
  int kb0 = 0, part = 0, split_tile = 0;  // the split tail's unit (TileInfo; kSplit only)
  int64_t b, h, bh, bhk, row_a;
  int32_t seq_q, tok0_q;
  int32_t seq_kv, causal_offset;
  // The sequence's figures the loop and epilogue read: a packed batch's from the members above, a
  // dense call's from the params (constants: holding them in registers across the loop measured
  // slower; docs/sm90-kernel.md, "Packed variable-length batches").
  __device__ __forceinline__ int k_blocks_of() const {
    return kPacked ? k_blocks : int(p.k_blocks);
  }
  __device__ __forceinline__ KeySight sight() const {
    return kPacked ? KeySight{seq_kv, causal_offset} : KeySight{p.seq_kv, p.causal_offset};
  }
  float q_scale_log2;
  const float* k_scale;
  uint64_t q_desc, k_desc, v_desc;
  float m[2], l[2];  // the rows' running max (base 2) and sum (this thread's part: its P̃·V step)
  float o[D / 2];    // the P̃·V accumulator
  float ls[4];       // a block's P^ against the ones: [0], [1] row g's sum of step t, [2], [3]
                     // row g + 8's
  uint32_t pf[Tr::kPvSteps][4];  // P^ of the previous block: the A operand of its P̃·V (issued
                                 // one block late)

  // Turns (a soft ping-pong): a consumer waits for its turn before issuing Q·Kᵀ(kb) (and
  // P̃·V(kb-1) behind it) and passes it once its Q·Kᵀ has landed (or its row maxima are taken,
  // kTurnAfterMax), so the next consumer's GEMMs enter the tensor cores' queue after this one's
  // Q·Kᵀ instead of beside it. The queue takes about eight m64n128k32 wgmmas per SM before wgmma
  // issue blocks the warp (tools/probes/wgmma_issue.cu), so with both consumers issuing their
  // eight at once the second's issue would block until the queue drained. Passing the turn right
  // after the issue (FlashAttention-3's ping-pong: the other consumer then issues into a full
  // queue) or serializing the softmaxes was slower (docs/sm90-kernel.md, "Turns between
  // consumers").
  __device__ __forceinline__ static void take_turn() { ptx::turn_wait<Tr::kBarTurn, kCons>(); }
  __device__ __forceinline__ static void pass_turn() { ptx::turn_pass<Tr::kBarTurn, kCons>(); }
  // Consumer 0 issues first: the last one hands it the first turn.
  __device__ __forceinline__ void start() const {
    if (consumer == kCons - 1) pass_turn();
  }

  __device__ __forceinline__ void release(uint64_t* bar) const {
    __syncwarp();
    if (lane == 0) ptx::mbar_arrive(bar);
  }

  // Tile ti (this CTA's it-th): its V statistics on their way, the softmax state reset, and its Q
  // in place (with fused Q and a causal mask, the CTA's first tile quantized here by every
  // consumer warp too).
  __device__ __forceinline__ void begin_tile(const TileInfo& ti, int tile_index) {
    it = tile_index;
    qbuf = it & 1;
    n_blocks = ti.n_blocks;
    b = ti.b, h = ti.h, bh = ti.bh, bhk = ti.bhk;
    const TileSeq s = tile_seq<kPacked>(p, ti.b, ti.bhk);
    seq_q = s.seq_q, tok0_q = s.tok0_q, seq_kv = s.seq_kv, causal_offset = s.causal_offset;
    k_blocks = int((s.seq_kv + quant::kBlockK - 1) / quant::kBlockK);
    const int64_t first_row = int64_t(ti.qb) * Tr::kBlockQ;
    row_a = first_row + warp * 16 + g;
    const int64_t min_end = kCausal ? min(s.seq_kv, first_row + s.causal_offset + 1) : s.seq_kv;
    first_masked_block = min_end > 0 ? int(min_end / kBlockK) : 0;  // blocks before: unmasked
    if constexpr (kSplit) {
      kb0 = ti.kb0, part = ti.part, split_tile = ti.split_tile;
      first_masked_block -= kb0;  // (the loop counts the unit's blocks from 0)
    }
    // This warpgroup's 64 Q rows are the A operand of Q·Kᵀ straight from shared memory (A from
    // registers held across the loop was miscompiled at D = 128: ptxas gave the P^ fragments the
    // Q fragments' registers).
    const uint8_t* q_wg = tiles.q + qbuf * Tr::kQTile + consumer * 64 * Tr::kRowBytes;
    // The Q scale: from the pre-pass (loaded before the wait), or from the quantizing warps.
    q_scale_log2 = fused_q ? 0.0f
                           : p.q_scale[(bh * p.q_blocks + ti.qb) * quant::kQGroups + warp * 8 + g];
    // (Dense: bhk · k_blocks groups in; packed: the sequence's rows of its KV head's slab.)
    k_scale = kPacked ? p.k_scale + (s.k_slab * p.kv_rows.pitch + s.k_row) / quant::kBlockK *
                                        quant::kKGroups
                      : p.k_scale + (bhk * p.k_blocks + key_block(0) * Tr::kKGroupsPerBlock) *
                                        quant::kKGroups;
    load_v_stats<D>(p, sh.v_stat[qbuf][consumer], bhk);
    m[0] = m[1] = -INFINITY;
    for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
    for (int i = 0; i < 4; ++i) ls[i] = 0.0f;
    l[0] = l[1] = 0.0f;
    if (Tr::first_q_help(kCausal) && fused_q && it == 0) {
      // The CTA's first Q tile: quantized with warps 1-3 (kFirstQWarps), then released by them.
      const unsigned long long kv_first_bad = p.kv_bad[bhk];
      ptx::mbar_wait(&sh.bar.staged, 0);
      quantize_q<D, OutT, kCausal, kPacked>(p, sh, tiles, ti, 0,
                                            kQuantWarps * 32 + threadIdx.x - 128,
                                            Tr::kFirstQWarps, kv_first_bad);
      ptx::named_bar_sync(Tr::kBarFirstQ, Tr::kFirstQWarps * 32);
    }
    ptx::mbar_wait(&sh.bar.full_q[qbuf], (it >> 1) & 1);
    if (fused_q) q_scale_log2 = sh.q_sc[qbuf][warp * 8 + g];
    q_scale_log2 *= p.scale_log2;
    tile_event(trace, it, 2);
    // Descriptors computed once: a stage and a k-step add (bytes >> 4) to the start address.
    q_desc = ptx::wgmma_desc<Tr::kRowBytes>(q_wg);
    k_desc = ptx::wgmma_desc<Tr::kRowBytes>(tiles.k);
    v_desc = ptx::wgmma_desc<kBlockK>(tiles.v);
  }

  // The call's key block of the unit's block kb (a split tail's part starts at kb0).
  __device__ __forceinline__ int key_block(int kb) const { return kSplit ? kb0 + kb : kb; }

  // The scale products f of each 64 keys of block kb (their K scale groups; k_scale points at the
  // unit's first).
  __device__ __forceinline__ void scales(int kb, float (&f)[Tr::kKGroupsPerBlock]) const {
    if constexpr (Tr::kKGroupsPerBlock == 1) {
      f[0] = q_scale_log2 * k_scale[kb * quant::kKGroups + t];
    } else {
      f[0] = q_scale_log2 * k_scale[(2 * kb) * quant::kKGroups + t];
      f[1] = q_scale_log2 *
             k_scale[min(2 * kb + 1, k_blocks_of() - 1 - 2 * key_block(0)) * quant::kKGroups + t];
    }
  }

  // Q·Kᵀ of block kb (in stage st) into sacc, seeded with kMagic (softmax.cuh) by 16-byte loads
  // from shared memory (a fourth of the instructions of a move each: the softmax step is bound by
  // issue); its scales into f (loaded before the wait: the wgmma asm orders memory, the load
  // hides behind it).
  template <int st>
  __device__ __forceinline__ void issue_qk(int (&sacc)[kScores], float (&f)[Tr::kKGroupsPerBlock],
                                           int kb) {
    const uint32_t seed = static_cast<uint32_t>(__cvta_generic_to_shared(sh.seed));
    for (int i = 0; i < kScores; i += 4)
      ptx::ld_shared_v4(seed, sacc[i], sacc[i + 1], sacc[i + 2], sacc[i + 3]);
    scales(kb, f);
    take_turn();
    ptx::mbar_wait(&sh.bar.full_k[st], phase.full(kb, st));
    ptx::wgmma_fence_regs(sacc);
    ptx::wgmma_fence();
    // Step s reads 32 bytes of each row at column s·32: panel s·32 / kRowBytes, then the offset.
    for (int s = 0; s < Tr::kQkSteps; ++s) {
      const int panel = s * 32 / Tr::kRowBytes, col = s * 32 % Tr::kRowBytes;
      qk_wgmma<kBlockK>(sacc, q_desc + uint64_t((panel * Tr::kQPanel + col) >> 4),
                        k_desc + uint64_t((st * Tr::kKTile + panel * Tr::kKPanel + col) >> 4));
    }
    ptx::wgmma_commit();
  }

  // P̃·V of block kb (in stage st; A = pf), and the block's row sums of P^ by step into ls
  // afresh: the ones tile sits right after the Vᵀ stages (Tiles), so its descriptor is Vᵀ's with
  // an immediate offset (no registers), read like a Vᵀ tile of 8 channels.
  template <int st>
  __device__ __forceinline__ void issue_pv(int kb) {
    ptx::mbar_wait(&sh.bar.full_v[st], phase.full(kb, st));
    ptx::wgmma_fence_regs(o);
    ptx::wgmma_fence_regs(ls);
    ptx::wgmma_fence();
    for (int c = 0; c < Tr::kPvSteps; ++c) {
      pv_wgmma<D>(o, pf[c], v_desc + uint64_t((st * Tr::kVTile + c * 32) >> 4));
      ptx::wgmma_m64n8k32_e4m3(ls, pf[c], v_desc + uint64_t((kStages * Tr::kVTile + c * 32) >> 4),
                               /*accumulate=*/c > 0);
    }
    ptx::wgmma_commit();
  }

  __device__ __forceinline__ void softmax(int (&sacc)[kScores], int kb,
                                          const float (&f)[Tr::kKGroupsPerBlock],
                                          float (&alpha)[2]) {
    softmax_block<Tr::kPolyEvery>(
        sacc, kb < first_masked_block, f, m, l, alpha, t,
        [&](int (&vis)[2]) {
          attn::visible_keys<kCausal, kBlockK>(sight(), row_a, int64_t(key_block(kb)) * kBlockK,
                                               vis);
        },
        [] {
          if constexpr (kTurnAfterMax) pass_turn();
        });
  }

  // O *= alpha, skipped when no row of the warp saw its max move (most blocks after the first
  // few): a warp-uniform branch outside any wgmma's flight.
  __device__ __forceinline__ void rescale_o(const float (&alpha)[2]) {
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f))
      for (int i = 0; i < D / 2; ++i) o[i] *= alpha[Frag::half(i)];
  }

  __device__ __forceinline__ void pack_p(const int (&pe)[kScores]) {
    attn::pack_p_e4m3(pf, [&](int n, int e) { return __int_as_float(pe[Frag::reg(n, e)]); });
  }

  // Block 0: Q·Kᵀ, its softmax, P^.
  __device__ __forceinline__ void first_block() {
    int sacc[kScores];
    float f[Tr::kKGroupsPerBlock], alpha[2];
    issue_qk<0>(sacc, f, 0);
    ptx::wgmma_wait<0>();
    ptx::wgmma_fence_regs(sacc);
    if constexpr (!kTurnAfterMax) pass_turn();
    release(&sh.bar.empty_k[0]);
    softmax(sacc, 0, f, alpha);
    pack_p(sacc);
    tile_event(trace, it, 3);
  }

  // Step kb >= 1 (in stage st; block kb-1 in the other), on entry pf = P^(kb-1): issue Q·Kᵀ(kb),
  // then P̃·V(kb-1) behind it; wait for Q·Kᵀ(kb) only and run the softmax of kb while P̃·V(kb-1)
  // is on the tensor cores; wait for it, O *= alpha, pf = P^(kb). (Two S register sets, Q·Kᵀ(kb+1)
  // in flight during softmax(kb), do not fit the consumers' registers: ptxas serialized every
  // wgmma or spilled.)
  template <int st>
  __device__ __forceinline__ void step(int kb) {
    int sacc[kScores];
    float f[Tr::kKGroupsPerBlock];
    trace_event(trace, it, kb, 0);
    issue_qk<st>(sacc, f, kb);
    trace_event(trace, it, kb, 1);
    issue_pv<1 - st>(kb - 1);
    trace_event(trace, it, kb, 2);
    ptx::wgmma_wait<1>();  // Q·Kᵀ(kb) is ready; P̃·V(kb-1) may still run
    ptx::wgmma_fence_regs(sacc);
    if constexpr (!kTurnAfterMax) pass_turn();
    trace_event(trace, it, kb, 3);
    release(&sh.bar.empty_k[st]);
    float alpha[2];
    softmax(sacc, kb, f, alpha);
    trace_event(trace, it, kb, 4);
    ptx::wgmma_wait<0>();  // P̃·V(kb-1) landed: O may be rescaled, pf rewritten
    ptx::wgmma_fence_regs(o);
    ptx::wgmma_fence_regs(ls);
    trace_event(trace, it, kb, 5);
    release(&sh.bar.empty_v[1 - st]);
    // Block kb-1's sums join l (rescaled by the softmax of kb) at kb's alpha, as O's rows do.
    for (int r = 0; r < 2; ++r) l[r] = fmaf(ls[2 * r], alpha[r], l[r]);
    rescale_o(alpha);
    pack_p(sacc);
    trace_event(trace, it, kb, 6);
  }

  // The last block's P̃·V, in turn like every GEMM issue (each consumer takes and passes the turn
  // n_blocks + 1 times a tile; the arrival the last consumer began with is left over at exit).
  __device__ __forceinline__ void last_pv() {
    tile_event(trace, it, 4);
    // The rows' poison (0, or NaN for a row an Inf/NaN input reaches) joins l at the end, read
    // while the Q buffer, and fused Q's poison beside it, are still this tile's (loaded into l
    // when the tile starts, it made the long tiles slower: docs/sm90-kernel.md, Tried).
    float poison[2];
    for (int r = 0; r < 2; ++r)
      poison[r] = fused_q ? sh.poison[qbuf][warp * 16 + g + 8 * r]
                          : attn::row_poison(p, bh, row_a + 8 * r);
    release(&sh.bar.empty_q[qbuf]);  // every Q·Kᵀ of the tile has landed: the Q buffer is free
    take_turn();
    if ((n_blocks - 1) & 1)
      issue_pv<1>(n_blocks - 1);
    else
      issue_pv<0>(n_blocks - 1);
    ptx::wgmma_wait<0>();
    ptx::wgmma_fence_regs(o);
    ptx::wgmma_fence_regs(ls);
    pass_turn();
    release(&sh.bar.empty_v[(n_blocks - 1) % kStages]);
    for (int r = 0; r < 2; ++r) l[r] = (l[r] + ls[2 * r]) + poison[r];
    tile_event(trace, it, 5);
  }

  // A tile no key is visible to (causal): Q was never read.
  __device__ __forceinline__ void skip_tile() const { release(&sh.bar.empty_q[qbuf]); }

  // The split tail's parts. Slot c (CTA c's later part, split_part_floats): [value][consumer
  // thread], O's D/2, then m and l's two each: each thread's stores and loads are its own, a
  // warp's coalesced.
  static constexpr int kPartThreads = kCons * 128;
  __device__ __forceinline__ float* part_slot(int64_t cta) const {
    return p.split_parts + cta * split_part_floats(D, kCons) + (threadIdx.x - 128);
  }
  __device__ __forceinline__ unsigned* part_flag() const {
    return p.split_flags + int64_t(split_tile) * kCons + consumer;
  }

  // A later part: this thread's O, m and l (l before the quad's sum) into the CTA's slot, then
  // one count in the tile's flag for this warpgroup (its stores ordered before the count by the
  // barrier and the counting thread's fence). Stores through L2: the merger runs on another SM.
  __device__ __forceinline__ void save_part() {
    ptx::cp_async_wait<0>();  // (this unit's V statistics: nobody reads them, but they land here)
    float* slot = part_slot(blockIdx.x);
    for (int i = 0; i < D / 2; ++i) __stcg(slot + i * kPartThreads, o[i]);
    for (int r = 0; r < 2; ++r) {
      __stcg(slot + (D / 2 + r) * kPartThreads, m[r]);
      __stcg(slot + (D / 2 + 2 + r) * kPartThreads, l[r]);
    }
    ptx::named_bar_sync(Tr::kBarEpilogue + consumer, 128);
    if (threadIdx.x % 128 == 0) {
      __threadfence();
      atomicAdd(part_flag(), 1u);
    }
  }

  // The first part, which merges `part` later ones (CTAs blockIdx.x + 1 ..): one thread waits for
  // their counts (and zeroes the flag for the next launch), then each is added in CTA order:
  // m the max, each side scaled by 2^(its m - m), l and O as a·x + (b·y) (the emulation's order,
  // src/ref/emulate_sm90.cpp).
  __device__ __forceinline__ void merge_parts() {
    if (threadIdx.x % 128 == 0) {
      unsigned* flag = part_flag();
      while (ptx::ld_acquire_gpu(reinterpret_cast<const int*>(flag)) != part) {
      }
      *flag = 0u;
    }
    ptx::named_bar_sync(Tr::kBarEpilogue + consumer, 128);
    for (int j = 1; j <= part; ++j) {
      const float* slot = part_slot(int64_t(blockIdx.x) + j);
      float a[2], c[2];
      for (int r = 0; r < 2; ++r) {
        const float mj = __ldcg(slot + (D / 2 + r) * kPartThreads);
        const float lj = __ldcg(slot + (D / 2 + 2 + r) * kPartThreads);
        const float mn = fmaxf(m[r], mj), mu = mn == -INFINITY ? 0.0f : mn;
        a[r] = ptx::ex2(m[r] - mu), c[r] = ptx::ex2(mj - mu);
        l[r] = __fmaf_rn(l[r], a[r], __fmul_rn(lj, c[r]));
        m[r] = mn;
      }
      for (int i = 0; i < D / 2; ++i)
        o[i] = __fmaf_rn(o[i], a[Frag::half(i)],
                         __fmul_rn(__ldcg(slot + i * kPartThreads), c[Frag::half(i)]));
    }
  }

  __device__ __forceinline__ void end_tile() {
    if constexpr (kSplit) {
      if (part < 0) {  // a later part: saved for its tile's first part, nothing stored here
        save_part();
        tile_event(trace, it, 6);
        phase.next_tile(n_blocks);
        return;
      }
      if (part > 0) merge_parts();
    }
    store_tile<D, OutT>(p, o, m, l, sh.v_stat[qbuf][consumer], Tr::kBarEpilogue + consumer, b, h,
                        row_a, t, kPacked ? seq_q : p.seq_q, kPacked ? tok0_q : 0,
                        shift_row0<kPacked>(p, kPacked ? tok0_q : 0, b, h, bh));
    tile_event(trace, it, 6);
    phase.next_tile(n_blocks);
  }
};

}  // namespace sage::sm90
