// The quantization pre-pass's products in the caller's workspace, and the steps that make them:
// INT8/INT4 K with per-thread scales per 64 keys, E4M3 Vᵀ with per-channel scales (keys permuted
// inside each 32 for the P·V MMA), K/V smoothing statistics, and Q (INT8/INT4 per 128-row block)
// unless the sm90 kernel quantizes Q itself. Both attention kernels (attn/mma, attn/sm90) read
// this layout. Plain C++ (no CUDA types): the planner (src/api) computes it on the host. The
// "Device memory" part of docs/c-api.md gives its size as a formula (tests/cpu/test_plan.cpp checks it).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/formats.h"  // SAGE_HOST_DEVICE
#include "common/workspace.h"
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
// attention epilogue writes the row as NaN (docs/c-api.md, "Non-finite inputs").
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

// Where one sequence's rows lie: tokens tok0 .. tok0 + len - 1 of the caller's tensors (added to
// the batch stride, which a packed batch has as 0), and rows ws0 .. of each head's rows in the
// workspace.
struct SeqSpan {
  int64_t tok0 = 0, len = 0, ws0 = 0;
};

// The first workspace row of packed sequence b, from its first token c0 alone: a multiple of
// 128 (a Q block, two K blocks, a statistics chunk), at least 128·⌈len/128⌉ rows before the
// next sequence's (floor((x + y)/128) >= floor(x/128) + floor(y/128) with y = len + 128), and
// at most total + 128·batch for b = batch (packed_pitch).
SAGE_HOST_DEVICE inline int64_t packed_start(int64_t c0, int64_t b) {
  return (c0 + b * 128) / 128 * 128;
}
SAGE_HOST_DEVICE inline int64_t packed_pitch(int64_t total, int64_t batch) {
  return (total + 127) / 128 * 128 + 128 * batch;
}

// One side's rows (Q, or K and V): dense, (b, h)'s rows start at b·batch_rows + h·pitch (pitch
// the padded length, batch_rows heads·pitch); packed (cu non-null: the device's cumulative
// lengths, read by the kernels, never by the host), at h·pitch + packed_start (pitch
// packed_pitch, batch_rows 0), every head holding every sequence. The statistics, scales and
// means of a (sequence, head) are indexed by these rows too (row / 128 or row / 64), so they are
// per sequence by construction.
struct SeqRows {
  const int32_t* cu = nullptr;
  int64_t len = 0;         // dense: the sequence length; packed: the longest (max_seqlen)
  int64_t total = 0;       // packed: tokens in all sequences (cu's last entry)
  int64_t pitch = 0, batch_rows = 0;
  SAGE_HOST_DEVICE bool packed() const { return cu != nullptr; }
  // Sequence b's span. A packed batch's cumulative lengths are clamped into [0, total] and each
  // length to len, so lengths the caller got wrong (the device's cu_seqlens are not checked) keep
  // every access inside the tensors and the workspace.
  SAGE_HOST_DEVICE SeqSpan span(int64_t b) const {
    if (!cu) return {0, len, 0};
    int64_t c0 = cu[b], c1 = cu[b + 1];
    c0 = c0 < 0 ? 0 : (c0 > total ? total : c0);
    c1 = c1 < c0 ? c0 : (c1 > total ? total : c1);
    return {c0, c1 - c0 < len ? c1 - c0 : len, packed_start(c0, b)};
  }
  SAGE_HOST_DEVICE int64_t row0(int64_t b, int64_t h, const SeqSpan& s) const {
    return b * batch_rows + h * pitch + s.ws0;
  }
};

// K's smoothing mean samples tokens 0, s, 2s, ... of a sequence of n keys (ref::mean_token_stride
// on the device: a packed batch's lengths are known there only).
SAGE_HOST_DEVICE inline int64_t k_mean_stride_of(int64_t n, int32_t k_mean_tokens) {
  const int64_t s = k_mean_tokens > 0 ? n / k_mean_tokens : 1;
  return s > 1 ? s : 1;
}

