// SageAttention2-8b on Hopper (sm_90a): wgmma s8·s8→s32 for Q·Kᵀ and E4M3 for P̃·V, K and Vᵀ
// tiles brought by TMA onto mbarriers, warp specialization: warpgroup 0 produces (one thread
// schedules the tiles and issues the TMA loads; warps 1-3 quantize Q from the caller's fp16/bf16
// with fused_q, else Q arrives pre-quantized by TMA), the other kCons warpgroups (Cfg: two, or
// three at D = 64) consume 64 query rows each. Persistent for both masks: one CTA per SM walks its
// tiles (query block, head), drawn statically (non-causal) or from a global counter (causal); the
// producer loads the next tile's Q (double buffered) and first K/Vᵀ blocks while the consumers
// finish the current one. Launched as a programmatic dependent of the pre-pass (griddepcontrol.wait
// before the first global read).
//
// It reads the same pre-pass products as the mma.sync kernel (attn/mma/params.h) and does the
// same arithmetic: a warp owns 16 query rows (one Q scale for rows g, g+8), K scales per 64-key
// group (a 128-key block holds two), Vᵀ keys permuted inside each 32 so the S accumulator
// converts to the P̃ A-operand in place. So its CPU emulation is the mma kernel's configuration
// (block_q 128, warps 8, block_k 64, per-thread mma groups) except for the P·V accumulator,
// the wgmma's own over the whole sequence, which keeps fewer bits than fp32 (measured so far
// against the mma kernel, not modelled yet: docs/fp8-accumulator.md), and for 2^x on one score
// in eight at D = 128 (a polynomial, relative error 1e-4 instead of 2^-22; poly_every).
//
// Overlap: each consumer issues Q·Kᵀ of block j together with P̃·V of block j-1 and runs the
// softmax of block j while that P̃·V is in flight. (Block 0 is peeled: with the first iteration's
// conditional GEMMs inside the loop ptxas serialized every wgmma, C7514, and it ran slower.)
// What bounds it (H100, docs/sm90-kernel.md): the softmax's instruction issue, not the tensor
// cores nor memory — without the softmax the same loop runs > 2800 TOPS. Hence the softmax is
// cut to about seven instructions per score: S seeded so scores come out as floats, one FFMA
// and one 2^x per score (at D = 128 one in eight as a polynomial off the MUFU pipe), the max on the
// bits, O rescaled only when a row's max moved. The consumers take turns to issue their GEMMs
// (a turn passes when the issuer's Q·Kᵀ has landed, at D = 128 non-causal once its row maxima
// are taken): issuing both at once overfilled the tensor cores' wgmma queue and stalled the
// second issuer (see take_turn below).
//
// Budget: a consumer thread holds S (64 int32), O (D/2 fp32), P̃ (16): under the registers
// setmaxnreg gives it (Cfg::kConsumerRegs: 232 with two consumers, 160 with three).
// Shared memory: two Q tiles (kBlockQ x D bytes) and kStages x (K tile 128 x D bytes + Vᵀ tile
// D x 128 bytes), 1024-byte aligned for the swizzle.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "attn/epilogue.cuh"
#include "attn/mma/params.h"
#include "ptx/async.cuh"
#include "ptx/barrier.cuh"
#include "ptx/cvt.cuh"
#include "ptx/math.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"
#include "quant/elements.cuh"

namespace sage::sm90 {

using mma::AttnParams;
constexpr int kBlockK = 128;  // keys per block = the N of the Q·Kᵀ wgmma
static_assert(kBlockK == 2 * mma::kBlockK,
              "the sm90 kernel reads the mma pre-pass layout: 64-key K scale groups");

constexpr int kStages = 2;  // K and Vᵀ tiles in flight

// The fused Q quantization (AttnParams::fused_q) runs on warps 1-3 of the producer warpgroup.
constexpr int kQuantWarps = 3;

// What follows from the number of consumer warpgroups, kCons, each owning 64 query rows of a
// tile: 2 (the default), or 3 (D = 64 with fused Q: more warps per scheduler to hide the
// softmax's latency; docs/sm90-kernel.md).
template <int kCons>
struct Cfg {
  static_assert(kCons == 2 || kCons == 3, "two or three consumer warpgroups");
  static constexpr int kBlockQ = 64 * kCons;
  static constexpr int kThreads = 128 * (kCons + 1);
  static constexpr int kConsumerWarps = 4 * kCons;
  static constexpr int kQGroups = kBlockQ / 2;  // Q scale groups: rows {g, g+8} of each 16
  // Registers per thread after setmaxnreg. The CTA's pool is what the launch allocated (ptxas's
  // count under __launch_bounds__(kThreads, 1): 168 for 384 threads, 128 for 512);
  // setmaxnreg.inc waits until the pool holds what it asks for, so a split over the pool hangs
  // every consumer (as 32/240 did). Two consumers: 40 lets the quantizing warps run without
  // spilling in their loop, and the consumer loop has no spills at 232. Three (D = 64 only: O
  // is 32 registers): 32 / 160.
  static constexpr int kAlloc = kCons == 2 ? 168 : 128;
  static constexpr int kProducerRegs = kCons == 2 ? 40 : 32;
  static constexpr int kConsumerRegs = kCons == 2 ? 232 : 160;
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kCons == kAlloc * kThreads,
                "the setmaxnreg split must fit the launch allocation exactly");
  // Named barriers: 0 is __syncthreads; 1 .. kCons sync one consumer warpgroup (the epilogue);
  // kTurnBar .. kTurnBar + kCons - 1 pass the turn to issue GEMMs; kQuantBar syncs the
  // Q-quantizing warps.
  static constexpr int kTurnBar = 1 + kCons, kQuantBar = 1 + 2 * kCons;
  // kFirstQBar syncs the quantizing warps with every consumer warp: the CTA's first Q tile
  // (fused_q) is quantized by all kFirstQWarps of them, as nothing else can start before it
  // (warps 1-3 alone took ~18k cycles for it, tile trace at N = 1k: about 7 % of the kernel).
  static constexpr int kFirstQBar = 2 + 2 * kCons;
  static constexpr int kFirstQWarps = kQuantWarps + kConsumerWarps;
};
// The pre-pass's Q layout (128-row blocks) fits two consumers only: three need fused Q.
static_assert(Cfg<2>::kBlockQ == mma::kBlockQ, "pre-pass Q blocks are two consumers' rows");

