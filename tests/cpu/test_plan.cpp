// The planner (src/api/plan.h) on described devices, without a GPU: which kernel family and tile
// it picks, the pre-pass steps, the workspace, the crossover hint, the emulation config it
// reports, and its refusals (each naming the argument).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "api/backend.h"
#include "api/plan.h"
#include "common/error.h"
#include "common/test_util.h"
#include "ref/reference.h"

namespace {

using sage::api::Device;
using sage::api::Family;
using sage::api::Plan;

using sage::api::CallShape;
// kH100 as the backend queries an H100: 8-CTA clusters, four CTAs of the staged K/V quantization
// (D = 64) an SM.
constexpr Device kH100{0, 90, 132, 8, 5120, 4}, kAda{0, 89, 128}, kBlackwell{0, 120, 84}, kAmpere{0, 86, 84};

// Host buffers standing in for device tensors (the planner reads shapes, strides and pointer
// alignment only).
struct Call {
  std::vector<uint16_t> q, k, v, o;
  sage_attention_args a{};
  Call(int64_t nq, int64_t nk, int64_t d, sage_mask mask = SAGE_MASK_NONE,
       sage_variant variant = SAGE_VARIANT_SAGE2_8B)
      : q(size_t(2 * 4 * nq * d)), k(size_t(2 * 2 * nk * d)), v(k.size()), o(q.size()) {
    sage_attention_args_init(&a);
    a.q = q.data(), a.k = k.data(), a.v = v.data(), a.o = o.data();
    a.batch = 2, a.heads_q = 4, a.heads_kv = 2, a.seq_q = nq, a.seq_kv = nk, a.head_dim = d;
    a.mask = mask;
    a.variant = variant;
  }
  // Other head counts and batch (the buffers resized, zero again).
  Call& with_heads(int64_t hq, int64_t hkv, int64_t batch = 2) {
    q.assign(size_t(batch * hq * a.seq_q * a.head_dim), 0), o.assign(q.size(), 0);
    k.assign(size_t(batch * hkv * a.seq_kv * a.head_dim), 0), v.assign(k.size(), 0);
    a.q = q.data(), a.k = k.data(), a.v = v.data(), a.o = o.data();
    a.batch = batch, a.heads_q = hq, a.heads_kv = hkv;
    return *this;
  }
  sage_status plan(const Device& dev, Plan* p) const {
    // Validated as host pointers (the CPU backend, which refuses a forced kernel), then planned
    // as the CUDA backend would.
    sage::api::Resolved r;
    sage_attention_args host = a;
    host.kernel = SAGE_KERNEL_AUTO;
    const sage_status s = sage::api::validate(&host, &r);
    if (s != SAGE_OK) return s;
    return sage::api::make_plan(r, a, dev, p);
  }
};

Plan must_plan(const Call& c, const Device& dev) {
  Plan p;
  EXPECT_EQ(c.plan(dev, &p), SAGE_OK) << sage_last_error();
  return p;
}

TEST(Planner, ChoosesTheFamilyPerArchitectureAndVariant) {
  EXPECT_EQ(must_plan(Call(1000, 1000, 128), kH100).family, Family::kSm90);
  EXPECT_EQ(must_plan(Call(1000, 1000, 64), kH100).family, Family::kSm90);
  // 4-bit and Q smoothing stay on mma.sync; every other architecture runs mma.sync.
  EXPECT_EQ(must_plan(Call(1000, 1000, 128, SAGE_MASK_NONE, SAGE_VARIANT_SAGE2_4B), kH100).family,
            Family::kMma);
  EXPECT_EQ(must_plan(Call(1000, 1000, 128), kAda).family, Family::kMma);
  EXPECT_EQ(must_plan(Call(1000, 1000, 128), kBlackwell).family, Family::kMma);
  // args.kernel forces a family, or is refused naming the kernel.
  Call forced(1000, 1000, 128);
  forced.a.kernel = SAGE_KERNEL_MMA;
  EXPECT_EQ(must_plan(forced, kH100).family, Family::kMma);
  forced.a.kernel = SAGE_KERNEL_SM90;
  Plan p;
  EXPECT_EQ(forced.plan(kAda, &p), SAGE_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(sage_last_error()).find("kernel = SM90"), std::string::npos);
  Call forced4(1000, 1000, 128, SAGE_MASK_NONE, SAGE_VARIANT_SAGE2_4B);
  forced4.a.kernel = SAGE_KERNEL_SM90;
  EXPECT_EQ(forced4.plan(kH100, &p), SAGE_ERROR_UNSUPPORTED);
}

// The split tail (attn/sm90/split.h): a dense non-causal call whose last round of tiles would
// leave most SMs idle shares that round's key blocks among them where that saves at least 3 %
// of the critical path, and its emulation config says so; causal calls, exact rounds, a last
// round the split would not shorten enough, the mma.sync kernel and SAGE_OPTION_WHOLE_TILES keep
// whole tiles.
TEST(Planner, Sm90SplitTailSharesTheLastRoundWhereItShortensTheCall) {
  // 26 heads of 4608 tokens, D 128: 936 tiles on 132 SMs, the last 12 (36 key blocks each)
  // shared by 108 CTAs (4 blocks each: parts of at least 4).
  Call h26(4608, 4608, 128);
  h26.with_heads(26, 26, 1);
  const Plan f = must_plan(h26, kH100);
  EXPECT_EQ(f.split.tiles, 12);
  EXPECT_EQ(f.split.blocks, 36);
  EXPECT_EQ(f.split.ctas, 108);
  EXPECT_EQ(f.emulation.split_tiles, 12);
  EXPECT_EQ(f.emulation.split_ctas, 108);
  EXPECT_EQ(f.prepass.total - f.prepass.split_parts, size_t(108 * 2 * 128 * (64 + 4) * 4));
  EXPECT_EQ(f.prepass.counters, 2 + 12 * 2);
  // Fewer tiles than SMs (B 2, H 4, N 3000: 192 tiles, 60 in the last round).
  const Plan few = must_plan(Call(3000, 3000, 128), kH100);
  EXPECT_EQ(few.split.tiles, 60);
  EXPECT_EQ(few.split.ctas, 132);
  // SDXL's first level (B 2, H 10, N 4096, D 64): three consumers' 192-row tiles, 22 a head,
  // 440 in all; the last 44 of 32 key blocks shared.
  Call sdxl(4096, 4096, 64);
  sdxl.with_heads(10, 10);
  const Plan d64 = must_plan(sdxl, kH100);
  ASSERT_EQ(d64.consumers, 3);
  EXPECT_EQ(d64.split.tiles, 44);
  EXPECT_EQ(d64.split.ctas, 132);
  EXPECT_EQ(d64.prepass.counters, 2 + 44 * 3);
  EXPECT_EQ(d64.prepass.total - d64.prepass.split_parts, size_t(132 * 3 * 128 * (32 + 4) * 4));
  // 128 tiles on 132 SMs: a share (32 blocks of 4096 over 132) is no shorter than a tile.
  EXPECT_EQ(must_plan(Call(3000, 4096, 64), kH100).split.tiles, 0);
  auto none = [](const Plan& p) {
    return p.split.tiles == 0 && p.split.ctas == 0 && p.emulation.split_tiles == 0 &&
           p.emulation.split_ctas == 0 && p.prepass.counters == 2 &&
           p.prepass.split_parts == p.prepass.total;
  };
  Call causal(4608, 4608, 128, SAGE_MASK_CAUSAL_TOP_LEFT);
  causal.with_heads(24, 24, 1);
  EXPECT_TRUE(none(must_plan(causal, kH100)));
  Call whole(4608, 4608, 128);
  whole.with_heads(24, 24, 1);
  whole.a.options = SAGE_OPTION_WHOLE_TILES;
  EXPECT_TRUE(none(must_plan(whole, kH100)));
  Call exact(4096, 4096, 128);  // 32 tiles a head x 33 heads = 8 rounds of 132
  exact.with_heads(33, 33, 1);
  EXPECT_TRUE(none(must_plan(exact, kH100)));
  // Flux.1 at 1024² (24 heads of 4608): 6.5 rounds; the split saves 4 % (7 rounds of 40
  // blocks' time against 6 and a share of 20 with two units): the last 72 tiles over 132 CTAs.
  Call flux(4608, 4608, 128);
  flux.with_heads(24, 24, 1);
  const Plan fx = must_plan(flux, kH100);
  EXPECT_EQ(fx.split.tiles, 72);
  EXPECT_EQ(fx.split.ctas, 132);
  // 128 heads of 4k: 31 rounds and 4 tiles, 2 %; B 4 H 32 at 16k (D 64 and 128) and SD3.5's
  // joint call (B 2, H 38, N 4429, D 64) under 1 %.
  Call grid(4096, 4096, 128);
  grid.with_heads(64, 64);
  EXPECT_TRUE(none(must_plan(grid, kH100)));
  for (const int d : {64, 128}) {
    Call longer(16384, 16384, d);
    longer.with_heads(32, 32, 4);
    EXPECT_TRUE(none(must_plan(longer, kH100))) << "D " << d;
  }
  Call sd35(4429, 4429, 64);
  sd35.with_heads(38, 38);
  EXPECT_TRUE(none(must_plan(sd35, kH100)));
  // 64 tiles of 8 blocks: a share of 4 blocks and two units' set-up cost a whole tile's time.
  EXPECT_TRUE(none(must_plan(Call(1000, 1000, 128), kH100)));
  EXPECT_TRUE(none(must_plan(Call(4608, 4608, 128), kAda)));  // mma.sync
}

TEST(Planner, Sm90TileAndFusedQ) {
  const Plan d128 = must_plan(Call(3000, 3000, 128), kH100);
  EXPECT_EQ(d128.consumers, 2);
  EXPECT_EQ(d128.block_q, 128);
  EXPECT_EQ(d128.block_k, 128);
  EXPECT_TRUE(d128.fused_q);
  EXPECT_FALSE(d128.prepass.quantize_q);
  // D = 64: three consumer warpgroups with fused Q, except causal up to 4096 query rows.
  EXPECT_EQ(must_plan(Call(3000, 3000, 64), kH100).consumers, 3);
  EXPECT_EQ(must_plan(Call(4097, 4097, 64, SAGE_MASK_CAUSAL_TOP_LEFT), kH100).consumers, 3);
  EXPECT_EQ(must_plan(Call(4096, 4096, 64, SAGE_MASK_CAUSAL_TOP_LEFT), kH100).consumers, 2);
  EXPECT_EQ(must_plan(Call(1500, 3000, 64, SAGE_MASK_CAUSAL_TOP_LEFT), kH100).consumers, 2);
  // Pre-pass Q (the option, or a Q a TMA map cannot describe): two consumers, quant_q runs.
  Call pre(3000, 3000, 64);
  pre.a.options = SAGE_OPTION_PREPASS_Q;
  const Plan pq = must_plan(pre, kH100);
  EXPECT_FALSE(pq.fused_q);
  EXPECT_TRUE(pq.prepass.quantize_q);
  EXPECT_EQ(pq.consumers, 2);
  EXPECT_EQ(pq.launches, d128.launches + 1);
  Call odd(3000, 3000, 64);
  odd.a.q = odd.q.data() + 1;  // rows 2-byte aligned only
  EXPECT_FALSE(must_plan(odd, kH100).fused_q);
  // The workspace holds Q^, its scales and the rows' LSE shifts (B·Hq·(nq·(D + 2) + 4·Nq) bytes)
  // only where the pre-pass quantizes Q (without the LSE): a caller caching the size per shape
  // keys it on Q's 16-byte alignment too.
  // (Compared up to the counters, the split tail's flags and parts: two and three consumers'
  // tiles split differently.)
  const size_t q_bytes = 2 * 4 * (3072 * (64 + 2) + 4 * 3000);
  EXPECT_EQ(pq.prepass.tile_counter,
            must_plan(Call(3000, 3000, 64), kH100).prepass.tile_counter + q_bytes);
  EXPECT_EQ(must_plan(odd, kH100).prepass.total, pq.prepass.total);
}

// K/V's pre-pass runs as one cluster launch where a cluster holds every 128-token chunk of a head
// (8 on the H100: N <= 1024), else (and with SAGE_OPTION_PREPASS_KV_SPLIT, or without clusters)
// as three launches; the workspace is the same either way.
TEST(Planner, KvPrepassOneLaunchWhereAClusterHoldsTheHead) {
  for (const int64_t nk : {1, 127, 128, 129, 1000, 1024}) {
    const Plan p = must_plan(Call(700, nk, 128), kH100);
    EXPECT_EQ(p.prepass.kv_cluster, (nk + 127) / 128) << nk;
    Call split(700, nk, 128);
    split.a.options = SAGE_OPTION_PREPASS_KV_SPLIT;
    const Plan s = must_plan(split, kH100);
    EXPECT_EQ(s.prepass.kv_cluster, 0) << nk;
    EXPECT_EQ(s.launches, p.launches + 2) << nk;
    EXPECT_EQ(s.prepass.total, p.prepass.total) << nk;
  }
  EXPECT_EQ(must_plan(Call(700, 1025, 128), kH100).prepass.kv_cluster, 0);
  EXPECT_EQ(must_plan(Call(700, 2048, 64), kH100).prepass.kv_cluster, 0);
  EXPECT_EQ(must_plan(Call(700, 1000, 128), kAda).prepass.kv_cluster, 0);
  EXPECT_EQ(must_plan(Call(700, 1000, 128), kAda).launches, 5);  // 3 K/V, quant_q, attention
}

// The three launches' K/V quantization runs on the staged grid at D = 64 where the device holds
// its CTAs: the CTAs all SMs hold at once, or one per 64-key block where the call has fewer; a
// CTA per block with SAGE_OPTION_PREPASS_KV_BLOCKS, at D = 128 and 256, on the cluster path and
// on a device that reports none. The workspace and the launch count are the same either way.
TEST(Planner, StagedKvQuantizationGridFromTheDevice) {
  struct Row {
    int64_t nk, d, batch, hkv;
  };
  for (const Row r : {Row{4608, 128, 1, 24}, Row{4096, 64, 2, 10}, Row{1025, 64, 1, 1},
                      Row{2048, 64, 4, 32}, Row{33000, 64, 1, 1}, Row{2000, 256, 1, 2}}) {
    Call c(700, r.nk, r.d);
    c.with_heads(r.hkv, r.hkv, r.batch);
    const Plan p = must_plan(c, kH100);
    const int64_t blocks = r.batch * r.hkv * ((r.nk + 63) / 64);
    const int64_t resident = int64_t(kH100.staged_kv_ctas) * kH100.sms;
    EXPECT_EQ(p.prepass.kv_cluster, 0) << r.nk;
    EXPECT_EQ(p.prepass.kv_grid, r.d == 64 ? std::min(blocks, resident) : 0) << r.nk << " " << r.d;
    Call b = c;
    b.a.options = SAGE_OPTION_PREPASS_KV_BLOCKS;
    const Plan pb = must_plan(b, kH100);
    EXPECT_EQ(pb.prepass.kv_grid, 0) << r.nk;
    EXPECT_EQ(pb.prepass.total, p.prepass.total) << r.nk;
    EXPECT_EQ(pb.launches, p.launches) << r.nk;
  }
  EXPECT_EQ(must_plan(Call(700, 1000, 64), kH100).prepass.kv_grid, 0);  // one cluster launch
  EXPECT_EQ(must_plan(Call(700, 4096, 64), kAda).prepass.kv_grid, 0);
  Call split(700, 1000, 64);
  split.a.options = SAGE_OPTION_PREPASS_KV_SPLIT;
  EXPECT_EQ(must_plan(split, kH100).prepass.kv_grid, 2 * 2 * 16);  // fewer blocks than the grid
}

// The pre-pass's loads are 16 bytes wide (its kVec instantiations) where every row of the tensor
// starts 16-byte aligned, else 2 bytes: the plan decides, from the call's pointers and strides, for
// K and V together and for Q; the workspace is the same either way.
TEST(Planner, PrepassLoadWidthFromRowAlignment) {
  for (const Device& dev : {kH100, kAda}) {
    const Plan aligned = must_plan(Call(700, 900, 128), dev);
    EXPECT_TRUE(aligned.prepass.vec_kv);
    EXPECT_TRUE(aligned.prepass.vec_q);
    Call k_odd(700, 900, 128);
    k_odd.a.k = k_odd.k.data() + 1;  // K's rows 2-byte aligned only: K and V both narrow
    const Plan pk = must_plan(k_odd, dev);
    EXPECT_FALSE(pk.prepass.vec_kv);
    EXPECT_TRUE(pk.prepass.vec_q);
    EXPECT_EQ(pk.prepass.total, aligned.prepass.total);
    Call v_odd(700, 900, 128);
    v_odd.a.v = v_odd.v.data() + 4;  // 8 bytes
    EXPECT_FALSE(must_plan(v_odd, dev).prepass.vec_kv);
    Call v_16(700, 900, 128);
    v_16.a.v = v_16.v.data() + 8;  // 16 bytes: still aligned
    EXPECT_TRUE(must_plan(v_16, dev).prepass.vec_kv);
    Call q_odd(700, 900, 128);
    q_odd.a.q = q_odd.q.data() + 1;
    const Plan pq = must_plan(q_odd, dev);
    EXPECT_TRUE(pq.prepass.vec_kv);
    EXPECT_FALSE(pq.prepass.vec_q);
  }
}

TEST(Planner, EmulationConfigIsWhatRuns) {
  // D = 256: 64-key blocks, each its own softmax block, the wgmma groups with the aligned
  // accumulator selecting the kernel's softmax form; no polynomial.
  for (const sage_mask mask : {SAGE_MASK_NONE, SAGE_MASK_CAUSAL_BOTTOM_RIGHT}) {
    const Plan p = must_plan(Call(2500, 2000, 256, mask), kH100);
    EXPECT_EQ(p.family, Family::kSm90);
    EXPECT_EQ(p.consumers, 2);
    EXPECT_EQ(p.block_q, 128);
    EXPECT_EQ(p.block_k, 64);
    const sage_quant_config& e = p.emulation;
    EXPECT_EQ(sage::ref::quant_config_error(e), "");
    EXPECT_TRUE(sage::ref::sm90_softmax_form(e));
    EXPECT_EQ(e.granularity, SAGE_GRANULARITY_PER_THREAD_WGMMA);
    EXPECT_EQ(e.pv_accum, SAGE_PV_ACCUM_ALIGNED);
    EXPECT_EQ(e.accum_mantissa_bits, 13);
    EXPECT_EQ(e.accum_chunk, 32);
    EXPECT_EQ(e.block_q, 128);
    EXPECT_EQ(e.warps, 8);
    EXPECT_EQ(e.block_k, 64);
    EXPECT_EQ(e.softmax_block_k, 64);
    EXPECT_EQ(e.exp2_poly_every, 0);
    EXPECT_EQ(e.qk_format, SAGE_QK_INT8);
  }
  for (const int64_t d : {64, 128}) {
    for (const sage_mask mask : {SAGE_MASK_NONE, SAGE_MASK_CAUSAL_BOTTOM_RIGHT}) {
      const Plan p = must_plan(Call(2500, 2000, d, mask), kH100);
      const sage_quant_config& e = p.emulation;
      EXPECT_EQ(sage::ref::quant_config_error(e), "");
      EXPECT_EQ(e.pv_accum, SAGE_PV_ACCUM_ALIGNED);
      EXPECT_EQ(e.accum_mantissa_bits, 13);
      EXPECT_EQ(e.accum_chunk, 32);
      EXPECT_EQ(e.block_q, p.block_q);
      EXPECT_EQ(e.warps * 16, p.block_q);
      EXPECT_EQ(e.block_k, 64);
      EXPECT_EQ(e.softmax_block_k, 128);
      EXPECT_EQ(e.exp2_poly_every, d == 128 ? 32 : 0);
      EXPECT_EQ(e.granularity, SAGE_GRANULARITY_PER_THREAD_MMA);
      EXPECT_EQ(e.qk_format, SAGE_QK_INT8);
      EXPECT_EQ(e.smooth, unsigned(SAGE_SMOOTH_K | SAGE_SMOOTH_V));
    }
  }
  // mma.sync: fp32 accumulation on sm_90 (measured), two-level over FP22 elsewhere.
  const Plan mma90 = must_plan(Call(1000, 1000, 128, SAGE_MASK_NONE, SAGE_VARIANT_SAGE2_4B), kH100);
  EXPECT_EQ(mma90.emulation.pv_accum, SAGE_PV_ACCUM_FP32);
  EXPECT_FALSE(mma90.two_level);
  EXPECT_EQ(mma90.emulation.qk_format, SAGE_QK_INT4);
  const Plan mma89 = must_plan(Call(1000, 1000, 128), kAda);
  EXPECT_EQ(mma89.emulation.pv_accum, SAGE_PV_ACCUM_TWO_LEVEL);
  EXPECT_TRUE(mma89.two_level);
  EXPECT_EQ(mma89.emulation.softmax_block_k, 0);
  EXPECT_EQ(sage::ref::quant_config_error(mma89.emulation), "");
}

// Head dims that are multiples of 8 from 8 to 256 run at the native 64, 128 or 256 (zero
// channels past head_dim): the kernel head dim, the family, the tile and the emulation config are
// the native head dim's, the workspace too (its layout is the kernel's); the pre-pass reads the
// caller's channels. Kernel head dim 256 runs the sm90 kernel on sm_90 (64-key blocks), the
// mma.sync kernel elsewhere. Every other head dim is refused naming it and the supported set.
TEST(Planner, PaddedHeadDimsRunAtTheNativeOne) {
  for (const int64_t d : {8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 112, 120, 128, 136, 144,
                          152, 160, 192, 200, 224, 240, 248, 256}) {
    SCOPED_TRACE("D = " + std::to_string(d));
    const int64_t dk = d <= 64 ? 64 : d <= 128 ? 128 : 256;
    const bool sm90_dk = true;  // every kernel head dim has an sm90 instantiation
    EXPECT_EQ(sage::api::gpu_kernel_head_dim(d), dk);
    for (const sage_mask mask : {SAGE_MASK_NONE, SAGE_MASK_CAUSAL_BOTTOM_RIGHT}) {
      for (const Device& dev : {kH100, kAda, kBlackwell}) {
        const Plan p = must_plan(Call(3000, 2500, d, mask), dev);
        const Plan native = must_plan(Call(3000, 2500, dk, mask), dev);
        EXPECT_EQ(p.prepass.head_dim, dk);
        EXPECT_EQ(p.prepass.channels, d);
        EXPECT_EQ(p.family, dev.cc == 90 && sm90_dk ? Family::kSm90 : Family::kMma);
        EXPECT_EQ(p.family, native.family);
        // TMA reads the D channels, zero-fills up to Dk
        EXPECT_EQ(p.fused_q, dev.cc == 90 && sm90_dk);
        // The one-launch K/V pre-pass stages a whole 128-token chunk: not at Dk = 256.
        const Plan short_kv = must_plan(Call(1000, 1000, d, mask), dev);
        EXPECT_EQ(short_kv.prepass.kv_cluster, dev.cc == 90 && dk <= 128 ? 8 : 0);
        EXPECT_EQ(p.consumers, native.consumers);
        EXPECT_EQ(p.block_q, native.block_q);
        EXPECT_EQ(p.launches, native.launches);
        EXPECT_EQ(p.prefer_sdpa, native.prefer_sdpa);
        // The backward has no padded head dims yet, and no D = 256.
        EXPECT_EQ(p.has_backward, d == dk && dk <= 128);
        EXPECT_EQ(native.has_backward, dk <= 128);
        EXPECT_EQ(p.prepass.total, native.prepass.total);
        EXPECT_EQ(p.prepass.row_bytes, native.prepass.row_bytes);
        // The emulation at the caller's D computes what the kernel at Dk does (plan.cpp says
        // why): the same config as the native head dim's.
        EXPECT_EQ(std::memcmp(&p.emulation, &native.emulation, sizeof(sage_quant_config)), 0);
        EXPECT_EQ(sage::ref::quant_config_error(p.emulation), "");
        sage_plan_info info{};
        sage::api::describe(p, &info);
        EXPECT_EQ(info.kernel_head_dim, dk);
        EXPECT_EQ(info.has_backward, d == dk && dk <= 128 ? 1 : 0);
      }
    }
    // Either family may be forced at every kernel head dim (tests and benchmarks compare them).
    {
      Call forced(1000, 1000, d);
      forced.a.kernel = SAGE_KERNEL_SM90;
      EXPECT_EQ(must_plan(forced, kH100).family, Family::kSm90);
      forced.a.kernel = SAGE_KERNEL_MMA;
      EXPECT_EQ(must_plan(forced, kH100).family, Family::kMma);
      // Q smoothing has no sm90 form: forcing it is refused, naming what it needs.
      Call smooth(1000, 1000, d, SAGE_MASK_NONE, SAGE_VARIANT_SAGE2_4B);
      smooth.a.kernel = SAGE_KERNEL_SM90;
      Plan p;
      EXPECT_EQ(smooth.plan(kH100, &p), SAGE_ERROR_UNSUPPORTED);
      const std::string msg = sage_last_error();
      EXPECT_NE(msg.find("head_dim = " + std::to_string(d)), std::string::npos) << msg;
    }
    // 4-bit (mma.sync on the H100 too) and Q smoothing pad the same way.
    const Plan p4 = must_plan(Call(1000, 1000, d, SAGE_MASK_NONE, SAGE_VARIANT_SAGE2_4B), kH100);
    EXPECT_EQ(p4.family, Family::kMma);
    EXPECT_EQ(p4.prepass.head_dim, dk);
    EXPECT_EQ(p4.prepass.row_bytes, dk / 2);
    // A Q that a TMA map cannot describe (rows 2-byte aligned) takes the pre-pass's Q.
    Call odd(3000, 3000, d);
    odd.a.q = odd.q.data() + 1;
    const Plan po = must_plan(odd, kH100);
    EXPECT_FALSE(po.fused_q);
    EXPECT_TRUE(po.prepass.quantize_q);
  }
  // The crossover of a padded head dim is its kernel's model (cuDNN pads too: D 72-96 measured
  // what D 128 costs), from D = 8 up to 256.
  for (const int64_t n : {1024, 4096, 8192, 16384})
    for (const sage_mask mask : {SAGE_MASK_NONE, SAGE_MASK_CAUSAL_TOP_LEFT})
      for (const auto& [d, dk] : {std::pair<int64_t, int64_t>{8, 64}, {40, 64}, {72, 128},
                                  {96, 128}, {160, 256}, {200, 256}}) {
        Call padded(n, n, d, mask), native(n, n, dk, mask);
        EXPECT_EQ(must_plan(padded.with_heads(32, 32), kH100).prefer_sdpa,
                  must_plan(native.with_heads(32, 32), kH100).prefer_sdpa)
            << "D " << d << " N " << n;
      }
  // Not a multiple of 8: refused on every GPU, naming head_dim and the set.
  Plan p;
  // The FP4 kernel has no padded head dims and no D = 256: refused, never run at its template
  // head dim.
  for (const int64_t d : {8, 32, 40, 48, 72, 80, 96, 112, 136, 144, 192, 200, 256}) {
    for (const Device& dev : {kH100, kBlackwell}) {
      EXPECT_EQ(Call(100, 100, d, SAGE_MASK_NONE, SAGE_VARIANT_SAGE3_FP4).plan(dev, &p),
                SAGE_ERROR_UNSUPPORTED)
          << d;
      const std::string msg = sage_last_error();
      EXPECT_NE(msg.find("head_dim = " + std::to_string(d) + ": the FP4 kernel"),
                std::string::npos)
          << msg;
    }
    if (d > 128) continue;
    EXPECT_EQ(must_plan(Call(100, 100, d <= 64 ? 64 : 128, SAGE_MASK_NONE,
                             SAGE_VARIANT_SAGE3_FP4),
                        kBlackwell)
                  .family,
              Family::kFp4);
  }
  for (const int64_t d : {1, 2, 4, 7, 12, 20, 36, 44, 76, 100, 132, 196, 250, 252, 255}) {
    EXPECT_EQ(sage::api::gpu_kernel_head_dim(d), 0) << d;
    for (const Device& dev : {kH100, kAda, kBlackwell}) {
      EXPECT_EQ(Call(100, 100, d).plan(dev, &p), SAGE_ERROR_UNSUPPORTED) << d;
      const std::string msg = sage_last_error();
      EXPECT_NE(msg.find("head_dim = " + std::to_string(d)), std::string::npos) << msg;
      EXPECT_NE(msg.find("multiples of 8 from 8 to 256"), std::string::npos) << msg;
      EXPECT_NE(msg.find("CPU reference"), std::string::npos) << msg;
    }
  }
}

// Why the plan's emulation at the caller's D is what the padded kernel computes: the kernel at Dk
// is held to the emulation at Dk (the native GPU sweep), and the emulation at Dk of inputs whose
// channels past D are zero is the emulation at D, bit for bit (the D channels of O and the LSE):
// for each config a padded call reports (sm90 8-bit, mma.sync two-level and fp32, 4-bit with Q
// smoothing), both masks, channel-biased inputs (smoothing at work), GQA, N not multiples of the
// blocks.
TEST(Planner, PaddedEmulationIsTheNativeOneOnZeroChannels) {
  std::mt19937_64 rng(sage::test::fresh_seed());
  const int64_t B = 1, Hq = 4, Hkv = 2, Nq = 300, Nk = 333;
  for (const int64_t d : {8, 32, 40, 48, 72, 80, 112, 136, 144, 200, 240, 248}) {
    const int64_t dk = d <= 64 ? 64 : d <= 128 ? 128 : 256;
    const sage::test::Fp16Tensor q = sage::test::random_tensor(rng, B, Hq, Nq, d, 2.0f);
    const sage::test::Fp16Tensor k = sage::test::random_tensor(rng, B, Hkv, Nk, d, 4.0f);
    const sage::test::Fp16Tensor v = sage::test::random_tensor(rng, B, Hkv, Nk, d, 4.0f);
    // The same tensors with dk channels, those past d zero.
    auto padded = [&](const sage::test::Fp16Tensor& x, int64_t H, int64_t N) {
      sage::test::Fp16Tensor y;
      y.strides = sage::ref::contiguous_strides(SAGE_LAYOUT_HND, H, N, dk);
      y.data.assign(size_t(B * H * N * dk), 0);
      for (int64_t r = 0; r < B * H * N; ++r)
        std::copy_n(&x.data[size_t(r * d)], d, &y.data[size_t(r * dk)]);
      return y;
    };
    const sage::test::Fp16Tensor qp = padded(q, Hq, Nq), kp = padded(k, Hkv, Nk),
                                 vp = padded(v, Hkv, Nk);
    for (const sage_mask mask : {SAGE_MASK_NONE, SAGE_MASK_CAUSAL_BOTTOM_RIGHT}) {
      const std::pair<Device, sage_variant> calls[] = {{kH100, SAGE_VARIANT_SAGE2_8B},
                                                       {kAda, SAGE_VARIANT_SAGE2_8B},
                                                       {kH100, SAGE_VARIANT_SAGE2_4B}};
      for (const auto& [dev, variant] : calls) {
        SCOPED_TRACE("D " + std::to_string(d) + " mask " + std::to_string(int(mask)) + " sm_" +
                     std::to_string(dev.cc) + " variant " + std::to_string(int(variant)));
        const sage_quant_config cfg = must_plan(Call(Nq, Nk, d, mask, variant), dev).emulation;
        const double scale = 1.0 / std::sqrt(double(d));
        const sage::ref::Problem at_d{B, Hq, Hkv, Nq, Nk, d, scale, mask};
        const sage::ref::Problem at_dk{B, Hq, Hkv, Nq, Nk, dk, scale, mask};
        std::vector<float> o(size_t(B * Hq * Nq * d)), lse(size_t(B * Hq * Nq));
        std::vector<float> op(size_t(B * Hq * Nq * dk)), lsep(lse.size());
        sage::ref::attention_quant(at_d, cfg, q.view(), k.view(), v.view(), o.data(), lse.data());
        sage::ref::attention_quant(at_dk, cfg, qp.view(), kp.view(), vp.view(), op.data(),
                                   lsep.data());
        size_t differ = 0;
        for (int64_t r = 0; r < B * Hq * Nq; ++r)
          differ += std::memcmp(&o[size_t(r * d)], &op[size_t(r * dk)], size_t(d) * 4) != 0;
        EXPECT_EQ(differ, 0u) << "rows of O that differ";
        EXPECT_EQ(std::memcmp(lse.data(), lsep.data(), lse.size() * 4), 0) << "LSE differs";
      }
    }
  }
}

// ---- The workspace: the documented formula (docs/c-api.md) -----------------------------------
// A call's extra device memory is its output plus the workspace; the workspace is the quantized K
// and V with their scales and means, the quantized Q with its scales only where the pre-pass
// quantizes Q, Q's block means only with Q smoothing, 4 bytes a query row only with the LSE, and
// nothing proportional to Nq·Nk. The formula below is docs/c-api.md's ("Device memory"), written
// out independently of the planner's layout code.
struct Shape {
  int64_t B, Hq, Hkv, Nq, Nk, D;
};

size_t up256(int64_t bytes) {
  return size_t((bytes + 255) / 256 * 256);
}

// split: the plan's split tail (sage_plan_info.emulation's split_tiles s and split_ctas S) and its
// consumer warpgroups c.
size_t documented_workspace(const Shape& s, int bits, bool prepass_q, bool smooth_q, bool lse,
                            const sage::sm90::SplitTail& split = {}, int consumers = 2) {
  const int64_t nq = (s.Nq + 127) / 128 * 128, nk = (s.Nk + 63) / 64 * 64, r = s.D * bits / 8;
  const int64_t bq = s.B * s.Hq, bk = s.B * s.Hkv;
  size_t w = up256(bk * nk * r)          // K^
             + up256(bk * nk / 4)        // K scales: 4 floats a 64-key block
             + up256(bk * s.D * nk)      // V^ᵀ (E4M3)
             + 6 * up256(4 * bk * s.D)   // K mean, V mean, V scale, 1 / V scale, V's bound, max
             + up256(4 * (2 + split.tiles * consumers))  // the sm90 tile counters, split flags
             + up256(8 * bk)             // each KV head's first non-finite key
             + up256(4 * bk)             // each KV head's mark: V past its bound
             + up256(split.ctas * consumers * 512 * (s.D / 2 + 4));  // the split tail's parts
  if (prepass_q) w += up256(bq * nq * r) + up256(2 * bq * nq);  // Q^, 64 scales a 128-row block
  if (smooth_q) w += up256(4 * bq * (nq / 128) * s.D);          // Q's block means
  if (prepass_q || lse) w += up256(4 * bq * s.Nq);              // each row's LSE shift
  return w;
}

// The args of a call on distinct fake addresses (the planner reads shapes, strides and pointer
// alignment only; validation touches no tensor memory), planned for `dev`.
Plan plan_of(const Shape& s, const Device& dev, sage_variant variant, bool lse,
             unsigned smooth = 0, uint32_t options = 0, sage_kernel kernel = SAGE_KERNEL_AUTO) {
  sage_attention_args a;
  sage_attention_args_init(&a);
  auto at = [](uintptr_t i) { return reinterpret_cast<void*>(i << 40); };  // 1 TiB apart
  a.q = at(1), a.k = at(2), a.v = at(3), a.o = at(4);
  a.lse = lse ? static_cast<float*>(at(5)) : nullptr;
  a.batch = s.B, a.heads_q = s.Hq, a.heads_kv = s.Hkv, a.seq_q = s.Nq, a.seq_kv = s.Nk;
  a.head_dim = s.D;
  a.variant = variant;
  if (smooth) {
    a.variant = SAGE_VARIANT_CUSTOM;
    sage_quant_config_init(&a.quant, variant);
    a.quant.smooth = smooth;
  }
  a.options = options;
  sage::api::Resolved r;
  EXPECT_EQ(sage::api::validate(&a, &r), SAGE_OK) << sage_last_error();
  a.kernel = kernel;
  Plan p;
  EXPECT_EQ(sage::api::make_plan(r, a, dev, &p), SAGE_OK) << sage_last_error();
  return p;
}

TEST(Workspace, OutputPlusKvAndScalesAt32k) {
  // B=1, H=32, N=32k, D=128, 8-bit on the H100 (the wgmma kernel, Q quantized in the kernel), no
  // LSE: K^ and V^ (128 MiB each), K's scales (256 KiB), the six per-channel vectors (16 KiB
  // each), the tile counters, the heads' first non-finite keys and marks (256 bytes each); with the
  // output (256 MiB), 512.3 MiB in all. (8192 tiles on 132 SMs: 62 rounds and 8 tiles, which a
  // split tail would shorten by well under 1 %: whole tiles, no parts in the workspace.)
  const Shape s{1, 32, 32, 32768, 32768, 128};
  constexpr size_t kMiB = size_t(1) << 20;
  const Plan p = plan_of(s, kH100, SAGE_VARIANT_SAGE2_8B, /*lse=*/false);
  ASSERT_EQ(p.family, Family::kSm90);
  ASSERT_TRUE(p.fused_q);
  EXPECT_EQ(p.split.tiles, 0);
  const size_t output = size_t(s.B * s.Hq * s.Nq * s.D) * 2;
  EXPECT_EQ(p.prepass.total, 256 * kMiB + 256 * 1024 + 6 * 16 * 1024 + 3 * 256);
  EXPECT_EQ(p.prepass.total, documented_workspace(s, 8, false, false, false, p.split));
  EXPECT_LE(output + p.prepass.total, 512 * kMiB + kMiB / 2);
  // With the LSE: 4 bytes a query row more (4 MiB), as the LSE itself.
  EXPECT_EQ(plan_of(s, kH100, SAGE_VARIANT_SAGE2_8B, true).prepass.total,
            p.prepass.total + 4 * kMiB);
  // Q smoothing (the mma kernel: Q^ by the pre-pass) adds Q^, its scales, its block means and the
  // rows' LSE shifts (they carry the rows' poison there), never the Nq·Nk/32 bytes (1 GiB here) a
  // stored ΔS would take.
  const Plan sq = plan_of(s, kH100, SAGE_VARIANT_SAGE2_8B, false,
                          SAGE_SMOOTH_Q | SAGE_SMOOTH_K | SAGE_SMOOTH_V);
  ASSERT_EQ(sq.family, Family::kMma);
  EXPECT_EQ(sq.prepass.total, p.prepass.total + 128 * kMiB + 2 * kMiB + 4 * kMiB + 4 * kMiB);
  // INT4 halves K^ and Q^.
  const Plan q4 = plan_of(s, kH100, SAGE_VARIANT_SAGE2_4B, false);
  EXPECT_EQ(q4.prepass.total, sq.prepass.total - 2 * 64 * kMiB);
}

TEST(Workspace, MatchesTheDocumentedFormulaOverShapesAndConfigs) {
  const Shape shapes[] = {{1, 2, 2, 1, 1, 128},      {1, 2, 2, 17, 17, 64},
                          {2, 8, 2, 1000, 3000, 64}, {1, 4, 1, 1, 4097, 128},
                          {3, 6, 3, 129, 65, 64},    {2, 4, 4, 5000, 300, 128},
                          {1, 4, 2, 700, 1024, 128}, {1, 4, 2, 700, 1025, 64}};
  constexpr unsigned kSmoothAll = SAGE_SMOOTH_Q | SAGE_SMOOTH_K | SAGE_SMOOTH_V;
  for (const Shape& s : shapes) {
    for (const bool lse : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "B " << s.B << " Hq " << s.Hq << " Hkv " << s.Hkv
                                        << " Nq " << s.Nq << " Nk " << s.Nk << " D " << s.D
                                        << " lse " << lse);
      struct Config {
        const char* name;
        Plan plan;
        int bits;
        bool prepass_q, smooth_q;
      };
      const Config configs[] = {
          {"8b, H100 (wgmma, fused Q)", plan_of(s, kH100, SAGE_VARIANT_SAGE2_8B, lse), 8, false,
           false},
          {"8b, H100, pre-pass Q",
           plan_of(s, kH100, SAGE_VARIANT_SAGE2_8B, lse, 0, SAGE_OPTION_PREPASS_Q), 8, true,
           false},
          {"8b, H100, K/V in three launches",
           plan_of(s, kH100, SAGE_VARIANT_SAGE2_8B, lse, 0, SAGE_OPTION_PREPASS_KV_SPLIT), 8,
           false, false},
          {"8b, H100, mma forced",
           plan_of(s, kH100, SAGE_VARIANT_SAGE2_8B, lse, 0, 0, SAGE_KERNEL_MMA), 8, true, false},
          {"8b, Ada (mma)", plan_of(s, kAda, SAGE_VARIANT_SAGE2_8B, lse), 8, true, false},
          {"8b + Q smoothing, H100 (mma)",
           plan_of(s, kH100, SAGE_VARIANT_SAGE2_8B, lse, kSmoothAll), 8, true, true},
          {"4b, H100 (mma)", plan_of(s, kH100, SAGE_VARIANT_SAGE2_4B, lse), 4, true, true},
          {"4b without Q smoothing, Blackwell",
           plan_of(s, kBlackwell, SAGE_VARIANT_SAGE2_4B, lse, SAGE_SMOOTH_K), 4, true, false},
      };
      for (const Config& c : configs) {
        SCOPED_TRACE(c.name);
        const sage::quant::PrepassPlan& w = c.plan.prepass;
        EXPECT_EQ(w.quantize_q, c.prepass_q);
        EXPECT_EQ(w.total, documented_workspace(s, c.bits, c.prepass_q, c.smooth_q, lse,
                                                c.plan.split, c.plan.consumers));
        sage_plan_info info;
        sage::api::describe(c.plan, &info);
        EXPECT_EQ(info.workspace_size, w.total);
        // The K/V statistics of every head fit at the start of its own Vᵀ rows.
        EXPECT_EQ(w.kv_stats, w.v);
        EXPECT_EQ(w.kv_stats_stride, s.D * w.nk_pad);
        EXPECT_LE(w.stat_chunks * s.D * sage::quant::kKvStatBytes, w.kv_stats_stride);
      }
    }
  }
}

