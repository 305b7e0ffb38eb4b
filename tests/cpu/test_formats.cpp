// Tests of the minifloat codec and the integer quantizer in src/common/formats.h, each against a
// reference written independently of it: decoding by bit surgery and hand tables, encoding by a
// nearest-value search in the decoded table, fp16/bf16 rounding done on the raw float bits.
// The expected NaN/inf/overflow results are those of PTX cvt (.rn, .satfinite) on sm_89+/sm_100a.
// Host only; any architecture.
#include <gtest/gtest.h>

#include "common/test_util.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/formats.h"

namespace {

using sage::FloatFormat;

using sage::test::bits_float;
using sage::test::float_bits;
using sage::test::hex;

// ---------------------------------------------------------------------------------------------
// Facts about each format, written out by hand (not derived from FloatFormat's arithmetic).
struct Spec {
  const char* name;
  FloatFormat fmt;
  int bits;                // total width
  uint32_t max_abs;        // code of the largest finite magnitude
  double max_value;        // its value
  uint32_t inf_abs;        // code of +infinity, 0 if the format has none
  uint32_t first_nan_abs;  // smallest positive NaN code, 0 if none
  uint32_t nan_out;        // what cvt writes for a NaN input (sign dropped)
};

const Spec kSpecE4M3{"E4M3", sage::kE4M3, 8, 0x7E, 448.0, 0, 0x7F, 0x7F};
const Spec kSpecE5M2{"E5M2", sage::kE5M2, 8, 0x7B, 57344.0, 0x7C, 0x7D, 0x7F};
const Spec kSpecE2M1{"E2M1", sage::kE2M1, 4, 0x7, 6.0, 0, 0, 0x7};  // NaN -> +MAX_NORM
const Spec kSpecFp16{"fp16", sage::kFp16, 16, 0x7BFF, 65504.0, 0x7C00, 0x7C01, 0x7FFF};
const Spec kSpecBf16{"bf16", sage::kBf16, 16,    0x7F7F, 3.3895313892515355e38,
                     0x7F80, 0x7F81,      0x7FFF};
const Spec* const kAllSpecs[] = {&kSpecE4M3, &kSpecE5M2, &kSpecE2M1, &kSpecFp16, &kSpecBf16};

uint32_t sign_bit(const Spec& s) {
  return 1u << (s.bits - 1);
}
uint32_t abs_code(const Spec& s, uint32_t c) {
  return c & (sign_bit(s) - 1);
}
bool code_is_nan(const Spec& s, uint32_t c) {
  return s.first_nan_abs != 0 && abs_code(s, c) >= s.first_nan_abs;
}
bool code_is_inf(const Spec& s, uint32_t c) {
  return s.inf_abs != 0 && abs_code(s, c) == s.inf_abs;
}

// Value of a finite code: an integer significand times one power of two,
// k * 2^(1 - bias - M) with k = m (subnormal) or (2^M + m) * 2^(e - 1).
double ref_value(const Spec& s, uint32_t c) {
  const int M = s.fmt.man_bits;
  const uint32_t mant = c & ((1u << M) - 1u);
  const uint32_t e = abs_code(s, c) >> M;
  const double k = e == 0 ? double(mant) : double((1u << M) + mant);
  const int shift = (e == 0 ? 0 : int(e) - 1) + 1 - s.fmt.bias - M;
  const double v = std::ldexp(k, shift);
  return (c & sign_bit(s)) ? -v : v;
}

// fp16 bits -> float bits by moving the fields (subnormals normalized by hand).
uint32_t half_to_float_bits(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0x1F) return sign | 0x7F800000u | (man << 13);  // inf, NaN with payload
  if (exp == 0) {
    if (man == 0) return sign;
    int e = 1;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --e;
    }
    return sign | (uint32_t(e + 112) << 23) | ((man & 0x3FFu) << 13);
  }
  return sign | ((exp + 112) << 23) | (man << 13);
}

