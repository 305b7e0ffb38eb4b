// Built-in test and demo inputs for the CPU reference and the `sage` tool (fp16, HND layout):
// the outlier structure of real models' Q, K, V (SageAttention2 paper, Fig. 2) plus an attention
// sink.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "ref/reference.h"

namespace sage::ref {

struct SyntheticSpec {
  int64_t batch = 1, heads_q = 2, heads_kv = 2, seq_q = 2048, seq_kv = 2048, head_dim = 128;
  // Per-channel biases (constant over tokens), as standard deviations over channels. A few
  // "massive" channels (outlier_channels of them) carry a larger bias in Q and K, and there K's
  // token-to-token variation is small, as in real models.
  float q_bias = 1.0f, q_outlier = 12.0f;
  float k_bias = 8.0f, k_outlier = 16.0f;
  float v_bias = 4.0f;
  int64_t outlier_channels = 8;
  float token_spread = 0.3f;  // std of the log token norm of Q and K (varies along the sequence)
  float sink = 9.0f;          // score boost (natural log units) of key 0 for every query; 0 = none
  uint64_t seed = 1;
};

struct SyntheticInputs {
  SyntheticSpec spec;
  std::vector<uint16_t> q, k, v;  // fp16 bits, HND, contiguous

  Problem problem(sage_mask mask = SAGE_MASK_NONE) const {
    return Problem{spec.batch,   spec.heads_q,  spec.heads_kv,
                   spec.seq_q,   spec.seq_kv,   spec.head_dim,
                   1.0 / std::sqrt(double(spec.head_dim)), mask};
  }
  TensorView q_view() const { return view(q.data(), spec.heads_q, spec.seq_q); }
  TensorView k_view() const { return view(k.data(), spec.heads_kv, spec.seq_kv); }
  TensorView v_view() const { return view(v.data(), spec.heads_kv, spec.seq_kv); }

 private:
  TensorView view(const uint16_t* p, int64_t heads, int64_t seq) const {
    return {p, SAGE_DTYPE_FP16, contiguous_strides(SAGE_LAYOUT_HND, heads, seq, spec.head_dim)};
  }
};

SyntheticInputs make_inputs(const SyntheticSpec& spec);

// Inputs with the structure training sees, for the backward's accuracy check: N(0,1) Q, K, V and
// dO, then one class of structure at a strength. HND, contiguous, rounded to dtype (uint16 bits).
enum class TrainingClass {
  kNormal,        // nothing more
  kOutlierScale,  // `channels` channels of Q and K (the same ones) times `strength`
  kOutlierBias,   // those channels offset by ±strength (a per-channel sign)
  kSink,          // key 0 of every KV head `strength` times longer, leaning along the mean query
  kPeaked,        // Q scaled so the scores' standard deviation is about `strength`
  kOutlierSink,   // kOutlierScale at `strength` plus a sink of 5
};

struct TrainingSpec {
  int64_t batch = 1, heads_q = 4, heads_kv = 1, seq_q = 256, seq_kv = 256, head_dim = 64;
  sage_dtype dtype = SAGE_DTYPE_BF16;
  TrainingClass kind = TrainingClass::kNormal;
  float strength = 1.0f;
  int64_t channels = 4;
  uint64_t seed = 1;
};

struct TrainingInputs {
  TrainingSpec spec;
  std::vector<uint16_t> q, k, v, d_o;  // dtype bits, HND, contiguous

  TensorView q_view() const { return view(q.data(), spec.heads_q, spec.seq_q); }
  TensorView k_view() const { return view(k.data(), spec.heads_kv, spec.seq_kv); }
  TensorView v_view() const { return view(v.data(), spec.heads_kv, spec.seq_kv); }
  TensorView d_o_view() const { return view(d_o.data(), spec.heads_q, spec.seq_q); }

 private:
  TensorView view(const uint16_t* p, int64_t heads, int64_t seq) const {
    return {p, spec.dtype, contiguous_strides(SAGE_LAYOUT_HND, heads, seq, spec.head_dim)};
  }
};

TrainingInputs make_training_inputs(const TrainingSpec& spec);

}  // namespace sage::ref
