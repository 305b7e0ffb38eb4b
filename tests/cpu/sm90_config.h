// The sm90 (wgmma) kernel's emulation configuration as the planner describes it (src/api/plan.cpp,
// sage_plan_info), written out for the CPU tests: block_q rows a tile (64 a consumer), 64-key K
// groups in 128-key softmax blocks (64-key ones at D = 256, the wgmma groups selecting the form),
// the aligned 13-bit wgmma accumulator in 32-key steps, the polynomial 2^x on the kernel's share
// of the scores at D = 128 (sm90::Traits::kPolyEvery). Host code.
#pragma once

#include <cstdint>

#include "attn/sm90/traits.h"
#include "ref/reference.h"

namespace sage::test {

inline sage_quant_config sm90_config(int64_t D, int32_t block_q) {
  sage_quant_config c = ref::quant_preset(SAGE_VARIANT_SAGE2_8B);
  c.block_q = block_q;
  c.warps = block_q / 16;
  c.block_k = 64;
  c.softmax_block_k = D == 256 ? 64 : 128;
  if (D == 256) c.granularity = SAGE_GRANULARITY_PER_THREAD_WGMMA;
  c.pv_accum = SAGE_PV_ACCUM_ALIGNED;
  c.accum_mantissa_bits = 13;
  c.accum_chunk = 32;
  c.exp2_poly_every = D == 128 ? sm90::Traits<128, 2>::kPolyEvery : 0;
  return c;
}

}  // namespace sage::test
