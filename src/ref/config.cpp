// Quantization configs: the presets behind sage_variant and the one validity check shared by the
// C API and the CPU reference. Host code.
#include <algorithm>
#include <string>

#include "common/error.h"
#include "ref/reference.h"

namespace sage::ref {

sage_quant_config quant_preset(sage_variant variant) {
  sage_quant_config c{};
  c.qk_format = SAGE_QK_INT8;
  c.granularity = SAGE_GRANULARITY_PER_THREAD_MMA;
  // Smoothing V is on by default: free in the kernel (v_mean added in the epilogue) and, on
  // inputs with a channel bias in V, about 5x lower rel-L1 (sage accuracy, accumulator table).
  c.smooth = SAGE_SMOOTH_K | SAGE_SMOOTH_V;
  c.pv_format = SAGE_PV_FP8_E4M3;
  // Per channel: V is read whole for its exact mean anyway (below). One power of two per block
  // (SAGE_V_SCALE_PER_BLOCK) is as accurate here but made the kernels slower (docs/sm90-kernel.md).
  c.v_scale = SAGE_V_SCALE_PER_CHANNEL;
  c.pv_accum = SAGE_PV_ACCUM_TWO_LEVEL;
  c.pv_flush_interval = 1;
  c.accum_mantissa_bits = 13;  // FP22 as the paper measured on Ada; see docs/ once measured here
  c.accum_chunk = 32;          // keys in one m16n8k32 / m64nNk32 FP8 MMA
  c.block_q = 128;  // the mma.sync kernel's tile: 8 warps of 16 rows, 64-key blocks
  c.block_k = 64;
  c.warps = 8;
  // K's smoothing mean from about 256 tokens: any k_mean leaves the softmax unchanged (a constant
  // per row) and only has to take the channel bias out, so the pre-pass reads K once. V's mean
  // takes every token: sampled, it made the 8-bit error depend on the draw, and on the GPU the
  // sm90 kernel's wgmma accumulator (each product cut to the grid of the running O) grew its
  // error with the length: V - v_mean must sum to zero (docs/sm90-kernel.md, Tried 29).
  c.k_mean_tokens = 256;
  switch (variant) {
    case SAGE_VARIANT_SAGE2_4B:
      c.qk_format = SAGE_QK_INT4;
      c.smooth = SAGE_SMOOTH_Q | SAGE_SMOOTH_K | SAGE_SMOOTH_V;
      break;
    case SAGE_VARIANT_SAGE3_FP4:
      // SageAttention3 paper, Algorithm 1: smooth K, smooth Q per block (with ΔS), NVFP4 Q·K,
      // two-level NVFP4 P~, NVFP4 V (no V smoothing in the paper), each key block's k64 MMA results
      // added into an fp32 O after the s_P1 multiply.
      c.qk_format = SAGE_QK_NVFP4;
      c.smooth = SAGE_SMOOTH_Q | SAGE_SMOOTH_K;
      c.pv_format = SAGE_PV_NVFP4;
      c.pv_accum = SAGE_PV_ACCUM_FP32;
      c.accum_chunk = 64;  // keys of one m16n8k64 FP4 MMA
      break;
    case SAGE_VARIANT_EXACT:
      c.qk_format = SAGE_QK_NONE;
      c.smooth = 0;
      c.pv_format = SAGE_PV_NONE;
      c.pv_accum = SAGE_PV_ACCUM_FP32;
      break;
    default:
      break;  // AUTO, SAGE2_8B, CUSTOM start from the 8-bit kernel
  }
  return c;
}

bool sm90_softmax_form(const sage_quant_config& c) {
  return c.softmax_block_k > c.block_k || c.exp2_poly_every > 0 ||
         (c.granularity == SAGE_GRANULARITY_PER_THREAD_WGMMA &&
          c.pv_accum == SAGE_PV_ACCUM_ALIGNED);
}

std::string quant_config_error(const sage_quant_config& c) {
  auto bad = [](const char* what, long long value) {
    return std::string("quant.") + what + " = " + std::to_string(value) + " is invalid";
  };
  if (enum_value(c.qk_format) < SAGE_QK_NONE || enum_value(c.qk_format) > SAGE_QK_MXFP4)
    return bad("qk_format", enum_value(c.qk_format));
  if (enum_value(c.granularity) < SAGE_GRANULARITY_PER_THREAD_MMA ||
      enum_value(c.granularity) > SAGE_GRANULARITY_PER_TENSOR)
    return bad("granularity", enum_value(c.granularity));
  if (c.smooth & ~(SAGE_SMOOTH_Q | SAGE_SMOOTH_K | SAGE_SMOOTH_V))
    return bad("smooth (unknown flag bits)", c.smooth);
  if (enum_value(c.pv_format) < SAGE_PV_NONE || enum_value(c.pv_format) > SAGE_PV_MXFP4)
    return bad("pv_format", enum_value(c.pv_format));
  if (enum_value(c.v_scale) < SAGE_V_SCALE_PER_CHANNEL ||
      enum_value(c.v_scale) > SAGE_V_SCALE_PER_BLOCK)
    return bad("v_scale", enum_value(c.v_scale));
  if (enum_value(c.pv_accum) < SAGE_PV_ACCUM_FP32 ||
      enum_value(c.pv_accum) > SAGE_PV_ACCUM_ALIGNED)
    return bad("pv_accum", enum_value(c.pv_accum));
  if (c.block_q < 1 || c.block_q > 1024) return bad("block_q (1..1024)", c.block_q);
  if (c.block_k < 1 || c.block_k > 1024) return bad("block_k (1..1024)", c.block_k);
  if (c.warps < 1 || c.block_q % c.warps != 0)
    return bad("warps (>= 1 and must divide block_q)", c.warps);
  if (c.pv_flush_interval < 1) return bad("pv_flush_interval (>= 1)", c.pv_flush_interval);
  if (c.accum_mantissa_bits < 1 || c.accum_mantissa_bits > 23)
    return bad("accum_mantissa_bits (1..23)", c.accum_mantissa_bits);
  if (c.accum_chunk < 1) return bad("accum_chunk (>= 1)", c.accum_chunk);
  if (c.k_mean_tokens < 0) return bad("k_mean_tokens (>= 0)", c.k_mean_tokens);
  if (c.granularity == SAGE_GRANULARITY_PER_THREAD_MMA && (c.block_q / c.warps) % 16 != 0)
    return bad("block_q (per-thread MMA groups need block_q / warps to be a multiple of 16)",
               c.block_q);
  if (c.granularity == SAGE_GRANULARITY_PER_THREAD_WGMMA && c.block_q % 16 != 0)
    return bad("block_q (per-thread WGMMA groups need a multiple of 16)", c.block_q);
  if ((c.granularity == SAGE_GRANULARITY_PER_THREAD_MMA ||
       c.granularity == SAGE_GRANULARITY_PER_THREAD_WGMMA) &&
      c.block_k % 8 != 0)
    return bad("block_k (per-thread K groups need a multiple of 8)", c.block_k);
  if (c.v_scale == SAGE_V_SCALE_PER_BLOCK_CHANNEL && c.pv_accum != SAGE_PV_ACCUM_FP32 &&
      c.pv_flush_interval != 1)
    return "quant.v_scale per (block, channel) needs the accumulator flushed every key block "
           "(pv_flush_interval = " +
           std::to_string(c.pv_flush_interval) + ", pv_accum = " + std::to_string(c.pv_accum) + ")";
  if (c.v_scale == SAGE_V_SCALE_PER_BLOCK_CHANNEL &&
      (c.pv_accum == SAGE_PV_ACCUM_HW || c.pv_accum == SAGE_PV_ACCUM_ALIGNED))
    return "quant.v_scale per (block, channel) cannot be used with pv_accum = HW or ALIGNED (the "
           "hardware accumulator is never flushed, so block scales cannot be applied)";
  if (c.softmax_block_k < 0 || c.softmax_block_k > 65536 ||
      (c.softmax_block_k > 0 && c.softmax_block_k % c.block_k != 0))
    return bad("softmax_block_k (0, or a multiple of block_k up to 65536)", c.softmax_block_k);
  if (c.exp2_poly_every != 0 && c.exp2_poly_every != 2 && c.exp2_poly_every != 4 &&
      c.exp2_poly_every != 8 && c.exp2_poly_every != 16 && c.exp2_poly_every != 32)
    return bad("exp2_poly_every (0, 2, 4, 8, 16 or 32)", c.exp2_poly_every);
  if (c.split_tiles < 0 || c.split_ctas < 0 || (c.split_tiles == 0) != (c.split_ctas == 0) ||
      c.split_ctas < c.split_tiles)
    return "quant.split_tiles = " + std::to_string(c.split_tiles) +
           ", split_ctas = " + std::to_string(c.split_ctas) +
           " are invalid (both 0, or 0 < split_tiles <= split_ctas)";
  if (c.split_tiles > 0 && !sm90_softmax_form(c))
    return "quant.split_tiles = " + std::to_string(c.split_tiles) +
           " is the sm90 kernel's split tail, modelled with its softmax form only "
           "(softmax_block_k > block_k, exp2_poly_every > 0, or granularity PER_THREAD_WGMMA "
           "with pv_accum ALIGNED)";
  // The sm90 kernel's softmax form (sm90_softmax_form) is modelled with per-channel V scales
  // only: a per-key-block V scale would have to act inside a softmax block (the kernel has none
  // of these).
  if (sm90_softmax_form(c) && c.v_scale != SAGE_V_SCALE_PER_CHANNEL)
    return "quant.v_scale = " + std::to_string(c.v_scale) +
           " needs to be per channel with softmax_block_k = " + std::to_string(c.softmax_block_k) +
           " (block_k = " + std::to_string(c.block_k) +
           ") and exp2_poly_every = " + std::to_string(c.exp2_poly_every) +
           " (the sm90 softmax form is modelled with per-channel V scales only)";
  // The power-of-two exponent is chosen so that |V| / 2^e < 256 fits E4M3's 448; other formats
  // would need another rule, and without a V format there is nothing to scale.
  if (c.v_scale == SAGE_V_SCALE_PER_BLOCK && c.pv_format != SAGE_PV_FP8_E4M3)
    return "quant.v_scale = per block (power of two) needs pv_format = FP8_E4M3 (pv_format = " +
           std::to_string(c.pv_format) + ")";
  if (const MicroscaleFormat* fp4 = pv_microscale(c.pv_format)) {
    const std::string what = "quant.pv_format = " + std::to_string(c.pv_format) + " (FP4) ";
    // P~'s runs lie inside one key block (each block has its own running max).
    if (c.block_k % fp4->block != 0)
      return what + "needs block_k to be a multiple of " + std::to_string(fp4->block) +
             " (block_k = " + std::to_string(c.block_k) + ")";
    if ((c.softmax_block_k != 0 && c.softmax_block_k != c.block_k) || c.exp2_poly_every != 0 ||
        sm90_softmax_form(c))
      return what +
             "is modelled with the mma softmax form only: softmax_block_k 0, "
             "exp2_poly_every 0, and not granularity PER_THREAD_WGMMA with pv_accum ALIGNED "
             "(softmax_block_k = " +
             std::to_string(c.softmax_block_k) +
             ", exp2_poly_every = " + std::to_string(c.exp2_poly_every) + ")";
    if (c.v_scale != SAGE_V_SCALE_PER_CHANNEL)
      return what +
             "carries V's scales in its runs: v_scale must be PER_CHANNEL, the default "
             "(v_scale = " +
             std::to_string(c.v_scale) + ")";
    // s_P1 changes from block to block: each block's product is scaled before it joins O.
    const bool flushed_every_block =
        c.pv_accum == SAGE_PV_ACCUM_FP32 ||
        (c.pv_accum == SAGE_PV_ACCUM_TWO_LEVEL && c.pv_flush_interval == 1);
    if (c.pv_format == SAGE_PV_NVFP4 && !flushed_every_block)
      return what +
             "scales P~ per row and key block (two-level): the accumulator must be "
             "flushed every key block (pv_accum FP32, or TWO_LEVEL with pv_flush_interval 1; "
             "pv_accum = " +
             std::to_string(c.pv_accum) +
             ", pv_flush_interval = " + std::to_string(c.pv_flush_interval) + ")";
  }
  return {};
}

int64_t mean_token_stride(int64_t tokens, int32_t k_mean_tokens) {
  return k_mean_tokens > 0 ? std::max<int64_t>(1, tokens / k_mean_tokens) : 1;
}

}  // namespace sage::ref
