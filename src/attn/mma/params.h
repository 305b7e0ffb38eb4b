// The mma.sync SageAttention2 path (sm_89, sm_90a, sm_120a): tile shape, the workspace plan
// (where the pre-pass puts quantized Q, K, V and their scales), and the kernels' params struct.
// Plain C++ (no CUDA types) so the host-side planner and the size query share it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/formats.h"  // SAGE_HOST_DEVICE

namespace sage::mma {

// One CTA: 8 warps, 128 query rows (16 a warp: rows {g, g+8} of a warp share a Q scale), key
// blocks of 64 (4 K groups of 16 keys: {8j+2t, 8j+2t+1}). The CPU emulation of this kernel is
// quant_preset() with block_q 128, warps 8, block_k 64.
constexpr int kBlockQ = 128;
constexpr int kBlockK = 64;
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kQGroups = kWarps * 8;  // Q scales per 128-row block
constexpr int kKGroups = 4;           // K scales per 64-key block
constexpr int kStatTokens = 256;      // tokens per K/V statistics chunk (fixed-order reduction)

// The key order of one 32-key chunk of Vᵀ: position kappa holds key perm(kappa), so that the
// S accumulator a thread holds is directly the A operand of the P·V MMA (see prepass.cu).
SAGE_HOST_DEVICE inline int v_key_of_position(int kappa) {
  const int half = kappa / 16, r = kappa % 16, t = r / 4, j = r % 4;
  return half * 16 + (j < 2 ? 2 * t + j : 8 + 2 * t + (j - 2));
}
SAGE_HOST_DEVICE inline int v_position_of_key(int key) {
  const int half = key / 16, r = key % 16, hi = r >= 8 ? 1 : 0, rr = r % 8;
  return half * 16 + 4 * (rr / 2) + (rr % 2) + 2 * hi;
}

// Byte offsets of every pre-pass product inside the caller's workspace (all 256-aligned).
struct Plan {
  int64_t batch = 0, heads_q = 0, heads_kv = 0, seq_q = 0, seq_kv = 0, head_dim = 0;
  int bits = 8;                 // QK format: 8 (INT8) or 4 (INT4)
  bool smooth_q = false, smooth_k = false, smooth_v = false;
  bool two_level = true;        // P·V accumulation (false where the MMA accumulator is fp32)
  // The K smoothing mean is taken over tokens 0, s, 2s, ... < Nk (s = k_mean_stride,
  // k_mean_samples of them; sage_quant_config::k_mean_tokens); V's statistics over every token.
  int64_t k_mean_stride = 1, k_mean_samples = 0;
  bool sm90 = false;            // run the Hopper wgmma kernel (attn/sm90) instead of mma.sync
  bool fused_q = false;         // sm90: Q quantized inside the attention kernel (no quant_q)
  int64_t q_blocks = 0, k_blocks = 0, nq_pad = 0, nk_pad = 0, row_bytes = 0, stat_chunks = 0;
  size_t q = 0, q_scale = 0, q_mean = 0, lse_shift = 0, k = 0, k_scale = 0, v = 0,
         kv_stats = 0, k_mean = 0, v_mean = 0, v_scale = 0, v_inv = 0, delta_s = 0,
         tile_counter = 0, total = 0;
};

inline Plan make_plan(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t seq_q,
                      int64_t seq_kv, int64_t head_dim, int bits, bool smooth_q, bool smooth_k,
                      bool smooth_v, int64_t k_mean_stride) {
  Plan p;
  p.batch = batch, p.heads_q = heads_q, p.heads_kv = heads_kv;
  p.seq_q = seq_q, p.seq_kv = seq_kv, p.head_dim = head_dim, p.bits = bits;
  p.smooth_q = smooth_q, p.smooth_k = smooth_k, p.smooth_v = smooth_v;
  p.q_blocks = (seq_q + kBlockQ - 1) / kBlockQ;
  p.k_blocks = (seq_kv + kBlockK - 1) / kBlockK;
  p.nq_pad = p.q_blocks * kBlockQ;
  p.nk_pad = p.k_blocks * kBlockK;
  p.row_bytes = head_dim * bits / 8;
  // K/V statistics are reduced in fixed-size token chunks (deterministic, no atomics).
  p.stat_chunks = (seq_kv + kStatTokens - 1) / kStatTokens;
  p.k_mean_stride = k_mean_stride;
  p.k_mean_samples = (seq_kv + p.k_mean_stride - 1) / p.k_mean_stride;
  const int64_t bq = batch * heads_q, bk = batch * heads_kv;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += (bytes + 255) / 256 * 256;
    return at;
  };
  p.q = take(size_t(bq * p.nq_pad * p.row_bytes));
  p.q_scale = take(size_t(bq * p.q_blocks * kQGroups) * 4);
  p.q_mean = take(smooth_q ? size_t(bq * p.q_blocks * head_dim) * 4 : 0);
  p.lse_shift = take(size_t(bq * seq_q) * 4);
  p.k = take(size_t(bk * p.nk_pad * p.row_bytes));
  p.k_scale = take(size_t(bk * p.k_blocks * kKGroups) * 4);
  p.v = take(size_t(bk * head_dim * p.nk_pad));
  // Per (kv head, chunk, channel): sum K over the chunk's sampled tokens, sum V (double), max V,
  // min V (float).
  p.kv_stats = take(size_t(bk * p.stat_chunks * head_dim) * 24);
  p.k_mean = take(size_t(bk * head_dim) * 4);
  p.v_mean = take(size_t(bk * head_dim) * 4);
  p.v_scale = take(size_t(bk * head_dim) * 4);
  p.v_inv = take(size_t(bk * head_dim) * 4);
  p.delta_s = take(smooth_q ? size_t(bq * p.q_blocks * p.nk_pad) * 4 : 0);
  // The sm90 kernel's causal tile scheduler: {next tile, CTAs done}, zeroed by the pre-pass
  // (kv_finalize) and reset by the kernel's last CTA.
  p.tile_counter = take(8);
  p.total = off;
  return p;
}

