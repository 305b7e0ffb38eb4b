// FP4 microscaling quantizers of the CPU reference (SageAttention3 paper §3.1): NVFP4 (E2M1 in runs
// of 16, E4M3 scale amax / 6) and MXFP4 (runs of 32, E8M0 scale), built on the codecs of
// common/formats.h, bit for bit what the block-scaled MMA would be handed. Host code.
#include <algorithm>
#include <cmath>
#include <limits>

#include "common/formats.h"
#include "ref/reference.h"

namespace sage::ref {

const MicroscaleFormat* qk_microscale(sage_qk_format f) {
  if (f == SAGE_QK_NVFP4) return &kNvfp4;
  if (f == SAGE_QK_MXFP4) return &kMxfp4;
  return nullptr;
}

const MicroscaleFormat* pv_microscale(sage_pv_format f) {
  if (f == SAGE_PV_NVFP4 || f == SAGE_PV_NVFP4_DIRECT) return &kNvfp4;
  if (f == SAGE_PV_MXFP4) return &kMxfp4;
  return nullptr;
}

void quantize_fp4(const float* x, int64_t n, int64_t stride, const MicroscaleFormat& f, float* out,
                  uint8_t* codes, uint8_t* scale_codes) {
  for (int64_t r0 = 0, run = 0; r0 < n; r0 += f.block, ++run) {
    const int64_t r1 = std::min(n, r0 + int64_t(f.block));
    float amax = 0.0f;
    bool finite = true;
    for (int64_t i = r0; i < r1; ++i) {
      const float a = std::fabs(x[i * stride]);
      finite = finite && std::isfinite(a);
      amax = std::max(amax, a);
    }
    // A NaN or infinity would come out of cvt's .satfinite as a finite scale or value: the run
    // dequantizes to NaN instead, so a non-finite input never looks finite.
    const uint32_t sc = finite ? fp4_scale_code(f, amax) : (f.e8m0_scale ? kE8M0Nan : 0x7Fu);
    const float scale = fp4_scale_value(f, sc);
    if (scale_codes) scale_codes[run] = uint8_t(sc);
    for (int64_t i = r0; i < r1; ++i) {
      const uint32_t c = fp4_encode(x[i * stride], scale);
      if (codes) codes[i] = uint8_t(c);
      out[i * stride] =
          finite ? decode_float(kE2M1, c) * scale : std::numeric_limits<float>::quiet_NaN();
    }
  }
}

template <typename Real>
void round_fp4(Real* x, int64_t n, int64_t stride, const MicroscaleFormat& f) {
  // The GPU quantizes fp32 registers: the values pass through float, a run at a time.
  float buf[64];  // a run: 16 or 32 values (kNvfp4, kMxfp4)
  for (int64_t r0 = 0; r0 < n; r0 += f.block) {
    const int64_t len = std::min<int64_t>(f.block, n - r0);
    for (int64_t i = 0; i < len; ++i) buf[i] = float(x[(r0 + i) * stride]);
    quantize_fp4(buf, len, 1, f, buf, nullptr, nullptr);
    for (int64_t i = 0; i < len; ++i) x[(r0 + i) * stride] = Real(buf[i]);
  }
}

template void round_fp4(float*, int64_t, int64_t, const MicroscaleFormat&);
template void round_fp4(double*, int64_t, int64_t, const MicroscaleFormat&);

}  // namespace sage::ref
