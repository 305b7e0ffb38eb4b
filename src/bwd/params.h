// SageBwd on the GPU (the mma.sync kernel, kernel.cuh; the Hopper wgmma one, sm90/kernel.cuh):
// the tile shape, the workspace layout the backward pre-pass and stats pass write, and the params
// struct of its kernels. Plain C++ (no CUDA types).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/formats.h"  // SAGE_HOST_DEVICE
#include "common/workspace.h"
#include "ref/reference.h"
#include "sage/sage.h"

namespace sage::bwd {

// A CTA owns kBlockK keys (4 warps x 16) and streams query blocks of kBlockQ; these are also the
// ψ blocks of Q, dO (kBlockQ rows) and K (kBlockK rows): the emulation is backward_preset().
constexpr int kBlockQ = 64;
constexpr int kBlockK = 64;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

// Offsets (bytes) into the workspace, each 256-byte aligned.
struct Layout {
  int64_t nq_pad = 0, nk_pad = 0, q_blocks = 0, k_blocks = 0, k_chunks = 0, q_chunks = 0;
  size_t k_part = 0;    // f32 [B*Hkv][k_chunks][D]: K's channel sums per chunk of keys
                        // (ref::kBwdSumChunk of them: the emulation forms k̄ the same way)
  size_t k_mean = 0;    // f32 [B*Hkv][D]
  size_t q_part = 0;    // f32 [B*Hq][q_chunks][D]: Q's channel sums per chunk of queries
  size_t q_mean = 0;    // f32 [B*Hq][D]: q̄ (zero without Q smoothing)
  size_t key_term = 0;  // f32 [B*Hq][nk_pad]: q̄·(K_j - k_mean)·scale·log2 e, the part of key
                        // j's scores that Q smoothing takes out of Q^ (0: padding)
  size_t k_scale = 0;   // f32 [B*Hkv][k_blocks]
  size_t khat = 0;      // s8 [B*Hkv][nk_pad][D]: ψ(K - k_mean) rows
  size_t khat_t = 0;    // s8 [B*Hkv][D][nk_pad]: the same, transposed
  size_t v = 0;         // dtype [B*Hkv][nk_pad][D]: V, zero-padded
  size_t q_scale = 0;   // f32 [B*Hq][q_blocks]
  size_t qhat = 0;      // s8 [B*Hq][nq_pad][D]: ψ(Q - q_mean)
  size_t qhat_t = 0;    // s8 [B*Hq][D][nq_pad], queries permuted in each 32 (query_at)
  size_t do_scale = 0;  // f32 [B*Hq][q_blocks]
  size_t dohat_t = 0;   // s8 [B*Hq][D][nq_pad], permuted as qhat_t
  size_t d_o = 0;       // dtype [B*Hq][nq_pad][D]: dO, zero-padded
  size_t qnorm2 = 0;    // f32 [B*Hq][nq_pad]: ‖Q_i - q_mean‖² (0: padding)
  size_t knorm2 = 0;    // f32 [B*Hkv][nk_pad]: ‖K_j - k_mean‖² (0: padding)
  size_t lse2 = 0;      // f32 [B*Hq][nq_pad]: log2 Σ_j 2^(x_ij) of the backward's own scores
                        // x = Q^·K^ᵀ·scales·scale·log2 e (stats.cuh); +inf: no key
  size_t delta = 0;     // f32 [B*Hq][nq_pad]: Σ_j P_ij·dP_ij with that P, minus dL/dLSE
  size_t err2 = 0;      // f32 [B*Hq][q_blocks]: Σ over the block's rows of the scores'
                        // estimated error² (summed per head in block order: deterministic)
  size_t verdict = 0;   // s32 [1]: 1 when a head's error was over max_score_err
  size_t dq_acc = 0;    // f32 [B*Hq][nq_pad x D], laid out by dq_offset: dQ / scale, summed by
                        // atomics or bulk reductions (or in turn)
  size_t dq_turn = 0;   // s32 [B*Hq][q_blocks]: the key block whose turn it is to add (dq_order)
  size_t total = 0;
};

inline Layout make_layout(const ref::Problem& p) {
  Layout w;
  const int64_t D = p.head_dim, bq = p.batch * p.heads_q, bk = p.batch * p.heads_kv;
  w.q_blocks = (p.seq_q + kBlockQ - 1) / kBlockQ;
  w.k_blocks = (p.seq_kv + kBlockK - 1) / kBlockK;
  w.nq_pad = w.q_blocks * kBlockQ;
  w.nk_pad = w.k_blocks * kBlockK;
  w.k_chunks = (p.seq_kv + ref::kBwdSumChunk - 1) / ref::kBwdSumChunk;
  w.q_chunks = (p.seq_q + ref::kBwdSumChunk - 1) / ref::kBwdSumChunk;
  WorkspaceCarver carve;
  auto take = [&](size_t bytes) { return carve.take(bytes); };
  w.k_part = take(size_t(bk * w.k_chunks * D) * 4);
  w.k_mean = take(size_t(bk * D) * 4);
  w.q_part = take(size_t(bq * w.q_chunks * D) * 4);
  w.q_mean = take(size_t(bq * D) * 4);
  w.key_term = take(size_t(bq * w.nk_pad) * 4);
  w.k_scale = take(size_t(bk * w.k_blocks) * 4);
  w.khat = take(size_t(bk * w.nk_pad * D));
  w.khat_t = take(size_t(bk * w.nk_pad * D));
  w.v = take(size_t(bk * w.nk_pad * D) * 2);
  w.q_scale = take(size_t(bq * w.q_blocks) * 4);
  w.qhat = take(size_t(bq * w.nq_pad * D));
  w.qhat_t = take(size_t(bq * w.nq_pad * D));
  w.do_scale = take(size_t(bq * w.q_blocks) * 4);
  w.dohat_t = take(size_t(bq * w.nq_pad * D));
  w.d_o = take(size_t(bq * w.nq_pad * D) * 2);
  w.qnorm2 = take(size_t(bq * w.nq_pad) * 4);
  w.knorm2 = take(size_t(bk * w.nk_pad) * 4);
  w.lse2 = take(size_t(bq * w.nq_pad) * 4);
  w.delta = take(size_t(bq * w.nq_pad) * 4);
  w.err2 = take(size_t(bq * w.q_blocks) * 4);
  w.verdict = take(4);
  w.dq_acc = take(size_t(bq * w.nq_pad * D) * 4);
  w.dq_turn = take(size_t(bq * w.q_blocks) * 4);
  w.total = carve.total;
  return w;
}

// The query stored at column position k (0..31) of a 32-query group of qhat_t and dohat_t: the
// INT8 A operand a thread packs from its m16n8 accumulator (columns 2t, 2t+1 of tiles 0..3) has
// k = 4t+j (j < 4) holding tile j/2's column 2t + j%2, and k = 16+4t+j tile 2 + j/2's.
SAGE_HOST_DEVICE inline int query_at(int k) {
  const int half = k / 16, t = (k % 16) / 4, j = k % 4;
  return 16 * half + 8 * (j / 2) + 2 * t + (j % 2);
}

// Where (row, channel d) of one query head's dQ accumulator ([nq_pad x D] floats) is stored:
// each 64-row block is D / 64 panels of [64 rows][64 channels], and in a panel row each 16-byte
// chunk is XORed with row % 8. So a panel of a block is 16 KB in one piece (the wgmma kernel stages
// one at a time in shared memory, in this same layout: eight rows' float2 stores of a column hit
// every bank, and a warp's 16 rows go out as one contiguous bulk reduction). Pairs (d, d + 1), d
// even, stay adjacent.
SAGE_HOST_DEVICE inline int dq_col(int64_t row, int d) {
  return ((d >> 2) ^ int(row & 7)) << 2 | (d & 3);
}
SAGE_HOST_DEVICE inline int64_t dq_offset(int64_t row, int d, int D) {
  return ((row >> 6) * (D >> 6) + (d >> 6)) * 4096 + (row & 63) * 64 + dq_col(row, d & 63);
}

// The (query head, query block) pairs one key block's CTA streams, in order, advanced without a
// division: every block from `first` of each head of the KV head's group.
struct BlockWalk {
  int64_t bh;
  int qb, first, end;
  SAGE_HOST_DEVICE void next() {
    if (++qb == end) qb = first, ++bh;
  }
};

// The query blocks the CTA whose keys start at k0 streams, for KV head (b, hkv): every kBlockQ-row
// block of each query head of the group from the first a causal mask lets see key k0; iters of
// them. (Every main kernel's scheduler; a template on the mask, as those kernels are.)
struct QueryStream {
  int64_t iters;
  BlockWalk first;
};
template <bool kCausal, typename P>
SAGE_HOST_DEVICE inline QueryStream query_stream(const P& p, int64_t b, int64_t hkv, int64_t k0) {
  const int64_t G = p.group(), d = k0 - p.causal_offset;
  const int64_t q_begin = kCausal ? (d > 0 ? d : 0) / kBlockQ : 0;
  const int64_t left = p.q_blocks - q_begin, n_q = left > 0 ? left : 0;
  return {n_q * G,
          BlockWalk{b * p.heads_q + hkv * G, int(q_begin), int(q_begin), int(p.q_blocks)}};
}

// Each kernel's Params is the parts of the call it reads (ParamsOf<...> below): a kernel cannot
// read what its launch did not hand it, and the plan fills every part once (the whole call's
// Params), from which each launch takes its own by slicing.

// The call's sizes (every kernel's).
struct Shape {
  int64_t batch, heads_q, heads_kv, seq_q, seq_kv, nq_pad, nk_pad, q_blocks, k_blocks, k_chunks,
      q_chunks;
  int64_t causal_offset;  // query i sees keys j <= i + causal_offset (causal masks)
  bool causal;

