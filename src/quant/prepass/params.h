// What each pre-pass kernel reads and writes: one Params per kernel, a ParamsOf<...> of the parts
// of the call it reads (as the backward's, src/bwd/params.h), so a kernel takes one argument,
// cannot read what its launch does not hand it, and the launcher (quant/prepass.cu) fills named
// fields from the plan rather than a row of positional ones. Plain C++ (no CUDA types): the
// caller's fp16/bf16 tensors travel as untyped pointers, which each kernel views as its element
// type. The parts are plain aggregates and each kernel's parts keep the order its positional
// arguments had, so its parameters lie in the order they did.
#pragma once

#include <cstdint>

#include "quant/layout.h"
#include "sage/sage.h"

namespace sage::quant {

// One chunk statistic: per (KV head, chunk of kStatTokens tokens, channel) Σk over the chunk's
// sampled tokens and Σv (double), max v and min v (float), in the bytes the head's Vᵀ later takes
// (PrepassPlan::kv_stats).
struct KvStat {
  double sum_k, sum_v;
  float max_v, min_v;
};
static_assert(sizeof(KvStat) == kKvStatBytes, "the plan reserves 24 bytes per statistic");

// A kernel's Params: the fields of its parts, each part a base (a field name shared by two parts
// of one kernel fails to compile as ambiguous). Built from its parts in order:
// KvStatsParams{kv_in, heads, sampling, stats}.
template <typename... Parts>
struct ParamsOf : Parts... {};

// ---- K/V's parts -----------------------------------------------------------------------------
// The caller's K and V (fp16/bf16, strides in elements) and the channels read: the caller's head
// dim (PrepassPlan::channels, a multiple of 8, <= the kernel's D; the rest of D is written as
// zero channels).
struct KvInput {
  const void* k;
  const void* v;
  sage_strides ks, vs;
  int dim;
};

// The KV heads: heads_kv a sequence, bk = batch·heads_kv (sequence, KV head) pairs, and where
// each one's rows lie in the workspace (a packed batch's sequences from kv_rows.cu).
struct KvHeads {
  int64_t heads_kv, bk;
  SeqRows kv_rows;
};

// K's smoothing mean samples k_mean_tokens tokens of each sequence (k_mean_stride_of).
struct KMeanSampling {
  int32_t k_mean_tokens;
};

struct Smoothing {
  bool smooth_k, smooth_v;
};

// The chunk statistics (in each head's Vᵀ rows: PrepassPlan::kv_stats).
struct ChunkStatsOut {
  KvStat* stats;
};

// What the finalize step writes per (sequence, KV head, channel): the means, V's E4M3 scale and
// its inverse; and the sm90 kernel's `counters` counters from tile_counter on (zeroed:
// PrepassPlan::counters) and each head's first Inf/NaN key (reset to kKvBadNone; the
// quantization lowers it).
struct HeadFinalOut {
  float* k_mean;
  float* v_mean;
  float* v_scale;
  float* v_inv;
  unsigned* tile_counter;
  unsigned long long* kv_bad;
  int32_t counters;
};

// The same, as the three-launch quantization reads it (kv_bad: lowered).
struct HeadFinalIn {
  const float* k_mean;
  const float* v_mean;
  const float* v_inv;
  unsigned long long* kv_bad;
};

// V's scale from a sample (PrepassPlan::kv_sampled): per (sequence, KV head, channel) the bound
// v_sample_bound of |v| over K's mean sample, the exact max of |v| of the channels where some
// value lies past it (float bits, atomicMax; zero elsewhere), and per (sequence, KV head) a mark
// that some did. kv_sample writes the bounds and zeroes the rest; quant_kv checks and notes;
// fix_v re-quantizes a marked head's V with the exact max.
struct VBound {
  float* v_bound;
  unsigned* v_amax;
  unsigned* v_over;
};
// One head's part of it, as quant_kv_block reads it.
struct VCheck {
  const float* bound = nullptr;
  unsigned* amax = nullptr;
  unsigned* over = nullptr;
};

// INT8/INT4 K̂ rows and their scales, E4M3 Vᵀ.
struct KvQuantOut {
  uint8_t* kq;
  float* k_scale;
  uint8_t* vq;
};

// ---- Q's parts -------------------------------------------------------------------------------
// The caller's Q (fp16/bf16, strides in elements) and the channels read (as KvInput's dim).
struct QInput {
  const void* q;
  sage_strides qs;
  int dim;
};

// The query heads: query heads a KV head (GQA) and batch·heads_q.
struct QHeads {
  int heads_kv, group_ratio;
  int64_t bq;
};

// Where the rows of Q (Q̂, its scales and block means), of K/V (a packed sequence's key count)
// and of the LSE shifts lie.
struct QRows {
  SeqRows q_rows, kv_rows, shift_rows;
};

// What the LSE shift scale·q·k_mean and its poisoning read: the KV heads' k_mean and first
// Inf/NaN key, and the keys each row sees (a packed batch's made per sequence on the device).
struct LseShiftIn {
  float scale;  // softmax scale
  const float* k_mean;
  const unsigned long long* kv_bad;
  RowSight sight;
  bool bottom_right;
};

// INT8/INT4 Q̂ and its scales, the block means (null without Q smoothing), the LSE shifts.
struct QQuantOut {
  uint8_t* qq;
  float* q_scale;
  float* q_mean;
  float* lse_shift;
};

// ---- The kernels' Params ---------------------------------------------------------------------
// K and V in one cluster launch (kv_cluster.cuh): statistics, finalize and quantization.
using KvPrepassParams =
    ParamsOf<KvInput, KvHeads, KMeanSampling, Smoothing, ChunkStatsOut, HeadFinalOut, KvQuantOut>;
// The three-launch path (kv_split.cuh): statistics, finalize, quantization.
using KvStatsParams = ParamsOf<KvInput, KvHeads, KMeanSampling, ChunkStatsOut>;
using KvFinalizeParams = ParamsOf<ChunkStatsOut, KvHeads, KMeanSampling, Smoothing, HeadFinalOut>;
using QuantKvParams = ParamsOf<KvInput, KvHeads, HeadFinalIn, KvQuantOut, VBound>;
// The sampled path (sample.cuh): the sample's statistics and bounds, the quantization checking
// them (QuantKvParams), the re-quantization of a head past them.
using KvSampleParams = ParamsOf<KvInput, KvHeads, KMeanSampling, Smoothing, HeadFinalOut, VBound>;
using VFixParams = ParamsOf<KvInput, KvHeads, HeadFinalOut, KvQuantOut, VBound>;
// Q's quantization and LSE shifts (q_quant.cuh).
using QuantQParams = ParamsOf<QInput, QHeads, QRows, LseShiftIn, QQuantOut>;

}  // namespace sage::quant
