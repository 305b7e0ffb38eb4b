// Helpers of the CPU backward tests on the training input classes (ref::make_training_inputs):
// the problem of a spec, float64 gradients (the truth), and the cosine against them.
#pragma once

#include <cmath>
#include <vector>

#include "ref/reference.h"
#include "ref/synthetic.h"
#include "sage/sage.h"

namespace sage::test {

struct Exact {
  std::vector<double> dq, dk, dv;
};

inline ref::Problem problem_of(const ref::TrainingSpec& s, sage_mask mask) {
  return ref::Problem{s.batch,   s.heads_q, s.heads_kv, s.seq_q, s.seq_kv, s.head_dim,
                      1.0 / std::sqrt(double(s.head_dim)), mask};
}

// float64 attention's gradients for dO, from its own O and LSE.
inline Exact exact_grads(const ref::Problem& p, const ref::TrainingInputs& in) {
  std::vector<double> o(size_t(p.out_elems())), lse(size_t(p.lse_elems()));
  ref::attention_exact(p, in.q_view(), in.k_view(), in.v_view(), o.data(), lse.data(), 2);
  Exact g;
  g.dq.resize(o.size());
  g.dk.resize(in.k.size());
  g.dv.resize(in.k.size());
  ref::attention_backward_exact(p, in.q_view(), in.k_view(), in.v_view(), o.data(), lse.data(),
                                in.d_o_view(), g.dq.data(), g.dk.data(), g.dv.data(), 2);
  return g;
}

inline double cosine(const std::vector<double>& truth, const std::vector<float>& x) {
  return ref::compare(truth.data(), x.data(), int64_t(x.size())).cos;
}
inline double rel_l1(const std::vector<double>& truth, const std::vector<float>& x) {
  return ref::compare(truth.data(), x.data(), int64_t(x.size())).rel_l1;
}

}  // namespace sage::test
