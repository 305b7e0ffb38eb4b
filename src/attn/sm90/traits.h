// The Hopper (sm_90a) kernel's fixed choices, per head dim D and number of consumer warpgroups:
// tile sizes, register and shared-memory budgets, the named barriers, and the softmax's chosen
// constants. Plain C++ (no CUDA types): the planner (src/api) reads the tile sizes from here.
#pragma once

namespace sage::sm90 {

constexpr int kBlockK = 128;     // keys per block = the N of the Q·Kᵀ wgmma (D <= 128; D = 256:
                                 // Traits::kBlockK)
constexpr int kStages = 2;       // K and Vᵀ tiles in flight (the consumer loop is unrolled by 2)
constexpr int kQuantWarps = 3;   // warps 1-3 of the producer warpgroup quantize Q (fused Q)
constexpr int kSchedSlots = 4;   // tiles published ahead to the CTA (the scheduler ring)

// kCons consumer warpgroups own 64 query rows each: 2, or 3 at D = 64 (a third warp per scheduler
// hides the softmax's latency there; at D = 128, S + O + P^ do not fit the 160 registers three
// would get). The planner chooses; the pre-pass's Q layout (128-row blocks) fits two only.
//
// D = 256 (two consumers) streams 64-key blocks: with 128 it would need S 64 + O 128 + P^ 16
// registers a consumer thread and 256 KB of shared memory. A 64-key block is one K scale group,
// the softmax block of the emulation (block_k 64, softmax_block_k 64), S 32 registers.
template <int D, int kCons>
struct Traits {
  static_assert(D == 64 || D == 128 || D == 256, "head dims 64, 128 and 256");
  static_assert(kCons == 2 || kCons == 3, "two or three consumer warpgroups");
  static_assert(D != 256 || kCons == 2, "D = 256: two consumer warpgroups");
  static constexpr int kBlockQ = 64 * kCons;
  static constexpr int kBlockK = D == 256 ? 64 : sm90::kBlockK;  // keys per block
  static constexpr int kThreads = 128 * (kCons + 1);
  static constexpr int kConsumerWarps = 4 * kCons;
  static constexpr int kQGroups = kBlockQ / 2;  // Q scale groups: rows {g, g+8} of each 16
  static constexpr int kQkSteps = D / 32;       // k32 wgmma steps along the head dim
  static constexpr int kPvSteps = kBlockK / 32;  // k32 wgmma steps along a block's keys
  static constexpr int kScores = kBlockK / 2;    // a consumer thread's scores of a block
  static constexpr int kKGroupsPerBlock = kBlockK / 64;  // K scale groups (64 keys) a block

  // INT8 Q and K rows wider than the 128-byte swizzle span (D = 256) are stored as panels of
  // 128-byte columns (one TMA box each), a tile's panels one after the other: the k-steps along
  // D walk a panel, then the next. Vᵀ rows are kBlockK keys (64-byte swizzle at 64).
  static constexpr int kRowBytes = D > 128 ? 128 : D;  // bytes of a Q/K row in one panel
  static constexpr int kPanels = D / kRowBytes;

  // Registers per thread after setmaxnreg. The CTA's pool is what the launch allocated (ptxas's
  // count under __launch_bounds__(kThreads, 1): 168 for 384 threads, 128 for 512);
  // setmaxnreg.inc waits until the pool holds what it asks for, so a split over the pool hangs
  // every consumer. A consumer thread holds S (64 int32), O (D/2 fp32) and P^ (16): at 232 its
  // loop has no spills; 40 lets the quantizing warps run without spilling in theirs. Three
  // consumers (D = 64: O is 32 registers): 32 / 160. D = 256 keeps 40 / 232: S 32 + O 128 +
  // P^ 8 registers, and its quantizing warps re-read the staged row instead of holding it.
  static constexpr int kAlloc = kCons == 2 ? 168 : 128;
  static constexpr int kProducerRegs = kCons == 2 ? 40 : 32;
  static constexpr int kConsumerRegs = kCons == 2 ? 232 : 160;
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kCons == kAlloc * kThreads,
                "the setmaxnreg split must fit the launch allocation exactly");