// Every point measured behind the crossover model (tools/crossover.py sweeps on an H100),
// replayed through the planner's model: it makes the fit's choice (the two implementations of
// the features agree), and no point it sends to sage measured more than 2 % slower than cuDNN.
struct MeasuredPoint {
  int cc, sms, bus;
  int64_t batch, heads_q, heads_kv, seq_q, seq_k, head_dim;
  bool causal;
  int block_q;
  double sage_ms, cudnn_ms, predicted_over_threshold;
  bool sage;
};
constexpr MeasuredPoint kMeasured[] = {
#include "crossover_points.inc"
};

TEST(Planner, CrossoverModelReplaysItsMeasurements) {
  int to_sage = 0, sage_faster = 0;
  double sdpa_ms = 0, dropin_ms = 0;
  for (const MeasuredPoint& m : kMeasured) {
    const Device dev{0, m.cc, m.sms, 8, m.bus};
    const int64_t dk = m.head_dim <= 64 ? 64 : m.head_dim <= 128 ? 128 : 256;
    const bool sdpa = sage::api::prefer_sdpa(
        dev, dk, m.causal ? SAGE_MASK_CAUSAL_BOTTOM_RIGHT : SAGE_MASK_NONE, m.seq_q, m.seq_k,
        false, {m.batch, m.heads_q, m.heads_kv, m.block_q});
    // (A point within rounding of its threshold may fall either way.)
    if (std::abs(m.predicted_over_threshold - 1.0) > 1e-5) {
      EXPECT_EQ(!sdpa, m.sage) << "H " << m.heads_q << "/" << m.heads_kv << " N " << m.seq_q
                               << " D " << m.head_dim << " causal " << m.causal;
    }
    if (!sdpa) {
      EXPECT_GE(m.cudnn_ms / m.sage_ms, 0.98) << "H " << m.heads_q << " N " << m.seq_q << " D "
                                              << m.head_dim << " causal " << m.causal;
      ++to_sage;
    }
    sage_faster += m.cudnn_ms > m.sage_ms;
    sdpa_ms += m.cudnn_ms;
    dropin_ms += sdpa ? m.cudnn_ms : m.sage_ms;
  }
  // The model is not "SDPA everywhere": it takes most of the time sage can save.
  EXPECT_GT(to_sage, sage_faster / 2);
  EXPECT_LT(dropin_ms, 0.9 * sdpa_ms);
  // The fit took each point's query tile from tools/crossover.py's copy of the plan's rule: the
  // plan's own (lengths to 8192 cover both sides of its 4096 threshold).
  std::set<std::tuple<int64_t, int64_t, bool>> seen;
  for (const MeasuredPoint& m : kMeasured)
    if (m.seq_q <= 8192 && seen.insert({m.seq_q, m.head_dim, m.causal}).second) {
      const Call c(m.seq_q, m.seq_k, m.head_dim,
                   m.causal ? SAGE_MASK_CAUSAL_BOTTOM_RIGHT : SAGE_MASK_NONE);
      EXPECT_EQ(must_plan(c, kH100).block_q, m.block_q)
          << "N " << m.seq_q << " D " << m.head_dim << " causal " << m.causal;
    }
}

