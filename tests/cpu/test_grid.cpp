// Grids past CUDA's 65535 limit on gridDim.y and gridDim.z (common/grid.h): the host's (y, z) for
// a count n, and the index each CTA recovers from blockIdx.y and .z (the same host+device
// functions the kernels call), on edge counts: every index below n taken by exactly one (y, z),
// every other CTA past n (it returns), the grid within the limits, CTAs of one index consecutive
// in launch order, and (b, h) decoded back.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "common/grid.h"

namespace sage {
namespace {

// 1, 2, the limit and around it, two rows and one more, primes (1000003, 4194301), the backend's
// largest count (2^31 - 1, prime), and the most (y, z) carry (65535²) and one less.
const int64_t kCounts[] = {1,
                           2,
                           65534,
                           65535,
                           65536,
                           65535 * 2,
                           65535 * 2 + 1,
                           131072,
                           1000003,
                           4194301,
                           2147483647,
                           kGridOuterMax - 1,
                           kGridOuterMax};

// Counts small enough to walk every (y, z) of their grid.
constexpr int64_t kWalkAll = int64_t(1) << 23;

TEST(Grid, WithinTheLimitsAndFewSpareSlots) {
  for (const int64_t n : kCounts) {
    SCOPED_TRACE("n = " + std::to_string(n));
    const OuterGrid g = outer_grid(n);
    const int64_t y = g.y, z = g.z;
    EXPECT_GE(y, 1);
    EXPECT_GE(z, 1);
    EXPECT_LE(y, kGridYZMax);
    EXPECT_LE(z, kGridYZMax);
    EXPECT_GE(y * z, n);        // every index has a slot
    EXPECT_LT(y * z - n, z);    // fewer than one spare slot a row
    EXPECT_LT(y * (z - 1), n);  // the last row holds an index
    if (n <= kGridYZMax) {      // the one-dimensional grid of before
      EXPECT_EQ(y, n);
      EXPECT_EQ(z, 1);
    }
  }
  EXPECT_EQ(outer_grid(kGridOuterMax).y, 65535u);
  EXPECT_EQ(outer_grid(kGridOuterMax).z, 65535u);
  // No count: one spare slot (its CTA returns).
  EXPECT_EQ(outer_grid(0).y, 1u);
  EXPECT_EQ(outer_grid(0).z, 1u);
}

// Walks (y, z) in launch order (y fastest, as the hardware after x), as a kernel sees them.
TEST(Grid, EveryIndexOnceNonePastTheCount) {
  for (const int64_t n : kCounts) {
    if (n > kWalkAll) continue;
    SCOPED_TRACE("n = " + std::to_string(n));
    const OuterGrid g = outer_grid(n);
    std::vector<uint8_t> seen(size_t(n), 0);
    int64_t past = 0, last = -1;
    bool ordered = true, once = true;
    for (uint32_t z = 0; z < g.z; ++z)
      for (uint32_t y = 0; y < g.y; ++y) {
        const int64_t i = outer_index(y, z, g.y);
        ordered &= i == last + 1;  // CTAs of a lower index launch before
        last = i;
        if (i >= n) {  // this CTA returns at once
          ++past;
          continue;
        }
        once &= ++seen[size_t(i)] == 1;
      }
    EXPECT_TRUE(ordered);
    EXPECT_TRUE(once);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(seen[size_t(i)], 1) << "index " << i;
    EXPECT_EQ(past, int64_t(g.y) * g.z - n);
  }
}

// Counts too large to walk: each row z covers [z·y, z·y + y) one after another (checked at both
// ends of every row, and at every y of the first, last and sampled rows), so the rows tile
// [0, y·z) once, and the indices past n are the last row's tail.
TEST(Grid, LargeCountsRowByRow) {
  std::mt19937_64 rng(12345);
  for (const int64_t n : kCounts) {
    if (n <= kWalkAll) continue;
    SCOPED_TRACE("n = " + std::to_string(n));
    const OuterGrid g = outer_grid(n);
    int64_t next = 0;
    for (uint32_t z = 0; z < g.z; ++z) {
      ASSERT_EQ(outer_index(0, z, g.y), next) << "row " << z;
      ASSERT_EQ(outer_index(g.y - 1, z, g.y), next + g.y - 1) << "row " << z;
      next += g.y;
    }
    EXPECT_EQ(next, int64_t(g.y) * g.z);
    std::vector<uint32_t> rows = {0u, g.z - 1};
    for (int s = 0; s < 8; ++s) rows.push_back(uint32_t(rng() % g.z));
    for (const uint32_t z : rows)
      for (uint32_t y = 0; y < g.y; ++y)
        ASSERT_EQ(outer_index(y, z, g.y), int64_t(z) * g.y + y) << "(" << y << ", " << z << ")";
    // The largest index a CTA keeps is n - 1, in the last row.
    const int64_t last_row0 = outer_index(0, g.z - 1, g.y);
    EXPECT_LE(last_row0, n - 1);
    EXPECT_GE(last_row0 + g.y - 1, n - 1);
  }
}

TEST(Grid, BatchAndHeadDecodeBack) {
  std::mt19937_64 rng(777);
  for (const int64_t heads : {int64_t(1), int64_t(2), int64_t(3), int64_t(16), int64_t(65535),
                              int64_t(65536), int64_t(1) << 31}) {
    SCOPED_TRACE("heads = " + std::to_string(heads));
    std::vector<int64_t> at = {0, heads - 1, heads, 65534, 65535, 65536, 131071};
    for (int s = 0; s < 1000; ++s) at.push_back(int64_t(rng() % uint64_t(kGridOuterMax)));
    for (const int64_t i : at) {
      const BatchHead x = batch_head(i, heads);
      ASSERT_EQ(x.b * heads + x.h, i);
      ASSERT_GE(x.h, 0);
      ASSERT_LT(x.h, heads);
    }
  }
}

// A kernel's view of windowed attention (Swin-style): B = 8192 windows × 16 heads, and GQA's two
// sides; each (b, h) is met by exactly one CTA, past-the-count CTAs return.
TEST(Grid, EachBatchHeadOnceInAKernelsView) {
  struct Shape {
    int64_t batch, heads;
  };
  for (const Shape s : {Shape{8192, 16}, Shape{66000, 1}, Shape{33000, 4}, Shape{33000, 2},
                        Shape{70000, 1}, Shape{1, 70001}}) {
    const int64_t n = s.batch * s.heads;
    SCOPED_TRACE("batch " + std::to_string(s.batch) + " heads " + std::to_string(s.heads));
    const OuterGrid g = outer_grid(n);
    std::vector<uint8_t> seen(size_t(n), 0);
    for (uint32_t z = 0; z < g.z; ++z)
      for (uint32_t y = 0; y < g.y; ++y) {
        const int64_t i = outer_index(y, z, g.y);
        if (i >= n) continue;
        const BatchHead x = batch_head(i, s.heads);
        ASSERT_LT(x.b, s.batch);
        ASSERT_EQ(seen[size_t(x.b * s.heads + x.h)]++, 0);
      }
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(seen[size_t(i)], 1) << "pair " << i;
  }
}

}  // namespace
}  // namespace sage
