// The producer of the forward-normalized backward's main kernel: one thread issues every TMA load,
// the CTA's K and V once, then each query block's Q, dO and rows' L and D into two stages, a stage
// refilled once every consumer thread has released it.
#pragma once

#include "bwd/fn/scheduler.cuh"
#include "bwd/fn/smem.h"
#include "ptx/tma.cuh"

namespace sage::bwd::fn {

template <int D>
struct Producer {
  using S = Smem<D>;
  const Params& p;
  const TmaMaps& maps;
  Barriers& bar;
  uint8_t* smem;

  __device__ void run(const CtaWork& w) const {
    ptx::mbar_arrive_expect_tx(&bar.keys, 2 * kKeys * D * 2);
    for (int h = 0; h < S::kPanels; ++h) {
      ptx::tma_load_4d(smem + S::kK + h * S::kKeyPanel, &maps.k, &bar.keys, 64 * h, int(w.k0),
                       int(w.hkv), int(w.b));
      ptx::tma_load_4d(smem + S::kV + h * S::kKeyPanel, &maps.v, &bar.keys, 64 * h, int(w.k0),
                       int(w.hkv), int(w.b));
    }
    BlockWalk walk = w.first;
    for (int64_t it = 0; it < w.iters; ++it, walk.next()) {
      const int s = int(it & 1);
      if (it >= 2) ptx::mbar_wait(&bar.empty[s], uint32_t((it / 2 - 1) & 1));
      ptx::mbar_arrive_expect_tx(&bar.full[s], 2 * kRows * D * 2 + 2 * kRows * 4);
      const int64_t row = walk.bh * p.nq_pad + int64_t(walk.qb) * kRows;
      ptx::bulk_load(smem + S::lse_stage(s), p.lse2 + row, kRows * 4, &bar.full[s]);
      ptx::bulk_load(smem + S::lse_stage(s) + kRows * 4, p.delta + row, kRows * 4, &bar.full[s]);
      const int hq = int(walk.bh % p.heads_q), b = int(walk.bh / p.heads_q);
      for (int h = 0; h < S::kPanels; ++h) {
        ptx::tma_load_4d(smem + S::q_stage(s) + h * S::kRowPanel, &maps.q, &bar.full[s], 64 * h,
                         walk.qb * kRows, hq, b);
        ptx::tma_load_4d(smem + S::do_stage(s) + h * S::kRowPanel, &maps.d_o, &bar.full[s], 64 * h,
                         walk.qb * kRows, hq, b);
      }
    }
  }
};

}  // namespace sage::bwd::fn
