// SageAttention2-8b on Hopper (sm_90a; other architectures compile an empty body): wgmma
// s8·s8→s32 for Q·Kᵀ and E4M3 for P̃·V, K and Vᵀ tiles brought by TMA onto mbarriers, warp
// specialization (a producer warpgroup, kCons consumer warpgroups of 64 query rows), persistent
// CTAs walking their tiles (query block, head) from the scheduler, launched as a programmatic
// dependent of the pre-pass. docs/sm90-kernel.md says how it works and what limits it.
//
// It reads the same pre-pass products as the mma.sync kernel and does the same quantization: a
// warp owns 16 query rows (one Q scale for rows g, g+8), K scales per 64-key group (a 128-key
// block holds two; D = 256's 64-key block one), Vᵀ keys permuted inside each 32 so the S
// accumulator converts to the P^ A-operand in place. What differs — 128-key softmax blocks (64 at
// D = 256), the polynomial 2^x share, the wgmma's E4M3 accumulator — is in its CPU emulation
// (sage_attention_plan's emulation config).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "attn/sm90/mainloop.cuh"
#include "attn/sm90/params.h"
#include "attn/sm90/pipeline.cuh"
#include "attn/sm90/producer.cuh"
#include "attn/sm90/scheduler.cuh"
#include "attn/sm90/trace.cuh"
#include "attn/sm90/traits.h"
#include "ptx/async.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"

namespace sage::sm90 {

// kPacked: a packed variable-length batch (the scheduler finds each tile's sequence from
// cu_seqlens; scheduler.cuh). kSplit: the split tail (split.h; dense non-causal calls).
template <int D, typename OutT, bool kCausal, int kCons, bool kPacked, bool kSplit>
__global__ void __launch_bounds__(Traits<D, kCons>::kThreads, 1)
    attention_kernel(const Params p, const __grid_constant__ TmaMaps maps) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Tr = Traits<D, kCons>;
  extern __shared__ uint8_t smem_raw[];
  __shared__ SharedStorage<D, kCons> sh;
  const Tiles<Tr> tiles(smem_raw);
#ifdef SAGE_SM90_TRACE
  uint32_t* const trace = maps.trace;
#else
  uint32_t* const trace = nullptr;
#endif
  // Q from the pre-pass (TMA of its INT8 128-row blocks) exists for two consumers only.
  const bool fused_q = kCons != 2 || p.fused_q;

  if (threadIdx.x == 0) {
    // Q buffers fill on TMA's bytes, or on every quantizing thread's arrival (each releases its
    // own writes); the scheduler ring is read by every consumer and quantizing thread.
    sh.bar.init(fused_q ? kQuantWarps * 32 : 1, Tr::kConsumerWarps);
    sh.sched.init(kCons * 128 + (fused_q ? kQuantWarps * 32 : 0));
    ptx::fence_barrier_init();
  }
  if (threadIdx.x < Tr::kOnesTile / 16) {
    // The row sums' B operand (mainloop.cuh): channels 2s and 2s + 1 are E4M3 1.0 (0x38) on the
    // 32 keys of P̃·V step s and 0 elsewhere. Written through Vᵀ's swizzle (16-byte chunk bits
    // 4.. XOR address bits 7..: three of them for 128-byte rows, two for 64-byte ones), as the
    // wgmma reads it.
    const uint32_t at = threadIdx.x * 16;
    const uint32_t logical = at ^ (((at >> 7) & (Tr::kBlockK == 128 ? 7u : 3u)) << 4);
    const uint32_t ch = logical / Tr::kBlockK, key = logical % Tr::kBlockK;
    const uint32_t b = key / 32 == ch / 2 ? 0x38383838u : 0u;
    reinterpret_cast<uint4*>(tiles.ones)[threadIdx.x] = make_uint4(b, b, b, b);
    ptx::fence_proxy_async_smem();  // (read by the consumers' wgmma: the async proxy)
  }
  if (threadIdx.x < 4) sh.seed[threadIdx.x] = kMagic;
  __syncthreads();
  // Everything above overlapped the pre-pass's tail; nothing is read from global memory before
  // the kernels this one depends on have finished.
  ptx::grid_dependency_wait();

  if (threadIdx.x < 128) {  // ---- the producer warpgroup ----
    ptx::setmaxnreg_dec<Tr::kProducerRegs>();
    const Producer<D, OutT, kCausal, kCons, kPacked, kSplit> producer{p, maps, sh, tiles};
    if (fused_q && threadIdx.x >= 32)
      producer.quantize_tiles();  // warps 1-3: Q of each tile, a tile ahead
    else if (threadIdx.x == 0)
      producer.load_tiles(fused_q);  // the scheduler and the TMA loads
    return;
  }

  // ---- the consumer warpgroups ----
  ptx::setmaxnreg_inc<Tr::kConsumerRegs>();
  Consumer<D, OutT, kCausal, kCons, kPacked, kSplit> c{p, sh, tiles, trace, fused_q};
  c.start();
  for (int it = 0;; ++it) {
    tile_event(trace, it, 0);
    const TileInfo ti = sh.sched.read(it);
    if (ti.done) break;
    tile_event(trace, it, 1);
    c.begin_tile(ti, it);  // V statistics on their way, softmax state reset, Q in place
    if (ti.n_blocks > 0) {
      c.first_block();  // Q·Kᵀ(0), softmax(0)
      // Q·Kᵀ(kb) + P̃·V(kb-1), softmax(kb), two blocks a turn; an odd count leaves after the
      // first (no wgmma is in flight between steps), so the step exists twice, not three times.
      for (int kb = 1; kb < ti.n_blocks; kb += 2) {
        c.template step<1>(kb);
        if (kb + 1 == ti.n_blocks) break;
        c.template step<0>(kb + 1);
      }
      c.last_pv();  // P̃·V(n-1)
    } else {
      c.skip_tile();
    }
    c.end_tile();  // O / l · v_scale + v_mean, LSE (a split tile: its parts merged first)
  }
#endif
}

}  // namespace sage::sm90
