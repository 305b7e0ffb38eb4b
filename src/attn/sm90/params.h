// What the Hopper kernel reads and writes: the pre-pass's products in the workspace
// (quant/layout.h), the caller's Q (fused Q), output and LSE with their strides, and the problem.
// Plain C++ (no CUDA types); the TMA descriptors travel beside it (sm90::TmaMaps).
#pragma once

#include <cstdint>

#include "common/formats.h"  // SAGE_HOST_DEVICE
#include "quant/layout.h"

namespace sage::sm90 {

struct Params {
  // The pre-pass's products: K [B*Hkv][nk_pad][D] INT8, Vᵀ [B*Hkv][D][nk_pad] E4M3 (keys
  // permuted inside each 32), Q [B*Hq][nq_pad][D] INT8 when the pre-pass quantized it; read
  // through the TMA maps. The scales and means are read directly.
  const uint8_t* q;
  const uint8_t* k;
  const uint8_t* v;
  const float* q_scale;    // [B*Hq][q_blocks][64] (pre-pass Q only)
  const float* k_scale;    // [B*Hkv][k_blocks][4]: per 64 keys and lane t
  const float* v_scale;    // [B*Hkv][D]
  const float* v_mean;     // [B*Hkv][D]
  const float* k_mean;     // [B*Hkv][D]: the LSE shift of fused Q
  float* lse_shift;        // [B*Hq][Nq]: scale · q·k_mean, NaN for a poisoned row (written by
                           // quant_q or by fused Q; the epilogue reads it for every row)
  const unsigned long long* kv_bad;  // [B*Hkv]: the first key with Inf/NaN (fused Q's poisoning)
  unsigned* tile_counter;  // causal: {next tile, CTAs done}, 0 on entry and on exit
  // The caller's Q (fp16/bf16 as o; fused Q reads it through its own TMA map), strides in elements.
  const void* q_in;
  int64_t q_in_batch, q_in_head, q_in_token;
  void* o;                 // the caller's output, strides in elements
  int64_t o_batch, o_head, o_token;
  int64_t head_dim;        // the caller's channels of q_in and o (<= D: D's past it are zero
                           // padding, read as zeros by fused Q's TMA and never stored)
  float* lse;              // the caller's LSE or null
  int64_t lse_batch, lse_head, lse_token;
  int64_t batch, heads_q, heads_kv;
  int64_t seq_q, seq_kv, nq_pad, nk_pad, q_blocks, k_blocks;
  int64_t causal_offset;   // query i sees keys j <= i + causal_offset
  float scale_log2;        // softmax scale · log2(e)
  float scale;             // softmax scale
  bool fused_q;            // Q quantized by the kernel (q, q_scale unused)
  // Where each (sequence, head)'s rows lie (quant/layout.h, SeqRows): dense, or a packed batch
  // whose sequences the scheduler finds from cu_seqlens on the device (fused Q only; the index
  // comments above are the dense case; kv_rows.pitch is the K/Vᵀ rows of one TMA slab: nk_pad,
  // or a packed head's). A packed batch's q_in, o and lse have batch strides 0.
  quant::SeqRows q_rows, kv_rows, shift_rows;
  bool bottom_right;       // packed, causal: each sequence's offset is its Nk - Nq (else 0)
  // The split tail (split.h; the kSplit instantiations): the call's last split_tiles tiles have
  // their key blocks shared among CTAs 0 .. split_ctas - 1 after their whole tiles. The later
  // parts' softmax states, a slot per CTA ([value][consumer thread]: O's D/2, then m and l's two
  // each), and a flag per (split tile, consumer warpgroup), 0 on entry and on exit.
  int64_t split_tiles, split_ctas;
  float* split_parts;
  unsigned* split_flags;

  // The K/V head (batch · heads_kv + KV head) query head h of batch b reads (GQA).
  SAGE_HOST_DEVICE int64_t kv_head(int64_t b, int64_t h) const {
    return b * heads_kv + h / (heads_q / heads_kv);
  }
};

}  // namespace sage::sm90