// Byte offsets of every pre-pass product inside the caller's workspace (all 256-aligned), and the
// steps the pre-pass runs. The size depends on the shapes, the config, whether the LSE is asked
// for and whether the pre-pass quantizes Q (on sm_90: whether Q's rows are 16-byte aligned), so a
// caller may cache it per shape and those two facts.
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
  // k_mean_samples of them; sage_quant_config::k_mean_tokens); V's scale is bounded from the same
  // sample (kv_sampled), or, with V smoothing, from V's statistics over every token.
  int64_t k_mean_stride = 1, k_mean_samples = 0;
  int32_t k_mean_tokens = 0;  // the kernels take each sequence's stride from its own length
  bool quantize_q = true;       // false: the sm90 kernel quantizes Q itself (fused Q)
  bool lse = false;             // the call asks for the LSE (the fused Q then writes each row's
                                // shift scale·q·k_mean)
  // K/V in one launch (kv_prepass_kernel, sm_90+): one CTA per statistics chunk and one
  // thread-block cluster per KV head, so each chunk's K and V are read from memory once, staged
  // in shared memory through the statistics, the cluster barrier and the quantization. 0: the
  // three-launch path (kv_stats, kv_finalize, quant_kv), for heads of more chunks than a cluster
  // holds and GPUs without clusters.
  int kv_cluster = 0;
  // K/V from a sample (sample.cuh, without V smoothing): kv_sample (K's mean and V's bounds from
  // K's mean sample), quant_kv checking V against the bounds, fix_v (re-quantizes a head where V
  // lay past them): V's scale by v_sample_bound's rule (common/formats.h), as the emulation's.
  // With V smoothing the exact mean needs a pass over all of V first, which gives V's exact range
  // too: kv_cluster or the three statistics launches.
  bool kv_sampled = false;
  // The width of the kernels' loads of the caller's rows (their kVec): 16 bytes (cp.async where a
  // chunk is staged) where every row of the tensor starts 16-byte aligned (rows_aligned16), else
  // 2 bytes. vec_kv: K and V both; vec_q: Q (quant_q). The planner sets them from the call's
  // pointers and strides (make_prepass_plan leaves them false); they change no product, no size.
  bool vec_kv = false, vec_q = false;
  // The three-launch path's quantization: 0, a CTA per 64-key block (quant_kv); else the staged
  // quant_kv's grid (head dim 64), about the CTAs the SMs hold at once, each pipelining its share
  // of the blocks through shared memory. The planner sets it from the device (make_prepass_plan
  // leaves it 0); it changes no product, no size.
  int64_t kv_grid = 0;
  // Grid extents: a packed batch's from its longest sequences (a CTA past its own sequence's
  // end exits), so no launch depends on cu_seqlens' contents.
  int64_t q_blocks = 0, k_blocks = 0, nq_pad = 0, nk_pad = 0, row_bytes = 0, stat_chunks = 0;
  // The rows of Q (Q̂, its scales and block means), K and V (K̂, its scales, Vᵀ's columns, the
  // chunk statistics) and the LSE shifts (SeqRows).
  SeqRows q_rows, kv_rows, shift_rows;
  // Offsets. q and q_scale hold bytes only where the pre-pass quantizes Q, q_mean only with Q
  // smoothing, lse_shift only where the pre-pass quantizes Q or the LSE is asked for; an empty
  // region has the offset of the next one. kv_stats is not a region of its own (see
  // make_prepass_plan).
  size_t q = 0, q_scale = 0, q_mean = 0, lse_shift = 0, k = 0, k_scale = 0, v = 0,
         kv_stats = 0, k_mean = 0, v_mean = 0, v_scale = 0, v_inv = 0, v_bound = 0, v_amax = 0,
         v_over = 0, tile_counter = 0, kv_bad = 0, split_parts = 0, total = 0;
  // The 32-bit counters at tile_counter the pre-pass zeroes: the causal scheduler's two, then the
  // split tail's flags (SplitRegions).
  int64_t counters = 2;
  int64_t kv_stats_stride = 0;  // bytes from one KV head's statistics to the next
};

// Per (kv head, chunk, channel): Σk over the chunk's sampled tokens and Σv (double), max v and
// min v (float).
constexpr int64_t kKvStatBytes = 24;

// The sm90 kernel's split tail (attn/sm90/split.h): a flag per (split tile, consumer warpgroup)
// after the scheduler's counters, and the later parts' softmax states, a slot per CTA.
struct SplitRegions {
  int64_t flags = 0;
  size_t part_bytes = 0;
};

