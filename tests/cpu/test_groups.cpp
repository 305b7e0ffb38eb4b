// Per-thread quantization groups (docs/status.md, the granularity knob): simulate the
// accumulator ownership of mma.sync m16n8 and wgmma m64nN and check that every element a thread
// holds needs exactly one Q scale and one K scale, and that every element of the block is held
// by exactly one thread.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <vector>

#include "ref/reference.h"

namespace sage::ref {
namespace {

struct Owned {
  int thread;  // warp * 32 + lane
  int64_t row, col;
};

// mma.sync m16n8kK accumulator: lane l, g = l/4, t = l%4 holds (g, 2t), (g, 2t+1), (g+8, 2t),
// (g+8, 2t+1) of each 16x8 tile. A warp owns rows_per_warp rows (rows_per_warp/16 m-tiles) and
// all block_k columns (block_k/8 n-tiles).
std::vector<Owned> mma_sync_ownership(int64_t block_q, int64_t rows_per_warp, int64_t block_k) {
  std::vector<Owned> v;
  for (int64_t w = 0; w < block_q / rows_per_warp; ++w)
    for (int lane = 0; lane < 32; ++lane)
      for (int64_t mt = 0; mt < rows_per_warp / 16; ++mt)
        for (int64_t nt = 0; nt < block_k / 8; ++nt)
          for (int reg = 0; reg < 4; ++reg) {
            const int g = lane / 4, t = lane % 4;
            const int64_t row = w * rows_per_warp + mt * 16 + g + (reg >= 2 ? 8 : 0);
            const int64_t col = nt * 8 + 2 * t + (reg & 1);
            v.push_back({int(w * 32 + lane), row, col});
          }
  return v;
}

// wgmma m64nNk32 accumulator: warp w of a warpgroup holds rows 16w..16w+15 of its 64-row tile,
// lane (g, t) the elements (16w+g, 8j+2t), (16w+g, 8j+2t+1), (16w+g+8, 8j+2t), (16w+g+8, 8j+2t+1).
// A block_q-row block is block_q/64 warpgroups.
std::vector<Owned> wgmma_ownership(int64_t block_q, int64_t block_k) {
  std::vector<Owned> v;
  for (int64_t wg = 0; wg < block_q / 64; ++wg)
    for (int w = 0; w < 4; ++w)
      for (int lane = 0; lane < 32; ++lane)
        for (int64_t j = 0; j < block_k / 8; ++j)
          for (int reg = 0; reg < 4; ++reg) {
            const int g = lane / 4, t = lane % 4;
            const int64_t row = wg * 64 + 16 * w + g + (reg >= 2 ? 8 : 0);
            const int64_t col = 8 * j + 2 * t + (reg & 1);
            v.push_back({int((wg * 4 + w) * 32 + lane), row, col});
          }
  return v;
}

void check_one_scale_per_thread(const std::vector<Owned>& own, int64_t block_q, int64_t block_k,
                                const GroupLayout& qg, const GroupLayout& kg) {
  // Every element held exactly once.
  std::vector<int> count(size_t(block_q * block_k), 0);
  for (const Owned& o : own) ++count[size_t(o.row * block_k + o.col)];
  for (int64_t i = 0; i < block_q * block_k; ++i)
    ASSERT_EQ(count[size_t(i)], 1) << "element (" << i / block_k << ", " << i % block_k << ")";
  // Every thread's elements share one Q group and one K group.
  std::map<int, std::set<int64_t>> q_groups, k_groups;
  for (const Owned& o : own) {
    q_groups[o.thread].insert(qg.group(o.row));
    k_groups[o.thread].insert(kg.group(o.col));
  }
  for (const auto& [thread, groups] : q_groups)
    EXPECT_EQ(groups.size(), 1u) << "thread " << thread << " needs several Q scales";
  for (const auto& [thread, groups] : k_groups)
    EXPECT_EQ(groups.size(), 1u) << "thread " << thread << " needs several K scales";
}

std::map<int64_t, int64_t> group_sizes(const GroupLayout& g, int64_t n) {
  std::map<int64_t, int64_t> sizes;
  for (int64_t t = 0; t < n; ++t) ++sizes[g.group(t)];
  return sizes;
}

TEST(Groups, MmaSyncLayoutOneScalePerThread) {
  // The paper's kernel: 4 warps of 32 rows (two m16 tiles each), 64-key blocks.
  sage_quant_config cfg = quant_preset(SAGE_VARIANT_SAGE2_4B);
  cfg.warps = 4;
  const GroupLayout qg = q_group_layout(cfg), kg = k_group_layout(cfg);
  check_one_scale_per_thread(mma_sync_ownership(128, 32, 64), 128, 64, qg, kg);
  // SPEC §4: 32 Q groups of 4 rows {g, g+8, g+16, g+24} per 128-row block, 4 K groups of 16 keys.
  const auto qs = group_sizes(qg, 128), ks = group_sizes(kg, 64);
  EXPECT_EQ(qs.size(), 32u);
  for (const auto& [g, n] : qs) EXPECT_EQ(n, 4) << "Q group " << g;
  EXPECT_EQ(ks.size(), 4u);
  for (const auto& [g, n] : ks) EXPECT_EQ(n, 16) << "K group " << g;
  EXPECT_EQ(qg.group(0), qg.group(8));
  EXPECT_EQ(qg.group(0), qg.group(24));
  EXPECT_NE(qg.group(0), qg.group(32));  // next warp
  EXPECT_EQ(kg.group(0), kg.group(1));
  EXPECT_EQ(kg.group(0), kg.group(57));
  EXPECT_NE(kg.group(0), kg.group(2));
}

TEST(Groups, PresetMatchesTheMmaKernelTile) {
  // This library's mma.sync kernel: 8 warps of 16 rows (one m16 tile), so groups of 2 rows.
  for (sage_variant v : {SAGE_VARIANT_SAGE2_8B, SAGE_VARIANT_SAGE2_4B}) {
    const sage_quant_config cfg = quant_preset(v);
    ASSERT_EQ(cfg.block_q, 128);
    ASSERT_EQ(cfg.warps, 8);
    ASSERT_EQ(cfg.block_k, 64);
    const GroupLayout qg = q_group_layout(cfg), kg = k_group_layout(cfg);
    check_one_scale_per_thread(mma_sync_ownership(128, 16, 64), 128, 64, qg, kg);
    const auto qs = group_sizes(qg, 128);
    EXPECT_EQ(qs.size(), 64u);
    for (const auto& [g, n] : qs) EXPECT_EQ(n, 2) << "Q group " << g;
  }
}

TEST(Groups, WgmmaLayoutOneScalePerThread) {
  for (int64_t block_k : {64, 128, 256}) {
    sage_quant_config cfg = quant_preset(SAGE_VARIANT_SAGE2_8B);
    cfg.granularity = SAGE_GRANULARITY_PER_THREAD_WGMMA;
    cfg.block_q = 128;
    cfg.block_k = int(block_k);
    const GroupLayout qg = q_group_layout(cfg), kg = k_group_layout(cfg);
    check_one_scale_per_thread(wgmma_ownership(128, block_k), 128, block_k, qg, kg);
    const auto qs = group_sizes(qg, 128), ks = group_sizes(kg, block_k);
    EXPECT_EQ(qs.size(), 64u);  // 8 warps x 8 lane groups, 2 rows each
    for (const auto& [g, n] : qs) EXPECT_EQ(n, 2);
    EXPECT_EQ(ks.size(), 4u);
    for (const auto& [g, n] : ks) EXPECT_EQ(n, block_k / 4);
  }
}

TEST(Groups, PerThreadIsFinerThanPerBlockAndCoarserThanPerToken) {
  // The MMA layout with two m-tiles a warp (32 rows) is what the paper's kernel uses; check a
  // warp of 64 rows (4 m-tiles) keeps one scale per thread too.
  const GroupLayout qg = GroupLayout::thread_q(256, 64), kg = GroupLayout::thread_k(64);
  check_one_scale_per_thread(mma_sync_ownership(256, 64, 64), 256, 64, qg, kg);
  // A per-block scale fits any thread trivially; per-token Q does not fit the mma layout
  // (a thread holds several rows), which is why per-token costs extra dequantization work.
  const GroupLayout tok = GroupLayout::per_token(128);
  std::set<int64_t> rows_of_thread0;
  for (const Owned& o : mma_sync_ownership(128, 32, 64))
    if (o.thread == 0) rows_of_thread0.insert(tok.group(o.row));
  EXPECT_GT(rows_of_thread0.size(), 1u);
}

TEST(Groups, LayoutArithmetic) {
  const GroupLayout t = GroupLayout::per_tensor();
  EXPECT_EQ(t.num_groups(1000), 1);
  EXPECT_EQ(t.group(999), 0);
  const GroupLayout b = GroupLayout::per_block(64);
  EXPECT_EQ(b.num_groups(65), 2);  // partial last block is its own group
  EXPECT_EQ(b.group(63), 0);
  EXPECT_EQ(b.group(64), 1);
  const GroupLayout w = GroupLayout::per_rows(128, 32);
  EXPECT_EQ(w.num_groups(128), 4);
  EXPECT_EQ(w.group(31), 0);
  EXPECT_EQ(w.group(32), 1);
  EXPECT_EQ(w.group(128 + 33), 5);
  const GroupLayout k = GroupLayout::thread_k(64);
  EXPECT_EQ(k.num_groups(100), 8);  // two blocks of 4 groups, the second partial
  EXPECT_EQ(k.group(64 + 2), 4 + 1);
}

}  // namespace
}  // namespace sage::ref
