// Built-in inputs with the outlier structure real models show (SageAttention2 paper, Fig. 2):
// per-channel biases (large in K, moderate in Q and V) with a few massive channels, token norms
// that drift along the sequence, and an attention sink (key 0), which puts much of the softmax mass
// in many tiny P~ values (paper §3.3). Deterministic for a seed. Host code.
#include <algorithm>
#include <cmath>
#include <random>

#include "common/formats.h"
#include "ref/synthetic.h"

namespace sage::ref {

SyntheticInputs make_inputs(const SyntheticSpec& s) {
  SyntheticInputs in;
  in.spec = s;
  const int64_t D = s.head_dim;
  in.q.resize(size_t(s.batch * s.heads_q * s.seq_q * D));
  in.k.resize(size_t(s.batch * s.heads_kv * s.seq_kv * D));
  in.v.resize(in.k.size());
  std::mt19937_64 rng(s.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto sign = [&] { return normal(rng) < 0 ? -1.0f : 1.0f; };
  auto fp16 = [](float x) { return uint16_t(encode_float(kFp16, x, false)); };
  auto token_norm = [&](int64_t t, int64_t seq) {
    const float drift = 1.0f + 0.5f * std::sin(9.42477796f * float(t) / float(seq));
    return drift * std::exp(s.token_spread * normal(rng));
  };
  const int64_t n_out = std::min<int64_t>(s.outlier_channels, D);

  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t hk = 0; hk < s.heads_kv; ++hk) {
      const int64_t ratio = s.heads_q / s.heads_kv;
      // The Q bias is shared by the query heads of one KV head (so the sink is the same key).
      const size_t dims = static_cast<size_t>(D);
      std::vector<float> qb(dims), kb(dims), vb(dims), k_noise(dims, 1.0f);
      for (int64_t d = 0; d < D; ++d) {
        const bool outlier = d < n_out;
        qb[size_t(d)] = outlier ? s.q_outlier * sign() : s.q_bias * normal(rng);
        kb[size_t(d)] = outlier ? s.k_outlier * sign() : s.k_bias * normal(rng);
        vb[size_t(d)] = s.v_bias * normal(rng);
        if (outlier) k_noise[size_t(d)] = 0.25f;
      }
      double qb_norm2 = 0;
      for (float x : qb) qb_norm2 += double(x) * x;
      for (int64_t hq = hk * ratio; hq < (hk + 1) * ratio; ++hq)
        for (int64_t t = 0; t < s.seq_q; ++t) {
          const float n = token_norm(t, s.seq_q);
          uint16_t* row = &in.q[size_t(((b * s.heads_q + hq) * s.seq_q + t) * D)];
          for (int64_t d = 0; d < D; ++d) row[d] = fp16(n * normal(rng) + qb[size_t(d)]);
        }
      for (int64_t t = 0; t < s.seq_kv; ++t) {
        const float n = token_norm(t, s.seq_kv);
        // The sink: key 0 leans along the Q bias so that q·k0·scale is `sink` above the rest.
        const float lean = t == 0 && qb_norm2 > 0
                               ? float(s.sink * std::sqrt(double(D)) / qb_norm2)
                               : 0.0f;
        const size_t row = size_t(((b * s.heads_kv + hk) * s.seq_kv + t) * D);
        for (int64_t d = 0; d < D; ++d) {
          in.k[row + size_t(d)] =
              fp16(n * k_noise[size_t(d)] * normal(rng) + kb[size_t(d)] + lean * qb[size_t(d)]);
          in.v[row + size_t(d)] = fp16(normal(rng) + vb[size_t(d)]);
        }
      }
    }
  }
  return in;
}

TrainingInputs make_training_inputs(const TrainingSpec& s) {
  TrainingInputs in;
  in.spec = s;
  const int64_t D = s.head_dim, G = s.heads_q / s.heads_kv;
  std::mt19937_64 rng(s.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto draw = [&](int64_t heads, int64_t seq) {
    std::vector<float> x(size_t(s.batch * heads * seq * D));
    for (float& e : x) e = normal(rng);
    return x;
  };
  std::vector<float> q = draw(s.heads_q, s.seq_q), k = draw(s.heads_kv, s.seq_kv),
                     v = draw(s.heads_kv, s.seq_kv), d_o = draw(s.heads_q, s.seq_q);
  const bool outliers = s.kind == TrainingClass::kOutlierScale ||
                        s.kind == TrainingClass::kOutlierBias ||
                        s.kind == TrainingClass::kOutlierSink;
  if (outliers) {
    const int64_t n = std::min(s.channels, D);
    std::vector<float> sign(static_cast<size_t>(n));
    for (float& x : sign) x = normal(rng) < 0 ? -1.0f : 1.0f;
    auto apply = [&](std::vector<float>& x) {
      for (size_t row = 0; row < x.size() / size_t(D); ++row)
        for (int64_t c = 0; c < n; ++c) {
          // Spread the outlier channels over the head dim (not only the first few).
          float& e = x[row * size_t(D) + size_t((c * D) / n)];
          e = s.kind == TrainingClass::kOutlierBias ? e + sign[size_t(c)] * s.strength
                                                    : e * s.strength;
        }
    };
    apply(q);
    apply(k);
  }
  if (s.kind == TrainingClass::kPeaked) {
    // q·k·scale with unit-variance entries has standard deviation 1: scale Q by the target.
    for (float& e : q) e *= s.strength;
  }
  if (s.kind == TrainingClass::kSink || s.kind == TrainingClass::kOutlierSink) {
    const float boost = s.kind == TrainingClass::kSink ? s.strength : 5.0f;
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t h = 0; h < s.heads_kv; ++h) {
        // The mean query of the group, so that the long key is attended, not avoided.
        std::vector<double> mean(static_cast<size_t>(D), 0.0);
        for (int64_t g = 0; g < G; ++g)
          for (int64_t i = 0; i < s.seq_q; ++i)
            for (int64_t d = 0; d < D; ++d)
              mean[size_t(d)] += q[size_t((((b * s.heads_q + h * G + g) * s.seq_q) + i) * D + d)];
        double mn = 0.0, kn = 0.0;
        for (double x : mean) mn += x * x;
        float* k0 = &k[size_t(((b * s.heads_kv + h) * s.seq_kv) * D)];
        for (int64_t d = 0; d < D; ++d) kn += double(k0[d]) * k0[d];
        mn = std::sqrt(mn);
        kn = std::sqrt(kn);
        for (int64_t d = 0; d < D; ++d)
          k0[d] = float(boost * 0.5 * (k0[d] + (mn > 0 ? kn * mean[size_t(d)] / mn : 0.0)));
      }
  }
  auto bits = [&](const std::vector<float>& x) {
    std::vector<uint16_t> out(x.size());
    for (size_t i = 0; i < x.size(); ++i) store_element(out.data(), s.dtype, int64_t(i), x[i]);
    return out;
  };
  in.q = bits(q);
  in.k = bits(k);
  in.v = bits(v);
  in.d_o = bits(d_o);
  return in;
}

}  // namespace sage::ref