TEST(Planner, CrossoverModelBounds) {
  // Lengths below the least measured one routed to sage: SDPA (decoding, a query against a long
  // cache; cross-attention to 77 text tokens).
  EXPECT_TRUE(must_plan(Call(1, 32768, 128), kH100).prefer_sdpa);
  EXPECT_TRUE(must_plan(Call(32768, 77, 128), kH100).prefer_sdpa);
  // Few heads at 4k (B·H = 8, as Call's): SDPA; a video model's 40 heads at 32k: sage.
  EXPECT_TRUE(must_plan(Call(4096, 4096, 128), kH100).prefer_sdpa);
  const CallShape wan{1, 40, 40, 128};
  EXPECT_FALSE(sage::api::prefer_sdpa(kH100, 128, SAGE_MASK_NONE, 32760, 32760, false, wan));
  EXPECT_FALSE(sage::api::prefer_sdpa(kH100, 128, SAGE_MASK_CAUSAL_BOTTOM_RIGHT, 32768, 32768,
                                      false, {1, 32, 8, 128}));
  // The H200 (6016-bit bus) has rows of its own: at real models' shapes, Flux.1 1024² (24 heads
  // at 4608, D 128), SD3.5 (2 x 38 heads at 4096 + 333, D 64) and Wan 2.1 go to sage, 12 heads
  // at 4096 (D 128) to SDPA.
  const Device h200{0, 90, 132, 8, 6016};
  EXPECT_FALSE(sage::api::prefer_sdpa(h200, 128, SAGE_MASK_NONE, 4608, 4608, false,
                                      {1, 24, 24, 128}));
  EXPECT_TRUE(sage::api::prefer_sdpa(h200, 128, SAGE_MASK_NONE, 4096, 4096, false,
                                     {1, 12, 12, 128}));
  EXPECT_FALSE(sage::api::prefer_sdpa(h200, 64, SAGE_MASK_NONE, 4429, 4429, false,
                                      {2, 38, 38, 64}));
  EXPECT_FALSE(sage::api::prefer_sdpa(h200, 128, SAGE_MASK_NONE, 32760, 32760, false, wan));
  // A GPU of a measured architecture that no sweep ran on (here a 6144-bit bus) takes the
  // narrowest-memory GPU's rows: with the same SMs, the same choices as the H100's.
  const Device other{0, 90, 132, 8, 6144};
  for (const int64_t n : {2048, 4096, 8192, 16384})
    for (const int64_t h : {8, 32, 128})
      EXPECT_EQ(sage::api::prefer_sdpa(other, 128, SAGE_MASK_NONE, n, n, false, {1, h, h, 128}),
                sage::api::prefer_sdpa(kH100, 128, SAGE_MASK_NONE, n, n, false, {1, h, h, 128}));
  // Architectures never measured against SDPA prefer it everywhere, however long the call (a
  // router sends a call to sage only where sage measured faster on that kind of GPU).
  for (const Device& dev : {kAda, kBlackwell})
    for (const sage_mask mask : {SAGE_MASK_NONE, SAGE_MASK_CAUSAL_TOP_LEFT})
      for (const int64_t hd : {64, 128, 256}) {
        EXPECT_TRUE(must_plan(Call(131072, 131072, hd, mask).with_heads(64, 8), dev).prefer_sdpa);
        EXPECT_TRUE(sage::api::prefer_sdpa(dev, hd, mask, 512, 512));
      }
  // Training (forward + SageBwd): no model, so torch trains every shape and GPU.
  EXPECT_TRUE(must_plan(Call(32768, 32768, 128), kH100).prefer_sdpa_training);
  for (const Device& dev : {kAda, kH100, kBlackwell})
    EXPECT_TRUE(sage::api::prefer_sdpa(dev, 64, SAGE_MASK_CAUSAL_TOP_LEFT, 16384, 16384, true));
}

