// Shared memory of the forward-normalized backward's main kernel (byte offsets, each 1024-byte
// aligned: the 128-byte swizzle atoms'). Every 16-bit tile is D / 64 panels of 64 channels, each
// row 128 bytes in TMA's (and wgmma's) 128-byte swizzle; K-major for one product and MN-major for
// another, the same bytes: Q [64 queries][D] is Sᵀ's B over the channels and dK's B over the
// queries.
#pragma once

#include "bwd/fn/params.h"

namespace sage::bwd::fn {

template <int D>
struct Smem {
  static constexpr int kPanels = D / 64;
  static constexpr int kKeyPanel = kKeys * 128;              // 128 keys x 64 channels
  static constexpr int kRowPanel = kRows * 128;              // 64 queries x 64 channels
  static constexpr int kK = 0;                               // K [128 keys][D]
  static constexpr int kV = kK + kPanels * kKeyPanel;        // V, as K
  static constexpr int kQ = kV + kPanels * kKeyPanel;        // Q [64][D], two stages
  static constexpr int kDo = kQ + 2 * kPanels * kRowPanel;   // dO, two stages
  static constexpr int kDs = kDo + 2 * kPanels * kRowPanel;  // dSᵀ [128 keys][64 queries], two
  static constexpr int kDsTile = kKeys * 128;                // (one a block, alternating)
  static constexpr int kDq = kDs + 2 * kDsTile;  // dQ's staging: [64][64] fp32 a consumer
  static constexpr int kDqPanel = kRows * 64 * 4;
  static constexpr int kRowStats = kDq + 2 * kDqPanel;  // L and D [64] each, two stages
  static constexpr int kBytes = kRowStats + 2 * 2 * kRows * 4 + 1024;  // + the base's alignment
  static constexpr int q_stage(int s) { return kQ + s * kPanels * kRowPanel; }
  static constexpr int do_stage(int s) { return kDo + s * kPanels * kRowPanel; }
  static constexpr int lse_stage(int s) { return kRowStats + s * 2 * kRows * 4; }  // D: + 256
  static_assert(kBytes <= 227 * 1024, "one CTA an SM");
};

// The CTA's barriers (static shared memory): the keys once, each query stage full (the bytes of its
// Q, dO, L and D) and empty (every consumer thread done with it).
struct Barriers {
  uint64_t keys, full[2], empty[2];
};

}  // namespace sage::bwd::fn
