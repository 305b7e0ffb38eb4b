// Built-in inputs with the outlier structure real models show (paper 003 Fig. 2): per-channel
// biases (large in K, moderate in Q and V) with a few massive channels, token norms that drift
// along the sequence, and an attention sink (key 0), which puts much of the softmax mass in many
// tiny P~ values (paper §3.3). Deterministic for a seed. Host code.
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

}  // namespace sage::ref
