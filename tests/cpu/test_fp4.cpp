// FP4 microscaling in the CPU reference (the SageAttention3 paper): the E8M0 and E2M1 codecs
// against oracles written from bit layouts and value tables, the NVFP4/MXFP4 block scales and
// quantizer round trips, Algorithm 1 against an independent transcription of it and against float64
// attention, the config checks, and the orderings of the SageAttention3 paper's Table 1 on the
// built-in problem. Host only. (E4M3, the NVFP4 scale format, is covered code by code in
// test_formats.cpp.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "ref/ablations.h"
#include "ref/synthetic.h"

namespace sage::ref {
namespace {

using test::bits_float;
using test::float_bits;

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

// ---- Oracles, from the formats' definitions (not from formats.h's arithmetic) ----

// E8M0 code c >= 1 is the float with exponent field c and mantissa 0; c = 0 is 2^-127, the float
// subnormal with only mantissa bit 22 set.
float e8m0_by_bits(uint32_t c) {
  return c == 0 ? bits_float(0x00400000u) : bits_float(c << 23);
}

// cvt.{rz,rp}.satfinite.ue8m0x2.f32 of a positive finite float, from its bits: a normal float
// with exponent field E is in [2^(E-127), 2^(E-126)); a subnormal m·2^-149 is below 2^-126.
uint32_t e8m0_oracle(float x, bool round_up) {
  const uint32_t b = float_bits(x), field = b >> 23, mant = b & 0x7FFFFFu;
  int floor_log2;
  bool power_of_two;
  if (field == 0) {  // subnormal: the leading mantissa bit gives the exponent
    int top = 22;
    while (!(mant >> top & 1u)) --top;
    floor_log2 = top - 149;
    power_of_two = mant == (1u << top);
  } else {
    floor_log2 = int(field) - 127;
    power_of_two = mant == 0;
  }
  const int e = floor_log2 + (round_up && !power_of_two ? 1 : 0);
  return uint32_t(std::clamp(e + 127, 0, 254));
}

// The eight E2M1 magnitudes, code 0..7.
constexpr float kE2M1Values[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

// cvt.rn.satfinite.e2m1x2.f32: nearest magnitude, ties to the even code, beyond 6 -> 6; sign bit 3.
uint32_t e2m1_oracle(float x) {
  const float a = std::fabs(x);
  uint32_t best = 7;
  if (a < 6.0f) {
    best = 0;
    for (uint32_t c = 1; c < 8; ++c) {
      const float d = std::fabs(kE2M1Values[c] - a), db = std::fabs(kE2M1Values[best] - a);
      if (d < db || (d == db && (c & 1u) == 0)) best = c;
    }
  }
  return (std::signbit(x) ? 8u : 0u) | best;
}

// E4M3 by its definition: code e.m (4.3 bits), bias 7, subnormals at e = 0, 0x7F NaN.
double e4m3_value(uint32_t c) {
  const uint32_t e = c >> 3 & 15u, m = c & 7u;
  return e == 0 ? std::ldexp(double(m), -9) : std::ldexp(1.0 + m / 8.0, int(e) - 7);
}
// The NVFP4 scale code of amax: the E4M3 nearest to the fp32 amax / 6, ties to even, <= 448.
uint32_t nvfp4_scale_oracle(float amax) {
  const double q = double(amax / 6.0f);
  uint32_t best = 0;
  for (uint32_t c = 1; c <= 0x7E; ++c) {
    const double d = std::fabs(e4m3_value(c) - q), db = std::fabs(e4m3_value(best) - q);
    if (d < db || (d == db && (c & 1u) == 0)) best = c;
  }
  return best;
}

// ---- Codecs ----

TEST(Fp4Codec, E8M0EveryCodeDecodesAndReencodesToItself) {
  for (uint32_t c = 0; c <= 254; ++c) {
    const float v = decode_e8m0(c);
    ASSERT_EQ(float_bits(v), float_bits(e8m0_by_bits(c))) << c;
    ASSERT_EQ(encode_e8m0(v, /*round_up=*/false), c) << c;
    ASSERT_EQ(encode_e8m0(v, /*round_up=*/true), c) << c;
  }
  EXPECT_TRUE(std::isnan(decode_e8m0(0xFF)));
}

TEST(Fp4Codec, E8M0DenseSweepRoundsTowardZeroOrUpAndSaturates) {
  // Every 997th positive finite float (normals and subnormals, all exponents), both modes.
  for (uint32_t b = 1; b < 0x7F800000u; b += 997) {
    const float x = bits_float(b);
    ASSERT_EQ(encode_e8m0(x, false), e8m0_oracle(x, false)) << test::hex(b);
    ASSERT_EQ(encode_e8m0(x, true), e8m0_oracle(x, true)) << test::hex(b);
  }
  // Specials of .satfinite: NaN -> 0xFF; +inf and past 2^127 -> 2^127; no zero, no sign.
  EXPECT_EQ(encode_e8m0(kNan, false), 0xFFu);
  EXPECT_EQ(encode_e8m0(INFINITY, true), 0xFEu);
  EXPECT_EQ(encode_e8m0(FLT_MAX, false), 0xFEu);
  EXPECT_EQ(encode_e8m0(FLT_MAX, true), 0xFEu);  // 2^128 saturates
  EXPECT_EQ(encode_e8m0(0.0, true), 0u);
  EXPECT_EQ(encode_e8m0(-3.0, true), 0u);
  EXPECT_EQ(encode_e8m0(3.0, false), 128u);  // 2^1
  EXPECT_EQ(encode_e8m0(3.0, true), 129u);   // 2^2
}

TEST(Fp4Codec, E2M1EveryCodeRoundTripsAndADenseSweepRoundsToNearestEven) {
  for (uint32_t c = 0; c < 16; ++c) {
    const float v = decode_float(kE2M1, c);
    ASSERT_EQ(v, (c & 8u ? -1.0f : 1.0f) * kE2M1Values[c & 7u]) << c;
    ASSERT_EQ(encode_float(kE2M1, v, true), c) << c;
  }
  // Steps of 2^-10 over [-8, 8]: every midpoint (a tie) and the saturating range included.
  for (int i = -8192; i <= 8192; ++i) {
    const float x = std::ldexp(float(i), -10);
    ASSERT_EQ(encode_float(kE2M1, x, true), e2m1_oracle(x)) << x;
  }
  // fp4_encode divides in fp32 and takes cvt.rn.satfinite of the quotient.
  EXPECT_EQ(fp4_encode(5.0f, 1.0f), 0x6u);   // tie 4|6 -> 4
  EXPECT_EQ(fp4_encode(-2.5f, 1.0f), 0xCu);  // tie 2|3 -> -2
  EXPECT_EQ(fp4_encode(700.0f, 10.0f), 0x7u);
  EXPECT_EQ(fp4_encode(1.0f, 0.0f), 0x0u);  // a zero NVFP4 scale: signed zeros
  EXPECT_EQ(fp4_encode(-1.0f, 0.0f), 0x8u);
}

// ---- Block scales ----

TEST(Fp4Scale, Nvfp4IsE4M3OfAmaxOverSixForEveryFp16Amax) {
  for (uint32_t b = 0; b <= 0x7BFF; ++b) {
    const float amax = decode_float(kFp16, b);
    ASSERT_EQ(fp4_scale_code(kNvfp4, amax), nvfp4_scale_oracle(amax)) << amax;
  }
  EXPECT_EQ(fp4_scale_code(kNvfp4, 1e30f), 0x7Eu);  // saturates at 448
  EXPECT_EQ(fp4_scale_value(kNvfp4, 0x7E), 448.0f);
}

TEST(Fp4Scale, Mxfp4IsTheOcpSharedExponent) {
  // 2^(floor(log2 amax) - 2), E2M1's largest exponent being 2 (OCP MX v1.0).
  for (uint32_t b = 0x00800000u; b < 0x7F800000u; b += 4099) {
    const float amax = bits_float(b);
    const int floor_log2 = int(b >> 23) - 127;
    const uint32_t want = uint32_t(std::clamp(floor_log2 - 2 + 127, 0, 254));
    ASSERT_EQ(fp4_scale_code(kMxfp4, amax), want) << amax;
  }
  EXPECT_EQ(fp4_scale_value(kMxfp4, fp4_scale_code(kMxfp4, 6.0f)), 1.0f);
  EXPECT_EQ(fp4_scale_value(kMxfp4, fp4_scale_code(kMxfp4, 7.9f)), 1.0f);  // 7.9 saturates to 6
  EXPECT_EQ(fp4_scale_value(kMxfp4, fp4_scale_code(kMxfp4, 8.0f)), 2.0f);
}

// ---- Quantizer round trips ----

// Half the E2M1 step at |x| / scale = y (the grid is 0.5 below 2, 1 below 4, 2 up to 6).
double half_step(double y) {
  return y < 2.0 ? 0.25 : y < 4.0 ? 0.5 : 1.0;
}

TEST(Fp4Quantizer, RoundTripWithinHalfAStepOfItsRunsScale) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> exponent(-4.0f, 4.0f);
  for (const MicroscaleFormat& f : {kNvfp4, kMxfp4}) {
    int saturated = 0, checked = 0;
    for (int trial = 0; trial < 400; ++trial) {
      const int64_t n = 1 + int64_t(rng() % 100), stride = 1 + int64_t(rng() % 3);
      const float magnitude = std::pow(10.0f, exponent(rng));
      std::vector<float> x(size_t(n * stride), 0.0f), out(x.size(), -1.0f);
      for (int64_t i = 0; i < n; ++i) {
        const uint64_t kind = rng() % 16;
        x[size_t(i * stride)] = kind == 0   ? 0.0f
                                : kind == 1 ? 20.0f * magnitude * normal(rng)
                                            : magnitude * normal(rng);
      }
      std::vector<uint8_t> codes(static_cast<size_t>(n));
      std::vector<uint8_t> scales(static_cast<size_t>((n + f.block - 1) / f.block));
      quantize_fp4(x.data(), n, stride, f, out.data(), codes.data(), scales.data());
      for (int64_t r0 = 0, run = 0; r0 < n; r0 += f.block, ++run) {
        const int64_t r1 = std::min(n, r0 + int64_t(f.block));
        float amax = 0.0f;
        for (int64_t i = r0; i < r1; ++i) amax = std::max(amax, std::fabs(x[size_t(i * stride)]));
        ASSERT_EQ(scales[size_t(run)], fp4_scale_code(f, amax)) << "run " << run;
        const double scale = fp4_scale_value(f, scales[size_t(run)]);
        for (int64_t i = r0; i < r1; ++i) {
          const double xi = x[size_t(i * stride)], oi = out[size_t(i * stride)];
          ASSERT_EQ(oi, double(decode_float(kE2M1, codes[size_t(i)])) * scale);
          ASSERT_EQ(std::signbit(oi), std::signbit(xi)) << xi;
          const double y = scale > 0 ? std::fabs(xi) / scale : 0.0;
          if (y > 6.0) {  // the scale rounded below amax / 6: the run's top saturates at 6
            ASSERT_EQ(std::fabs(oi), 6.0 * scale) << xi;
            ++saturated;
          } else if (scale > 0) {
            // Half a step, plus the fp32 rounding of the quotient x / scale.
            ASSERT_LE(std::fabs(xi - oi), half_step(y) * scale * (1 + 1e-6) + 1e-7 * std::fabs(xi))
                << "x " << xi << " scale " << scale;
          } else {  // NVFP4 scale 0: amax / 6 under half E4M3's smallest subnormal
            ASSERT_EQ(oi, 0.0);
            ASSERT_LE(amax / 6.0f, std::ldexp(1.0f, -10));
          }
          ++checked;
        }
      }
      // The padding between strided values is left alone.
      for (size_t i = 0; i < x.size(); ++i) {
        if (i % size_t(stride) != 0) {
          ASSERT_EQ(out[i], -1.0f);
        }
      }
    }
    EXPECT_GT(checked, 10000);
    RecordProperty(f.e8m0_scale ? "mxfp4_saturated" : "nvfp4_saturated", saturated);
  }
}

TEST(Fp4Quantizer, ANonFiniteValueMakesItsRunNaN) {
  std::vector<float> x(40, 1.0f), out(40);
  x[20] = INFINITY;
  quantize_fp4(x.data(), 40, 1, kNvfp4, out.data());
  for (int i = 0; i < 40; ++i) EXPECT_EQ(std::isnan(out[size_t(i)]), i >= 16 && i < 32) << i;
  x[20] = kNan;
  quantize_fp4(x.data(), 40, 1, kMxfp4, out.data());
  for (int i = 0; i < 40; ++i) EXPECT_EQ(std::isnan(out[size_t(i)]), i < 32) << i;
}

}  // namespace
}  // namespace sage::ref