template <int D, int kCons = 2>
struct Smem {
  static constexpr int kBlockQ = Cfg<kCons>::kBlockQ;
  static constexpr int kQTile = kBlockQ * D;  // [kBlockQ rows][D bytes], swizzled (A of Q·Kᵀ)
  static constexpr int kKTile = kBlockK * D;  // [128 keys][D bytes], swizzled
  static constexpr int kVTile = D * kBlockK;  // [D channels][128 keys], swizzled
  // Two Q tiles: the next tile's Q lands while this one's last blocks run.
  static constexpr int kBytes = 2 * kQTile + kStages * (kKTile + kVTile) + 1024;  // + align slack
  // With the Q quantization fused (AttnParams::fused_q): one staged fp16/bf16 Q tile besides.
  static constexpr int kQStaged = kBlockQ * D * 2;  // [kBlockQ rows][D elements], not swizzled
  static constexpr int kBytesFused = kBytes + kQStaged;
};

// Everything the kernel needs besides AttnParams: the TMA descriptors of Q, K and Vᵀ.
struct TmaMaps {
  CUtensorMap q;     // 3-D: {D bytes, nq_pad rows, B*Hq}, box {D, 128, 1}
  CUtensorMap k;     // 3-D: {D bytes, nk_pad keys, B*Hkv}, box {D, 128, 1}
  CUtensorMap v;     // 3-D: {nk_pad keys, D channels, B*Hkv}, box {128, D, 1}
  CUtensorMap q_in;  // fused_q: the caller's Q, 4-D {D, Nq, Hq, B} 16-bit, box {D, kBlockQ, 1, 1}
#ifdef SAGE_SM90_TRACE
  uint32_t* trace;  // kTraceWords (a development build only)
#endif
};

// Slots of the ring through which the producer thread tells the CTA its tiles (one round ahead).
constexpr int kSchedSlots = 4;

// A tile as the producer thread decodes it, once, for the whole CTA (the consumers and the
// quantizing warps used to divide the 64-bit tile number themselves: four 64-bit divisions, a
// software routine each, per thread and tile).
struct TileInfo {
  int64_t bh;        // batch · heads_q + query head
  int32_t qb;        // query block
  int32_t n_blocks;  // key blocks the tile sees (0 only when causal hides every key)
  int32_t b, h;      // batch, query head
  int32_t bhk;       // batch · heads_kv + its KV head
  int32_t done;      // past the last tile: the loops end here
};

// Quantizes the staged Q tile (2·kQGroups rows x D fp16/bf16, row-major, rows past seq_q zero:
// TMA's out-of-bounds fill) as the pre-pass's quant_q does: INT8 per thread group (rows g, g+8 of
// each 16-row slab: the rows one consumer thread's accumulator holds), scale max|q| / 127, into the
// INT8 tile in the layout the Q·Kᵀ wgmma reads (TMA's 128-byte swizzle for 128-byte rows, 64-byte
// for 64-byte rows), and the group scales into q_sc. With km (this KV head's K mean; LSE asked
// for) also each row's LSE shift scale · q·k_mean (exact products summed in double, as quant_q).
// qt: the thread's index among the n_warps·32 quantizing threads. Eight lanes take a group
// (four a row, D/32 16-byte chunks each: a three-step max), a warp four groups at a time: the
// latency of a pass (shared loads, shuffles, two divisions) is paid 6 times a tile, not 22.
template <int D, typename T, int kQGroups>
__device__ __forceinline__ void quantize_q_tile(const uint8_t* staged, uint8_t* q_tile, float* q_sc,
                                                int qt, int n_warps, const float* km, float* shift,
                                                int64_t row0, int64_t seq_q, float scale) {
  constexpr int kLanesPerGroup = 8, kGroupsPerPass = 32 / kLanesPerGroup;
  constexpr int kChunks = D / 32;                    // 16-byte chunks per lane: c·4 + part
  constexpr uint32_t kSwizzle = D == 128 ? 7u : 3u;  // 16-byte chunk ^= (byte offset >> 7) & this
  const int lane = qt % 32, li = lane % kLanesPerGroup;
  const int hi = li / 4, part = li % 4;
#pragma unroll 1
  for (int g0 = (qt / 32) * kGroupsPerPass; g0 < kQGroups; g0 += n_warps * kGroupsPerPass) {
    const int grp = g0 + lane / kLanesPerGroup;
    const int r = 16 * (grp / 8) + grp % 8 + 8 * hi;
    uint4 w[kChunks];
    for (int c = 0; c < kChunks; ++c)
      w[c] = *reinterpret_cast<const uint4*>(staged + (r * D + (c * 4 + part) * 8) * 2);
    float amax = 0.0f;  // NaN stays out, as fmaxf drops it (quant_q's float path)
    for (int c = 0; c < kChunks; ++c)
      for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(quant::elem_float<T>(w[c], e)));
    for (int m = 1; m < kLanesPerGroup; m *= 2)
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
    const QuantScale sc = make_quant_scale(amax, float(kInt8Max));
    // As quant_q: without NaN or infinity among this lane's elements and with a finite scale, no
    // product can leave [-127, 127] and none is NaN, so the clamp and the NaN test are skipped.
    const bool fast = quant::special_any<T>(w) == 0u && quant::finite_scale(amax, sc.inv);
    quant::quantize_store_row_part<T, D, 8>(
        q_tile, w, [](float x, int) { return x; }, part, sc.inv, float(kInt8Max), fast, 0xFFFFFFFFu,
        [r](int d0) {
          const uint32_t off = uint32_t(r * D + d0);
          return int(off ^ (((off >> 7) & kSwizzle) << 4));
        });
    if (li == 0) q_sc[grp] = sc.scale;
    if (km) {  // the staged row again (still in place), so w need not live this long
      double sh = 0;
      for (int c = 0; c < kChunks; ++c) {
        const uint4 x = *reinterpret_cast<const uint4*>(staged + (r * D + (c * 4 + part) * 8) * 2);
        for (int e = 0; e < 8; ++e)
          sh = __fma_rn(double(quant::elem_float<T>(x, e)), double(km[(c * 4 + part) * 8 + e]), sh);
      }
      for (int m = 1; m < 4; m *= 2) sh += __shfl_xor_sync(0xffffffffu, sh, m);
      if (part == 0 && row0 + r < seq_q) shift[row0 + r] = float(double(scale) * sh);
    }
  }
}

