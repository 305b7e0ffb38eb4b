// The ablation rows of `sage accuracy`: each one the 4-bit (or 8-bit) kernel with one knob turned,
// and the SageAttention3 paper's FP4 table (formats and P~ quantization).
#include "ref/ablations.h"

#include "ref/reference.h"

namespace sage::ref {

std::vector<AblationRow> paper_ablations() {
  std::vector<AblationRow> rows;
  const sage_quant_config b4 = quant_preset(SAGE_VARIANT_SAGE2_4B);
  const sage_quant_config b8 = quant_preset(SAGE_VARIANT_SAGE2_8B);

  const std::string t4 = "Smoothing, INT4 per-thread Q,K, E4M3 P,V (paper Table 4)";
  const std::pair<const char*, uint32_t> smooth[] = {
      {"none", 0u}, {"K", SAGE_SMOOTH_K}, {"Q", SAGE_SMOOTH_Q}, {"Q+K", SAGE_SMOOTH_Q | SAGE_SMOOTH_K}};
  for (const auto& [label, flags] : smooth) {
    sage_quant_config c = b4;
    c.smooth = flags;
    rows.push_back({t4, label, c});
  }

  const std::string t6 = "Granularity, INT4 Q,K smoothed Q+K, E4M3 P,V (paper Table 6)";
  const std::pair<const char*, sage_granularity> gran[] = {
      {"per-token", SAGE_GRANULARITY_PER_TOKEN},
      {"per-thread (mma)", SAGE_GRANULARITY_PER_THREAD_MMA},
      {"per-thread (wgmma)", SAGE_GRANULARITY_PER_THREAD_WGMMA},
      {"per-warp", SAGE_GRANULARITY_PER_WARP},
      {"per-block", SAGE_GRANULARITY_PER_BLOCK},
      {"per-tensor", SAGE_GRANULARITY_PER_TENSOR}};
  for (const auto& [label, g] : gran) {
    sage_quant_config c = b4;
    c.smooth = SAGE_SMOOTH_Q | SAGE_SMOOTH_K;  // as the paper's table
    c.granularity = g;
    rows.push_back({t6, label, c});
  }

  const std::string t7 = "P~,V format, INT4 Q,K smoothed Q+K, fp32 accumulator (paper Table 7)";
  const std::pair<const char*, sage_pv_format> pv[] = {{"INT8", SAGE_PV_INT8},
                                                       {"E5M2", SAGE_PV_FP8_E5M2},
                                                       {"E4M3", SAGE_PV_FP8_E4M3},
                                                       {"FP16", SAGE_PV_FP16}};
  for (const auto& [label, f] : pv) {
    sage_quant_config c = b4;
    c.smooth = SAGE_SMOOTH_Q | SAGE_SMOOTH_K;  // as the paper's table
    c.pv_format = f;
    c.pv_accum = SAGE_PV_ACCUM_FP32;
    rows.push_back({t7, label, c});
  }

  const std::string ta =
      "P~V accumulator, SageAttn2-8b without smooth V (paper 3.4; FP22 = 13 mantissa bits)";
  struct Acc {
    const char* label;
    sage_pv_accum accum;
    int flush;
    uint32_t extra_smooth;
  };
  const Acc acc[] = {{"fp32", SAGE_PV_ACCUM_FP32, 1, 0},
                     {"FP22 only", SAGE_PV_ACCUM_HW, 1, 0},
                     {"FP22 only + smooth V", SAGE_PV_ACCUM_HW, 1, SAGE_SMOOTH_V},
                     {"two-level, flush every 16 blocks", SAGE_PV_ACCUM_TWO_LEVEL, 16, 0},
                     {"two-level, flush every 4 blocks", SAGE_PV_ACCUM_TWO_LEVEL, 4, 0},
                     {"two-level, flush every block", SAGE_PV_ACCUM_TWO_LEVEL, 1, 0},
                     {"aligned per product (wgmma model)", SAGE_PV_ACCUM_ALIGNED, 1, 0},
                     {"aligned per product + smooth V", SAGE_PV_ACCUM_ALIGNED, 1, SAGE_SMOOTH_V}};
  for (const Acc& a : acc) {
    sage_quant_config c = b8;
    c.pv_accum = a.accum;
    c.pv_flush_interval = a.flush;
    c.smooth = (b8.smooth & ~SAGE_SMOOTH_V) | a.extra_smooth;
    rows.push_back({ta, a.label, c});
  }

  // The presets take K's smoothing mean from 256 sampled tokens; the next rows show the mean over
  // every token, and one power-of-two V scale per key block (SAGE_V_SCALE_PER_BLOCK) instead of
  // the per-channel one.
  const std::string tv = "Kernel variants (paper Table 3; presets smooth V too)";
  rows.push_back({tv, "SageAttn2-8b (mma, 128x64)", b8});
  sage_quant_config a8 = b8;
  a8.k_mean_tokens = 0;
  rows.push_back({tv, "SageAttn2-8b (mma, K mean over every token)", a8});
  sage_quant_config c8 = b8;
  c8.v_scale = SAGE_V_SCALE_PER_BLOCK;
  rows.push_back({tv, "SageAttn2-8b (mma, power-of-two V scale per block)", c8});
  sage_quant_config w8 = b8;
  w8.granularity = SAGE_GRANULARITY_PER_THREAD_WGMMA;
  w8.block_k = 128;
  rows.push_back({tv, "SageAttn2-8b (wgmma, 128x128)", w8});
  sage_quant_config w8v = w8;
  w8v.v_scale = SAGE_V_SCALE_PER_BLOCK_CHANNEL;
  rows.push_back({tv, "SageAttn2-8b (wgmma, per-block-channel V)", w8v});
  rows.push_back({tv, "SageAttn2-4b (mma, 128x64)", b4});

  // The SageAttention3 paper's Table 1(a) and (b): the FP4 format, and P~'s quantization, beside
  // the 8-bit kernel and fp16 attention (Q, K, P~, V in fp16, fp32 accumulator). Every FP4 row
  // smooths Q and K as Algorithm 1 does. The format is compared on Q·K alone (P~·V in fp16) and on
  // both products; MXFP4 takes P~ directly (its power-of-two scales leave a first level nothing to
  // gain).
  const std::string t1 = "FP4 microscaling, smoothed Q+K (paper 004 Table 1; CPU emulation)";
  sage_quant_config f16 = quant_preset(SAGE_VARIANT_EXACT);
  f16.pv_format = SAGE_PV_FP16;  // Q, K are fp16 inputs already (qk_format NONE)
  rows.push_back({t1, "fp16 (P~, V in fp16, fp32 accumulator)", f16});
  rows.push_back({t1, "SageAttn2-8b", b8});
  const sage_quant_config nv = quant_preset(SAGE_VARIANT_SAGE3_FP4);
  struct Fp4Row {
    const char* label;
    sage_qk_format qk;
    sage_pv_format pv;
    uint32_t extra_smooth;
  };
  const Fp4Row fp4[] = {
      {"MXFP4 Q·K only (P~, V in fp16)", SAGE_QK_MXFP4, SAGE_PV_FP16, 0},
      {"NVFP4 Q·K only (P~, V in fp16)", SAGE_QK_NVFP4, SAGE_PV_FP16, 0},
      {"MXFP4 (E8M0 scale / 32), P~ direct", SAGE_QK_MXFP4, SAGE_PV_MXFP4, 0},
      {"NVFP4 (E4M3 scale / 16), P~ direct", SAGE_QK_NVFP4, SAGE_PV_NVFP4_DIRECT, 0},
      {"NVFP4, P~ two-level (SageAttn3)", SAGE_QK_NVFP4, SAGE_PV_NVFP4, 0},
      {"NVFP4, P~ two-level + smooth V", SAGE_QK_NVFP4, SAGE_PV_NVFP4, SAGE_SMOOTH_V}};
  for (const Fp4Row& f : fp4) {
    sage_quant_config c = nv;
    c.qk_format = f.qk;
    c.pv_format = f.pv;
    c.smooth |= f.extra_smooth;
    rows.push_back({t1, f.label, c});
  }
  return rows;
}

}  // namespace sage::ref
