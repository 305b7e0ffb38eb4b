// The P·V accumulator models of the emulation (emulate.h, accumulate_pv): what one row's MMA
// accumulator register holds after each MMA of accum_chunk keys, for the fp32 accumulator, the
// FP22-like one that keeps a few mantissa bits on each add (sm_89's FP8 mma.sync, the paper's
// §3.4), and the sm_90 wgmma E4M3 one that aligns each step's products to the largest addend
// (docs/fp8-accumulator.md). Host code.
#include <algorithm>
#include <cmath>

#include "ref/emulate.h"

namespace sage::ref {

double mma_aligned_step(double acc, const double* products, int n, int bits) {
  // The largest exponent among the addends is the exponent of the largest magnitude (frexp's
  // exponent is monotone in |x|): one frexp per step instead of one per addend (the emulation
  // calls this for every (row, channel, 32 keys) of the sm90 configuration).
  double amax = std::fabs(acc);
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(products[i]));
  if (amax == 0.0) return 0.0;
  if (!std::isfinite(amax)) {  // inf or NaN: whatever the grid, the sum is not finite
    double sum = acc;
    for (int i = 0; i < n; ++i) sum += products[i];
    return double(float(sum));
  }
  int e_max = 0;
  std::frexp(amax, &e_max);
  // The largest addend keeps its leading bit and `bits` more; the others are cut to that grid.
  // Scaling by the power of two 2^(bits + 1 - e_max) is exact, so trunc cuts at the grid.
  const double quantum = std::ldexp(1.0, e_max - 1 - bits), inv = std::ldexp(1.0, bits + 1 - e_max);
  double sum = std::trunc(acc * inv) * quantum;  // exact: multiples of quantum, few bits
  for (int i = 0; i < n; ++i) sum += std::trunc(products[i] * inv) * quantum;
  return double(float(sum));  // the accumulator register is fp32
}

namespace emu {

double truncate_mantissa(double x, int bits) {
  if (x == 0.0 || !std::isfinite(x)) return x;
  int e = 0;
  const double f = std::frexp(x, &e);  // |f| in [0.5, 1)
  return std::ldexp(std::trunc(std::ldexp(f, bits + 1)), e - (bits + 1));
}

template <typename Real>
void accumulate_pv(const sage_quant_config& cfg, const Real* p, const Real* v, int64_t j0,
                   int64_t j1, int64_t D, double* acc, PvScratch& scratch) {
  const int bits = cfg.accum_mantissa_bits;
  for (int64_t c0 = j0; c0 < j1; c0 += cfg.accum_chunk) {
    const int64_t c1 = std::min(j1, c0 + int64_t(cfg.accum_chunk));
    if (cfg.pv_accum == SAGE_PV_ACCUM_ALIGNED) {  // product by product (wgmma)
      for (int64_t d = 0; d < D; ++d) {
        int64_t n_step = 0;
        for (int64_t j = c0; j < c1; ++j)
          scratch.step[size_t(n_step++)] = double(p[j - j0]) * double(v[j * D + d]);
        acc[d] = mma_aligned_step(acc[d], scratch.step.data(), int(n_step), bits);
      }
      continue;
    }
    // The MMA's exact sum of its products, then one accumulator add.
    std::vector<double>& chunk = scratch.chunk;
    std::fill(chunk.begin(), chunk.end(), 0.0);
    for (int64_t j = c0; j < c1; ++j) {
      const double pj = double(p[j - j0]);
      if (pj == 0.0) continue;
      const Real* vj = &v[j * D];
      for (int64_t d = 0; d < D; ++d) chunk[size_t(d)] += pj * double(vj[d]);
    }
    if (cfg.pv_accum == SAGE_PV_ACCUM_FP32) {  // rounded to Real: fp32 for the emulation
      for (int64_t d = 0; d < D; ++d) acc[d] = double(Real(acc[d] + chunk[size_t(d)]));
    } else {
      for (int64_t d = 0; d < D; ++d) acc[d] = truncate_mantissa(acc[d] + chunk[size_t(d)], bits);
    }
  }
}

template void accumulate_pv(const sage_quant_config&, const float*, const float*, int64_t,
                            int64_t, int64_t, double*, PvScratch&);
template void accumulate_pv(const sage_quant_config&, const double*, const double*, int64_t,
                            int64_t, int64_t, double*, PvScratch&);

}  // namespace emu
}  // namespace sage::ref