// sdpa_below: a router may hand a call shorter than it to SDPA without planning it, so every
// such call must be one the model sends there, on every head dim, mask and shape; and the bound is
// no stand-in (calls at and above it do go to sage). On GPUs never measured every length is under
// it.
TEST(Planner, SdpaBelowBoundsEveryCallTheModelHandsToSdpaByLength) {
  const Device h200{0, 90, 132, 8, 6016};
  for (const Device& dev : {kH100, h200}) {
    const int64_t below = sage::api::sdpa_below(dev);
    ASSERT_GT(below, 1);
    EXPECT_EQ(must_plan(Call(1000, 1000, 128), dev).sdpa_below, below);
    bool some_sage = false;
    for (const int64_t hd : {64, 128, 256})
      for (const sage_mask mask :
           {SAGE_MASK_NONE, SAGE_MASK_CAUSAL_TOP_LEFT, SAGE_MASK_CAUSAL_BOTTOM_RIGHT})
        for (const int64_t bh : {1, 8, 64, 1024})
          for (const int64_t hkv : {int64_t(1), bh}) {
            const sage::api::CallShape shape{1, bh, hkv, 128};
            for (const int64_t shorter : {int64_t(1), int64_t(77), below / 2, below - 1})
              for (const int64_t other : {int64_t(128), below, int64_t(131072)}) {
                EXPECT_TRUE(sage::api::prefer_sdpa(dev, hd, mask, shorter, other, false, shape))
                    << hd << " " << mask << " " << bh << " " << shorter << " " << other;
                EXPECT_TRUE(sage::api::prefer_sdpa(dev, hd, mask, other, shorter, false, shape));
              }
            for (const int64_t n : {below, 2 * below, int64_t(65536)})
              some_sage |= !sage::api::prefer_sdpa(dev, hd, mask, n, n, false, shape);
          }
    EXPECT_TRUE(some_sage);
  }
  for (const Device& dev : {kAda, kBlackwell}) {
    EXPECT_EQ(sage::api::sdpa_below(dev), std::numeric_limits<int64_t>::max());
    EXPECT_EQ(must_plan(Call(1000, 1000, 128), dev).sdpa_below,
              std::numeric_limits<int64_t>::max());
  }
}

