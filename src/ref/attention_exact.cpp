// float64 attention, the "truth" of every accuracy figure: O = softmax(Q·Kᵀ·scale + mask)·V with
// GQA, both causal alignments and LSE, from inputs read exactly as stored. Host code.
#include <cmath>
#include <limits>

#include "ref/reference.h"

namespace sage::ref {
namespace {

constexpr int64_t kRowsPerItem = 32;

std::vector<double> load_matrix_f64(const TensorView& t, int64_t b, int64_t h, int64_t rows,
                                    int64_t dim) {
  const std::vector<float> f = load_matrix(t, b, h, rows, dim);
  return std::vector<double>(f.begin(), f.end());
}


}  // namespace

void attention_exact(const Problem& p, const TensorView& q, const TensorView& k,
                     const TensorView& v, double* out, double* lse, int threads) {
  const int64_t D = p.head_dim, Nq = p.seq_q, Nk = p.seq_kv;
  // K and V of every (batch, kv head), converted once.
  std::vector<std::vector<double>> ks(size_t(p.batch * p.heads_kv)), vs(ks.size());
  parallel_for(int64_t(ks.size()), threads, [&](int64_t i) {
    ks[size_t(i)] = load_matrix_f64(k, i / p.heads_kv, i % p.heads_kv, Nk, D);
    vs[size_t(i)] = load_matrix_f64(v, i / p.heads_kv, i % p.heads_kv, Nk, D);
  });

  const int64_t chunks = (Nq + kRowsPerItem - 1) / kRowsPerItem;
  parallel_for(p.batch * p.heads_q * chunks, threads, [&](int64_t item) {
    const int64_t chunk = item % chunks, bh = item / chunks;
    const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
    const size_t kv = size_t(b * p.heads_kv + h / p.group_ratio());
    const double* K = ks[kv].data();
    const double* V = vs[kv].data();
    const int64_t r0 = chunk * kRowsPerItem, r1 = std::min(Nq, r0 + kRowsPerItem);
    std::vector<double> qrow(static_cast<size_t>(D)), s(static_cast<size_t>(Nk));
    for (int64_t i = r0; i < r1; ++i) {
      for (int64_t d = 0; d < D; ++d)
        qrow[size_t(d)] = load_element(q.data, q.dtype,
                                       b * q.strides.batch + h * q.strides.head +
                                           i * q.strides.token + d);
      double* o = out + (bh * Nq + i) * D;
      const int64_t n = p.visible_keys(i);
      if (n == 0) {
        for (int64_t d = 0; d < D; ++d) o[d] = 0.0;
        if (lse) lse[bh * Nq + i] = -std::numeric_limits<double>::infinity();
        continue;
      }
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        s[size_t(j)] = p.scale * dot_f64(qrow.data(), K + j * D, D);
        m = std::max(m, s[size_t(j)]);
      }
      double l = 0;
      std::vector<double> acc(size_t(D), 0.0);
      for (int64_t j = 0; j < n; ++j) {
        const double e = std::exp(s[size_t(j)] - m);
        l += e;
        const double* vj = V + j * D;
        for (int64_t d = 0; d < D; ++d) acc[size_t(d)] += e * vj[d];
      }
      for (int64_t d = 0; d < D; ++d) o[d] = acc[size_t(d)] / l;
      if (lse) lse[bh * Nq + i] = m + std::log(l);
    }
  });
}

double dot_f64(const double* a, const double* b, int64_t n) {
  double acc[4] = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int l = 0; l < 4; ++l) acc[l] += a[i + l] * b[i + l];
  for (; i < n; ++i) acc[0] += a[i] * b[i];
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

}  // namespace sage::ref
