// Helpers shared by the test suites: fresh random fp16 tensors with optional strides, and a
// naive long-double attention written independently of src/ref (the oracle of the oracle).
#pragma once

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/formats.h"
#include "ref/reference.h"

namespace sage::test {

inline uint32_t float_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}
inline float bits_float(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}
inline std::string hex(uint32_t v) {
  std::ostringstream s;
  s << "0x" << std::hex << v;
  return s.str();
}

// A fresh seed per run; tests print it (SCOPED_TRACE) so a failure can be replayed: the
// environment variable SAGE_TEST_SEED, when set, replaces it.
inline uint64_t fresh_seed() {
  if (const char* s = std::getenv("SAGE_TEST_SEED")) return std::strtoull(s, nullptr, 0);
  std::random_device rd;
  return (uint64_t(rd()) << 32) ^ rd();
}

// A [B, H, N, D] fp16 tensor in a buffer with the given strides (elements not covered stay 0).
struct Fp16Tensor {
  std::vector<uint16_t> data;
  sage_strides strides{};
  ref::TensorView view() const { return {data.data(), SAGE_DTYPE_FP16, strides}; }
};

inline Fp16Tensor random_tensor(std::mt19937_64& rng, int64_t B, int64_t H, int64_t N, int64_t D,
                                sage_strides strides, float bias_std = 0.0f, float std = 1.0f) {
  Fp16Tensor t;
  t.strides = strides;
  const int64_t extent = (B - 1) * strides.batch + (H - 1) * strides.head +
                         (N - 1) * strides.token + D;
  t.data.assign(size_t(extent), 0);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      std::vector<float> bias(static_cast<size_t>(D));
      for (float& x : bias) x = bias_std * normal(rng);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t d = 0; d < D; ++d)
          t.data[size_t(b * strides.batch + h * strides.head + n * strides.token + d)] =
              uint16_t(encode_float(kFp16, std * normal(rng) + bias[size_t(d)], false));
    }
  return t;
}

inline Fp16Tensor random_tensor(std::mt19937_64& rng, int64_t B, int64_t H, int64_t N, int64_t D,
                                float bias_std = 0.0f, float std = 1.0f) {
  return random_tensor(rng, B, H, N, D, ref::contiguous_strides(SAGE_LAYOUT_HND, H, N, D),
                       bias_std, std);
}

// Naive attention in long double: out [B, Hq, Nq, D], lse [B, Hq, Nq]. Written from the
// definition (softmax(Q·Kᵀ·scale + mask)·V, docs/status.md) without sharing code with src/ref.
inline void naive_attention(int64_t B, int64_t Hq, int64_t Hkv, int64_t Nq, int64_t Nk, int64_t D,
                            double scale, sage_mask mask, const ref::TensorView& q,
                            const ref::TensorView& k, const ref::TensorView& v,
                            std::vector<double>* out, std::vector<double>* lse) {
  out->assign(size_t(B * Hq * Nq * D), 0.0);
  lse->assign(size_t(B * Hq * Nq), 0.0);
  auto at = [](const ref::TensorView& t, int64_t b, int64_t h, int64_t n, int64_t d) {
    const uint16_t bits = static_cast<const uint16_t*>(
        t.data)[b * t.strides.batch + h * t.strides.head + n * t.strides.token + d];
    return (long double)decode_float(kFp16, bits);
  };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / (Hq / Hkv);
      for (int64_t i = 0; i < Nq; ++i) {
        std::vector<long double> s;
        std::vector<int64_t> keys;
        for (int64_t j = 0; j < Nk; ++j) {
          const bool visible = mask == SAGE_MASK_NONE ||
                               (mask == SAGE_MASK_CAUSAL_TOP_LEFT && j <= i) ||
                               (mask == SAGE_MASK_CAUSAL_BOTTOM_RIGHT && j <= i + Nk - Nq);
          if (!visible) continue;
          long double x = 0;
          for (int64_t d = 0; d < D; ++d) x += at(q, b, h, i, d) * at(k, b, hk, j, d);
          s.push_back(x * (long double)scale);
          keys.push_back(j);
        }
        const size_t row = size_t((b * Hq + h) * Nq + i);
        if (keys.empty()) {
          (*lse)[row] = -std::numeric_limits<double>::infinity();
          continue;
        }
        long double mx = s[0];
        for (long double x : s) mx = std::max(mx, x);
        long double sum = 0;
        for (long double x : s) sum += std::exp(x - mx);
        for (int64_t d = 0; d < D; ++d) {
          long double acc = 0;
          for (size_t n = 0; n < keys.size(); ++n)
            acc += std::exp(s[n] - mx) / sum * at(v, b, hk, keys[n], d);
          (*out)[row * size_t(D) + size_t(d)] = double(acc);
        }
        (*lse)[row] = double(mx + std::log(sum));
      }
    }
}

}  // namespace sage::test

namespace sage::test {

// Attention of one head from dense double matrices (row-major [N][D]) with an additive score
// term `bias` [Nq][Nk] (may be empty): out = softmax((Q·Kᵀ + bias)·scale) · V, causal top-left if
// asked. Written from the definition, for the emulation-faithfulness tests.
inline std::vector<double> dense_attention(const std::vector<double>& Q, const std::vector<double>& K,
                                           const std::vector<double>& V,
                                           const std::vector<double>& bias, int64_t Nq,
                                           int64_t Nk, int64_t D, double scale) {
  std::vector<double> out(size_t(Nq * D), 0.0), s(static_cast<size_t>(Nk));
  for (int64_t i = 0; i < Nq; ++i) {
    double mx = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < Nk; ++j) {
      double x = 0;
      for (int64_t d = 0; d < D; ++d) x += Q[size_t(i * D + d)] * K[size_t(j * D + d)];
      if (!bias.empty()) x += bias[size_t(i * Nk + j)];
      s[size_t(j)] = x * scale;
      mx = std::max(mx, s[size_t(j)]);
    }
    double sum = 0;
    for (int64_t j = 0; j < Nk; ++j) sum += std::exp(s[size_t(j)] - mx);
    for (int64_t j = 0; j < Nk; ++j) {
      const double p = std::exp(s[size_t(j)] - mx) / sum;
      for (int64_t d = 0; d < D; ++d) out[size_t(i * D + d)] += p * V[size_t(j * D + d)];
    }
  }
  return out;
}

// One (b=0, h) matrix of an fp16 tensor as doubles.
inline std::vector<double> head_matrix(const Fp16Tensor& t, int64_t h, int64_t N, int64_t D) {
  std::vector<double> m(size_t(N * D));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t d = 0; d < D; ++d)
      m[size_t(n * D + d)] =
          decode_float(kFp16, t.data[size_t(h * t.strides.head + n * t.strides.token + d)]);
  return m;
}

}  // namespace sage::test