TEST(Planner, RefusesWhatNoKernelTakesNamingTheArgument) {
  Plan p;
  auto refused = [&](const Call& c, const Device& dev, const char* word) {
    EXPECT_EQ(c.plan(dev, &p), SAGE_ERROR_UNSUPPORTED) << word;
    EXPECT_NE(std::string(sage_last_error()).find(word), std::string::npos) << sage_last_error();
  };
  refused(Call(100, 100, 76), kH100, "head_dim = 76");
  refused(Call(100, 100, 132), kH100, "GPU kernels: multiples of 8 from 8 to 256");  // the set
  refused(Call(100, 100, 128, SAGE_MASK_NONE, SAGE_VARIANT_EXACT), kH100, "EXACT");
  refused(Call(100, 100, 128), kAmpere, "sm_86");
  Call custom(100, 100, 128);
  custom.a.variant = SAGE_VARIANT_CUSTOM;
  custom.a.quant.exp2_poly_every = 8;  // an sm90 emulation knob: the kernels take the preset's
  refused(custom, kH100, "quant");
  Call odd(100, 100, 128);
  odd.a.o_strides = {4 * 100 * 129, 100 * 129, 129};
  odd.o.resize(size_t(2 * 4 * 100 * 129));
  odd.a.o = odd.o.data();
  refused(odd, kH100, "o:");
}