template <int D>
__device__ __forceinline__ void pv_wgmma(float (&o)[D / 2], const uint32_t (&p)[4], uint64_t desc) {
  if constexpr (D == 128)
    ptx::wgmma_m64n128k32_e4m3(o, p, desc, /*accumulate=*/true);
  else
    ptx::wgmma_m64n64k32_e4m3(o, p, desc, /*accumulate=*/true);
}

// One score in poly_every<D>() takes 2^x from a degree-3 polynomial on the FMA pipe (exp2_poly)
// instead of MUFU.EX2 (16 results / SM / clock); 1 << 20: none. H100, one call each, kernel-only
// TOPS at 4k / 16k non-causal (causal): D = 128 (two consumers) every 8th 760 / 853 (647 / 827),
// every 4th 732 / 826 (603 / 800), every 2nd 707 / 792, every 16th - / 826, none 718 / 813;
// D = 64 with three consumers none 538 / 616 (420 / 570), every 8th 515 / 584, every 4th
// 476 / 547, every 2nd 437 / 497 (a third warp per scheduler moves the limit off the MUFU queue
// onto issue). D = 64 with two (causal under 2048 rows, pre-pass Q): none as every 8th (190.6 vs
// 190.0 at causal 1k), so one choice per D, which keeps the fused and pre-pass Q paths bit for bit
// the same (the GPU test compares them). SAGE_SM90_POLY_EVERY (a measurement build) overrides it
// (0: none).
template <int D>
constexpr int poly_every() {
#ifdef SAGE_SM90_POLY_EVERY
  return SAGE_SM90_POLY_EVERY > 0 ? SAGE_SM90_POLY_EVERY : 1 << 20;
#else
  return D == 64 ? 1 << 20 : 8;
#endif
}

// Where a consumer passes the GEMM-issue turn (see take_turn): when its Q·Kᵀ has landed, or
// once its block's row maxima are taken, which sends the other consumer's Q·Kᵀ out later and
// its maxima under this one's 2^x. H100, kernel-only TOPS, one call (base twice vs after the
// maxima): D = 128 non-causal 16k 847 / 846 vs 865, 1k 509 / 501 vs 517, 4k 761 / 764 vs 757;
// D = 128 causal 16k 828 / 825 vs 799, 4k 648 / 650 vs 642; D = 64 with three consumers 8-11 %
// slower. So after the maxima for D = 128 non-causal only (two consumers, blocks of equal
// length); a second call, D = 128 non-causal, this choice twice vs the turn at the landing:
// kernel-only 1k 517 / 528 vs 505, 4k 777 / 777 vs 761, 16k 871 / 855 vs 857 (e2e 326 / 330 vs
// 323, 653 / 651 vs 647, 830 / 831 vs 820), causal (the same code) within 1 %.
// SAGE_SM90_TURN_AFTER_MAX (a measurement build) forces it: 1 everywhere, 0 nowhere.
template <int D, bool kCausal, int kCons>
constexpr bool turn_after_max() {
#ifdef SAGE_SM90_TURN_AFTER_MAX
  return SAGE_SM90_TURN_AFTER_MAX != 0;
#else
  return D == 128 && !kCausal && kCons == 2;
#endif
}

// SAGE_SM90_SEED=0 (a measurement build): the S accumulator starts from zero (the first Q·Kᵀ
// wgmma without accumulate) instead of the 64 seed MOVs before each Q·Kᵀ, and each score takes
// one integer add (x + kMagic) in the softmax instead. Same results, bit for bit. The seed MOVs
// cost ~10 % when measured against no conversion at all (885 vs ~800 TOPS at 16k, before the
// turns); whether the adds cost less where they sit is what this switch measures.
#ifndef SAGE_SM90_SEED
#define SAGE_SM90_SEED 1
#endif

// Named barriers: see Cfg (two consumers: 1, 2 their epilogues; 3, 4 the turns; 5 the quantizing
// warps; 6 the quantizing warps with the consumers for the CTA's first Q tile).

// 1.5·2^23: a float whose unit in the last place is 1, so adding it rounds to an integer held in
// the low mantissa bits (exp2_poly), and its bits plus an int32 x are the float 1.5·2^23 + x (the
// S accumulator's seed, kMagic below).
constexpr float kMagicF = 12582912.0f;

// Phase trace (a development build only: -DSAGE_SM90_TRACE): lane 0 of every consumer warp of
// the first kTraceCtas CTAs of row blockIdx.y == 0 writes the SM clock at seven points of each of
// its first kTraceBlocks key blocks (trace_event below); the launcher prints per-phase means.
// The stores perturb the schedule by a few per cent.
#ifdef SAGE_SM90_TRACE
constexpr int kTraceCtas = 4, kTraceBlocks = 48, kTraceEvents = 7;
// Tile-level events of the same warps over their first kTraceTiles tiles: loop top, tile read,
// Q ready, block 0 done, loop done, last P·V landed, epilogue done. Both go to a buffer the
// launcher allocates (TmaMaps::trace): blocks first, then tiles.
constexpr int kTraceTiles = 16, kTileEvents = 7;
constexpr int kTraceWarps = 12;  // consumer warps of up to three warpgroups
constexpr int kTraceWords =
    kTraceCtas * kTraceWarps * (kTraceBlocks * kTraceEvents + kTraceTiles * kTileEvents);
