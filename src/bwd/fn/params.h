// The forward-normalized 16-bit backward (config.normalizer SAGE_BWD_NORM_FORWARD, no INT8
// product): P = 2^(S·scale·log2 e - L) with L the forward's LSE, D = rowsum(dO∘O) - g from its O,
// and all five products in the input dtype with fp32 accumulation. It needs no statistics pass
// and no verdict: P is its forward's P to fp32 rounding, for any input. The workspace, the tile
// shape and the params of its three kernels (rows.cuh, the main kernel of kernel.cuh, the dQ
// store). Plain C++ (no CUDA types).
#pragma once

#include <cstddef>
#include <cstdint>

#include "bwd/params.h"

namespace sage::bwd::fn {

// A CTA owns kKeys keys of a KV head (two consumer warpgroups of 64) and streams the 64-query
// blocks of its group's query heads.
constexpr int kKeys = 128;
constexpr int kRows = 64;

struct Layout {
  int64_t nq_pad = 0, q_blocks = 0;
  size_t lse2 = 0;   // f32 [B*Hq][nq_pad]: the forward's LSE·log2 e (+inf: a row that sees no key)
  size_t delta = 0;  // f32 [B*Hq][nq_pad]: rowsum(dO∘O) - g (0 there)
  size_t dq_acc = 0;  // f32 [B*Hq][nq_pad x D] in dq_offset's layout: Σ dS·K, summed by bulk
                      // reductions
  size_t total = 0;
};

inline Layout make_layout(const ref::Problem& p) {
  Layout w;
  const int64_t bq = p.batch * p.heads_q;
  w.q_blocks = (p.seq_q + kRows - 1) / kRows;
  w.nq_pad = w.q_blocks * kRows;
  WorkspaceCarver carve;
  w.lse2 = carve.take(size_t(bq * w.nq_pad) * 4);
  w.delta = carve.take(size_t(bq * w.nq_pad) * 4);
  w.dq_acc = carve.take(size_t(bq * w.nq_pad * p.head_dim) * 4);
  w.total = carve.total;
  return w;
}

// The forward's outputs the backward reads.
struct Forward {
  const void* o;
  const float* lse;
  sage_strides o_st, lse_st;
};

// The whole call: shapes (Shape's q_blocks and nq_pad are this layout's; its key-side sizes are
// unused), the caller's tensors, the workspace's rows and dQ accumulator, the softmax scale.
using Params = ParamsOf<Shape, Inputs, LseGrad, Grads, Forward, RowStats, DqAccum, Scaling>;

}  // namespace sage::bwd::fn
