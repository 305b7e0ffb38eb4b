// Numeric formats shared by host and device code: small floats (FP8 E4M3/E5M2, FP4 E2M1, fp16,
// bf16) encoded with round-to-nearest-even like the GPU's `cvt.rn[.satfinite]`, and the symmetric
// integer quantizer (INT8/INT4) with `cvt.rni` rounding. One general minifloat codec serves every
// format, so each one is described by a handful of numbers, not by its own code; E8M0 (exponent
// only, no sign, no zero) and the FP4 microscaling block scales (NVFP4, MXFP4) sit beside it.
// Any architecture.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define SAGE_HOST_DEVICE __host__ __device__
#else
#define SAGE_HOST_DEVICE
#endif

namespace sage {

// How the all-ones exponent field is used.
enum class FloatSpecials : uint8_t {
  kIeee,     // all-ones exponent: mantissa 0 = infinity, else NaN (fp16, bf16, E5M2)
  kOnlyNan,  // only S.1111.111 is NaN, no infinity, the rest are numbers (E4M3 "fn")
  kNone      // every code is a finite number (E2M1)
};

struct FloatFormat {
  int exp_bits;
  int man_bits;
  int bias;
  FloatSpecials specials;

  SAGE_HOST_DEVICE constexpr int total_bits() const { return 1 + exp_bits + man_bits; }
  SAGE_HOST_DEVICE constexpr int exp_field_max() const { return (1 << exp_bits) - 1; }
  SAGE_HOST_DEVICE constexpr int min_normal_exp() const { return 1 - bias; }
  // Largest finite value's exponent field and mantissa.
  SAGE_HOST_DEVICE constexpr int max_field() const {
    return specials == FloatSpecials::kIeee ? exp_field_max() - 1 : exp_field_max();
  }
  SAGE_HOST_DEVICE constexpr int max_mantissa() const {
    return specials == FloatSpecials::kOnlyNan ? (1 << man_bits) - 2 : (1 << man_bits) - 1;
  }
  SAGE_HOST_DEVICE double max_finite() const {
    return std::ldexp(1.0 + double(max_mantissa()) / double(1 << man_bits), max_field() - bias);
  }
  // What a NaN input becomes: the positive all-ones code, as the GPU's cvt writes it (0x7F for
  // E4M3 and E5M2, 0x7FFF for fp16 and bf16; sign and payload dropped). E2M1 has no NaN; there
  // this code is +6, PTX cvt.satfinite's "NaN becomes positive MAX_NORM".
  SAGE_HOST_DEVICE constexpr uint32_t nan_code() const {
    return (1u << (exp_bits + man_bits)) - 1u;
  }
};

inline constexpr FloatFormat kE4M3{4, 3, 7, FloatSpecials::kOnlyNan};  // max 448
inline constexpr FloatFormat kE5M2{5, 2, 15, FloatSpecials::kIeee};    // max 57344
inline constexpr FloatFormat kE2M1{2, 1, 1, FloatSpecials::kNone};     // max 6
inline constexpr FloatFormat kFp16{5, 10, 15, FloatSpecials::kIeee};   // max 65504
inline constexpr FloatFormat kBf16{8, 7, 127, FloatSpecials::kIeee};

// Bits of x in `f`, rounded to nearest, ties to even. With `saturate` (PTX .satfinite) a finite
// or infinite value beyond the range becomes +-max_finite; without it, it becomes infinity (or
// NaN for a format with no infinity). A NaN of either sign becomes nan_code() (E2M1: +6).
// x is taken as a double so a float64 result is rounded once, not through float first.
SAGE_HOST_DEVICE inline uint32_t encode_float(const FloatFormat& f, double x, bool saturate) {
  if (std::isnan(x)) return f.nan_code();
  const uint32_t sign = std::signbit(x) ? (1u << (f.exp_bits + f.man_bits)) : 0u;
  const double a = std::fabs(x);
  const uint32_t max_code = (uint32_t(f.max_field()) << f.man_bits) | uint32_t(f.max_mantissa());
  const uint32_t overflow_code =
      saturate ? max_code
               : (f.specials == FloatSpecials::kIeee ? uint32_t(f.exp_field_max()) << f.man_bits
                                                     : f.nan_code());
  if (std::isinf(x)) return sign | overflow_code;
  if (a == 0.0) return sign;
  int e2 = 0;
  std::frexp(a, &e2);  // a = m * 2^e2, m in [0.5, 1)
  int ex = e2 - 1;     // unbiased exponent of the leading bit
  if (ex < f.min_normal_exp()) ex = f.min_normal_exp();
  const double quantum = std::ldexp(1.0, ex - f.man_bits);
  double r = std::nearbyint(a / quantum);  // default rounding mode: to nearest, ties to even
  const double one = double(1u << f.man_bits);
  if (r >= 2.0 * one) {  // carry into the next binade
    r *= 0.5;
    ex += 1;
  }
  uint32_t field, mant;
  if (r < one) {  // subnormal (only reachable at the minimum exponent)
    field = 0;
    mant = uint32_t(r);
  } else {
    field = uint32_t(ex + f.bias);
    mant = uint32_t(r - one);
  }
  if (r * quantum > f.max_finite() || int(field) > f.max_field()) return sign | overflow_code;
  return sign | (field << f.man_bits) | mant;
}

SAGE_HOST_DEVICE inline float decode_float(const FloatFormat& f, uint32_t bits) {
  const uint32_t mant_mask = (1u << f.man_bits) - 1u;
  const bool neg = (bits >> (f.exp_bits + f.man_bits)) & 1u;
  const int field = int((bits >> f.man_bits) & uint32_t(f.exp_field_max()));
  const uint32_t mant = bits & mant_mask;
  double v;
  if (f.specials == FloatSpecials::kIeee && field == f.exp_field_max()) {
    v = mant == 0 ? HUGE_VAL : NAN;
  } else if (f.specials == FloatSpecials::kOnlyNan && field == f.exp_field_max() &&
             mant == mant_mask) {
    v = NAN;
  } else if (field == 0) {
    v = std::ldexp(double(mant), f.min_normal_exp() - f.man_bits);
  } else {
    v = std::ldexp(1.0 + double(mant) / double(1u << f.man_bits), field - f.bias);
  }
  return float(neg ? -v : v);
}

// x rounded through the format and back (saturating, as the quantizers use it).
SAGE_HOST_DEVICE inline float round_float(const FloatFormat& f, float x, bool saturate = true) {
  return decode_float(f, encode_float(f, x, saturate));
}
SAGE_HOST_DEVICE inline float round_fp16(float x) { return round_float(kFp16, x, false); }
SAGE_HOST_DEVICE inline float round_bf16(float x) { return round_float(kBf16, x, false); }

// Symmetric quantization scale of a group: x_hat = q(x * inv), x ~ x_hat * scale.
// Both are computed (not one as the reciprocal of the other) so host and device agree bit for bit.
struct QuantScale {
  float scale;  // amax / qmax
  float inv;    // qmax / amax
};
SAGE_HOST_DEVICE inline QuantScale make_quant_scale(float amax, float qmax) {
  if (!(amax > 0.0f)) return {0.0f, 0.0f};  // all-zero group: every x_hat is 0
  return {amax / qmax, qmax / amax};
}

// Integer quantization, as `cvt.rni.sat.s32.f32` of x * inv then a clamp to [-qmax, qmax].
// A NaN product gives 0, as that cvt does (int(NaN) would be undefined behaviour).
SAGE_HOST_DEVICE inline int quantize_int(float x, float inv, int qmax) {
  const float y = x * inv;
  if (std::isnan(y)) return 0;
  float r = std::nearbyint(y);
  if (r > float(qmax)) r = float(qmax);
  if (r < -float(qmax)) r = -float(qmax);
  return int(r);
}

// V's per-channel scale without V smoothing (SageAttn2's FP8 V): from a bound on the channel's
// |v| taken from K's mean sample of the tokens (every k_mean_stride-th, ref::mean_token_stride),
// four times that sample's max, unless some token exceeds it, in which case the channel's exact
// max. (Twice is exceeded in a few per cent of N(0,1) heads of thousands of tokens, since a
// 256-token sample's max can fall well under the sequence's, and each such head is quantized
// twice; four times costs E4M3 two binades at the bottom of its range, where V's values weigh
// least.) So amax = max(v_sample_bound(sample max), exact max): the pre-pass quantizes V with
// the bound without a statistics pass over all of V first, and re-quantizes a head only where a
// token lies past it (docs/sm90-kernel.md, "What limits it"). Clamped to a finite float.
SAGE_HOST_DEVICE inline float v_sample_bound(float sample_amax) {
  const float b = 4.0f * sample_amax;
  return b < 3.402823466e38f ? b : 3.402823466e38f;
}

inline constexpr int kInt8Max = 127;
inline constexpr int kInt4Max = 7;
inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kE5M2Max = 57344.0f;
inline constexpr float kE2M1Max = 6.0f;

// ---- E8M0 (UE8M0), the OCP MX block scale: 8 exponent bits, bias 127, value 2^(code - 127);
// no sign, no zero (code 0 is 2^-127), 0xFF is NaN.
inline constexpr uint32_t kE8M0Nan = 0xFF;
inline constexpr uint32_t kE8M0MaxCode = 0xFE;  // 2^127

SAGE_HOST_DEVICE inline float decode_e8m0(uint32_t code) {
  code &= 0xFFu;
  if (code == kE8M0Nan) return NAN;
  return float(std::ldexp(1.0, int(code) - 127));  // 2^-127 is a float subnormal: exact
}

// cvt.{rz,rp}.satfinite.ue8m0x2.f32 of one value (PTX ISA, cvt: .frnd3 = {.rz, .rp}): the power
// of two at or below x (round_up false) or at or above it (true), clamped to [2^-127, 2^127]
// (.satfinite: +inf and values past 2^127 give 0xFE; zero, negatives and values under 2^-127 give
// 0x00, the format having no zero and no sign). NaN gives 0xFF.
SAGE_HOST_DEVICE inline uint32_t encode_e8m0(double x, bool round_up) {
  if (std::isnan(x)) return kE8M0Nan;
  if (!(x > 0.0)) return 0u;
  if (std::isinf(x)) return kE8M0MaxCode;
  int e2 = 0;
  const double m = std::frexp(x, &e2);  // x = m * 2^e2, m in [0.5, 1)
  int e = e2 - 1;                       // floor(log2 x)
  if (round_up && m != 0.5) e += 1;     // not a power of two: the next one up
  const int code = e + 127;
  if (code < 0) return 0u;
  if (code > int(kE8M0MaxCode)) return kE8M0MaxCode;
  return uint32_t(code);
}

// ---- FP4 microscaling: E2M1 values in 1 x block runs along the reduction dimension of the
// product they feed, one scale per run (SageAttention3 paper §3.1; PTX ISA, "Block Scaling" of mma
// and tcgen05.mma: kind::mxf4nvf4 with scale_vec::4X = one E4M3 scale per 16 values, scale_vec::2X
// = one E8M0 scale per 32).
struct MicroscaleFormat {
  int block;        // values sharing one scale
  bool e8m0_scale;  // MXFP4 (E8M0 scale) rather than NVFP4 (E4M3 scale)
};
inline constexpr MicroscaleFormat kNvfp4{16, false};
inline constexpr MicroscaleFormat kMxfp4{32, true};

// The scale code of a run whose largest |x| is amax (a finite, non-negative float):
//   NVFP4: E4M3(amax / 6), cvt.rn.satfinite.e4m3x2.f32 of the fp32 quotient (the SageAttention3
//          paper: the scale is amax / 6, in E4M3); it may round below amax / 6, and the values
//          that then pass 6 saturate.
//   MXFP4: 2^(floor(log2 amax) - 2), the OCP MX v1.0 rule (shared exponent floor(log2 amax) minus
//          the element format's largest exponent, 2 for E2M1) = cvt.rz.satfinite.ue8m0x2.f32 of
//          amax / 4 (exact). Values in [1.5, 2) x 2^floor(log2 amax) saturate to 6 x scale.
// (Local constexpr copies of the formats: device code may use their values, not the objects.)
SAGE_HOST_DEVICE inline uint32_t fp4_scale_code(const MicroscaleFormat& f, float amax) {
  constexpr FloatFormat e4m3 = kE4M3;
  if (f.e8m0_scale) return encode_e8m0(double(amax * 0.25f), /*round_up=*/false);
  return encode_float(e4m3, double(amax / 6.0f), /*saturate=*/true);
}
SAGE_HOST_DEVICE inline float fp4_scale_value(const MicroscaleFormat& f, uint32_t code) {
  constexpr FloatFormat e4m3 = kE4M3;
  return f.e8m0_scale ? decode_e8m0(code) : decode_float(e4m3, code);
}
// One value's E2M1 code: cvt.rn.satfinite.e2m1x2.f32 of the fp32 quotient x / scale. A zero
// scale (an NVFP4 run whose amax / 6 rounds to 0 in E4M3) gives a signed zero: the value it
// dequantizes to whatever code a kernel writes there.
SAGE_HOST_DEVICE inline uint32_t fp4_encode(float x, float scale) {
  constexpr FloatFormat e2m1 = kE2M1;
  if (scale == 0.0f) return std::signbit(x) ? 0x8u : 0u;
  return encode_float(e2m1, double(x / scale), /*saturate=*/true);
}

}  // namespace sage
