// The planner (plan.h): which kernel, which tile, which pre-pass steps, which workspace layout,
// and what the call computes (its emulation config). Host code; any architecture.
#include "api/plan.h"

#include <algorithm>
#include <limits>
#include <string>

#include "attn/mma/params.h"
#include "attn/sm90/traits.h"
#include "common/error.h"

namespace sage::api {
namespace {

// The crossover model's rows (one per GPU, kernel head dim and mask), fitted to measurements by
// tools/crossover.py; prefer_sdpa and sdpa_below read them.
struct Model {
  int cc, sms, bus;
  int64_t head_dim;
  bool causal;
  // ms per: call, K/V element·D, Q element·D, tera-MAC·D, critical-path G·D, tera-MAC·D at
  // lengths that are not multiples of 128
  double sage[6];
  double cudnn[5];  // the same but K/V
  double margin;
  int64_t min_seq;
};
constexpr Model kModels[] = {
#include "api/crossover_model.inc"
};

// The sm90 kernel's tile: three consumer warpgroups at D = 64 with fused Q (their 192-row tiles
// have no pre-pass Q layout): a third warp per scheduler hides more of the softmax's latency.
// Not for causal calls of up to 4096 query rows, where two consumers measured faster
// (docs/sm90-kernel.md, "The CTA", has the figures).
int sm90_consumers(int64_t head_dim, bool causal, int64_t seq_q, bool fused_q) {
  return head_dim == 64 && fused_q && !(causal && seq_q <= 4096) ? 3 : 2;
}

int sm90_poly_every(int64_t head_dim, int consumers) {
  return head_dim == 256 ? sm90::Traits<256, 2>::kPolyEvery
         : head_dim == 128
             ? sm90::Traits<128, 2>::kPolyEvery
             : (consumers == 3 ? sm90::Traits<64, 3>::kPolyEvery : sm90::Traits<64, 2>::kPolyEvery);
}

// The sm90 kernel's key block (the softmax block): 128 keys, 64 at D = 256.
int sm90_block_k(int64_t head_dim) {
  return head_dim == 256 ? sm90::Traits<256, 2>::kBlockK : sm90::Traits<128, 2>::kBlockK;
}

// The sm90 kernel's split tail (attn/sm90/split.h) for a call of `tiles` tiles of `blocks` key
// blocks on `sms` SMs: the last round's tiles shared among more CTAs where that shortens the
// call's critical path by at least kMinSaving, else none. Costs in key blocks: a unit (a tile or
// a part of one) pays about kUnitBlocks blocks' worth besides its own blocks (its first block
// alone, the last P·V alone, the epilogue: docs/sm90-kernel.md, "What limits it"), and a CTA's
// share of the tail holds at most two units; parts are kept at least kMinPart blocks long. The
// split measured slower than whole tiles where this model predicted small savings, for reasons it
// does not capture: a split is taken only where it predicts a large one (docs/sm90-kernel.md,
// "The split tail").
sm90::SplitTail sm90_split(int64_t tiles, int64_t blocks, int sms) {
  constexpr int64_t kUnitBlocks = 4, kMinPart = 4;
  constexpr double kMinSaving = 0.03;
  if (sms <= 0 || tiles <= 0 || blocks <= 0) return {};
  const int64_t rest = tiles % sms;  // the last round's tiles (all of them under one round)
  if (rest == 0) return {};
  const int64_t steps = rest * blocks;
  const int64_t ctas = std::min<int64_t>(sms, std::max<int64_t>(rest, steps / kMinPart));
  if (ctas <= rest) return {};
  const int64_t share = (steps + ctas - 1) / ctas, rounds = tiles / sms;
  const double whole = double((rounds + 1) * (blocks + kUnitBlocks));
  const double split = double(rounds * (blocks + kUnitBlocks) + share + 2 * kUnitBlocks);
  if (split > (1.0 - kMinSaving) * whole) return {};
  return {rest, blocks, ctas};
}

// The one FP4 combination the GPU computes (src/fp4), variant SAGE3_FP4's with any Q/K
// smoothing and K-mean sampling: the first field that departs from it, as "field = value", or
// an empty string.
std::string fp4_gpu_mismatch(const sage_quant_config& c) {
  auto pv_name = [](sage_pv_format f) {
    return f == SAGE_PV_MXFP4 ? "MXFP4" : f == SAGE_PV_NVFP4_DIRECT ? "NVFP4_DIRECT"
           : f == SAGE_PV_NVFP4 ? "NVFP4" : "not FP4";
  };
  if (c.qk_format == SAGE_QK_MXFP4) return "quant.qk_format = MXFP4";
  if (c.pv_format != SAGE_PV_NVFP4 && c.pv_format != SAGE_PV_NONE && c.pv_format != SAGE_PV_FP16 &&
      c.pv_format != SAGE_PV_FP8_E4M3 && c.pv_format != SAGE_PV_FP8_E5M2 &&
      c.pv_format != SAGE_PV_INT8)
    return std::string("quant.pv_format = ") + pv_name(c.pv_format);
  if (c.qk_format != SAGE_QK_NVFP4)  // P~/V in FP4 after a Q·K that is not
    return std::string("quant.pv_format = ") + pv_name(c.pv_format);
  if (c.pv_format != SAGE_PV_NVFP4) return "quant.qk_format = NVFP4 (quant.pv_format not NVFP4)";
  if (c.pv_accum != SAGE_PV_ACCUM_FP32) return "quant.pv_accum (not FP32)";
  if (c.accum_chunk != 64) return "quant.accum_chunk = " + std::to_string(c.accum_chunk);
  if (c.block_q != fp4::kBlockQ) return "quant.block_q = " + std::to_string(c.block_q);
  if (c.block_k != fp4::kBlockK) return "quant.block_k = " + std::to_string(c.block_k);
  if (c.softmax_block_k != 0 && c.softmax_block_k != c.block_k)
    return "quant.softmax_block_k = " + std::to_string(c.softmax_block_k);
  if (c.exp2_poly_every != 0) return "quant.exp2_poly_every = " + std::to_string(c.exp2_poly_every);
  if (c.smooth & SAGE_SMOOTH_V) return "quant.smooth (V smoothing)";
  return std::string();
}

}  // namespace

bool prefer_sdpa(const Device& dev, int64_t head_dim, sage_mask mask, int64_t seq_q,
                 int64_t seq_kv, bool training, CallShape shape) {
  // Training (forward + SageBwd) has no model: it never measured faster, so torch's SDPA trains
  // every shape until one does.
  if (training) return true;
  // One cost model per implementation, per (GPU, kernel head dim, mask), each a sum of what the
  // kernel pays for, fitted to a sweep of (B·H, N, D, mask, GQA) on that GPU under CUDA-graph
  // replay by tools/crossover.py (which documents the features; the two must agree: the CPU
  // tests replay every measured point through this function). Sage is chosen where its predicted
  // time, raised by the row's margin (the least that routes no measured point where sage was
  // more than 2 % slower), still beats cuDNN's, and both lengths reach the least length routed
  // there (shorter ones were never measured: cross-attention to a few text tokens, decoding).
  const bool causal = mask != SAGE_MASK_NONE;
  // This GPU's rows; a GPU of a measured architecture that no sweep ran on (another SM count or
  // memory) takes the narrowest-memory GPU's rows, where sage's memory-bound pre-pass weighs the
  // most.
  const Model* m = nullptr;
  for (const Model& r : kModels)
    if (r.cc == dev.cc && r.head_dim == head_dim && r.causal == causal) {
      const bool exact = r.sms == dev.sms && r.bus == dev.mem_bus_bits;
      if (exact) { m = &r; break; }
      if (m == nullptr || r.bus < m->bus) m = &r;
    }
  // A GPU no sweep measured sage against SDPA on (another architecture: Ada, Blackwell) gets
  // torch's SDPA: a router sends a call to sage only where sage measured faster on that kind of
  // GPU, and here nothing was measured (sage_attention() still runs any call it is given).
  if (m == nullptr) return true;
  if (seq_q < m->min_seq || seq_kv < m->min_seq) return true;
  const int sms = dev.sms > 0 ? dev.sms : m->sms;
  const double visit = causal ? 0.5 : 1.0;  // the share of keys a query tile visits on average
  const double dk = static_cast<double>(head_dim), nq = static_cast<double>(seq_q),
               nk = static_cast<double>(seq_kv);
  const double bh = static_cast<double>(shape.batch * shape.heads_q);
  const double work = bh * nq * nk * visit * dk * 1e-12;
  // The critical path: whole waves of equal tiles, or under a causal mask the longer of the
  // longest tile (all keys) and the average SM's share.
  auto tail = [&](int64_t bq) {
    const int64_t tiles = shape.batch * shape.heads_q * ((seq_q + bq - 1) / bq);
    const double b = static_cast<double>(bq);
    if (causal)
      return std::max(b * nk, static_cast<double>(tiles) * b * nk * visit / sms) * dk * 1e-9;
    return static_cast<double>((tiles + sms - 1) / sms) * b * nk * dk * 1e-9;
  };
  const double q_elems = bh * nq * dk * 1e-9;
  const double ragged = seq_q % 128 != 0 || seq_kv % 128 != 0 ? work : 0.0;
  const double kv_elems = static_cast<double>(shape.batch * shape.heads_kv) * nk * dk * 1e-9;
  const double t_sage = m->sage[0] + m->sage[1] * kv_elems + m->sage[2] * q_elems +
                        m->sage[3] * work + m->sage[4] * tail(shape.block_q) + m->sage[5] * ragged;
  const double t_cudnn = m->cudnn[0] + m->cudnn[1] * q_elems + m->cudnn[2] * work +
                         m->cudnn[3] * tail(128) + m->cudnn[4] * ragged;
  return !(t_cudnn > t_sage * (1.0 + m->margin));
}

int64_t sdpa_below(const Device& dev) {
  // prefer_sdpa takes one row of this GPU's architecture per (kernel head dim, mask) and sends
  // lengths under its least length to torch; a (head dim, mask) without a row sends every call
  // there. So the least over the architecture's rows bounds any call, and on an architecture
  // without rows every length is under it.
  int64_t least = std::numeric_limits<int64_t>::max();
  for (const Model& r : kModels)
    if (r.cc == dev.cc) least = std::min(least, r.min_seq);
  return least;
}

sage_status make_plan(const Resolved& r, const sage_attention_args& a, const Device& dev,
                      Plan* out) {
  const sage_quant_config& c = r.quant;
  const ref::Problem& p = r.problem;
  if (r.exact)
    return set_error(SAGE_ERROR_UNSUPPORTED,
                     "variant = EXACT has no GPU kernel (float64 runs on the CPU reference)");
  // FP4 microscaling (SageAttention3): one GPU path computes Algorithm 1 of its paper exactly as
  // the CPU emulation of SAGE3_FP4 does (NVFP4 Q, K, two-level P~, V on fp16 tensor cores:
  // src/fp4); every other FP4 combination runs on the CPU only, and no other kernel stands in.
  const bool fp4 = ref::qk_microscale(c.qk_format) != nullptr ||
                   ref::pv_microscale(c.pv_format) != nullptr;
  if (fp4 && r.packed())
    return set_error(SAGE_ERROR_UNSUPPORTED,
                     "cu_seqlens_q: packed variable-length batches have no FP4 GPU kernel (the "
                     "8-bit and 4-bit variants take them; the CPU reference runs FP4 ones)");
  if (fp4) {
    const std::string off = fp4_gpu_mismatch(c);
    if (!off.empty())
      return set_error(SAGE_ERROR_UNSUPPORTED,
                       "%s%s: this FP4 combination has no GPU kernel; the GPU runs variant "
                       "SAGE3_FP4's (qk_format NVFP4, pv_format NVFP4, pv_accum FP32, "
                       "accum_chunk 64, block_q 128, block_k 64, no V smoothing); the CPU "
                       "reference emulates every combination (pass host pointers)",
                       a.variant == SAGE_VARIANT_SAGE3_FP4 ? "variant = SAGE3_FP4: " : "",
                       off.c_str());
  }
  if (a.dtype != SAGE_DTYPE_FP16 && a.dtype != SAGE_DTYPE_BF16)
    return set_error(SAGE_ERROR_UNSUPPORTED,
                     "dtype = FP32 has no GPU kernel: pass fp16 or bf16 (fp32 runs on the CPU "
                     "reference)");
  // D: the caller's head dim; Dk: the native head dim of the kernel that runs it (64, 128 or 256),
  // the workspace's channels, D's zero-padded up to it.
  const int64_t D = p.head_dim, Dk = gpu_kernel_head_dim(D);
  if (Dk == 0)
    return set_error(SAGE_ERROR_UNSUPPORTED,
                     "head_dim = %lld has no GPU kernel yet (GPU kernels: %s; the CPU reference "
                     "takes 1..%lld)",
                     static_cast<long long>(D), kGpuHeadDims, static_cast<long long>(kMaxHeadDim));
  const bool kernel_shape = c.granularity == SAGE_GRANULARITY_PER_THREAD_MMA &&
                            c.block_q == mma::kBlockQ && c.warps == mma::kWarps &&
                            c.block_k == mma::kBlockK && (c.softmax_block_k == 0 ||
                                                          c.softmax_block_k == c.block_k) &&
                            c.split_tiles == 0;
  const bool kernel_pv = c.pv_format == SAGE_PV_FP8_E4M3 && c.v_scale == SAGE_V_SCALE_PER_CHANNEL &&
                         c.pv_accum == SAGE_PV_ACCUM_TWO_LEVEL && c.pv_flush_interval == 1 &&
                         c.exp2_poly_every == 0;
  if (!fp4 && ((c.qk_format != SAGE_QK_INT8 && c.qk_format != SAGE_QK_INT4) || !kernel_shape ||
               !kernel_pv))
    return set_error(SAGE_ERROR_UNSUPPORTED,
                     "quant: no GPU kernel for this combination; the GPU kernels take qk_format "
                     "INT8/INT4, granularity PER_THREAD_MMA with block_q %d, warps %d, block_k %d "
                     "(softmax_block_k 0), pv_format FP8_E4M3, v_scale PER_CHANNEL, pv_accum "
                     "TWO_LEVEL with pv_flush_interval 1, exp2_poly_every 0, split_tiles 0 (any "
                     "smoothing); "
                     "sage_attention_plan() reports what the chosen kernel computes",
                     mma::kBlockQ, mma::kWarps, mma::kBlockK);
  if (reinterpret_cast<uintptr_t>(a.o) % 4 != 0 || r.o.batch % 2 || r.o.head % 2 || r.o.token % 2)
    return set_error(SAGE_ERROR_UNSUPPORTED,
                     "o: the GPU kernels store channel pairs, so o must be 4-byte aligned and its "
                     "strides even (o = %p, strides {%lld, %lld, %lld})",
                     a.o, static_cast<long long>(r.o.batch), static_cast<long long>(r.o.head),
                     static_cast<long long>(r.o.token));
  if (dev.cc < 89)
    return set_error(SAGE_ERROR_UNSUPPORTED,
                     "the GPU is sm_%d%d; the SageAttention2 kernels need sm_89 or newer (FP8 MMA)",
                     dev.cc / 10, dev.cc % 10);
  if (fp4) {
    // The FP4 kernel reads the caller's Q, K, V at its template head dim: native ones only (no
    // zero padding there yet), 64 and 128.
    if (D != Dk || Dk > 128)
      return set_error(SAGE_ERROR_UNSUPPORTED,
                       "head_dim = %lld: the FP4 kernel (variant SAGE3_FP4) takes head dims 64 "
                       "and 128 (the 8-bit and 4-bit kernels take %s; the CPU reference any)",
                       static_cast<long long>(D), kGpuHeadDims);
    if (a.kernel != SAGE_KERNEL_AUTO)
      return set_error(SAGE_ERROR_UNSUPPORTED,
                       "kernel = %s: FP4 calls run their own kernel (SAGE_KERNEL_FP4); pass AUTO",
                       a.kernel == SAGE_KERNEL_MMA ? "MMA" : "SM90");
    Plan plan;
    plan.family = Family::kFp4;
    plan.fp4 = fp4::make_layout(p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_kv, D);
    plan.prepass.total = plan.fp4.total;
    plan.prepass.head_dim = plan.prepass.channels = D;  // (sage_plan_info.kernel_head_dim)
    plan.block_q = 64;
    plan.block_k = fp4::kBlockK;
    plan.launches = 5;
    plan.emulation = c;  // the kernel computes the emulation's own steps (src/fp4/fp4.cu)
    *out = plan;
    return SAGE_OK;
  }
  const bool bits8 = c.qk_format == SAGE_QK_INT8, smooth_q = c.smooth & SAGE_SMOOTH_Q;
  const bool causal = p.mask != SAGE_MASK_NONE;

  // The family: the wgmma kernel on sm_90 where it applies (8-bit, no Q smoothing: ΔS stays on
  // mma.sync); args.kernel forces one (tests and benchmarks compare them). A packed batch takes
  // it too where fused Q can read its Q (the packed path quantizes Q in the kernel only): the
  // wgmma kernel's lead over mma.sync holds for packed batches as for dense ones
  // (docs/sm90-kernel.md, "Packed variable-length batches").
  const bool q_map = quant::rows_aligned16(a.q, r.q) && (r.packed() || r.q.batch > 0) &&
                     r.q.head > 0 && r.q.token > 0;  // a TMA map can describe Q (fused Q)
  const bool packed_sm90 = q_map && !(a.options & SAGE_OPTION_PREPASS_Q);
  if (a.kernel == SAGE_KERNEL_SM90 && r.packed() && !packed_sm90)
    return set_error(SAGE_ERROR_UNSUPPORTED,
                     "kernel = SM90: a packed batch (cu_seqlens_q) runs on the wgmma kernel only "
                     "with Q quantized in the kernel: q's rows 16-byte aligned, positive strides, "
                     "no SAGE_OPTION_PREPASS_Q; pass AUTO or MMA");
  const bool sm90_ok = dev.cc == 90 && bits8 && !smooth_q && sm90_has_kernel_head_dim(Dk) &&
                       (!r.packed() || packed_sm90);
  if (a.kernel == SAGE_KERNEL_SM90 && !sm90_ok)
    return set_error(SAGE_ERROR_UNSUPPORTED,
                     "kernel = SM90: the wgmma kernel needs an sm_90 GPU (this is sm_%d%d), "
                     "qk_format INT8, no Q smoothing and a head_dim it takes (head_dim = %lld)",
                     dev.cc / 10, dev.cc % 10, static_cast<long long>(D));
  Plan plan;
  plan.family = sm90_ok && a.kernel != SAGE_KERNEL_MMA ? Family::kSm90 : Family::kMma;
  // The sm90 kernel quantizes Q itself (reading it once, through TMA, a tile ahead of its use)
  // when a TMA map can describe Q: rows 16-byte aligned, positive strides (the map's inner
  // extent is D and its box Dk: TMA fills the channels past D with zeros, so any D takes it);
  // SAGE_OPTION_PREPASS_Q keeps the pre-pass's quant_q (to compare the two).
  plan.fused_q = plan.family == Family::kSm90 && !(a.options & SAGE_OPTION_PREPASS_Q) && q_map;
  quant::SplitRegions split_regions;
  if (plan.family == Family::kSm90) {
    // A packed batch: two consumers (its instantiations, attn/sm90/launch.cuh; the emulation is
    // the same either way: the polynomial share depends on the head dim only).
    plan.consumers = r.packed() ? 2 : sm90_consumers(Dk, causal, p.seq_q, plan.fused_q);
    plan.block_q = 64 * plan.consumers;
    plan.block_k = sm90_block_k(Dk);
    // The split tail: dense non-causal calls (causal and packed ones draw their tiles from a
    // counter, which balances them already).
    if (!causal && !r.packed() && !(a.options & SAGE_OPTION_WHOLE_TILES)) {
      const int64_t tiles = p.batch * p.heads_q * ((p.seq_q + plan.block_q - 1) / plan.block_q);
      plan.split = sm90_split(tiles, (p.seq_kv + plan.block_k - 1) / plan.block_k, dev.sms);
      split_regions.flags = plan.split.tiles * plan.consumers;
      split_regions.part_bytes =
          size_t(plan.split.ctas * sm90::split_part_floats(Dk, plan.consumers)) * 4;
    }
  }
  plan.prepass = quant::make_prepass_plan(
      p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_kv, Dk, D, bits8 ? 8 : 4, smooth_q,
      c.smooth & SAGE_SMOOTH_K, c.smooth & SAGE_SMOOTH_V,
      ref::mean_token_stride(p.seq_kv, c.k_mean_tokens),  // as the emulation samples K's mean
      // K/V's pre-pass in one cluster launch where a cluster holds the head's chunks;
      // SAGE_OPTION_PREPASS_KV_SPLIT keeps the three launches (to compare the two). Not at
      // Dk = 256: a staged chunk (132 KB) exceeds what sm_89/sm_120 give a CTA, and with chunks
      // that large (one CTA an SM) the one launch measured slower than the three
      // (docs/sm90-kernel.md, Tried 41).
      (a.options & SAGE_OPTION_PREPASS_KV_SPLIT) || Dk > 128 ? 0 : dev.kv_cluster,
      /*quantize_q=*/!plan.fused_q, /*lse=*/a.lse != nullptr, c.k_mean_tokens,
      // A packed batch: p.seq_q, p.seq_kv are the longest sequences (the grids' extents), the
      // workspace rows come from the totals (quant/layout.h, SeqRows).
      r.cu_seqlens_q, r.cu_seqlens_k, r.total_q, r.total_k, split_regions);
  // The pre-pass's loads: 16 bytes wide where every row of the tensor is 16-byte aligned (the
  // kernels' kVec instantiations), with a packed batch's batch stride read as 0, as the backend
  // passes it.
  auto rows16 = [&](const void* base, sage_strides s) {
    if (r.packed()) s.batch = 0;
    return quant::rows_aligned16(base, s);
  };
  plan.prepass.vec_kv = rows16(a.k, r.k) && rows16(a.v, r.v);
  plan.prepass.vec_q = rows16(a.q, r.q);
  // The three launches' quantization staged and pipelined at Dk = 64 (where the device holds its
  // CTAs): a grid of the CTAs the SMs hold at once, fewer for a call with fewer blocks. At
  // Dk = 128 the staged grid measured no faster than a CTA per block (docs/sm90-kernel.md, Tried
  // 51); at 256 two stages (141 KB) would leave one CTA an SM, and it is not built there.
  // SAGE_OPTION_PREPASS_KV_BLOCKS keeps a CTA per block (to compare the two).
  if (!plan.prepass.kv_cluster && Dk == 64 && dev.staged_kv_ctas > 0 &&
      !(a.options & SAGE_OPTION_PREPASS_KV_BLOCKS)) {
    const int64_t blocks = plan.prepass.batch * plan.prepass.heads_kv * plan.prepass.k_blocks;
    plan.prepass.kv_grid = std::min(blocks, int64_t(dev.staged_kv_ctas) * dev.sms);
  }
  plan.launches = (plan.prepass.kv_cluster ? 1 : 3) + (plan.fused_q ? 0 : 1) + 1;
  // A padded head dim looks up its kernel's row: it does Dk's work while SDPA does D's, so Dk's
  // crossover is the least length from which it could win (not measured at the padded dims).
  // (No SDPA stands in for a packed batch: the table is for dense calls.)
  // (prefer_sdpa below, once the tile is known.)
  // The backward has no zero-padded head dims yet: a training call at a padded D gets its forward
  // here and must get its backward elsewhere (the SDPA drop-in asks this before taking one).
  plan.has_backward = gpu_backward_has_head_dim(D);

  // What the call computes, as the CPU emulation's config, at the caller's D. With D < Dk the
  // kernel computes exactly what it would at D: the pre-pass reads D channels and writes the rest
  // as zeros (zero K and V means, V scale 0), and a zero channel changes no quantization group's
  // max (|0 - 0| is below any), no integer Q·K dot product (exact), no mean, no ΔS, no LSE shift
  // (exact zero products), while P (its scores, maxima, sums, E4M3 rounding and the polynomial
  // 2^x positions: by key) and each output channel's P·V accumulation (the wgmma accumulator
  // aligns per output element) never read another channel; the channels past D are not stored.
  // What does depend on Dk is the kernel's tile (consumers, poly share): taken at Dk below.
  sage_quant_config e = c;
  e.granularity = SAGE_GRANULARITY_PER_THREAD_MMA;
  e.pv_format = SAGE_PV_FP8_E4M3;
  e.v_scale = SAGE_V_SCALE_PER_CHANNEL;
  e.pv_flush_interval = 1;
  e.accum_chunk = 32;  // keys of one k32 MMA step
  e.block_k = quant::kBlockK;
  if (plan.family == Family::kSm90) {
    // The wgmma E4M3 accumulator: each k32 step's products aligned to its largest addend and cut
    // to 13 bits after its leading one (docs/fp8-accumulator.md), over the whole sequence.
    e.pv_accum = SAGE_PV_ACCUM_ALIGNED;
    e.accum_mantissa_bits = 13;
    e.block_q = plan.block_q;
    e.warps = plan.block_q / 16;
    e.softmax_block_k = plan.block_k;
    e.exp2_poly_every = sm90_poly_every(Dk, plan.consumers);
    e.split_tiles = int32_t(plan.split.tiles);
    e.split_ctas = int32_t(plan.split.ctas);
    // At D = 256 the softmax block is the 64-key K block: the wgmma groups with the aligned
    // accumulator select the kernel's softmax form there (ref::sm90_softmax_form; the groups are
    // the mma ones at 16 rows a warp, so D = 64 and 128 keep PER_THREAD_MMA).
    if (Dk == 256) e.granularity = SAGE_GRANULARITY_PER_THREAD_WGMMA;
  } else {
    plan.block_q = mma::kBlockQ;
    plan.block_k = mma::kBlockK;
    // Two-level P·V accumulation guards an FP8 MMA accumulator narrower than fp32 (the paper's
    // FP22 on sm_89). sm_90's mma.sync one is a true fp32 (measured, docs/fp8-accumulator.md):
    // one level there.
    plan.two_level = dev.cc != 90;
    e.pv_accum = plan.two_level ? SAGE_PV_ACCUM_TWO_LEVEL : SAGE_PV_ACCUM_FP32;
    e.accum_mantissa_bits = 13;  // FP22 as the paper measured on Ada (not measured here)
    e.block_q = mma::kBlockQ;
    e.warps = mma::kWarps;
    e.softmax_block_k = 0;
    e.exp2_poly_every = 0;
  }
  plan.emulation = e;
  const CallShape shape{p.batch, p.heads_q, p.heads_kv, plan.block_q};
  plan.prefer_sdpa =
      !r.packed() && prefer_sdpa(dev, Dk, p.mask, p.seq_q, p.seq_kv, false, shape);
  plan.prefer_sdpa_training =
      !r.packed() && prefer_sdpa(dev, Dk, p.mask, p.seq_q, p.seq_kv, true, shape);
  plan.sdpa_below = sdpa_below(dev);
  *out = plan;
  return SAGE_OK;
}

namespace {

// TMA reads q, k, v and d_o in place: rows 16-byte aligned (quant::rows_aligned16, as for the
// forward's fused Q) and a positive stride for each dimension longer than one (a dimension of one
// takes any stride: the launcher gives it a placeholder).
bool tma_ready(const void* base, sage_strides st, int64_t heads, int64_t seq, int64_t batch) {
  if (batch == 1) st.batch = 0;
  if (heads == 1) st.head = 0;
  if (seq == 1) st.token = 0;
  return quant::rows_aligned16(base, st) && (batch == 1 || st.batch > 0) &&
         (heads == 1 || st.head > 0) && (seq == 1 || st.token > 0);
}

// The forward-normalized 16-bit backward: P from the forward's LSE, D from its O, every product
// in the input dtype (sm_90a's wgmma kernel, bwd/fn).
sage_status make_forward_normalized_plan(const ResolvedBackward& r, const sage_backward_args& a,
                                         const Device& dev, BackwardPlan* out) {
  const ref::Problem& p = r.problem;
  const sage_backward_config& c = r.config;
  if (dev.cc != 90 || a.kernel == SAGE_KERNEL_MMA)
    return set_error(SAGE_ERROR_UNSUPPORTED,
                     "config.normalizer = SAGE_BWD_NORM_FORWARD with 16-bit products runs on the "
                     "wgmma kernel of an sm_90 GPU (this is sm_%d%s)",
                     dev.cc, a.kernel == SAGE_KERNEL_MMA ? ", kernel = MMA" : "");
  if (c.smooth & SAGE_SMOOTH_Q)
    return set_error(SAGE_ERROR_UNSUPPORTED,
                     "config.smooth = 0x%x: the 16-bit forward-normalized backward on the GPU "
                     "takes no Q smoothing (nothing is quantized; the CPU reference runs it)",
                     unsigned(c.smooth));
  if (a.options & SAGE_BWD_OPTION_DETERMINISTIC)
    return set_error(SAGE_ERROR_UNSUPPORTED,
                     "options = SAGE_BWD_OPTION_DETERMINISTIC: the forward-normalized backward "
                     "sums dQ by bulk reductions in any order");
  const struct {
    const char* name;
    const void* base;
    const sage_strides& st;
    int64_t heads, seq;
  } reads[] = {{"q", a.q, r.q, p.heads_q, p.seq_q},
               {"d_o", a.d_o, r.d_o, p.heads_q, p.seq_q},
               {"k", a.k, r.k, p.heads_kv, p.seq_kv},
               {"v", a.v, r.v, p.heads_kv, p.seq_kv}};
  for (const auto& x : reads)
    if (!tma_ready(x.base, x.st, x.heads, x.seq, p.batch))
      return set_error(SAGE_ERROR_UNSUPPORTED,
                       "%s: the forward-normalized backward reads it by TMA, which needs a "
                       "16-byte aligned base and strides of 16-byte multiples (strides %lld, "
                       "%lld, %lld elements)",
                       x.name, static_cast<long long>(x.st.batch),
                       static_cast<long long>(x.st.head), static_cast<long long>(x.st.token));
  BackwardPlan plan;
  plan.family = Family::kSm90;
  plan.forward_normalized = true;
  plan.fn_layout = bwd::fn::make_layout(p);
  plan.launches = 3;  // rows, main kernel, dQ store
  *out = plan;
  return SAGE_OK;
}

}  // namespace

sage_status make_backward_plan(const ResolvedBackward& r, const sage_backward_args& a,
                               const Device& dev, BackwardPlan* out) {
  const ref::Problem& p = r.problem;
  // The kernels themselves need sm_80, but the library builds for sm_89 and newer only (its
  // forward pre-pass needs FP8 conversions): below that there is no kernel image to launch.
  if (dev.cc < 89)
    return set_error(SAGE_ERROR_UNSUPPORTED,
                     "the GPU is sm_%d; the backward, like the library, is built for sm_89 or "
                     "newer",
                     dev.cc);
  if (!gpu_backward_has_head_dim(p.head_dim))
    return set_error(SAGE_ERROR_UNSUPPORTED,
                     "head_dim = %lld has no GPU backward kernel (GPU backward kernels: %s; the "
                     "CPU reference takes 1..%lld)",
                     static_cast<long long>(p.head_dim), kGpuBackwardHeadDims,
                     static_cast<long long>(kMaxHeadDim));
  if (a.dtype == SAGE_DTYPE_FP32)
    return set_error(SAGE_ERROR_UNSUPPORTED, "dtype = FP32 runs on the CPU reference only");
  const sage_backward_config& c = r.config;
  if (c.normalizer == SAGE_BWD_NORM_FORWARD && c.int8 == 0u)
    return make_forward_normalized_plan(r, a, dev, out);
  sage_backward_config want = ref::backward_preset();
  want.smooth = r.config.smooth;  // either way: k_mean is zero without smoothing
  if (c.int8 != want.int8 || c.block_q != want.block_q || c.block_k != want.block_k ||
      c.granularity != want.granularity || c.channel_scales != want.channel_scales ||
      c.normalizer != want.normalizer)
    return set_error(SAGE_ERROR_UNSUPPORTED,
                     "config (int8 0x%x, block %d x %d, granularity %d, channel_scales 0x%x, "
                     "normalizer %u): the GPU backward runs the preset only (int8 0x%x, block %d "
                     "x %d, per token, no channel scales, its own normalizer); the CPU reference "
                     "runs any",
                     unsigned(c.int8), int(c.block_q), int(c.block_k), int(c.granularity),
                     unsigned(c.channel_scales), unsigned(c.normalizer), unsigned(want.int8),
                     int(want.block_q), int(want.block_k));
  if (a.kernel == SAGE_KERNEL_SM90 && dev.cc != 90)
    return set_error(SAGE_ERROR_UNSUPPORTED,
                     "kernel = SM90: the wgmma backward needs an sm_90 GPU (this is sm_%d)",
                     dev.cc);
  BackwardPlan plan;
  // sm_90 runs the wgmma main kernel unless the mma.sync one is asked for.
  plan.family = dev.cc == 90 && a.kernel != SAGE_KERNEL_MMA ? Family::kSm90 : Family::kMma;
  plan.layout = bwd::make_layout(p);
  // The pre-pass (K's and Q's channel sums, their means, K and V, Q and dO), the stats pass, the
  // verdict (which a refused call's main kernel and dQ store read to return at once), the main
  // kernel, the dQ store, the NaN of a refused call.
  plan.launches = 11;
  *out = plan;
  return SAGE_OK;
}

void describe(const Plan& plan, sage_plan_info* info) {
  *info = sage_plan_info{};
  info->struct_size = sizeof(sage_plan_info);
  info->backend = SAGE_BACKEND_CUDA;
  info->kernel = plan.family == Family::kSm90  ? SAGE_KERNEL_SM90
                 : plan.family == Family::kFp4 ? SAGE_KERNEL_FP4
                                               : SAGE_KERNEL_MMA;
  info->block_q = plan.block_q;
  info->block_k = plan.block_k;
  info->fused_q = plan.fused_q;
  info->launches = plan.launches;
  info->prefer_sdpa = plan.prefer_sdpa;
  info->prefer_sdpa_training = plan.prefer_sdpa_training;
  info->sdpa_below = plan.sdpa_below;
  info->workspace_size = plan.prepass.total;
  info->emulation = plan.emulation;
  info->kernel_head_dim = plan.prepass.head_dim;
  info->has_backward = plan.has_backward;
}

}  // namespace sage::api
