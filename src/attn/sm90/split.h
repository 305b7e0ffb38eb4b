// The sm90 kernel's split tail (non-causal, dense calls). A persistent grid of G CTAs takes whole
// tiles (query block, batch·head) round after round; when the tile count T is not a multiple of
// G, the last round's T mod G tiles would keep that many CTAs busy for a whole tile while the
// rest wait (Flux's 864 tiles on 132 SMs: 6.5 rounds cost 7). The plan can instead share those
// tiles' (tile, key block) steps out among `ctas` CTAs: the steps in tile-major order, cut into
// `ctas` ranges of near-equal length, range c to CTA c once its whole tiles are done.
//
// A range is at most a tile long (ctas >= tiles), so it holds the end of one tile and/or the start
// of the next: at most two units, each one tile's key blocks [kb0, kb0 + n). A tile cut in parts
// is finished by the CTA holding its first part (the merger), the last unit of that CTA's range;
// its other parts are the first units of the next CTAs' ranges (CTAs c + 1 .. c + k), which
// write their rows' softmax state (O, m, l) to their CTA's slot of the workspace and count
// themselves in the tile's flag. The merger waits for the k counts and adds the parts in CTA
// order, so the result does not depend on which part finished first. No CTA waits on one that
// waits on it: a later part is written before its CTA's own merge.
//
// Plain C++: the planner, the CPU emulation (src/ref/emulate_sm90.cpp) and the kernel's scheduler
// make the same cut.
#pragma once

#include <cstdint>

#include "common/formats.h"  // SAGE_HOST_DEVICE

namespace sage::sm90 {

// A later part's softmax state, the floats of a CTA's slot in the workspace: each consumer
// thread's O (head_dim / 2) and its two rows' m and l, stored [value][thread].
SAGE_HOST_DEVICE constexpr int64_t split_part_floats(int64_t head_dim, int consumers) {
  return int64_t(consumers) * 128 * (head_dim / 2 + 4);
}

struct SplitTail {
  int64_t tiles = 0;   // the split tiles: the call's last ones (0: no split)
  int64_t blocks = 0;  // key blocks per tile
  int64_t ctas = 0;    // CTAs their steps are shared among: tiles <= ctas <= tiles · blocks

  // One tile's part for a CTA: key blocks [kb0, kb0 + n) of split tile `tile` (0 .. tiles - 1).
  // part: 0 the whole tile; k > 0 its first part, which merges k more (CTAs c + 1 .. c + k);
  // -1 a later part, written to the CTA's slot. n == 0: no unit.
  struct Unit {
    int64_t tile;
    int32_t kb0, n, part;
  };

  SAGE_HOST_DEVICE int64_t steps() const { return tiles * blocks; }
  // The first step of CTA c's range (c = ctas: the end).
  SAGE_HOST_DEVICE int64_t begin(int64_t c) const { return c * steps() / ctas; }
  // The CTA whose range holds step s: the last c with begin(c) <= s.
  SAGE_HOST_DEVICE int64_t owner(int64_t s) const { return ((s + 1) * ctas - 1) / steps(); }

  // Unit u (0 or 1) of CTA c's range.
  SAGE_HOST_DEVICE Unit unit(int64_t c, int u) const {
    Unit x{0, 0, 0, 0};
    if (c >= ctas || u < 0 || u > 1) return x;
    const int64_t lo = begin(c), hi = begin(c + 1);
    int64_t tile = lo / blocks, first = lo;
    if (u == 1) {
      ++tile;
      first = tile * blocks;
      if (first >= hi) return x;
    }
    const int64_t end = hi < (tile + 1) * blocks ? hi : (tile + 1) * blocks;
    if (end <= first) return x;
    x.tile = tile;
    x.kb0 = int32_t(first - tile * blocks);
    x.n = int32_t(end - first);
    if (x.kb0 > 0)
      x.part = -1;
    else if (x.n < blocks)
      x.part = int32_t(owner((tile + 1) * blocks - 1) - c);
    return x;
  }
};

}  // namespace sage::sm90