  // Named barriers (0 is __syncthreads).
  enum Barrier : int {
    kBarEpilogue = 1,             // + c: consumer warpgroup c alone (its epilogue)
    kBarTurn = 1 + kCons,         // + c: consumer c's turn to issue GEMMs (a ring of kCons)
    kBarQuant = 1 + 2 * kCons,    // the Q-quantizing warps
    kBarFirstQ = 2 + 2 * kCons,   // the quantizing warps with every consumer warp (first Q tile)
  };
  // Under a causal mask the CTA's first Q tile is quantized by warps 1-3 and every consumer
  // warp: nothing can start before it, the consumer warps have nothing else to do yet, and a
  // causal CTA's first tile is one of its heaviest (heaviest query blocks first). Without a mask
  // warps 1-3 quantize it alone: the consumers' copy of the quantizer is code each CTA runs once,
  // cold from the instruction cache, and costs more than the faster Q saves there
  // (docs/sm90-kernel.md, "Fused Q quantization", has the measurements).
  static constexpr bool first_q_help(bool causal) { return causal; }
  static constexpr int kFirstQWarps = kQuantWarps + kConsumerWarps;

  // Shared memory (the swizzled tiles, 1024-byte aligned): two Q tiles (the next tile's Q lands
  // while this one's last blocks run), kStages K and Vᵀ tiles, and with fused Q one staged
  // fp16/bf16 Q tile.
  static constexpr int kQTile = kBlockQ * D;  // [panel][kBlockQ rows][kRowBytes] INT8 (A of Q·Kᵀ)
  static constexpr int kKTile = kBlockK * D;  // [panel][kBlockK keys][kRowBytes] INT8
  static constexpr int kVTile = D * kBlockK;  // [D channels][kBlockK keys] E4M3
  static constexpr int kQPanel = kBlockQ * kRowBytes;
  static constexpr int kKPanel = kBlockK * kRowBytes;
  static constexpr int kQStaged = kBlockQ * D * 2;  // [kBlockQ rows][D elements], not swizzled
  // The row sums' B operand: 8 channels of E4M3 ones and zeros, a swizzle atom of 8 rows read
  // through Vᵀ's descriptor (kernel.cuh, mainloop.cuh).
  static constexpr int kOnesTile = 1024;
  static_assert(kOnesTile >= 8 * kBlockK, "8 rows of a Vᵀ tile");
  static constexpr int kBytes =
      2 * kQTile + kStages * (kKTile + kVTile) + kOnesTile + 1024;  // + alignment
  static constexpr int kBytesFused = kBytes + kQStaged;

  // One score in kPolyEvery takes 2^x from a polynomial on the FMA pipe instead of MUFU.EX2
  // (16 results per SM per clock), at register positions i % kPolyEvery == kPolyEvery - 1 of the
  // thread's 64 scores (0: none). At D = 128 (two warps a scheduler) the MUFU queue is a limit,
  // and one in 32 relieves it most before the polynomial's issue slots (about eight instructions
  // for one MUFU's) outweigh it; at D = 64 three warps a scheduler move the limit to
  // issue, where the polynomial's extra instructions cost more than they relieve. At D = 256 a
  // score costs twice D = 128's tensor work for the same MUFU work, so MUFU is not the limit
  // there: none (docs/sm90-kernel.md, "Softmax" and "D = 256", has the measurements).
  static constexpr int kPolyEvery = D == 128 ? 32 : 0;

  // Where a consumer passes the GEMM-issue turn: once its Q·Kᵀ has landed, or (D = 128
  // non-causal: two consumers with blocks of equal length) once its row maxima are taken, which
  // sends the other consumer's Q·Kᵀ out later and its maxima under this one's 2^x. Causal tiles
  // (uneven blocks) and D = 64's three-consumer ring lost with the later turn.
  static constexpr bool turn_after_max(bool causal) { return D == 128 && !causal && kCons == 2; }
};

}  // namespace sage::sm90