// Everything the attention kernel reads and writes. Pointers into the workspace follow the Plan.
struct AttnParams {
  const uint8_t* q;        // [B*Hq][nq_pad][row_bytes] INT8 or packed INT4 (low nibble first)
  const float* q_scale;    // [B*Hq][q_blocks][kQGroups]
  const uint8_t* k;        // [B*Hkv][nk_pad][row_bytes]
  const float* k_scale;    // [B*Hkv][k_blocks][kKGroups]
  const uint8_t* v;        // [B*Hkv][D][nk_pad] E4M3, keys permuted inside each 32 (see prepass)
  const float* v_scale;    // [B*Hkv][D]
  const float* v_mean;     // [B*Hkv][D]
  const float* delta_s;    // [B*Hq][q_blocks][nk_pad] or null (no Q smoothing)
  float* lse_shift;        // [B*Hq][Nq] (written by quant_q, or by the kernel with fused_q)
  void* o;                 // caller's output, strides in elements
  int64_t o_batch, o_head, o_token;
  float* lse;              // caller's LSE or null
  int64_t lse_batch, lse_head, lse_token;
  int64_t batch, heads_q, heads_kv;
  int64_t seq_q, seq_kv, nq_pad, nk_pad, q_blocks, k_blocks;
  int64_t causal_offset;   // query i sees keys j <= i + causal_offset
  float scale_log2;        // softmax scale * log2(e)
  // fused_q (sm90 only): the kernel reads fp16/bf16 Q through its own TMA map and quantizes it
  // (q and q_scale unused); it then also writes lse_shift = scale · q·k_mean when lse is set.
  bool fused_q;
  float scale;             // softmax scale
  const float* k_mean;     // [B*Hkv][D]
  unsigned* tile_counter;  // sm90 causal: {next tile, CTAs done}, 0 on entry and on exit
  const void* q_in;        // the caller's Q (fp16/bf16, as o's dtype), strides in elements
  int64_t q_in_batch, q_in_head, q_in_token;

  // The K/V head (batch · heads_kv + KV head) query head h of batch b reads (GQA).
  SAGE_HOST_DEVICE int64_t kv_head(int64_t b, int64_t h) const {
    return b * heads_kv + h / (heads_q / heads_kv);
  }
};

}  // namespace sage::mma