inline PrepassPlan make_prepass_plan(int64_t batch, int64_t heads_q, int64_t heads_kv,
                                     int64_t seq_q, int64_t seq_kv, int64_t head_dim,
                                     int64_t channels, int bits, bool smooth_q, bool smooth_k,
                                     bool smooth_v, int64_t k_mean_stride, int max_kv_cluster,
                                     bool quantize_q, bool lse, int32_t k_mean_tokens = 0,
                                     const int32_t* cu_q = nullptr,
                                     const int32_t* cu_k = nullptr, int64_t total_q = 0,
                                     int64_t total_k = 0, SplitRegions split = {}) {
  PrepassPlan p;
  p.batch = batch, p.heads_q = heads_q, p.heads_kv = heads_kv;
  p.seq_q = seq_q, p.seq_kv = seq_kv, p.head_dim = head_dim, p.channels = channels, p.bits = bits;
  p.smooth_q = smooth_q, p.smooth_k = smooth_k, p.smooth_v = smooth_v;
  p.quantize_q = quantize_q, p.lse = lse;
  p.q_blocks = (seq_q + kBlockQ - 1) / kBlockQ;
  p.k_blocks = (seq_kv + kBlockK - 1) / kBlockK;
  p.nq_pad = p.q_blocks * kBlockQ;
  p.nk_pad = p.k_blocks * kBlockK;
  p.row_bytes = head_dim * bits / 8;
  // K/V statistics are reduced in fixed-size token chunks (deterministic, no atomics).
  p.stat_chunks = (seq_kv + kStatTokens - 1) / kStatTokens;
  p.kv_sampled = !smooth_v;
  p.kv_cluster = !p.kv_sampled && p.stat_chunks <= max_kv_cluster ? int(p.stat_chunks) : 0;
  p.k_mean_stride = k_mean_stride;
  p.k_mean_samples = (seq_kv + p.k_mean_stride - 1) / p.k_mean_stride;
  p.k_mean_tokens = k_mean_tokens;
  const int64_t bq = batch * heads_q, bk = batch * heads_kv;
  // Rows of all (sequence, head) pairs: dense B·H·padded length; packed H·packed_pitch (each
  // sequence padded to a multiple of 128 rows at most: total + 128·B rows a head, not
  // B·max_seqlen).
  if (cu_q) {
    p.q_rows = {cu_q, seq_q, total_q, packed_pitch(total_q, batch), 0};
    p.kv_rows = {cu_k, seq_kv, total_k, packed_pitch(total_k, batch), 0};
    p.shift_rows = p.q_rows;
  } else {
    p.q_rows = {nullptr, seq_q, 0, p.nq_pad, heads_q * p.nq_pad};
    p.kv_rows = {nullptr, seq_kv, 0, p.nk_pad, heads_kv * p.nk_pad};
    p.shift_rows = {nullptr, seq_q, 0, seq_q, heads_q * seq_q};
  }
  const int64_t q_all = cu_q ? heads_q * p.q_rows.pitch : bq * p.nq_pad;
  const int64_t k_all = cu_q ? heads_kv * p.kv_rows.pitch : bk * p.nk_pad;
  const int64_t shift_all = cu_q ? q_all : bq * seq_q;
  WorkspaceCarver carve;
  auto take = [&](size_t bytes) { return carve.take(bytes); };
  // Q: the pre-pass's INT8/INT4 rows and 64 group scales a 128-row block (the sm90 kernel's fused
  // Q quantizes each tile in shared memory instead); the block means with Q smoothing (the mma
  // kernel forms ΔS from them and the caller's K); each row's LSE shift, NaN for a row an Inf/NaN
  // input poisons: quant_q writes it for every row and the kernels read it for every row, where
  // the pre-pass quantizes Q; the fused Q writes it (and keeps the poison in shared memory) only
  // where the LSE is asked for.
  p.q = take(quantize_q ? size_t(q_all * p.row_bytes) : 0);
  p.q_scale = take(quantize_q ? size_t(q_all / kBlockQ * kQGroups) * 4 : 0);
  p.q_mean = take(smooth_q ? size_t(q_all / kBlockQ * head_dim) * 4 : 0);
  p.lse_shift = take(quantize_q || lse ? size_t(shift_all) * 4 : 0);
  p.k = take(size_t(k_all * p.row_bytes));
  p.k_scale = take(size_t(k_all / kBlockK * kKGroups) * 4);
  p.v = take(size_t(k_all * head_dim));
  // The K/V statistics of a head sit at the start of that head's Vᵀ rows rather than in a region
  // of their own: quant_kv's V stores are their only overwriter and come after their last read
  // (three launches: a later kernel of the stream; one cluster launch: after a second cluster
  // barrier, and a cluster writes only its own head's Vᵀ). A head's D·nk_pad bytes hold its
  // 24·chunks·D: nk_pad >= 128·chunks - 64 >= 24·chunks. A packed sequence's head has no
  // contiguous Vᵀ bytes: its statistic (chunk, channel) sits at the start of the 128 columns of
  // that chunk in that channel's Vᵀ row (StatView), inside the sequence's own columns.
  p.kv_stats = p.v;
  p.kv_stats_stride = head_dim * p.nk_pad;
  p.k_mean = take(size_t(bk * head_dim) * 4);
  p.v_mean = take(size_t(bk * head_dim) * 4);
  p.v_scale = take(size_t(bk * head_dim) * 4);
  p.v_inv = take(size_t(bk * head_dim) * 4);
  // V's sampled bounds, the exact maxima of channels past them, a mark a head (VBound; written
  // by the sampled path only, laid out always).
  p.v_bound = take(size_t(bk * head_dim) * 4);
  p.v_amax = take(size_t(bk * head_dim) * 4);
  p.v_over = take(size_t(bk) * 4);
  // The sm90 kernel's causal tile scheduler: {next tile, CTAs done}, and the split tail's flags,
  // zeroed by the pre-pass (kv_sample, kv_finalize, kv_prepass) and reset by the kernel (the
  // causal scheduler's last CTA, each split tile's merger).
  p.counters = 2 + split.flags;
  p.tile_counter = take(size_t(p.counters) * 4);
  // Per KV head: the first key whose K or V row holds Inf/NaN (kKvBadNone: none), for the rows
  // the pre-pass or the sm90 kernel's Q quantization marks as poisoned.
  p.kv_bad = take(size_t(bk) * 8);
  p.split_parts = take(split.part_bytes);
  p.total = carve.total;
  return p;
}

}  // namespace sage::quant
