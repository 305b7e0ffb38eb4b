// The polynomial 2^x the sm90 kernel takes for a share of its scores (sage_quant_config
// .exp2_poly_every), the 1.5·2^23 constant behind it and the kernel's seeded S accumulator, and
// its running max's slack, for host and device: the kernel computes 2^x with this function and
// the CPU emulation reproduces it bit for bit from the same definition. Any architecture.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/formats.h"  // SAGE_HOST_DEVICE

namespace sage {

// 1.5·2^23: a float whose unit in the last place is 1, so adding it rounds to an integer held in
// the low mantissa bits, and its bits plus an int32 x are the float 1.5·2^23 + x.
constexpr float kMagicF = 12582912.0f;

// The sm90 softmax's running max moves only when a block's row max passes it by more than this
// (base 2; attn/sm90/softmax.cuh), so P~ is written in units of 448 / 2^kMaxSlack.
constexpr int kMaxSlack = 1;

// 2^r ~ 1 + c1·r + c2·r^2 + c3·r^3 on |r| <= 1/2, fitted for relative error (max 1.0e-4).
constexpr float kExp2PolyC1 = 0.693282928f, kExp2PolyC2 = 0.242210972f,
                kExp2PolyC3 = 0.0550089331f;

SAGE_HOST_DEVICE inline uint32_t float_to_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
#endif
}
SAGE_HOST_DEVICE inline float bits_to_float(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
#endif
}

// 2^x for x <= 9 (in [-125, 9] exactly enough; below, a value under 2^-125 that E4M3 and the row
// sum cannot see), on the FMA and integer pipes: x = n + r with n = round(x) (the add of
// 1.5·2^23, round to nearest even), |r| <= 1/2; 2^r by the polynomial in Horner form; n added to
// the exponent field (a wrapping 32-bit integer add).
SAGE_HOST_DEVICE inline float exp2_poly(float x) {
  x = fmaxf(x, -125.0f);
  const float t = x + kMagicF;  // 1.5·2^23 + n: the low bits of t hold n
  const float r = x - (t - kMagicF);
  float q = fmaf(kExp2PolyC3, r, kExp2PolyC2);
  q = fmaf(q, r, kExp2PolyC1);
  q = fmaf(q, r, 1.0f);
  return bits_to_float(float_to_bits(q) + (float_to_bits(t) << 23));
}

}  // namespace sage