  SAGE_HOST_DEVICE int64_t group() const { return heads_q / heads_kv; }
  // Query i sees a key: Nk >= 1 and, causal, i + causal_offset >= 0. The rows of a head that do
  // (the same for every head): those from max(0, -causal_offset) on.
  SAGE_HOST_DEVICE bool sees_key(int64_t i) const {
    return seq_kv > 0 && (!causal || i + causal_offset >= 0);
  }
  SAGE_HOST_DEVICE int64_t rows_seeing_keys() const {
    if (seq_kv <= 0) return 0;
    const int64_t first = causal && causal_offset < 0 ? -causal_offset : 0;
    return first < seq_q ? seq_q - first : 0;
  }
};
// The caller's Q, K, V, dO (strides in elements; the last dimension contiguous).
struct Inputs {
  const void* q;
  const void* k;
  const void* v;
  const void* d_o;
  sage_strides q_st, k_st, v_st, do_st;
};
// The caller's gradient on the LSE (optional, null: zero).
struct LseGrad {
  const float* d_lse;
  sage_strides dlse_st;
};
// The caller's dQ, dK, dV.
struct Grads {
  void* dq;
  void* dk;
  void* dv;
  sage_strides dq_st, dk_st, dv_st;
};
// The pre-pass's products in the workspace (Layout).
struct Quantized {
  float* k_part;
  float* k_mean;
  float* q_part;
  float* q_mean;
  float* key_term;
  float* k_scale;
  int8_t* khat;
  int8_t* khat_t;
  uint16_t* v_ws;
  float* q_scale;
  int8_t* qhat;
  int8_t* qhat_t;
  float* do_scale;
  int8_t* dohat_t;
  uint16_t* do_ws;
  float* qnorm2;
  float* knorm2;
  bool smooth_k, smooth_q;
};
// The stats pass's products: each row's L' and D, each query block's score error.
struct RowStats {
  float* lse2;
  float* delta;
  float* err2;
};
// dQ's fp32 accumulator in the workspace.
struct DqAccum {
  float* dq_acc;
  int* dq_turn;
  bool deterministic;  // dQ's tiles summed in key-block order (dq_order.cuh), not by atomics
};
// The accuracy check's verdict.
struct Verdict {
  int32_t* verdict;    // the workspace's (mean_kernel zeroes it)
  int32_t* untrusted;  // the caller's (optional, null: none): the verdict, written every call
  // The bound on a query head's rms score error (natural-log units; stats.cuh).
  float max_score_err;
};
// The softmax scale.
struct Scaling {
  float scale;       // softmax scale
  float scale_log2;  // scale · log2(e)
};

template <typename... Parts>
struct ParamsOf : Parts... {
  ParamsOf() = default;
  // The parts of a call that has them all (at least these), copied whole.
  template <typename Whole>
  explicit ParamsOf(const Whole& w) : Parts(static_cast<const Parts&>(w))... {}
};

// The whole call (the plan fills it, cuda_backend.cu), and each kernel's part of it.
using Params =
    ParamsOf<Shape, Inputs, LseGrad, Grads, Quantized, RowStats, DqAccum, Verdict, Scaling>;
using SumParams = ParamsOf<Shape, Inputs, Quantized>;
using MeanParams = ParamsOf<Shape, Quantized, Verdict>;
using KPrepParams = ParamsOf<Shape, Inputs, Quantized, Scaling>;
using QPrepParams = ParamsOf<Shape, Inputs, Quantized, DqAccum>;
using StatsParams = ParamsOf<Shape, LseGrad, Quantized, RowStats, Scaling>;
using JudgeParams = ParamsOf<Shape, RowStats, Verdict>;
// (The main kernels' parts with the pointers before the sizes, as the single Params had them:
// ptxas schedules the mma.sync kernel after its parameters' layout, and this order keeps the
// schedule the kernel was tuned with.)
using MainParams = ParamsOf<Grads, Quantized, RowStats, DqAccum, Verdict, Shape, Scaling>;
using DqStoreParams = ParamsOf<Shape, LseGrad, Grads, Quantized, DqAccum, Verdict, Scaling>;
using PoisonParams = ParamsOf<Shape, Grads, Verdict>;

#ifdef __CUDACC__
// Whether the verdict refused this call: judge_kernel runs right after the stats pass, so that
// the main kernels and the dQ store of a call whose gradients will be NaN cost nothing (the
// caller recomputes such a call another way).
__device__ __forceinline__ bool refused(const Verdict& p) { return *p.verdict != 0; }
#endif

}  // namespace sage::bwd