// E4M3 bits -> fp16 bits by moving the fields (every E4M3 value is an fp16 normal or zero).
uint16_t e4m3_to_half_bits(uint8_t c) {
  const uint16_t sign = uint16_t((c & 0x80u) << 8);
  int exp = (c >> 3) & 0xF;
  uint32_t man = c & 0x7u;
  if (exp == 0) {
    if (man == 0) return sign;
    exp = 1;
    while ((man & 0x8u) == 0) {
      man <<= 1;
      --exp;
    }
    man &= 0x7u;
  }
  return uint16_t(sign | uint16_t((exp + 8) << 10) | uint16_t(man << 7));
}

// float -> fp16 with round-to-nearest-even done on the raw bits (cvt.rn.f16.f32).
uint16_t float_to_half_rne_bits(float x) {
  const uint32_t f = float_bits(x);
  const uint16_t sign = uint16_t((f >> 16) & 0x8000u);
  const uint32_t exp = (f >> 23) & 0xFFu;
  const uint32_t man = f & 0x7FFFFFu;
  if (exp == 0xFF) return man != 0 ? uint16_t(0x7FFF) : uint16_t(sign | 0x7C00u);
  const int hexp = int(exp) - 127 + 15;
  if (hexp >= 31) return uint16_t(sign | 0x7C00u);
  if (hexp >= 1) {
    uint32_t r = (uint32_t(hexp) << 10) | (man >> 13);
    const uint32_t rem = man & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;  // a carry may reach 0x7C00 = inf
    return uint16_t(sign | r);
  }
  if (exp == 0) return sign;             // float subnormal or zero: far below half of 2^-24
  const uint32_t sig = man | 0x800000u;  // value = sig * 2^(exp - 150) = sig * 2^(exp - 126) units
  const uint32_t shift = 126u - exp;     // of 2^-24, the fp16 subnormal step
  if (shift > 24) return sign;
  uint32_t r = sig >> shift;
  const uint32_t rem = sig & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (r & 1u))) ++r;
  return uint16_t(sign | r);
}

