// The float64 attention backward (the truth the backward emulation, backward.cpp, is measured
// against). Host code.
//
// The exact backward recomputes S and P = exp(S - LSE) from the forward's LSE, D = rowsum(dO∘O)
// from its O, dP = dO·Vᵀ, dS = P∘(dP - D), then dV = Pᵀ·dO, dQ = scale·dS·K, dK = scale·dSᵀ·Q.
// dK and dV sum over the query heads of a GQA group. Fully masked rows (LSE = -inf) have P = 0.
#include <cmath>
#include <limits>
#include <vector>

#include "ref/reference.h"

namespace sage::ref {
namespace {

std::vector<double> to_f64(const std::vector<float>& f) {
  return std::vector<double>(f.begin(), f.end());
}

}  // namespace

void attention_backward_exact(const Problem& p, const TensorView& q, const TensorView& k,
                              const TensorView& v, const double* o, const double* lse,
                              const TensorView& d_o, double* dq, double* dk, double* dv,
                              int threads, const double* d_lse) {
  const int64_t D = p.head_dim, Nq = p.seq_q, Nk = p.seq_kv, G = p.group_ratio();
  const size_t dims = size_t(D);
  // Per (batch, q head): Q and dO; per (batch, kv head): K and V, in double.
  std::vector<std::vector<double>> qs(size_t(p.batch * p.heads_q)), dos(qs.size()),
      ks(size_t(p.batch * p.heads_kv)), vs(ks.size());
  std::vector<double> delta(size_t(p.lse_elems()));  // D_i = dO_i·O_i
  parallel_for(int64_t(qs.size()), threads, [&](int64_t bh) {
    const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
    qs[size_t(bh)] = to_f64(load_matrix(q, b, h, Nq, D));
    dos[size_t(bh)] = to_f64(load_matrix(d_o, b, h, Nq, D));
    for (int64_t i = 0; i < Nq; ++i)
      delta[size_t(bh * Nq + i)] =
          dot_f64(dos[size_t(bh)].data() + i * D, o + (bh * Nq + i) * D, D) -
          (d_lse ? d_lse[bh * Nq + i] : 0.0);
  });
  parallel_for(int64_t(ks.size()), threads, [&](int64_t bh) {
    ks[size_t(bh)] = to_f64(load_matrix(k, bh / p.heads_kv, bh % p.heads_kv, Nk, D));
    vs[size_t(bh)] = to_f64(load_matrix(v, bh / p.heads_kv, bh % p.heads_kv, Nk, D));
  });
  // dS_ij for one (q head, row i, key j), recomputed by both passes.
  auto prob = [&](int64_t bh, int64_t i, int64_t j, double* p_out) {
    const int64_t kv = (bh / p.heads_q) * p.heads_kv + (bh % p.heads_q) / G;
    const double L = lse[bh * Nq + i];
    if (j >= p.visible_keys(i) || !(L > -std::numeric_limits<double>::infinity())) {
      *p_out = 0.0;
      return 0.0;
    }
    const double s =
        p.scale * dot_f64(qs[size_t(bh)].data() + i * D, ks[size_t(kv)].data() + j * D, D);
    const double pij = std::exp(s - L);
    const double dp = dot_f64(dos[size_t(bh)].data() + i * D, vs[size_t(kv)].data() + j * D, D);
    *p_out = pij;
    return pij * (dp - delta[size_t(bh * Nq + i)]);
  };
  // dQ: one task per (batch, q head, row).
  parallel_for(p.batch * p.heads_q * Nq, threads, [&](int64_t item) {
    const int64_t bh = item / Nq, i = item % Nq;
    const int64_t kv = (bh / p.heads_q) * p.heads_kv + (bh % p.heads_q) / G;
    std::vector<double> acc(dims, 0.0);
    for (int64_t j = 0; j < Nk; ++j) {
      double pij;
      const double ds = prob(bh, i, j, &pij);
      if (ds == 0.0) continue;
      const double* kj = ks[size_t(kv)].data() + j * D;
      for (int64_t d = 0; d < D; ++d) acc[size_t(d)] += ds * kj[d];
    }
    for (int64_t d = 0; d < D; ++d) dq[item * D + d] = p.scale * acc[size_t(d)];
  });
  // dK, dV: one task per (batch, kv head, key), over every query of the group.
  parallel_for(p.batch * p.heads_kv * Nk, threads, [&](int64_t item) {
    const int64_t bkv = item / Nk, j = item % Nk;
    const int64_t b = bkv / p.heads_kv, hkv = bkv % p.heads_kv;
    std::vector<double> ak(dims, 0.0), av(dims, 0.0);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t bh = b * p.heads_q + hkv * G + g;
      for (int64_t i = 0; i < Nq; ++i) {
        double pij;
        const double ds = prob(bh, i, j, &pij);
        const double* qi = qs[size_t(bh)].data() + i * D;
        const double* doi = dos[size_t(bh)].data() + i * D;
        for (int64_t d = 0; d < D; ++d) {
          ak[size_t(d)] += ds * qi[d];
          av[size_t(d)] += pij * doi[d];
        }
      }
    }
    for (int64_t d = 0; d < D; ++d) {
      dk[item * D + d] = p.scale * ak[size_t(d)];
      dv[item * D + d] = av[size_t(d)];
    }
  });
}

}  // namespace sage::ref