// FP4 microscaling (SageAttention3) is emulated on the CPU only: on every GPU, Blackwell
// included, the plan refuses it naming the argument, and never hands it to another kernel.
// SAGE3_FP4's configuration runs on its own family (src/fp4: its emulation config exactly,
// never forced onto another kernel); every other FP4 combination is refused, naming it.
TEST(Planner, Fp4RunsSage3ConfigOnlyAndRefusesTheRestNamingTheArgument) {
  Plan p;
  auto refused = [&](const Call& c, const Device& dev, std::vector<std::string> words) {
    EXPECT_EQ(c.plan(dev, &p), SAGE_ERROR_UNSUPPORTED);
    const std::string msg = sage_last_error();
    for (const std::string& w : words) EXPECT_NE(msg.find(w), std::string::npos) << msg;
    EXPECT_NE(msg.find("CPU reference"), std::string::npos) << msg;
  };
  for (const Device& dev : {kH100, kAda, kBlackwell}) {
    const Call sage3(100, 100, 128, SAGE_MASK_NONE, SAGE_VARIANT_SAGE3_FP4);
    ASSERT_EQ(sage3.plan(dev, &p), SAGE_OK) << sage_last_error();
    EXPECT_EQ(p.family, sage::api::Family::kFp4);
    const sage_quant_config preset = sage::ref::quant_preset(SAGE_VARIANT_SAGE3_FP4);
    EXPECT_EQ(std::memcmp(&p.emulation, &preset, sizeof preset), 0);
    EXPECT_EQ(p.prepass.total, p.fp4.total);
    Call forced = sage3;
    forced.a.kernel = SAGE_KERNEL_MMA;
    EXPECT_EQ(forced.plan(dev, &p), SAGE_ERROR_UNSUPPORTED);
    Call direct(100, 100, 128, SAGE_MASK_NONE, SAGE_VARIANT_CUSTOM);
    direct.a.quant = preset;
    direct.a.quant.pv_format = SAGE_PV_NVFP4_DIRECT;
    refused(direct, dev, {"quant.pv_format = NVFP4_DIRECT"});
    Call qk(100, 100, 128);
    qk.a.variant = SAGE_VARIANT_CUSTOM;
    qk.a.quant.qk_format = SAGE_QK_MXFP4;  // the rest of the 8-bit preset unchanged
    refused(qk, dev, {"quant.qk_format = MXFP4"});
    const std::pair<sage_pv_format, const char*> pv[] = {
        {SAGE_PV_NVFP4, "NVFP4"}, {SAGE_PV_NVFP4_DIRECT, "NVFP4_DIRECT"}, {SAGE_PV_MXFP4, "MXFP4"}};
    for (const auto& [f, name] : pv) {
      Call c(100, 100, 128);
      c.a.variant = SAGE_VARIANT_CUSTOM;
      c.a.quant.pv_format = f;
      c.a.quant.pv_accum = SAGE_PV_ACCUM_FP32;
      refused(c, dev, {std::string("quant.pv_format = ") + name + ":"});
    }
  }
}

}  // namespace