#endif
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

// 2^x for x <= 9 (in [-125, 9] exactly enough; below, a value under 2^-125 that E4M3 and the row
// sum cannot see), on the FMA and integer pipes: x = n + r with n = round(x), |r| <= 1/2;
// 2^r by a degree-3 polynomial fitted for relative error (max 1.0e-4); n added to the exponent.
__device__ __forceinline__ float exp2_poly(float x) {
  x = fmaxf(x, -125.0f);
  const float t = x + kMagicF;  // 1.5·2^23 + n: the low bits of t hold n
  const float r = x - (t - kMagicF);
  float q = fmaf(0.0550089331f, r, 0.242210972f);
  q = fmaf(q, r, 0.693282928f);
  q = fmaf(q, r, 1.0f);
  return __int_as_float(__float_as_int(q) + (__float_as_int(t) << 23));
}

template <int D, typename OutT, bool kCausal, int kCons>
__global__ void __launch_bounds__(Cfg<kCons>::kThreads, 1)
    attention_kernel(const AttnParams p, const __grid_constant__ TmaMaps maps) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = Smem<D, kCons>;
  using C = Cfg<kCons>;
  constexpr int kBlockQ = C::kBlockQ, kConsumerWarps = C::kConsumerWarps;
  constexpr int kProducerRegs = C::kProducerRegs, kConsumerRegs = C::kConsumerRegs;
  constexpr int kTurnBar = C::kTurnBar, kQuantBar = C::kQuantBar, kFirstQBar = C::kFirstQBar;
  constexpr int kFirstQWarps = C::kFirstQWarps;
  constexpr int kPoly = poly_every<D>();
  // Q from the pre-pass (TMA of its INT8 blocks) exists for two consumers only.
  const bool fused_q = kCons != 2 || p.fused_q;
#ifdef SAGE_SM90_TRACE
  uint32_t* const trace_buf = maps.trace;
#else
  uint32_t* const trace_buf = nullptr;
