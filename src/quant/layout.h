// The quantization pre-pass's products in the caller's workspace, and the steps that make them:
// INT8/INT4 K with per-thread scales per 64 keys, E4M3 Vᵀ with per-channel scales (keys permuted
// inside each 32 for the P·V MMA), K/V smoothing statistics, and Q (INT8/INT4 per 128-row block)
// unless the sm90 kernel quantizes Q itself. Both attention kernels (attn/mma, attn/sm90) read
// this layout. Plain C++ (no CUDA types): the planner (src/api) computes it on the host.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/formats.h"  // SAGE_HOST_DEVICE
#include "sage/sage.h"

namespace sage::quant {

// Q blocks of 128 rows (8 warps of 16: rows {g, g+8} of a warp share a Q scale) and K scale
// groups per 64 keys (4 groups: {8j+2t, 8j+2t+1}): the mma.sync kernel's tile, which the sm90
// kernel's wgmma accumulator shares (a 128-key sm90 block holds two 64-key groups).
constexpr int kBlockQ = 128;
constexpr int kBlockK = 64;
constexpr int kQGroups = 64;      // Q scales per 128-row block: 8 warps x 8 lane groups
constexpr int kKGroups = 4;       // K scales per 64-key block
constexpr int kStatTokens = 128;  // tokens per K/V statistics chunk (fixed-order reduction)
// PrepassPlan::kv_bad's value for a KV head whose K and V are finite.
constexpr unsigned long long kKvBadNone = ~0ull;

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

// True when every row of a 16-bit tensor starts 16-byte aligned (base and strides in elements),
// so every 8-element chunk of a row is one 16-byte load (and a TMA map can describe it).
inline bool rows_aligned16(const void* base, const sage_strides& s) {
  const uint64_t bytes = uint64_t(s.batch) | uint64_t(s.head) | uint64_t(s.token);  // ×2 below
  return ((reinterpret_cast<uintptr_t>(base) | (bytes << 1)) & 15u) == 0;
}

// Which keys a query row sees (keys j < visible(row)), to mark the rows an Inf/NaN input poisons:
// a row that sees keys is poisoned when its own Q row holds Inf/NaN or when it sees the head's
// first key whose K or V row does (PrepassPlan::kv_bad). Its LSE shift is then NaN, and the
// attention epilogue writes the row as NaN (non-finite inputs: the README).
struct RowSight {
  int64_t seq_kv = 0;
  int64_t causal_offset = 0;  // causal: query i sees keys j <= i + causal_offset
  bool causal = false;
  SAGE_HOST_DEVICE int64_t visible(int64_t row) const {
    if (!causal) return seq_kv;
    const int64_t n = row + causal_offset + 1;
    return n < 0 ? 0 : (n > seq_kv ? seq_kv : n);
  }
  SAGE_HOST_DEVICE bool poisoned(int64_t row, bool row_bad,
                                 unsigned long long kv_first_bad) const {
    const int64_t n = visible(row);
    return n > 0 && (row_bad || kv_first_bad < static_cast<unsigned long long>(n));
  }
};

// Byte offsets of every pre-pass product inside the caller's workspace (all 256-aligned), and the
// steps the pre-pass runs. The size depends on the shapes and the config only (never on
// pointers), so a caller may cache it per shape.
struct PrepassPlan {
  int64_t batch = 0, heads_q = 0, heads_kv = 0, seq_q = 0, seq_kv = 0;
  // head_dim: the kernel's (native) head dim, the workspace's channels; channels: the caller's
  // head_dim, the channels read from Q, K and V (<= head_dim). The pre-pass writes the channels
  // from `channels` to head_dim as an all-zero channel's products: 0 in Q, K and Vᵀ, k_mean,
  // v_mean and V's scale 0 (make_quant_scale of a zero amax), so they change no dot product, no
  // group max and no mean (plan.h).
  int64_t head_dim = 0, channels = 0;
  int bits = 8;                 // QK format: 8 (INT8) or 4 (INT4)
  bool smooth_q = false, smooth_k = false, smooth_v = false;
  // The K smoothing mean is taken over tokens 0, s, 2s, ... < Nk (s = k_mean_stride,
  // k_mean_samples of them; sage_quant_config::k_mean_tokens); V's statistics over every token.
  int64_t k_mean_stride = 1, k_mean_samples = 0;
  bool quantize_q = true;       // false: the sm90 kernel quantizes Q itself (fused Q)
  // K/V in one launch (kv_prepass_kernel, sm_90+): one CTA per statistics chunk and one
  // thread-block cluster per KV head, so each chunk's K and V are read from memory once, staged
  // in shared memory through the statistics, the cluster barrier and the quantization. 0: the
  // three-launch path (kv_stats, kv_finalize, quant_kv), for heads of more chunks than a cluster
  // holds and GPUs without clusters.
  int kv_cluster = 0;
  int64_t q_blocks = 0, k_blocks = 0, nq_pad = 0, nk_pad = 0, row_bytes = 0, stat_chunks = 0;
  size_t q = 0, q_scale = 0, q_mean = 0, lse_shift = 0, k = 0, k_scale = 0, v = 0,
         kv_stats = 0, k_mean = 0, v_mean = 0, v_scale = 0, v_inv = 0, delta_s = 0,
         tile_counter = 0, kv_bad = 0, total = 0;
};

inline PrepassPlan make_prepass_plan(int64_t batch, int64_t heads_q, int64_t heads_kv,
                                     int64_t seq_q, int64_t seq_kv, int64_t head_dim,
                                     int64_t channels, int bits, bool smooth_q, bool smooth_k,
                                     bool smooth_v, int64_t k_mean_stride, int max_kv_cluster) {
  PrepassPlan p;
  p.batch = batch, p.heads_q = heads_q, p.heads_kv = heads_kv;
  p.seq_q = seq_q, p.seq_kv = seq_kv, p.head_dim = head_dim, p.channels = channels, p.bits = bits;
  p.smooth_q = smooth_q, p.smooth_k = smooth_k, p.smooth_v = smooth_v;
  p.q_blocks = (seq_q + kBlockQ - 1) / kBlockQ;
  p.k_blocks = (seq_kv + kBlockK - 1) / kBlockK;
  p.nq_pad = p.q_blocks * kBlockQ;
  p.nk_pad = p.k_blocks * kBlockK;
  p.row_bytes = head_dim * bits / 8;
  // K/V statistics are reduced in fixed-size token chunks (deterministic, no atomics).
  p.stat_chunks = (seq_kv + kStatTokens - 1) / kStatTokens;
  p.kv_cluster = p.stat_chunks <= max_kv_cluster ? int(p.stat_chunks) : 0;
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
  // Per KV head: the first key whose K or V row holds Inf/NaN (kKvBadNone: none), for the rows
  // the pre-pass or the sm90 kernel's Q quantization marks as poisoned.
  p.kv_bad = take(size_t(bk) * 8);
  p.total = off;
  return p;
}

}  // namespace sage::quant