namespace {

// A backward call validated as host pointers (the CPU backend), then planned as the CUDA backend
// would on a described device.
sage_status plan_backward(const Device& dev, int64_t d, sage_dtype dtype, sage_kernel kernel,
                          sage::api::BackwardPlan* out, int64_t n = 300,
                          const sage_backward_config* config = nullptr, uint32_t options = 0,
                          const sage_strides* k_strides = nullptr) {
  const size_t qn = size_t(4 * n * d), kn = size_t(2 * n * d);
  static std::vector<uint16_t> q, k, v, o, d_o, dq, dk, dv;
  static std::vector<float> lse;
  for (auto* x : {&q, &o, &d_o, &dq}) x->assign(qn * 2, 0);
  for (auto* x : {&k, &v, &dk, &dv}) x->assign(kn * 2, 0);
  lse.assign(size_t(4 * n), 0.0f);
  sage_backward_args a;
  sage_backward_args_init(&a);
  a.q = q.data(), a.k = k.data(), a.v = v.data(), a.o = o.data(), a.lse = lse.data();
  a.d_o = d_o.data(), a.dq = dq.data(), a.dk = dk.data(), a.dv = dv.data();
  a.batch = 1, a.heads_q = 4, a.heads_kv = 2, a.seq_q = n, a.seq_kv = n, a.head_dim = d;
  a.dtype = dtype;
  a.options = options;
  if (config) a.variant = SAGE_VARIANT_CUSTOM, a.config = *config;
  if (k_strides) a.k_strides = *k_strides;
  sage::api::ResolvedBackward r;
  const sage_status s = sage::api::validate_backward(&a, &r);
  if (s != SAGE_OK) return s;
  a.kernel = kernel;  // (the CPU backend refuses a forced family; the plan is the CUDA one's)
  return sage::api::make_backward_plan(r, a, dev, out);
}

}  // namespace