#endif
  constexpr int kQkSteps = D / 32;  // k32 steps along head_dim
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* q_tiles = smem;  // two buffers: tile i of this CTA uses buffer i & 1
  uint8_t* k_tiles = smem + 2 * S::kQTile;
  uint8_t* v_tiles = k_tiles + kStages * S::kKTile;
  uint8_t* q_staged = v_tiles + kStages * S::kVTile;  // fused_q: the caller's Q tile, by TMA
  __shared__ float v_stat[2][kCons][2][D];  // [tile parity][consumer warpgroup]: V scales, means
  __shared__ float q_sc[2][C::kQGroups];    // fused_q: the Q group scales of each Q buffer
  __shared__ __align__(8) uint64_t full_q[2], empty_q[2], full_k[kStages], full_v[kStages],
      empty_k[kStages], empty_v[kStages], full_staged;
  // The tile of each of this CTA's rounds, published by the producer thread one round ahead
  // (slot it % kSchedSlots; full: published, empty: read by every consumer and quantizing thread).
  __shared__ TileInfo sched[kSchedSlots];
  __shared__ __align__(8) uint64_t sched_full[kSchedSlots], sched_empty[kSchedSlots];

  // Persistent: tiles (query block, batch·head) are numbered head-major, so a head's K and V stay
  // in L2 while the grid works on it (numbered across heads, the causal tiles put ~130 heads' K
  // and V in flight: 16k causal fell from 795 to 650 TOPS); causal: each head's heaviest query
  // blocks (most keys) first. Non-causal (equal tiles): CTA c takes one tile per round of
  // gridDim.x, c in even rounds and gridDim.x - 1 - c in odd ones (a snake). Causal (tiles of 1 ..
  // Nk/128 blocks): tile c first, then the next untaken tile in order from a global counter
  // whenever the CTA starts a round, as the hardware dispatched one CTA per tile (a static snake
  // balanced the work to 1.03x but lost to that dispatch: 16k 742 vs 795 TOPS).
  // Query tiles of kBlockQ rows (two consumers: the pre-pass's q_blocks).
  const int64_t q_tiles_n = (p.seq_q + kBlockQ - 1) / kBlockQ;
  const int64_t bhq = p.batch * p.heads_q, tiles = q_tiles_n * bhq;
  auto tile_of = [&](int round) -> int64_t {  // the producer thread's scheduler
    if (kCausal)
      return round == 0 ? int64_t(blockIdx.x) : int64_t(gridDim.x) + atomicAdd(p.tile_counter, 1u);
    return int64_t(round) * gridDim.x + ((round & 1) ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
  };
  auto decode = [&](int64_t tile) {  // the producer thread, once per tile
    TileInfo ti{};
    ti.done = tile >= tiles;
    if (ti.done) return ti;
    ti.bh = tile / q_tiles_n;
    const int64_t qb = kCausal ? q_tiles_n - 1 - tile % q_tiles_n : tile % q_tiles_n;
    ti.qb = int32_t(qb);
    const int64_t last_row = min(p.seq_q, (qb + 1) * kBlockQ) - 1;
    const int64_t kv_end = kCausal ? min(p.seq_kv, last_row + p.causal_offset + 1) : p.seq_kv;
    ti.n_blocks = kv_end > 0 ? int32_t((kv_end + kBlockK - 1) / kBlockK) : 0;
    ti.b = int32_t(ti.bh / p.heads_q);
    ti.h = int32_t(ti.bh % p.heads_q);
    ti.bhk = int32_t(p.kv_head(ti.b, ti.h));
    return ti;
  };
  // Everyone else reads a round's tile from the ring (and releases the slot).
  auto read_tile = [&](int round) {
    const int slot = round % kSchedSlots;
    ptx::mbar_wait(&sched_full[slot], (round / kSchedSlots) & 1);
    const TileInfo ti = sched[slot];
    ptx::mbar_arrive(&sched_empty[slot]);
    return ti;
  };
  // Barrier phases across tiles: a tile's blocks use stages 0, 1, 0, ... from stage 0, so stage s
  // is used ceil(n/2) (s = 0) or floor(n/2) times; bit s of `base` flips with that parity, and
  // block kb's phase on stage kb & 1 is bit 1 of kb xor that bit.
  auto next_base = [](uint32_t base, int n_blocks) {
    return base ^ uint32_t(((n_blocks + 1) >> 1) & 1) ^ (uint32_t((n_blocks >> 1) & 1) << 1);
  };
  // The phase of block kb's full barriers on stage s (the producer waits the empty ones at the
  // opposite phase).
  auto kv_phase = [](int kb, int s, uint32_t base) {
    return uint32_t((kb >> 1) ^ (base >> s)) & 1;
  };

  // fused_q: tile ti's staged Q quantized into Q buffer qbuf by quantizing thread qt of n_warps
  // warps (warps 1-3 every tile; with every consumer warp for the CTA's first), made visible to
  // the wgmma (the async proxy). The caller then syncs its quantizing threads.
  auto quantize_q = [&](const TileInfo& ti, int qbuf, int qt, int n_warps) {
    quantize_q_tile<D, OutT, C::kQGroups>(q_staged, q_tiles + qbuf * S::kQTile, q_sc[qbuf], qt,
                                          n_warps, p.lse ? p.k_mean + int64_t(ti.bhk) * D : nullptr,
                                          p.lse_shift + ti.bh * p.seq_q, int64_t(ti.qb) * kBlockQ,
                                          p.seq_q, p.scale);
    ptx::fence_proxy_async_smem();
  };

  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int i = 0; i < 2; ++i) {
      // fused_q: every quantizing thread arrives once its part of the buffer is written (each
      // releases its own writes); else the TMA's single arrival.
      ptx::mbar_init(&full_q[i], fused_q ? kQuantWarps * 32 : 1);
      ptx::mbar_init(&empty_q[i], kConsumerWarps);
    }
    ptx::mbar_init(&full_staged, 1);
    for (int i = 0; i < kSchedSlots; ++i) {
      ptx::mbar_init(&sched_full[i], 1);
      ptx::mbar_init(&sched_empty[i], kCons * 128 + (fused_q ? kQuantWarps * 32 : 0));
    }
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(&full_k[s], 1);
      ptx::mbar_init(&full_v[s], 1);
      ptx::mbar_init(&empty_k[s], kConsumerWarps);
      ptx::mbar_init(&empty_v[s], kConsumerWarps);
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();
  // Programmatic dependent launch: everything above overlapped the pre-pass's tail; nothing is
  // read from global memory before the kernels this one depends on have finished.
  ptx::grid_dependency_wait();

  if (wg == 0) {  // ---- producer ----
    ptx::setmaxnreg_dec<kProducerRegs>();
    // fused_q: the caller's Q of tile ti staged by TMA (16-bit, rows past Nq zero).
    auto stage_q = [&](const TileInfo& ti) {
      ptx::mbar_arrive_expect_tx(&full_staged, S::kQStaged);
      ptx::tma_load_4d(q_staged, &maps.q_in, &full_staged, 0, ti.qb * kBlockQ, ti.h, ti.b);
    };
    if (fused_q && threadIdx.x >= 32) {
      // Warps 1-3: Q of each tile, the caller's fp16/bf16 staged by TMA, quantized into the Q
      // buffer once the consumers have released it (a tile ahead of them: the buffer frees when
      // the tile before last is done). The next tile's staging load is issued as soon as every
      // quantizing thread has read this one.
      // (The CTA's first tile is staged by the producer thread.)
      const int qt = threadIdx.x - 32;
      TileInfo ti = read_tile(0);
      for (int it = 0; !ti.done; ++it) {
        const int qbuf = it & 1;
        ptx::mbar_wait(&full_staged, it & 1);
        ptx::mbar_wait(&empty_q[qbuf], ((it >> 1) & 1) ^ 1);  // the first round passes at once
        // The first tile with the consumers (quantizing threads 96 .. are theirs).
        quantize_q(ti, qbuf, qt, it == 0 ? kFirstQWarps : kQuantWarps);
        if (it == 0)  // every quantizing thread, the consumers' too: the staged tile is free
          ptx::named_bar_sync(kFirstQBar, kFirstQWarps * 32);
        else
          ptx::named_bar_sync(kQuantBar, kQuantWarps * 32);  // the staged tile is free
        ptx::mbar_arrive(&full_q[qbuf]);
        ti = read_tile(it + 1);
        if (qt == 0 && !ti.done) stage_q(ti);
      }
      return;
    }
    if (threadIdx.x == 0) {
      auto publish = [&](int round, const TileInfo& ti) {
        const int slot = round % kSchedSlots;
        ptx::mbar_wait(&sched_empty[slot], ((round / kSchedSlots) & 1) ^ 1);  // first: at once
        sched[slot] = ti;
        ptx::mbar_arrive(&sched_full[slot]);  // releases the write
      };
      uint32_t base = 0;
      TileInfo ti = decode(tile_of(0));
      // The first tile's Q before any K/V load: every CTA starts at once, and the ~12 MB of
      // first Q tiles and K/V stages they ask for together made each CTA's first Q tile wait
      // ~13.7k cycles (tile trace at 1k) while nothing can start without it; issued first, the
      // Q tiles are not queued behind the K/V stages.
      if (fused_q && !ti.done) stage_q(ti);
      publish(0, ti);
      for (int it = 0; !ti.done; ++it) {
        // One round ahead: the quantizing warps prepare the next tile's Q during this one.
        const TileInfo next = decode(tile_of(it + 1));
        publish(it + 1, next);
        const int qbuf = it & 1;
        if (!fused_q) {
          ptx::mbar_wait(&empty_q[qbuf], ((it >> 1) & 1) ^ 1);  // the first round passes at once
          ptx::mbar_arrive_expect_tx(&full_q[qbuf], S::kQTile);
          ptx::tma_load_3d(q_tiles + qbuf * S::kQTile, &maps.q, &full_q[qbuf], 0, ti.qb * kBlockQ,
                           int(ti.bh));
        }
        for (int kb = 0; kb < ti.n_blocks; ++kb) {
          const int s = kb % kStages;
          const uint32_t parity = kv_phase(kb, s, base) ^ 1;  // the first round passes at once
          ptx::mbar_wait(&empty_k[s], parity);
          ptx::mbar_arrive_expect_tx(&full_k[s], S::kKTile);
          ptx::tma_load_3d(k_tiles + s * S::kKTile, &maps.k, &full_k[s], 0, kb * kBlockK, ti.bhk);
          ptx::mbar_wait(&empty_v[s], parity);
          ptx::mbar_arrive_expect_tx(&full_v[s], S::kVTile);
          ptx::tma_load_3d(v_tiles + s * S::kVTile, &maps.v, &full_v[s], kb * kBlockK, 0, ti.bhk);
        }
        base = next_base(base, ti.n_blocks);
        ti = next;
      }
      // Causal: every CTA has drawn past the last tile; the last one out zeroes the counters for
      // the next launch.
      if (kCausal && atomicAdd(p.tile_counter + 1, 1u) == gridDim.x - 1) {
        p.tile_counter[0] = 0u;
        p.tile_counter[1] = 0u;
      }
    }
    return;
  }

  // ---- consumers: warpgroup c = wg - 1 owns rows c*64 .. c*64+63 of each tile ----
  ptx::setmaxnreg_inc<kConsumerRegs>();
  const int warp = threadIdx.x / 32 - 4;  // the 16-row slab of the tile (0 .. kConsumerWarps-1)
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int consumer = warp / 4;
  // Turns (a soft ping-pong): a consumer waits for its turn before issuing Q·Kᵀ(kb) (and
  // P·V(kb-1) behind it) and passes the turn once its Q·Kᵀ has landed, so the other consumer's
  // GEMMs enter the tensor cores' queue after this one's Q·Kᵀ instead of beside it. The queue
  // takes about eight m64n128k32 wgmmas per SM before wgmma issue blocks the warp
  // (tools/probes/wgmma_issue.cu: 16 back to back take 625 cycles to issue, 8 take 103), so
  // with both consumers issuing their eight at once the second stalled ~500 cycles in issue.
  // Measured (H100, D=128): kernel-only 4k 699 -> 728, 16k 799 -> 821 TOPS; passing the turn
  // right after the issue (the other consumer then issues into a full queue) or serializing
  // the softmaxes instead was slower (docs/sm90-kernel.md). D = 128 non-causal passes it later,
  // once the block's row maxima are taken (turn_after_max). Consumer 0 goes first.
  auto take_turn = [] { ptx::turn_wait<kTurnBar, kCons>(); };
  auto pass_turn = [] { ptx::turn_pass<kTurnBar, kCons>(); };
  if (consumer == kCons - 1) pass_turn();  // consumer 0 goes first

  uint32_t base = 0;  // barrier phases across tiles, as the producer's
  for (int it = 0;; ++it) {
    tile_event(trace_buf, it, 0);
    const TileInfo ti = read_tile(it);
    if (ti.done) break;
    tile_event(trace_buf, it, 1);
    const int64_t qb = ti.qb, bh = ti.bh, b = ti.b, h = ti.h, bhk = ti.bhk;
    const int n_blocks = ti.n_blocks;
    const int64_t row_a = qb * kBlockQ + warp * 16 + g;
    const int64_t first_row = qb * kBlockQ;
    const int64_t min_end = kCausal ? min(p.seq_kv, first_row + p.causal_offset + 1) : p.seq_kv;
    const int first_masked_block = min_end > 0 ? int(min_end / kBlockK) : 0;
    const int qbuf = it & 1;

    // Q (quantized by the pre-pass) arrives by TMA into buffer qbuf; this warpgroup's 64 rows are
    // the A operand of Q·Kᵀ straight from shared memory. (A from registers held across the loop
    // was miscompiled at D=128: ptxas gave the P̃ fragments the Q fragments' registers.)
    const uint8_t* q_wg = q_tiles + qbuf * S::kQTile + consumer * 64 * D;
    // The Q scale: from the pre-pass (loaded before the wait), or from the quantizing warps.
    float q_scale_log2 =
        fused_q ? 0.0f : p.q_scale[(bh * p.q_blocks + qb) * mma::kQGroups + warp * 8 + g];
    const float* k_scale = p.k_scale + bhk * p.k_blocks * mma::kKGroups;
    // The epilogue's V scales and means, copied now into this warpgroup's shared copy for this
    // tile (cp.async: nothing waits until the epilogue; the buffer alternates with the tile, so
    // the previous tile's epilogue may still read the other). Read from global there, their
    // load latency sat exposed in every tile's epilogue: 25-30 % of the stall samples at N = 1k.
    float(&vst)[2][D] = v_stat[qbuf][consumer];
    for (int j = threadIdx.x % 128; j < 2 * D; j += 128)
      ptx::cp_async_4(&vst[j / D][j % D], (j < D ? p.v_scale : p.v_mean) + bhk * D + j % D);
    ptx::cp_async_commit();

    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    float o[D / 2];
    for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
    // P^ of the previous block, the A operand of its P·V (issued one block late).
    uint32_t pf[4][4];
    if (fused_q && it == 0) {
      // The CTA's first Q tile: quantized with warps 1-3 (kFirstQWarps), then released by them.
      ptx::mbar_wait(&full_staged, 0);
      quantize_q(ti, 0, kQuantWarps * 32 + threadIdx.x - 128, kFirstQWarps);
      ptx::named_bar_sync(kFirstQBar, kFirstQWarps * 32);
    }
    ptx::mbar_wait(&full_q[qbuf], (it >> 1) & 1);
    if (fused_q) q_scale_log2 = q_sc[qbuf][warp * 8 + g];
    q_scale_log2 *= p.scale_log2;
    tile_event(trace_buf, it, 2);

    // The S accumulator starts at the bits of 1.5·2^23 (kMagic), so the exact int32 score x
    // (|x| < 2^21 for int8 at D <= 128) comes out of the wgmma as the bits of the float
    // 1.5·2^23 + x: the int -> float conversion costs nothing, the max can be taken on the bits,
    // and the softmax of a visible score is one FFMA and one EX2:
    //   P~ · 448 = 2^(x·f - m + log2 448) = 2^(y·f - bias),  y = 1.5·2^23 + x,
    //   bias = 1.5·2^23·f + m - log2 448,
    // where f = q_scale · k_scale · scale · log2 e. Rounding bias costs at most 0.75·f in the
    // exponent, under a unit of the int32 score (int8 rounding moves it by hundreds). The softmax
    // writes P~ · 448 (the E4M3-range values P^ is packed from) over the scores, as float bits,
    // and l sums them (finalize's kLUnit 448).
    constexpr int kMagic = 0x4B400000;  // the bits of kMagicF
    // A score's accumulator word as the float 1.5·2^23 + x (seeded: it already is).
    auto seeded = [](int v) { return __int_as_float(SAGE_SM90_SEED ? v : v + kMagic); };
    constexpr float kLog2E4m3Max = 8.80735492205760410f;  // log2 448
    auto scales = [&](int kb, float(&f)[2]) {             // f of keys 0-63 and 64-127 of block kb
      f[0] = q_scale_log2 * k_scale[(2 * kb) * mma::kKGroups + t];
      f[1] = q_scale_log2 * k_scale[min(2 * kb + 1, int(p.k_blocks) - 1) * mma::kKGroups + t];
    };
    constexpr bool kTurnAfterMax = turn_after_max<D, kCausal, kCons>();
    auto softmax_block = [&](int(&sacc)[64], int kb, const float(&f)[2], float(&alpha)[2]) {
      float row_max[2], m_use[2];
      float part[2][4] = {};          // four partial sums per row: short FADD chains
      if (kb < first_masked_block) {  // every key visible to every row (CTA-uniform)
        int mx[2][2];
        for (int r = 0; r < 2; ++r)
          for (int h = 0; h < 2; ++h) {  // a tree over the 16 scores of (row r, key half h)
            int v[16];
            for (int j = 0; j < 16; ++j) v[j] = sacc[32 * h + 4 * (j / 2) + 2 * r + (j & 1)];
            for (int w = 16; w > 1; w /= 2)
              for (int j = 0; j < w / 2; ++j) v[j] = max(v[j], v[j + w / 2]);
            mx[r][h] = v[0];
          }
        for (int r = 0; r < 2; ++r)
          row_max[r] =
              fmaxf((seeded(mx[r][0]) - kMagicF) * f[0], (seeded(mx[r][1]) - kMagicF) * f[1]);
        attn::online_max(row_max, m, l, alpha, m_use);
        if constexpr (kTurnAfterMax) pass_turn();
        float bias[2][2];
        for (int r = 0; r < 2; ++r)
          for (int h = 0; h < 2; ++h) bias[r][h] = fmaf(kMagicF, f[h], m_use[r] - kLog2E4m3Max);
        for (int i = 0; i < 64; ++i) {
          const float x = fmaf(seeded(sacc[i]), f[i / 32], -bias[(i / 2) & 1][i / 32]);
          const float e = i % kPoly == kPoly - 1 ? exp2_poly(x) : ptx::ex2(x);
          part[(i / 2) & 1][i / 16] += e;
          sacc[i] = __float_as_int(e);
        }
      } else {  // the diagonal and the Nk edge: scores as floats, hidden ones -inf
        int visible[2];
        attn::visible_keys<kCausal, kBlockK>(p, row_a, int64_t(kb) * kBlockK, visible);
        row_max[0] = row_max[1] = -INFINITY;
        for (int i = 0; i < 64; ++i) {
          const bool hidden = (i / 4) * 8 + 2 * t + (i & 1) >= visible[(i / 2) & 1];
          const float x = hidden ? -INFINITY : (seeded(sacc[i]) - kMagicF) * f[i / 32];
          row_max[(i / 2) & 1] = fmaxf(row_max[(i / 2) & 1], x);
          sacc[i] = __float_as_int(x);
        }
        attn::online_max(row_max, m, l, alpha, m_use);
        if constexpr (kTurnAfterMax) pass_turn();
        for (int i = 0; i < 64; ++i) {
          const float e = ptx::ex2(__int_as_float(sacc[i]) - (m_use[(i / 2) & 1] - kLog2E4m3Max));
          part[(i / 2) & 1][i / 16] += e;
          sacc[i] = __float_as_int(e);
        }
      }
      for (int r = 0; r < 2; ++r) l[r] += (part[r][0] + part[r][1]) + (part[r][2] + part[r][3]);
    };
    auto pack_p = [&](const int(&pe)[64]) {
      attn::pack_p_e4m3(pf, [&](int n, int e) { return __int_as_float(pe[4 * n + e]); });
    };
    // O *= alpha, skipped when no row of the warp saw its max move (most blocks after the first
    // few): a warp-uniform branch outside any wgmma's flight.
    auto rescale_o = [&](const float(&alpha)[2]) {
      if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f))
        for (int i = 0; i < D / 2; ++i) o[i] *= alpha[(i / 2) & 1];
    };

    // Descriptors: computed once, a stage and a k-step add (bytes >> 4) to the start address.
    const uint64_t q_desc = ptx::wgmma_desc<D>(q_wg);
    const uint64_t k_desc = ptx::wgmma_desc<D>(k_tiles);
    const uint64_t v_desc = ptx::wgmma_desc<128>(v_tiles);
    // The ring has two stages and the loop runs two blocks per turn, so a block's stage is a
    // compile-time constant (its descriptors, barriers and offsets fold into immediates) and its
    // barrier phase is bit 1 of the block index.
    static_assert(kStages == 2, "the consumer loop is unrolled over a two-stage ring");
    using Stage0 = std::integral_constant<int, 0>;
    using Stage1 = std::integral_constant<int, 1>;
    // Q·Kᵀ of block kb (in stage st) into sacc (seeded with kMagic, or from zero with
    // SAGE_SM90_SEED=0), and its scales into f.
    auto issue_qk = [&](auto stage, int(&sacc)[64], float(&f)[2], int kb) {
      constexpr int st = decltype(stage)::value;
      if (SAGE_SM90_SEED)
        for (int i = 0; i < 64; ++i) sacc[i] = kMagic;
      scales(kb, f);  // loaded before the wait: the wgmma asm orders memory, the load hides behind
      take_turn();
      ptx::mbar_wait(&full_k[st], kv_phase(kb, st, base));
      ptx::wgmma_fence_regs(sacc);
      ptx::wgmma_fence();
      for (int s = 0; s < kQkSteps; ++s)
        ptx::wgmma_m64n128k32_s8_ss(sacc, q_desc + uint64_t(s * 32 >> 4),
                                    k_desc + uint64_t((st * S::kKTile + s * 32) >> 4),
                                    /*accumulate=*/SAGE_SM90_SEED || s > 0);
      ptx::wgmma_commit();
    };
    // P·V of block kb (in stage st; A = pf).
    auto issue_pv = [&](auto stage, int kb) {
      constexpr int st = decltype(stage)::value;
      ptx::mbar_wait(&full_v[st], kv_phase(kb, st, base));
      ptx::wgmma_fence_regs(o);
      ptx::wgmma_fence();
      for (int c = 0; c < 4; ++c)
        pv_wgmma<D>(o, pf[c], v_desc + uint64_t((st * S::kVTile + c * 32) >> 4));
      ptx::wgmma_commit();
    };
    auto release = [&](uint64_t* bar) {
      __syncwarp();
      if (lane == 0) ptx::mbar_arrive(bar);
    };

    // Step kb (kb >= 1, in stage st; block kb-1 in the other), on entry pf = P^(kb-1): issue
    // Q·Kᵀ(kb), then P·V(kb-1) behind it; wait for Q·Kᵀ(kb) only and run the softmax of kb while
    // P·V(kb-1) is on the tensor cores; wait for it, O *= alpha, pf = P^(kb). Every wgmma of the
    // loop is issued unconditionally (a conditional GEMM in the loop made ptxas serialize them
    // all, C7514: block 0 is peeled, and the odd last block runs after the loop).
    // (Two S register sets, Q·Kᵀ(kb+1) in flight during softmax(kb), need more than the 240
    // registers a consumer gets: ptxas spilled ~1.2 KB.)
    auto step = [&](auto stage, int kb) {
      constexpr int st = decltype(stage)::value;
      using Prev = std::integral_constant<int, 1 - st>;
      int sacc[64];
      float f[2];
      trace_event(trace_buf, kb, 0);
      issue_qk(stage, sacc, f, kb);
      trace_event(trace_buf, kb, 1);
      issue_pv(Prev{}, kb - 1);
      trace_event(trace_buf, kb, 2);
      ptx::wgmma_wait<1>();  // Q·Kᵀ(kb) is ready; P·V(kb-1) may still run
      ptx::wgmma_fence_regs(sacc);
      if constexpr (!kTurnAfterMax) pass_turn();
      trace_event(trace_buf, kb, 3);
      release(&empty_k[st]);
      float alpha[2];
      softmax_block(sacc, kb, f, alpha);
      trace_event(trace_buf, kb, 4);
      ptx::wgmma_wait<0>();  // P·V(kb-1) landed: O may be rescaled, pf rewritten
      ptx::wgmma_fence_regs(o);
      trace_event(trace_buf, kb, 5);
      release(&empty_v[1 - st]);
      rescale_o(alpha);
      pack_p(sacc);
      trace_event(trace_buf, kb, 6);
    };

    if (n_blocks > 0) {
      {
        int sacc[64];
        float f[2], alpha[2];
        issue_qk(Stage0{}, sacc, f, 0);
        ptx::wgmma_wait<0>();
        ptx::wgmma_fence_regs(sacc);
        if constexpr (!kTurnAfterMax) pass_turn();
        release(&empty_k[0]);
        softmax_block(sacc, 0, f, alpha);
        pack_p(sacc);
      }
      tile_event(trace_buf, it, 3);
      int kb = 1;
      for (; kb + 1 < n_blocks; kb += 2) {
        step(Stage1{}, kb);
        step(Stage0{}, kb + 1);
      }
      if (kb < n_blocks) step(Stage1{}, kb);
      tile_event(trace_buf, it, 4);
      // The last block's P·V (in turn, like every GEMM issue: both consumers take and pass the
      // turn n_blocks + 1 times; the arrival consumer 1 began with is left over at exit).
      release(
          &empty_q[qbuf]);  // every Q·Kᵀ of the tile has landed: the producer may reuse the buffer
      take_turn();
      if ((n_blocks - 1) & 1)
        issue_pv(Stage1{}, n_blocks - 1);
      else
        issue_pv(Stage0{}, n_blocks - 1);
      ptx::wgmma_wait<0>();
      ptx::wgmma_fence_regs(o);
      pass_turn();
      release(&empty_v[(n_blocks - 1) % kStages]);
      tile_event(trace_buf, it, 5);
    } else {
      release(&empty_q[qbuf]);  // no key visible to the tile (causal): Q was never read
    }

    ptx::cp_async_wait<0>();  // this warpgroup's copy of the V scales and means has landed
    ptx::named_bar_sync(1 + consumer, 128);
    attn::finalize<D, OutT, 448>(
        p, [&](int i, int e) { return o[4 * i + e]; }, m, l, b, h, bh, row_a, t, vst[0], vst[1]);
    tile_event(trace_buf, it, 6);
    base = next_base(base, n_blocks);
  }  // tile loop
#endif
}

}  // namespace sage::sm90
