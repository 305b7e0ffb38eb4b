// Helpers of the CPU backward tests on the training input classes (ref::make_training_inputs):
// the problem of a spec, float64 gradients (the truth) and forward outputs, and the cosine against
// them.
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

// The float64 forward's outputs as a forward-normalized backward takes them: O in fp32 (o32)
// and rounded to the dtype as a 16-bit forward returns it (o16), and the LSE.
struct Forward {
  std::vector<float> o32, o16, lse;
};
inline Forward forward_of(const ref::Problem& p, const ref::TrainingInputs& in, sage_dtype dtype) {
  std::vector<double> o(size_t(p.out_elems())), lse(size_t(p.lse_elems()));
  ref::attention_exact(p, in.q_view(), in.k_view(), in.v_view(), o.data(), lse.data(), 2);
  Forward f{std::vector<float>(o.begin(), o.end()), std::vector<float>(o.size()),
            std::vector<float>(lse.begin(), lse.end())};
  std::vector<uint16_t> bits(o.size());
  for (size_t i = 0; i < o.size(); ++i) {
    ref::store_element(bits.data(), dtype, int64_t(i), o[i]);
    f.o16[i] = ref::load_element(bits.data(), dtype, int64_t(i));
  }
  return f;
}

inline double cosine(const std::vector<double>& truth, const std::vector<float>& x) {
  return ref::compare(truth.data(), x.data(), int64_t(x.size())).cos;
}
inline double rel_l1(const std::vector<double>& truth, const std::vector<float>& x) {
  return ref::compare(truth.data(), x.data(), int64_t(x.size())).rel_l1;
}

}  // namespace sage::test