TEST(BackwardPlan, FamilyWorkspaceAndRefusals) {
  sage::api::BackwardPlan p;
  // sm_90: the wgmma main kernel unless mma.sync is asked for; elsewhere mma.sync.
  ASSERT_EQ(plan_backward(kH100, 128, SAGE_DTYPE_BF16, SAGE_KERNEL_AUTO, &p), SAGE_OK);
  EXPECT_EQ(p.family, Family::kSm90);
  EXPECT_EQ(p.launches, 11);
  EXPECT_EQ(p.layout.total, sage::bwd::make_layout(sage::ref::Problem{
                                1, 4, 2, 300, 300, 128, 1.0 / std::sqrt(128.0)}).total);
  EXPECT_GT(p.layout.total, size_t(0));
  ASSERT_EQ(plan_backward(kH100, 64, SAGE_DTYPE_FP16, SAGE_KERNEL_MMA, &p), SAGE_OK);
  EXPECT_EQ(p.family, Family::kMma);
  for (const Device& dev : {kAda, kBlackwell}) {
    ASSERT_EQ(plan_backward(dev, 128, SAGE_DTYPE_FP16, SAGE_KERNEL_AUTO, &p), SAGE_OK);
    EXPECT_EQ(p.family, Family::kMma);
    EXPECT_EQ(plan_backward(dev, 128, SAGE_DTYPE_FP16, SAGE_KERNEL_SM90, &p),
              SAGE_ERROR_UNSUPPORTED);
    EXPECT_NE(std::string(sage_last_error()).find("kernel = SM90"), std::string::npos);
  }
  EXPECT_EQ(plan_backward(kAmpere, 128, SAGE_DTYPE_FP16, SAGE_KERNEL_AUTO, &p),
            SAGE_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(sage_last_error()).find("sm_86"), std::string::npos);
  EXPECT_EQ(plan_backward(kH100, 96, SAGE_DTYPE_FP16, SAGE_KERNEL_AUTO, &p),
            SAGE_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(sage_last_error()).find("head_dim = 96"), std::string::npos);
  EXPECT_EQ(plan_backward(kH100, 64, SAGE_DTYPE_FP32, SAGE_KERNEL_AUTO, &p),
            SAGE_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(sage_last_error()).find("FP32"), std::string::npos);
}

// The forward-normalized 16-bit config: sm_90's own kernel family (three launches, its own
// workspace: two floats a query row and dQ's fp32 accumulator), refused elsewhere and with what
// it does not compute, naming the argument.
TEST(BackwardPlan, ForwardNormalizedSixteenBit) {
  sage_backward_config c = sage::ref::backward_preset();
  c.int8 = 0, c.smooth = 0, c.normalizer = SAGE_BWD_NORM_FORWARD;
  sage::api::BackwardPlan p;
  ASSERT_EQ(plan_backward(kH100, 128, SAGE_DTYPE_BF16, SAGE_KERNEL_AUTO, &p, 300, &c), SAGE_OK)
      << sage_last_error();
  EXPECT_TRUE(p.forward_normalized);
  EXPECT_EQ(p.launches, 3);
  const int64_t nq_pad = 320;  // 300 rows in 64-row blocks
  EXPECT_EQ(p.workspace(), size_t(4 * nq_pad * 4 * 2 + 4 * nq_pad * 128 * 4));
  ASSERT_EQ(plan_backward(kH100, 64, SAGE_DTYPE_FP16, SAGE_KERNEL_SM90, &p, 77, &c), SAGE_OK);
  EXPECT_TRUE(p.forward_normalized);
  for (const Device& dev : {kAda, kBlackwell}) {
    EXPECT_EQ(plan_backward(dev, 128, SAGE_DTYPE_FP16, SAGE_KERNEL_AUTO, &p, 300, &c),
              SAGE_ERROR_UNSUPPORTED);
    EXPECT_NE(std::string(sage_last_error()).find("SAGE_BWD_NORM_FORWARD"), std::string::npos);
  }
  EXPECT_EQ(plan_backward(kH100, 128, SAGE_DTYPE_FP16, SAGE_KERNEL_MMA, &p, 300, &c),
            SAGE_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(sage_last_error()).find("kernel = MMA"), std::string::npos);
  EXPECT_EQ(plan_backward(kH100, 128, SAGE_DTYPE_FP16, SAGE_KERNEL_AUTO, &p, 300, &c,
                          SAGE_BWD_OPTION_DETERMINISTIC),
            SAGE_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(sage_last_error()).find("DETERMINISTIC"), std::string::npos);
  sage_backward_config q = c;
  q.smooth = SAGE_SMOOTH_Q;
  EXPECT_EQ(plan_backward(kH100, 128, SAGE_DTYPE_FP16, SAGE_KERNEL_AUTO, &p, 300, &q),
            SAGE_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(sage_last_error()).find("config.smooth"), std::string::npos);
  // TMA reads k in place: rows of D + 1 elements are not 16-byte aligned (refused, naming k);
  // the stride of a dimension of one (B = 1) is not read.
  const sage_strides odd_rows{2 * 300 * 129, 300 * 129, 129};
  EXPECT_EQ(plan_backward(kH100, 128, SAGE_DTYPE_FP16, SAGE_KERNEL_AUTO, &p, 300, &c, 0,
                          &odd_rows),
            SAGE_ERROR_UNSUPPORTED);
  EXPECT_EQ(std::string(sage_last_error()).rfind("k: ", 0), 0u) << sage_last_error();
  const sage_strides odd_batch{7, 300 * 128, 128};
  EXPECT_EQ(plan_backward(kH100, 128, SAGE_DTYPE_FP16, SAGE_KERNEL_AUTO, &p, 300, &c, 0,
                          &odd_batch),
            SAGE_OK)
      << sage_last_error();
}
