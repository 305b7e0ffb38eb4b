// The accuracy metrics of the SageAttention2 paper (its appendix A.7): cosine similarity,
// relative L1, RMSE, max |error|, over flattened outputs, accumulated in double. Host code.
#include <cmath>

#include "ref/reference.h"

namespace sage::ref {
namespace {
template <typename T>
Metrics compare_impl(const double* ref, const T* x, int64_t n) {
  double dot = 0, rr = 0, xx = 0, l1 = 0, ref_l1 = 0, sq = 0, mx = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double a = ref[i], b = double(x[i]), e = b - a;
    dot += a * b;
    rr += a * a;
    xx += b * b;
    l1 += std::fabs(e);
    ref_l1 += std::fabs(a);
    sq += e * e;
    // A NaN must not hide: once seen it stays (fmax would drop it).
    if (!std::isnan(mx) && !(std::fabs(e) <= mx)) mx = std::fabs(e);
  }
  Metrics m;
  m.cos = (rr > 0 && xx > 0) ? dot / (std::sqrt(rr) * std::sqrt(xx)) : (rr == xx ? 1.0 : 0.0);
  m.rel_l1 = ref_l1 > 0 ? l1 / ref_l1 : l1;
  m.rmse = n > 0 ? std::sqrt(sq / double(n)) : 0.0;
  m.max_abs = mx;
  return m;
}
}  // namespace

Metrics compare(const double* ref, const float* x, int64_t n) { return compare_impl(ref, x, n); }
Metrics compare(const double* ref, const double* x, int64_t n) { return compare_impl(ref, x, n); }

}  // namespace sage::ref
