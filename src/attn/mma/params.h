// The mma.sync SageAttention2 kernel (sm_89, sm_90a, sm_120a): its tile shape and its params
// struct (pointers into the pre-pass's workspace, quant/layout.h). Plain C++ (no CUDA types).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/formats.h"  // SAGE_HOST_DEVICE
#include "quant/layout.h"

namespace sage::mma {

// One CTA: 8 warps, 128 query rows (16 a warp: rows {g, g+8} of a warp share a Q scale), key
// blocks of 64 (4 K groups of 16 keys: {8j+2t, 8j+2t+1}): the pre-pass layout's blocks. The CPU
// emulation of this kernel is quant_preset() with block_q 128, warps 8, block_k 64.
constexpr int kBlockQ = quant::kBlockQ;
constexpr int kBlockK = quant::kBlockK;
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kQGroups = quant::kQGroups;
constexpr int kKGroups = quant::kKGroups;
static_assert(kQGroups == kWarps * 8, "a Q group per lane group of each warp");

// Everything the attention kernel reads and writes. Pointers into the workspace follow the
// pre-pass plan (quant/layout.h).
struct AttnParams {
  const uint8_t* q;        // [B*Hq][nq_pad][row_bytes] INT8 or packed INT4 (low nibble first)
  const float* q_scale;    // [B*Hq][q_blocks][kQGroups]
  const uint8_t* k;        // [B*Hkv][nk_pad][row_bytes]
  const float* k_scale;    // [B*Hkv][k_blocks][kKGroups]
  const uint8_t* v;        // [B*Hkv][D][nk_pad] E4M3, keys permuted inside each 32 (see prepass)
  const float* v_scale;    // [B*Hkv][D]
  const float* v_mean;     // [B*Hkv][D]
  const float* lse_shift;  // [B*Hq][Nq] (written by quant_q; read where the LSE is asked for)
  // Q smoothing (LaunchConfig::smooth_q): ΔS = q_mean·(k - k_mean), formed in the kernel from
  // the block means, K's means and the caller's K (fp16/bf16 as o; strides in elements).
  const float* q_mean;     // [B*Hq][q_blocks][D]
  const float* k_mean;     // [B*Hkv][D]
  const void* k_in;
  int64_t k_in_batch, k_in_head, k_in_token;
  bool k_in_vec;           // every row of k_in 16-byte aligned: one load per 8 channels
  void* o;                 // caller's output, strides in elements
  int64_t o_batch, o_head, o_token;
  int64_t head_dim;        // the caller's channels of o (<= D: D's past it are zero padding,
                           // never stored)
  float* lse;              // caller's LSE or null
  int64_t lse_batch, lse_head, lse_token;
  int64_t batch, heads_q, heads_kv;
  int64_t seq_q, seq_kv, nq_pad, nk_pad, q_blocks, k_blocks;
  int64_t causal_offset;   // query i sees keys j <= i + causal_offset
  float scale_log2;        // softmax scale * log2(e)
  // Where each (sequence, head)'s rows lie in the workspace and the caller's tensors (dense, or a
  // packed batch read from cu_seqlens on the device: quant/layout.h, SeqRows); the index
  // comments above are the dense case. A packed batch's o and lse have batch strides 0.
  quant::SeqRows q_rows, kv_rows, shift_rows;
  bool bottom_right;       // packed, causal: each sequence's offset is its Nk - Nq (else 0)

  // The K/V head (batch · heads_kv + KV head) query head h of batch b reads (GQA).
  SAGE_HOST_DEVICE int64_t kv_head(int64_t b, int64_t h) const {
    return b * heads_kv + h / (heads_q / heads_kv);
  }
};

}  // namespace sage::mma
