// The CPU emulation of quantized attention: which kernel family's emulation computes a config.
// Each family is the algorithm of one GPU kernel read top to bottom, on the shared pre-pass,
// scores and accumulator models of emulate.h:
//   sm90_softmax_form(cfg)  emulate_sm90.cpp  the sm90 wgmma kernel: softmax blocks over several
//                                             K scale blocks, the polynomial 2^x, the aligned
//                                             E4M3 accumulator, its finalize;
//   an FP4 P·V format       emulate_fp4.cpp   the FP4 kernel (SageAttention3, Algorithm 1);
//   anything else           emulate_mma.cpp   the mma.sync kernel (SageAttention2), and the
//                                             ablations of its form (`sage accuracy`).
// Host code.
#include <string>

#include "common/error.h"
#include "ref/emulate.h"

namespace sage::ref {
namespace {

template <typename Real>
void run(const Problem& p, const sage_quant_config& cfg, const TensorView& q, const TensorView& k,
         const TensorView& v, Real* out, Real* lse, int threads) {
  if (const std::string e = quant_config_error(cfg); !e.empty())
    throw Error{SAGE_ERROR_INVALID_ARGUMENT, e};
  if (sm90_softmax_form(cfg))
    emu::emulate_sm90(p, cfg, q, k, v, out, lse, threads);
  else if (pv_microscale(cfg.pv_format))
    emu::emulate_fp4(p, cfg, q, k, v, out, lse, threads);
  else
    emu::emulate_mma(p, cfg, q, k, v, out, lse, threads);
}

}  // namespace

void attention_quant(const Problem& p, const sage_quant_config& cfg, const TensorView& q,
                     const TensorView& k, const TensorView& v, float* out, float* lse,
                     int threads) {
  run<float>(p, cfg, q, k, v, out, lse, threads);
}

void attention_quant(const Problem& p, const sage_quant_config& cfg, const TensorView& q,
                     const TensorView& k, const TensorView& v, double* out, double* lse,
                     int threads) {
  run<double>(p, cfg, q, k, v, out, lse, threads);
}

}  // namespace sage::ref
