// Quantization groups: which tokens share one scale, for every sage_granularity,
// including the per-thread layouts that follow the mma.sync / wgmma accumulator, and the
// quantizer of a matrix by such groups (or by FP4 runs along its rows). Host code.
#include <algorithm>
#include <cmath>

#include "common/formats.h"
#include "ref/reference.h"

namespace sage::ref {

int64_t GroupLayout::group(int64_t t) const {
  if (span == 0) return 0;
  return (t / span) * groups_per_span + group_of[size_t(t % span)];
}

int64_t GroupLayout::num_groups(int64_t n) const {
  if (span == 0) return 1;
  return (n + span - 1) / span * groups_per_span;
}

GroupLayout GroupLayout::per_tensor() { return GroupLayout{}; }

GroupLayout GroupLayout::per_rows(int64_t block, int64_t rows) {
  GroupLayout g;
  g.span = block;
  g.groups_per_span = int((block + rows - 1) / rows);
  g.group_of.resize(size_t(block));
  for (int64_t r = 0; r < block; ++r) g.group_of[size_t(r)] = int(r / rows);
  return g;
}

GroupLayout GroupLayout::per_block(int64_t block) { return per_rows(block, block); }
GroupLayout GroupLayout::per_token(int64_t block) { return per_rows(block, 1); }

GroupLayout GroupLayout::thread_q(int64_t block_q, int64_t rows_per_warp) {
  GroupLayout g;
  g.span = block_q;
  g.groups_per_span = int(block_q / rows_per_warp) * 8;
  g.group_of.resize(size_t(block_q));
  for (int64_t r = 0; r < block_q; ++r)
    g.group_of[size_t(r)] = int((r / rows_per_warp) * 8 + r % 8);
  return g;
}

GroupLayout GroupLayout::thread_k(int64_t block_k) {
  GroupLayout g;
  g.span = block_k;
  g.groups_per_span = 4;
  g.group_of.resize(size_t(block_k));
  for (int64_t c = 0; c < block_k; ++c) g.group_of[size_t(c)] = int((c % 8) / 2);
  return g;
}

GroupLayout q_group_layout(const sage_quant_config& cfg) {
  switch (cfg.granularity) {
    case SAGE_GRANULARITY_PER_THREAD_MMA: return GroupLayout::thread_q(cfg.block_q, cfg.block_q / cfg.warps);
    case SAGE_GRANULARITY_PER_THREAD_WGMMA: return GroupLayout::thread_q(cfg.block_q, 16);
    case SAGE_GRANULARITY_PER_TOKEN: return GroupLayout::per_token(cfg.block_q);
    case SAGE_GRANULARITY_PER_WARP: return GroupLayout::per_rows(cfg.block_q, cfg.block_q / cfg.warps);
    case SAGE_GRANULARITY_PER_BLOCK: return GroupLayout::per_block(cfg.block_q);
    default: return GroupLayout::per_tensor();
  }
}

GroupLayout k_group_layout(const sage_quant_config& cfg) {
  switch (cfg.granularity) {
    case SAGE_GRANULARITY_PER_THREAD_MMA:
    case SAGE_GRANULARITY_PER_THREAD_WGMMA: return GroupLayout::thread_k(cfg.block_k);
    case SAGE_GRANULARITY_PER_TOKEN: return GroupLayout::per_token(cfg.block_k);
    case SAGE_GRANULARITY_PER_WARP:  // warps split queries, not keys: K stays per block
    case SAGE_GRANULARITY_PER_BLOCK: return GroupLayout::per_block(cfg.block_k);
    default: return GroupLayout::per_tensor();
  }
}

template <typename Real>
QuantizedGroups<Real> quantize_groups(const std::vector<Real>& x, int64_t rows, int64_t dim,
                                      const GroupLayout& layout, sage_qk_format format) {
  QuantizedGroups<Real> out;
  out.scale.assign(size_t(rows), Real(1));
  if (format == SAGE_QK_NONE) {
    out.values = x;
    return out;
  }
  if (const MicroscaleFormat* fp4 = qk_microscale(format)) {  // runs along each row
    out.values = x;
    for (int64_t r = 0; r < rows; ++r) round_fp4(&out.values[size_t(r * dim)], dim, 1, *fp4);
    return out;
  }
  out.values.resize(x.size());
  std::vector<float> amax(size_t(layout.num_groups(rows)), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    float& a = amax[size_t(layout.group(r))];
    for (int64_t d = 0; d < dim; ++d) a = std::max(a, float(std::fabs(x[size_t(r * dim + d)])));
  }
  const float qmax = format == SAGE_QK_INT8   ? float(kInt8Max)
                     : format == SAGE_QK_INT4 ? float(kInt4Max)
                                              : kE4M3Max;
  for (int64_t r = 0; r < rows; ++r) {
    const QuantScale s = make_quant_scale(amax[size_t(layout.group(r))], qmax);
    out.scale[size_t(r)] = Real(s.scale);
    for (int64_t d = 0; d < dim; ++d) {
      const size_t i = size_t(r * dim + d);
      const float xf = float(x[i]);
      out.values[i] = format == SAGE_QK_FP8_E4M3 ? Real(round_float(kE4M3, xf * s.inv))
                                                 : Real(quantize_int(xf, s.inv, int(qmax)));
    }
  }
  return out;
}

template QuantizedGroups<float> quantize_groups(const std::vector<float>&, int64_t, int64_t,
                                                const GroupLayout&, sage_qk_format);
template QuantizedGroups<double> quantize_groups(const std::vector<double>&, int64_t, int64_t,
                                                 const GroupLayout&, sage_qk_format);

}  // namespace sage::ref