// float -> bf16 with round-to-nearest-even on the raw bits (cvt.rn.bf16.f32).
uint16_t float_to_bf16_rne_bits(float x) {
  const uint32_t f = float_bits(x);
  if ((f & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
  return uint16_t((f + 0x7FFFu + ((f >> 16) & 1u)) >> 16);
}

// ---------------------------------------------------------------------------------------------
// Oracle encoder: nearest entry of the decoded table of positive finite values, ties to the even
// code. One more candidate sits past the maximum (code max_abs + 1, value max + last step): when
// it wins, the value overflows, to +-max with saturation, else to inf (or NaN, or max for E2M1).
struct Table {
  const Spec* spec;
  std::vector<double> values;  // ascending, values[i] is the value of codes[i]
  std::vector<uint32_t> codes;
};

Table make_table(const Spec& s) {
  std::vector<std::pair<double, uint32_t>> entries;
  for (uint32_t c = 0; c <= s.max_abs; ++c) entries.emplace_back(ref_value(s, c), c);
  std::sort(entries.begin(), entries.end());
  const double step = entries.back().first - entries[entries.size() - 2].first;
  entries.emplace_back(entries.back().first + step, s.max_abs + 1);  // overflow sentinel
  Table t{&s, {}, {}};
  for (const auto& e : entries) {
    t.values.push_back(e.first);
    t.codes.push_back(e.second);
  }
  return t;
}

uint32_t oracle_encode(const Table& t, double x, bool saturate) {
  const Spec& s = *t.spec;
  if (std::isnan(x)) return s.nan_out;
  const uint32_t sign = std::signbit(x) ? sign_bit(s) : 0u;
  const uint32_t overflow =
      saturate ? s.max_abs
               : (s.inf_abs != 0 ? s.inf_abs : (s.first_nan_abs != 0 ? 0x7F : s.max_abs));
  const double a = std::fabs(x);
  if (std::isinf(a) || a >= t.values.back()) return sign | overflow;
  const size_t hi =
      size_t(std::upper_bound(t.values.begin(), t.values.end(), a) - t.values.begin());
  const size_t lo = hi - 1;  // values[0] == 0 <= a, so hi >= 1
  uint32_t code;
  if (t.values[lo] == a) {
    code = t.codes[lo];
  } else {
    const double d_lo = a - t.values[lo];  // exact (Sterbenz): neighbours of a
    const double d_hi = t.values[hi] - a;
    if (d_lo < d_hi) {
      code = t.codes[lo];
    } else if (d_hi < d_lo) {
      code = t.codes[hi];
    } else {
      code = (t.codes[lo] & 1u) == 0 ? t.codes[lo] : t.codes[hi];
    }
  }
  if (code > s.max_abs) return sign | overflow;
  return sign | code;
}

// Midpoints between adjacent table entries (the overflow sentinel included), both signs, with
// the floats one ulp either side of each.
std::vector<float> midpoint_inputs(const Table& t) {
  std::vector<float> out;
  for (size_t i = 0; i + 1 < t.values.size(); ++i) {
    const double mid = 0.5 * (t.values[i] + t.values[i + 1]);
    const float m = float(mid);
    EXPECT_EQ(double(m), mid) << t.spec->name << ": a midpoint is not a float";
    for (float v : {m, std::nextafter(m, 0.0f), std::nextafter(m, HUGE_VALF)}) {
      out.push_back(v);
      out.push_back(-v);
    }
  }
  return out;
}

const Table& table_of(const Spec& s) {
  static const std::vector<Table> tables = [] {
    std::vector<Table> v;
    for (const Spec* sp : kAllSpecs) v.push_back(make_table(*sp));
    return v;
  }();
  for (const Table& t : tables)
    if (t.spec == &s) return t;
  return tables.front();  // not reached
}

// Compares encode_float with the oracle over `inputs`; reports the first few differences.
void expect_encode_matches_oracle(const Spec& s, const std::vector<double>& inputs, bool saturate,
                                  const char* what) {
  const Table& t = table_of(s);
  size_t bad = 0;
  std::string first;
  for (double x : inputs) {
    const uint32_t got = sage::encode_float(s.fmt, x, saturate);
    const uint32_t want = oracle_encode(t, x, saturate);
    if (got != want) {
      if (++bad <= 5) {
        std::ostringstream m;
        m << "\n  x=" << x << " (float bits " << hex(float_bits(float(x))) << ") got " << hex(got)
          << " want " << hex(want);
        first += m.str();
      }
    }
  }
  EXPECT_EQ(bad, 0u) << s.name << " saturate=" << saturate << " on " << what << ": " << bad
                     << " of " << inputs.size() << " differ" << first;
}

std::vector<double> as_doubles(const std::vector<float>& v) {
  return {v.begin(), v.end()};
}

std::vector<double> every_fp16_value() {
  std::vector<double> v;
  for (uint32_t h = 0; h < 0x10000u; ++h) v.push_back(bits_float(half_to_float_bits(uint16_t(h))));
  return v;
}

// ---------------------------------------------------------------------------------------------
// Decoding.

TEST(FormatsDecode, E2M1MatchesHandTable) {
  const float kTable[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (uint32_t c = 0; c < 16; ++c) {
    const float want = (c & 8u) ? -kTable[c & 7u] : kTable[c & 7u];
    const float got = sage::decode_float(sage::kE2M1, c);
    EXPECT_EQ(float_bits(got), float_bits(want)) << "code " << c;  // bits: -0 for code 8
  }
}

TEST(FormatsDecode, KnownValues) {
  struct Case {
    const FloatFormat* f;
    uint32_t code;
    double value;
  };
  const Case cases[] = {
      {&sage::kE4M3, 0x7E, 448.0},
      {&sage::kE4M3, 0xFE, -448.0},
      {&sage::kE4M3, 0x01, 0x1p-9},
      {&sage::kE4M3, 0x07, 7 * 0x1p-9},
      {&sage::kE4M3, 0x08, 0x1p-6},
      {&sage::kE4M3, 0x38, 1.0},
      {&sage::kE4M3, 0x77, 240.0},
      {&sage::kE4M3, 0x7D, 416.0},
      {&sage::kE5M2, 0x7B, 57344.0},
      {&sage::kE5M2, 0xFB, -57344.0},
      {&sage::kE5M2, 0x01, 0x1p-16},
      {&sage::kE5M2, 0x03, 3 * 0x1p-16},
      {&sage::kE5M2, 0x04, 0x1p-14},
      {&sage::kE5M2, 0x3C, 1.0},
      {&sage::kE5M2, 0x7C, HUGE_VAL},
      {&sage::kE5M2, 0xFC, -HUGE_VAL},
      {&sage::kFp16, 0x7BFF, 65504.0},
      {&sage::kFp16, 0x0001, 0x1p-24},
      {&sage::kFp16, 0x03FF, 1023 * 0x1p-24},
      {&sage::kFp16, 0x3C00, 1.0},
      {&sage::kFp16, 0x3555, 0.333251953125},
      {&sage::kFp16, 0xFC00, -HUGE_VAL},
      {&sage::kBf16, 0x3F80, 1.0},
      {&sage::kBf16, 0x0001, 0x1p-133},
      {&sage::kBf16, 0x7F7F, 3.3895313892515355e38},
      {&sage::kBf16, 0x4049, 3.140625},
      {&sage::kBf16, 0x7F80, HUGE_VAL},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(double(sage::decode_float(*c.f, c.code)), c.value) << "code " << hex(c.code);
  }
  EXPECT_TRUE(std::isnan(sage::decode_float(sage::kE4M3, 0x7F)));
  EXPECT_TRUE(std::isnan(sage::decode_float(sage::kE4M3, 0xFF)));
  for (uint32_t c : {0x7Du, 0x7Eu, 0x7Fu, 0xFDu, 0xFFu})
    EXPECT_TRUE(std::isnan(sage::decode_float(sage::kE5M2, c))) << hex(c);
}

// Every code of every format: value from the generic integer formula (finite codes), and the
// NaN / infinity classification from the hand-written Spec.
TEST(FormatsDecode, EveryCodeMatchesIntegerFormula) {
  for (const Spec* sp : kAllSpecs) {
    const Spec& s = *sp;
    for (uint32_t c = 0; c < (1u << s.bits); ++c) {
      const float got = sage::decode_float(s.fmt, c);
      if (code_is_nan(s, c)) {
        EXPECT_TRUE(std::isnan(got)) << s.name << " " << hex(c);
      } else if (code_is_inf(s, c)) {
        EXPECT_TRUE(std::isinf(got) && std::signbit(got) == bool(c & sign_bit(s)))
            << s.name << " " << hex(c);
      } else {
        const float want = float(ref_value(s, c));
        ASSERT_EQ(double(want), ref_value(s, c));  // every finite value is a float
        EXPECT_EQ(float_bits(got), float_bits(want)) << s.name << " " << hex(c);
      }
    }
  }
}

// Bit-level cross checks: fp16 by field surgery, bf16 as the top half of a float, E5M2 as the top
// byte of an fp16, E4M3 re-packed into an fp16.
TEST(FormatsDecode, EveryCodeMatchesBitSurgery) {
  for (uint32_t c = 0; c < 0x10000u; ++c) {
    const uint32_t want16 = half_to_float_bits(uint16_t(c));
    const float got16 = sage::decode_float(sage::kFp16, c);
    if (std::isnan(bits_float(want16))) {
      EXPECT_TRUE(std::isnan(got16)) << "fp16 " << hex(c);
    } else {
      EXPECT_EQ(float_bits(got16), want16) << "fp16 " << hex(c);
    }
    const uint32_t want_bf = c << 16;
    const float got_bf = sage::decode_float(sage::kBf16, c);
    if (std::isnan(bits_float(want_bf))) {
      EXPECT_TRUE(std::isnan(got_bf)) << "bf16 " << hex(c);
    } else {
      EXPECT_EQ(float_bits(got_bf), want_bf) << "bf16 " << hex(c);
    }
  }
  for (uint32_t c = 0; c < 0x100u; ++c) {
    const uint32_t want5 = half_to_float_bits(uint16_t(c << 8));
    const float got5 = sage::decode_float(sage::kE5M2, c);
    if (std::isnan(bits_float(want5))) {
      EXPECT_TRUE(std::isnan(got5)) << "E5M2 " << hex(c);
    } else {
      EXPECT_EQ(float_bits(got5), want5) << "E5M2 " << hex(c);
    }
    const float got4 = sage::decode_float(sage::kE4M3, c);
    if ((c & 0x7Fu) == 0x7Fu) {
      EXPECT_TRUE(std::isnan(got4)) << "E4M3 " << hex(c);
    } else {
      EXPECT_EQ(float_bits(got4), half_to_float_bits(e4m3_to_half_bits(uint8_t(c))))
          << "E4M3 " << hex(c);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Round trip: every non-NaN code (both signs, -0 included) survives decode then encode.

TEST(FormatsRoundTrip, EveryNonNanCode) {
  for (const Spec* sp : kAllSpecs) {
    const Spec& s = *sp;
    for (uint32_t c = 0; c < (1u << s.bits); ++c) {
      if (code_is_nan(s, c)) continue;
      const float v = sage::decode_float(s.fmt, c);
      EXPECT_EQ(sage::encode_float(s.fmt, v, /*saturate=*/false), c) << s.name << " " << hex(c);
      const uint32_t sat_want = code_is_inf(s, c) ? ((c & sign_bit(s)) | s.max_abs) : c;
      EXPECT_EQ(sage::encode_float(s.fmt, v, /*saturate=*/true), sat_want)
          << s.name << " " << hex(c);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Encoding against the oracle.

TEST(FormatsEncode, EveryFp16ValueMatchesOracle) {
  const std::vector<double> inputs = every_fp16_value();
  for (const Spec* sp : kAllSpecs) {
    expect_encode_matches_oracle(*sp, inputs, /*saturate=*/true, "every fp16 value");
    expect_encode_matches_oracle(*sp, inputs, /*saturate=*/false, "every fp16 value");
  }
}

TEST(FormatsEncode, MidpointsAndNeighboursMatchOracle) {
  for (const Spec* sp : kAllSpecs) {
    const std::vector<float> mids = midpoint_inputs(table_of(*sp));
    ASSERT_GT(mids.size(), 6u);
    // The midpoints of every format, encoded into every format: each one is a tie somewhere.
    for (const Spec* target : kAllSpecs) {
      for (bool saturate : {true, false}) {
        const std::string what = std::string(sp->name) + " midpoints";
        expect_encode_matches_oracle(*target, as_doubles(mids), saturate, what.c_str());
      }
    }
  }
}

// encode_float takes a double: a value a hair off a midpoint must round once, by its own side.
TEST(FormatsEncode, DoubleInputsNearMidpointsRoundOnce) {
  for (const Spec* sp : kAllSpecs) {
    const Table& t = table_of(*sp);
    std::vector<double> inputs;
    for (size_t i = 0; i + 1 < t.values.size(); ++i) {
      const double mid = 0.5 * (t.values[i] + t.values[i + 1]);
      for (double v : {std::nextafter(mid, 0.0), std::nextafter(mid, HUGE_VAL)}) {
        inputs.push_back(v);
        inputs.push_back(-v);
      }
    }
    expect_encode_matches_oracle(*sp, inputs, /*saturate=*/true, "double midpoint neighbours");
    expect_encode_matches_oracle(*sp, inputs, /*saturate=*/false, "double midpoint neighbours");
  }
}

// Specials and range edges, with the results PTX cvt gives (checked on an H100 for FP8, fp16 and
// bf16; E2M1 per the PTX ISA: NaN -> +MAX_NORM).
TEST(FormatsEncode, SpecialsFollowPtx) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nans[] = {std::numeric_limits<float>::quiet_NaN(),
                        -std::numeric_limits<float>::quiet_NaN(),
                        std::numeric_limits<float>::signaling_NaN(),
                        bits_float(0x7F800001u),
                        bits_float(0xFFFFFFFFu),
                        bits_float(0xFFC00000u)};
  for (const Spec* sp : kAllSpecs) {
    const Spec& s = *sp;
    for (float n : nans) {
      EXPECT_EQ(sage::encode_float(s.fmt, n, true), s.nan_out)
          << s.name << " " << hex(float_bits(n));
      EXPECT_EQ(sage::encode_float(s.fmt, n, false), s.nan_out) << s.name;
    }
    // .satfinite: +-inf and anything beyond the range -> +-max.
    for (float big : {inf, FLT_MAX, float(s.max_value) * 4.0f}) {
      EXPECT_EQ(sage::encode_float(s.fmt, big, true), s.max_abs) << s.name << " " << big;
      EXPECT_EQ(sage::encode_float(s.fmt, -big, true), sign_bit(s) | s.max_abs) << s.name;
    }
    EXPECT_EQ(sage::encode_float(s.fmt, 0.0f, true), 0u) << s.name;
    EXPECT_EQ(sage::encode_float(s.fmt, -0.0f, true), sign_bit(s)) << s.name;
    // Far below the smallest subnormal: a signed zero.
    EXPECT_EQ(sage::encode_float(s.fmt, -FLT_TRUE_MIN, true), sign_bit(s)) << s.name;
  }
  // FP8 edges: the midpoint past the maximum (464 for E4M3) still rounds to it.
  EXPECT_EQ(sage::encode_float(sage::kE4M3, 464.0f, true), 0x7Eu);
  EXPECT_EQ(sage::encode_float(sage::kE4M3, 464.0f, false), 0x7Eu);  // tie to even 0b110
  EXPECT_TRUE(
      std::isnan(sage::decode_float(sage::kE4M3, sage::encode_float(sage::kE4M3, 465.0f, false))));
  EXPECT_EQ(sage::encode_float(sage::kE4M3, 0x1p-10f, true), 0x00u);  // tie -> even 0
  EXPECT_EQ(sage::encode_float(sage::kE4M3, 3 * 0x1p-10f, true), 0x02u);
  EXPECT_EQ(sage::encode_float(sage::kE5M2, 61440.0f, true), 0x7Bu);
  EXPECT_EQ(sage::encode_float(sage::kE5M2, 61440.0f, false), 0x7Cu);  // tie goes to inf (even)
  EXPECT_EQ(sage::encode_float(sage::kE5M2, std::nextafter(61440.0f, 0.0f), false), 0x7Bu);
  EXPECT_EQ(sage::encode_float(sage::kE2M1, 5.0f, true), 0x6u);   // tie 4|6 -> 4 (even)
  EXPECT_EQ(sage::encode_float(sage::kE2M1, 0.25f, true), 0x0u);  // tie 0|0.5 -> 0
  EXPECT_EQ(sage::encode_float(sage::kE2M1, 2.5f, true), 0x4u);   // tie 2|3 -> 2
  EXPECT_EQ(sage::encode_float(sage::kE2M1, 7.0f, false), 0x7u);  // no inf: stays 6
  // fp16 without saturation (cvt.rn.f16.f32): the overflow threshold is exactly 65520.
  EXPECT_EQ(sage::encode_float(sage::kFp16, 65520.0f, false), 0x7C00u);
  EXPECT_EQ(sage::encode_float(sage::kFp16, -65520.0f, false), 0xFC00u);
  EXPECT_EQ(sage::encode_float(sage::kFp16, std::nextafter(65520.0f, 0.0f), false), 0x7BFFu);
  EXPECT_EQ(sage::encode_float(sage::kFp16, 65504.0f, false), 0x7BFFu);
  EXPECT_EQ(sage::encode_float(sage::kFp16, inf, false), 0x7C00u);
  EXPECT_EQ(sage::encode_float(sage::kFp16, -inf, false), 0xFC00u);
  EXPECT_EQ(sage::encode_float(sage::kFp16, FLT_MAX, false), 0x7C00u);
  EXPECT_EQ(sage::encode_float(sage::kFp16, 0x1p-25f, false), 0x0000u);  // tie -> 0
  EXPECT_EQ(sage::encode_float(sage::kFp16, std::nextafter(0x1p-25f, 1.0f), false), 0x0001u);
  EXPECT_EQ(sage::encode_float(sage::kFp16, 0x1.8p-24f, false), 0x0002u);  // tie 1|2 -> 2
  // bf16 without saturation (cvt.rn.bf16.f32).
  EXPECT_EQ(sage::encode_float(sage::kBf16, FLT_MAX, false), 0x7F80u);
  EXPECT_EQ(sage::encode_float(sage::kBf16, bits_float(0x7F7F7FFFu), false), 0x7F7Fu);
  EXPECT_EQ(sage::encode_float(sage::kBf16, bits_float(0x7F7F8000u), false), 0x7F80u);
  EXPECT_EQ(sage::encode_float(sage::kBf16, -inf, false), 0xFF80u);
  EXPECT_EQ(sage::encode_float(sage::kBf16, FLT_TRUE_MIN, false), 0x0000u);
  EXPECT_EQ(sage::encode_float(sage::kBf16, bits_float(0x00008000u), false), 0x0000u);  // tie
  EXPECT_EQ(sage::encode_float(sage::kBf16, bits_float(0x00018000u), false), 0x0002u);  // tie
}

// fp16 and bf16 of random floats against rounding done on the raw bits.
TEST(FormatsEncode, Fp16Bf16RandomFloatsMatchBitRounding) {
  std::mt19937 rng(12345);
  std::vector<float> inputs;
  for (int i = 0; i < (1 << 19); ++i) inputs.push_back(bits_float(uint32_t(rng())));
  // Concentrated on the fp16 range, subnormals and overflow edge included: exponents 95..145.
  std::uniform_int_distribution<uint32_t> exp_dist(95, 145);
  for (int i = 0; i < (1 << 19); ++i) {
    const uint32_t b = (uint32_t(rng()) & 0x807FFFFFu) | (exp_dist(rng) << 23);
    inputs.push_back(bits_float(b));
  }
  // Exact ties for fp16 and bf16 (the lowest kept bit random, the rest of the tail zero).
  for (int i = 0; i < (1 << 16); ++i) {
    const uint32_t b = uint32_t(rng());
    inputs.push_back(bits_float((b & 0xFFFFE000u) | 0x1000u));
    inputs.push_back(bits_float((b & 0xFFFF0000u) | 0x8000u));
  }
  size_t bad16 = 0, bad_bf = 0;
  std::string first;
  for (float x : inputs) {
    const uint32_t got16 = sage::encode_float(sage::kFp16, x, false);
    const uint32_t want16 = float_to_half_rne_bits(x);
    if (got16 != want16 && ++bad16 <= 5)
      first += "\n  fp16 " + hex(float_bits(x)) + " got " + hex(got16) + " want " + hex(want16);
    const uint32_t got_bf = sage::encode_float(sage::kBf16, x, false);
    const uint32_t want_bf = float_to_bf16_rne_bits(x);
    if (got_bf != want_bf && ++bad_bf <= 5)
      first += "\n  bf16 " + hex(float_bits(x)) + " got " + hex(got_bf) + " want " + hex(want_bf);
  }
  EXPECT_EQ(bad16 + bad_bf, 0u) << bad16 << " fp16 and " << bad_bf << " bf16 differences of "
                                << inputs.size() << first;
  // round_fp16/round_bf16 are encode then decode without saturation.
  EXPECT_EQ(sage::round_fp16(65520.0f), std::numeric_limits<float>::infinity());
  EXPECT_EQ(sage::round_bf16(1.00390625f), 1.0f);  // tie -> even
}

// ---------------------------------------------------------------------------------------------
// Integer quantization.

TEST(FormatsQuantInt, RoundsHalfToEven) {
  const struct {
    float x;
    int q;
  } cases[] = {{0.5f, 0},   {1.5f, 2},     {2.5f, 2},      {3.5f, 4},        {-0.5f, 0},
               {-1.5f, -2}, {-2.5f, -2},   {-3.5f, -4},    {0.49999997f, 0}, {0.50000006f, 1},
               {-0.0f, 0},  {126.5f, 126}, {-126.5f, -126}};
  for (const auto& c : cases) {
    EXPECT_EQ(sage::quantize_int(c.x, 1.0f, sage::kInt8Max), c.q) << c.x;
  }
  EXPECT_EQ(sage::quantize_int(5.0f, 0.5f, sage::kInt8Max), 2);  // 2.5 -> 2
  EXPECT_EQ(sage::quantize_int(7.0f, 0.5f, sage::kInt8Max), 4);  // 3.5 -> 4
}

TEST(FormatsQuantInt, ClampsToQmax) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(sage::quantize_int(1000.0f, 1.0f, sage::kInt8Max), 127);
  EXPECT_EQ(sage::quantize_int(-1000.0f, 1.0f, sage::kInt8Max), -127);  // not -128
  EXPECT_EQ(sage::quantize_int(127.5f, 1.0f, sage::kInt8Max), 127);     // rounds to 128
  EXPECT_EQ(sage::quantize_int(-128.0f, 1.0f, sage::kInt8Max), -127);
  EXPECT_EQ(sage::quantize_int(7.6f, 1.0f, sage::kInt4Max), 7);
  EXPECT_EQ(sage::quantize_int(7.5f, 1.0f, sage::kInt4Max), 7);  // rounds to 8
  EXPECT_EQ(sage::quantize_int(-8.0f, 1.0f, sage::kInt4Max), -7);
  EXPECT_EQ(sage::quantize_int(6.5f, 1.0f, sage::kInt4Max), 6);
  EXPECT_EQ(sage::quantize_int(inf, 1.0f, sage::kInt8Max), 127);
  EXPECT_EQ(sage::quantize_int(-inf, 1.0f, sage::kInt4Max), -7);
  // cvt.rni.s32.f32 of NaN is 0 (volatile: keep the compiler from folding the call).
  volatile float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(sage::quantize_int(nan, 1.0f, sage::kInt8Max), 0);
}

TEST(FormatsQuantInt, ZeroGroupScale) {
  for (float amax : {0.0f, -0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN()}) {
    const sage::QuantScale s = sage::make_quant_scale(amax, float(sage::kInt8Max));
    EXPECT_EQ(s.scale, 0.0f) << amax;
    EXPECT_EQ(s.inv, 0.0f) << amax;
  }
  const sage::QuantScale z = sage::make_quant_scale(0.0f, float(sage::kInt4Max));
  for (float x : {0.0f, -0.0f, 1e-30f, -3.0f}) EXPECT_EQ(sage::quantize_int(x, z.inv, 7), 0) << x;
}

// Random groups: every q within +-qmax, the extremes at +-qmax, and |x - q*scale| <= scale/2
// (plus the float rounding of x*inv and of the two scale factors).
TEST(FormatsQuantInt, GroupRoundTripErrorWithinHalfStep) {
  std::mt19937 rng(777);
  for (int qmax : {sage::kInt8Max, sage::kInt4Max}) {
    for (int g = 0; g < 2000; ++g) {
      const float magnitude = std::ldexp(1.0f, int(rng() % 40) - 20);
      std::uniform_real_distribution<float> dist(-magnitude, magnitude);
      std::vector<float> group(64);
      float amax = 0.0f;
      for (float& x : group) {
        x = dist(rng);
        amax = std::max(amax, std::fabs(x));
      }
      const sage::QuantScale s = sage::make_quant_scale(amax, float(qmax));
      ASSERT_GT(s.scale, 0.0f);
      const double tol = 0.5 * double(s.scale) + 8.0 * FLT_EPSILON * double(amax);
      for (float x : group) {
        const int q = sage::quantize_int(x, s.inv, qmax);
        ASSERT_LE(std::abs(q), qmax);
        const double err = std::fabs(double(x) - double(q) * double(s.scale));
        ASSERT_LE(err, tol) << "x=" << x << " q=" << q << " scale=" << s.scale << " qmax=" << qmax;
        if (std::fabs(x) == amax) {
          ASSERT_EQ(q, x > 0 ? qmax : -qmax) << x;
        }
      }
    }
  }
}

}  // namespace
