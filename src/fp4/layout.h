// The workspace of SageAttention3's FP4 path on fp16 tensor cores (fp4.h): plain C++ (no CUDA
// types), so the planner computes it on the host.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/workspace.h"

namespace sage::fp4 {

constexpr int kBlockQ = 128;  // the emulation's Q block (block_q): Q's smoothing mean, ΔS
constexpr int kBlockK = 64;   // the emulation's key block (block_k): P~'s two-level scale

// Byte offsets of the workspace: fp16 Q^, K^ (row-major, padded to the blocks), fp16 V^ᵀ
// ([kv head][channel][key]), Q's block means, K's mean, the LSE shift, the first bad key.
struct Layout {
  int64_t nq_pad = 0, nk_pad = 0, q_blocks = 0;
  size_t q = 0, k = 0, vt = 0, q_mean = 0, k_mean = 0, lse_shift = 0, kv_bad = 0, total = 0;
};

inline Layout make_layout(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t seq_q,
                          int64_t seq_kv, int64_t head_dim) {
  Layout l;
  l.q_blocks = (seq_q + kBlockQ - 1) / kBlockQ;
  l.nq_pad = l.q_blocks * kBlockQ;
  l.nk_pad = (seq_kv + kBlockK - 1) / kBlockK * kBlockK;
  const int64_t bq = batch * heads_q, bk = batch * heads_kv;
  WorkspaceCarver carve;
  auto take = [&](size_t bytes) { return carve.take(bytes); };
  l.q = take(size_t(bq * l.nq_pad * head_dim) * 2);
  l.k = take(size_t(bk * l.nk_pad * head_dim) * 2);
  l.vt = take(size_t(bk * l.nk_pad * head_dim) * 2);
  l.q_mean = take(size_t(bq * l.q_blocks * head_dim) * 4);
  l.k_mean = take(size_t(bk * head_dim) * 4);
  l.lse_shift = take(size_t(bq * seq_q) * 4);
  l.kv_bad = take(size_t(bk) * 8);
  l.total = carve.total;
  return l;
}

}  // namespace sage::fp4
