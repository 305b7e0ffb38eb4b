// The emulation's model of the sm90 (wgmma) kernel: softmax blocks over several K scale blocks
// (softmax_block_k) and the polynomial 2^x on a share of the scores (exp2_poly_every), against
// computations written here from the definitions (sage.h), their validation, the polynomial's
// accuracy and position rule, and the sm90 configuration's error against float64. At D = 256 the
// kernel's softmax block is its 64-key K block, selected by the wgmma groups with the aligned
// accumulator.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attn/sm90/split.h"
#include "common/exp2_poly.h"  // kMagicF
#include "common/test_util.h"
#include "cpu/sm90_config.h"

namespace sage::ref {
namespace {

using test::Fp16Tensor;

constexpr double kLog2e = 1.4426950408889634;

// Keys row i sees, from sage.h's mask definitions (written here, not Problem::visible_keys).
int64_t keys_seen(sage_mask mask, int64_t i, int64_t Nq, int64_t Nk) {
  int64_t last = Nk - 1;
  if (mask == SAGE_MASK_CAUSAL_TOP_LEFT) last = std::min(last, i);
  if (mask == SAGE_MASK_CAUSAL_BOTTOM_RIGHT) last = std::min(last, i + Nk - Nq);
  return std::max<int64_t>(last + 1, 0);
}

// The kernel's polynomial, evaluated here in long double from its (float) coefficients: 2^x = 2^n · q(r)
// with n = x rounded to nearest (ties to even), r = x - n. (The emulation's double version must
// agree to double rounding; its float version to float rounding.)
long double poly_2x(long double x) {
  x = std::max(x, -125.0L);
  const long double n = std::nearbyint(x), r = x - n;
  const long double q =
      (((long double)0.0550089331f * r + (long double)0.242210972f) * r +
       (long double)0.693282928f) * r + 1.0L;
  return std::ldexp(q, int(n));
}

// Which (row mod 16, key mod 128) a register i of the m64n128 wgmma accumulator holds, per the
// PTX layout (lane l: g = l / 4, t = l % 4; register i: row g + 8·((i / 2) % 2), key
// 8·(i / 4) + 2t + i % 2): the scores taking the polynomial are those with i % n == n - 1.
std::vector<std::vector<bool>> poly_table(int every) {
  std::vector<std::vector<bool>> at(16, std::vector<bool>(128, false));
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 64; ++i) {
      const int g = lane / 4, t = lane % 4;
      const int row = g + 8 * ((i / 2) % 2), key = 8 * (i / 4) + 2 * t + i % 2;
      if (every > 0 && i % every == every - 1) at[size_t(row)][size_t(key)] = true;
    }
  return at;
}

TEST(Exp2Poly, PositionRuleFollowsTheWgmmaRegisterLayout) {
  for (int every : {0, 2, 4, 8, 16, 32}) {
    const auto table = poly_table(every);
    int64_t taken = 0;
    for (int64_t row = 0; row < 48; ++row)
      for (int64_t key = 0; key < 384; ++key) {
        const bool want = table[size_t(row % 16)][size_t(key % 128)];
        ASSERT_EQ(exp2_poly_at(row, key, every), want)
            << "every " << every << " row " << row << " key " << key;
        taken += want;
      }
    // One score in `every` (none for 0): the kernel's share of the MUFU work moved.
    EXPECT_EQ(taken, every == 0 ? 0 : 48 * 384 / every) << every;
  }
}

TEST(Exp2Poly, RelativeErrorAboutOneIn1e4AndFloatIsTheDoublePolynomialRounded) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-125.0f, 9.0f);
  double worst = 0, worst_vs_double = 0;
  for (int n = 0; n < 200000; ++n) {
    // Random points and a fine grid around the half-integers where n = round(x) switches.
    const float x = n % 2 ? u(rng) : float(-60 + (n / 2) % 140) * 0.5f + float(n % 7 - 3) * 1e-6f;
    const float got = exp2_poly(x);
    const long double want = std::exp2((long double)x);
    worst = std::max(worst, double(std::fabs((long double)got - want) / want));
    const long double poly = poly_2x(x);
    worst_vs_double = std::max(worst_vs_double, double(std::fabs((long double)got - poly) / poly));
    ASSERT_EQ(exp2_poly(double(x)) == 0.0, false);
    ASSERT_NEAR(exp2_poly(double(x)) / double(poly), 1.0, 1e-14) << x;
  }
  // The fitted cubic: max relative error 1.0e-4 (the kernel's comment); it is a polynomial, not
  // an exact 2^x (the test would be vacuous if it were).
  EXPECT_LT(worst, 1.1e-4);
  EXPECT_GT(worst, 5e-5);
  // Three fmaf roundings and an exact exponent add: within a few float ulps of the polynomial.
  EXPECT_LT(worst_vs_double, 4 * std::ldexp(1.0, -24));
  // Integers are exact (r = 0), and the argument is clamped at -125 (E4M3 and the row sum cannot
  // see anything below).
  for (int k = -125; k <= 9; ++k) EXPECT_EQ(exp2_poly(float(k)), std::ldexp(1.0f, k)) << k;
  EXPECT_EQ(exp2_poly(-300.0f), exp2_poly(-125.0f));
}

// Problem, inputs and the sm90 softmax form computed from the definitions (double): softmax
// blocks of sbk keys, each block's running max m_b, which moves to the block's max over its
// visible keys only where that passes m_b of the block before by more than `slack` (or none
// was seen yet), e_j = 2^(s_j - m_b(j) + log2 u) with the unit u = 448 / 2^slack (the
// polynomial where the block is whole for the tile's first row and the position rule picks
// (i, j)), P^ = E4M3(e_j) (e_j <= 448 by the slack), O = Σ P^ V^ 2^(m_b - M) / l · δV with the
// row sum of the weights O takes, l = Σ P^ 2^(m_b - M) (the mma form: l = Σ e 2^(m_b - M)),
// LSE = (M + log2(l / u)) · ln 2. Q and K unquantized, V per channel.
// With a split tail (sage.h, split_tiles): the running max starts afresh at each part's first
// block (one head: tile = row / block_q).
struct Sm90Definition {
  int64_t Nq, Nk, D, block_q, sbk;
  int every;
  sage_mask mask;
  double scale;
  sm90::SplitTail split{};
  // The running max's slack (kMaxSlack in the sm90 form, 0 in the mma form the default knobs
  // select: ref::sm90_softmax_form).
  int slack = kMaxSlack;
  // Whether l sums P^ (the sm90 form: the P̃·V wgmma's column of ones) or e (the mma form).
  bool l_of_phat = true;
  // Whether row i's running max restarts at block b (a split tile's part begins there).
  bool restarts(int64_t i, int64_t b) const {
    const int64_t tiles = (Nq + block_q - 1) / block_q, tail = i / block_q - (tiles - split.tiles);
    if (split.tiles == 0 || tail < 0 || b == 0) return false;
    for (int64_t c = 1; c < split.ctas; ++c)
      if (split.begin(c) == tail * split.blocks + b) return true;
    return false;
  }
  void run(const std::vector<double>& Q, const std::vector<double>& K,
           const std::vector<double>& V, std::vector<double>* out,
           std::vector<double>* lse) const {
    std::vector<double> vscale(static_cast<size_t>(D)), Vq(V.size());
    // V's scale without V smoothing: the exact max, or v_sample_bound of the max over K's mean
    // sample (every stride-th token: the presets' 256 samples) where that is larger.
    const int64_t stride = mean_token_stride(Nk, 256);
    for (int64_t d = 0; d < D; ++d) {
      float amax = 0, smax = 0;
      for (int64_t j = 0; j < Nk; ++j) {
        const float a = float(std::fabs(V[size_t(j * D + d)]));
        amax = std::max(amax, a);
        if (j % stride == 0) smax = std::max(smax, a);
      }
      amax = std::max(amax, v_sample_bound(smax));
      vscale[size_t(d)] = double(amax / 448.0f);
      for (int64_t j = 0; j < Nk; ++j)
        Vq[size_t(j * D + d)] = round_float(kE4M3, float(V[size_t(j * D + d)]) * (448.0f / amax));
    }
    const auto table = poly_table(every);
    const double unit = 448.0 / double(1 << slack);
    out->assign(size_t(Nq * D), 0.0);
    lse->assign(size_t(Nq), -std::numeric_limits<double>::infinity());
    for (int64_t i = 0; i < Nq; ++i) {
      const int64_t n = keys_seen(mask, i, Nq, Nk);
      const int64_t tile_first = i / block_q * block_q;
      const int64_t tile_n = keys_seen(mask, tile_first, Nq, Nk);
      if (n == 0) continue;
      std::vector<double> s(static_cast<size_t>(n)), mb(static_cast<size_t>(n));
      for (int64_t j = 0; j < n; ++j) {
        double x = 0;
        for (int64_t d = 0; d < D; ++d) x += Q[size_t(i * D + d)] * K[size_t(j * D + d)];
        s[size_t(j)] = x * scale * kLog2e;
      }
      double run_max = -std::numeric_limits<double>::infinity();
      for (int64_t b0 = 0; b0 < n; b0 += sbk) {
        if (restarts(i, b0 / sbk)) run_max = -std::numeric_limits<double>::infinity();
        double block_max = -std::numeric_limits<double>::infinity();
        for (int64_t j = b0; j < std::min(n, b0 + sbk); ++j)
          block_max = std::max(block_max, s[size_t(j)]);
        if (block_max > run_max + slack) run_max = block_max;
        for (int64_t j = b0; j < std::min(n, b0 + sbk); ++j) mb[size_t(j)] = run_max;
      }
      double M = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < n; ++j) M = std::max(M, mb[size_t(j)]);
      double sum = 0;
      std::vector<double> o(static_cast<size_t>(D), 0.0);
      for (int64_t j = 0; j < n; ++j) {
        const double x = s[size_t(j)] - mb[size_t(j)] + std::log2(unit);
        const bool whole = (j / sbk + 1) * sbk <= tile_n;
        const bool poly = whole && table[size_t(i % 16)][size_t(j % 128)];
        const double e = poly ? double(poly_2x(x)) : std::exp2(x);
        const double w = std::exp2(mb[size_t(j)] - M);
        const double ph = round_float(kE4M3, float(e));
        sum += (l_of_phat ? ph : e) * w;
        for (int64_t d = 0; d < D; ++d) o[size_t(d)] += ph * w * Vq[size_t(j * D + d)];
      }
      for (int64_t d = 0; d < D; ++d) (*out)[size_t(i * D + d)] = o[size_t(d)] / sum * vscale[size_t(d)];
      (*lse)[size_t(i)] = (M + std::log2(sum / unit)) * 0.6931471805599453;
    }
  }
};

// One head of the definition tests' inputs (q with a spread of 2, v with a bias of 4), as
// tensors for the emulation and as double matrices for Sm90Definition.
struct DefinitionInputs {
  Fp16Tensor q, k, v;
  std::vector<double> Q, K, V;
  DefinitionInputs(std::mt19937_64& rng, int64_t Nq, int64_t Nk, int64_t D)
      : q(test::random_tensor(rng, 1, 1, Nq, D, 0.0f, 2.0f)),
        k(test::random_tensor(rng, 1, 1, Nk, D)),
        v(test::random_tensor(rng, 1, 1, Nk, D, 4.0f)),
        Q(test::head_matrix(q, 0, Nq, D)),
        K(test::head_matrix(k, 0, Nk, D)),
        V(test::head_matrix(v, 0, Nk, D)) {}
};

// The definition tests' emulation config: E4M3 P̃·V, 16-row tiles of one warp (several tiles,
// some partly causal), 32-key quantization blocks, these softmax blocks and polynomial share.
sage_quant_config definition_config(int64_t softmax_block_k, int exp2_poly_every) {
  sage_quant_config cfg = quant_preset(SAGE_VARIANT_EXACT);
  cfg.pv_format = SAGE_PV_FP8_E4M3;
  cfg.block_q = 16;
  cfg.warps = 1;
  cfg.block_k = 32;
  cfg.softmax_block_k = int32_t(softmax_block_k);
  cfg.exp2_poly_every = exp2_poly_every;
  return cfg;
}

// The double emulation's O and LSE (got) against the definition's (want). Same quantization,
// ideal arithmetic in both: only double rounding (the running max folded in another order, Q·K
// summed in another order) remains. An E4M3 tie flipped by it would show as ~1e-3: none in 200
// seeds at 1e-9. A -inf LSE (a row that sees no key) must be the same.
void expect_definition(const std::vector<double>& got, const std::vector<double>& got_lse,
                       const std::vector<double>& want, const std::vector<double>& want_lse) {
  for (size_t i = 0; i < want.size(); ++i)
    ASSERT_NEAR(got[i], want[i], 1e-9 * (1 + std::fabs(want[i]))) << "element " << i;
  for (size_t i = 0; i < want_lse.size(); ++i) {
    if (std::isinf(want_lse[i])) {
      ASSERT_EQ(got_lse[i], want_lse[i]) << "lse " << i;
    } else {
      ASSERT_NEAR(got_lse[i], want_lse[i], 1e-12 * (1 + std::fabs(want_lse[i]))) << "lse " << i;
    }
  }
}

// The double emulation with softmax_block_k (and the polynomial) against the definition, for
// every mask, sizes that are not multiples of the blocks, and Nq != Nk; in the sm90 form with
// the running max's slack, which takes effect (the definition without it differs).
TEST(Sm90Form, SoftmaxBlocksAndPolynomialMatchTheDefinition) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t Nq = 45, Nk = 300, D = 64;
  const DefinitionInputs in(rng, Nq, Nk, D);
  double slack_effect = 0;
  for (sage_mask mask :
       {SAGE_MASK_NONE, SAGE_MASK_CAUSAL_TOP_LEFT, SAGE_MASK_CAUSAL_BOTTOM_RIGHT})
    for (int64_t sbk : {32, 96, 128})
      for (int every : {0, 2, 8}) {
        SCOPED_TRACE("mask " + std::to_string(mask) + " softmax_block_k " + std::to_string(sbk) +
                     " exp2_poly_every " + std::to_string(every));
        const Problem p{1, 1, 1, Nq, Nk, D, 0.125, mask};
        const sage_quant_config cfg = definition_config(sbk, every);
        std::vector<double> got(size_t(p.out_elems())), got_lse(size_t(p.lse_elems()));
        attention_quant(p, cfg, in.q.view(), in.k.view(), in.v.view(), got.data(),
                        got_lse.data());
        Sm90Definition def{Nq, Nk, D, 16, sbk, every, mask, 0.125};
        def.slack = sm90_softmax_form(cfg) ? kMaxSlack : 0;
        def.l_of_phat = sm90_softmax_form(cfg);
        std::vector<double> want, want_lse;
        def.run(in.Q, in.K, in.V, &want, &want_lse);
        ASSERT_NO_FATAL_FAILURE(expect_definition(got, got_lse, want, want_lse));
        if (def.slack > 0) {
          def.slack = 0;
          std::vector<double> tight, tight_lse;
          def.run(in.Q, in.K, in.V, &tight, &tight_lse);
          for (size_t i = 0; i < want.size(); ++i)
            slack_effect =
                std::max(slack_effect, std::fabs(tight[i] - want[i]) / (1 + std::fabs(want[i])));
        }
      }
  EXPECT_GT(slack_effect, 1e-6);
  EXPECT_LT(slack_effect, 0.05);
}

// The knobs take effect: 128-key softmax blocks and the polynomial each change the quantized
// result (so the definition test above is not passing on a no-op), by little.
TEST(Sm90Form, KnobsChangeTheResultSlightly) {
  std::mt19937_64 rng(test::fresh_seed());
  const int64_t N = 700, D = 128;
  const Fp16Tensor q = test::random_tensor(rng, 1, 1, N, D, 1.0f);
  const Fp16Tensor k = test::random_tensor(rng, 1, 1, N, D, 2.0f);
  const Fp16Tensor v = test::random_tensor(rng, 1, 1, N, D, 2.0f);
  const Problem p{1, 1, 1, N, N, D, 1.0 / std::sqrt(double(D)), SAGE_MASK_CAUSAL_BOTTOM_RIGHT};
  auto run = [&](int32_t sbk, int32_t every) {
    sage_quant_config cfg = quant_preset(SAGE_VARIANT_SAGE2_8B);
    cfg.softmax_block_k = sbk;
    cfg.exp2_poly_every = every;
    std::vector<float> o(size_t(p.out_elems()));
    attention_quant(p, cfg, q.view(), k.view(), v.view(), o.data(), nullptr);
    return std::vector<double>(o.begin(), o.end());
  };
  const std::vector<double> base = run(0, 0), blocks = run(128, 0), poly = run(128, 8);
  std::vector<float> bf(blocks.begin(), blocks.end()), pf(poly.begin(), poly.end());
  const Metrics blocks_vs_base = compare(base.data(), bf.data(), p.out_elems());
  const Metrics poly_vs_blocks = compare(blocks.data(), pf.data(), p.out_elems());
  EXPECT_GT(blocks_vs_base.rel_l1, 0.0);
  EXPECT_LT(blocks_vs_base.rel_l1, 5e-3);  // P~ rounded against another running max
  EXPECT_GT(poly_vs_blocks.rel_l1, 0.0);
  EXPECT_LT(poly_vs_blocks.rel_l1, 2e-3);  // 1e-4 on one score in eight
}

// The split tail's cut (attn/sm90/split.h): every (tile, block) step of the split tiles in exactly
// one unit; at most two units a CTA; a cut tile's first part merges the count of its other parts,
// which are the first units of the next CTAs in order, and is its CTA's last unit.
TEST(Sm90Split, UnitsCoverTheTailOnceAndNameTheirMerger) {
  for (int64_t tiles = 1; tiles <= 9; ++tiles)
    for (int64_t blocks : {1, 2, 3, 7, 36})
      for (int64_t ctas = tiles; ctas <= std::min<int64_t>(tiles * blocks, 40); ++ctas) {
        SCOPED_TRACE(::testing::Message() << tiles << " tiles of " << blocks << " blocks on "
                                          << ctas << " CTAs");
        const sm90::SplitTail sp{tiles, blocks, ctas};
        std::vector<int> seen(size_t(tiles * blocks), 0);
        std::vector<int64_t> merger(size_t(tiles), -1), parts(size_t(tiles), 0);
        std::vector<std::vector<int64_t>> later(static_cast<size_t>(tiles));
        for (int64_t c = 0; c < ctas; ++c) {
          EXPECT_EQ(sp.unit(c, 2).n, 0);
          for (int u = 0; u < 2; ++u) {
            const sm90::SplitTail::Unit x = sp.unit(c, u);
            if (x.n == 0) {
              EXPECT_EQ(sp.unit(c, 1).n, 0) << "a second unit without a first";
              break;
            }
            ASSERT_GE(x.tile, 0);
            ASSERT_LT(x.tile, tiles);
            ASSERT_LE(x.kb0 + x.n, blocks);
            for (int64_t b = x.kb0; b < x.kb0 + x.n; ++b) ++seen[size_t(x.tile * blocks + b)];
            if (x.part == 0) {
              EXPECT_TRUE(x.kb0 == 0 && x.n == blocks);
            } else if (x.part > 0) {
              EXPECT_EQ(x.kb0, 0);
              EXPECT_EQ(merger[size_t(x.tile)], -1);
              merger[size_t(x.tile)] = c;
              parts[size_t(x.tile)] = x.part;
              EXPECT_EQ(sp.unit(c, u + 1).n, 0) << "a merger is its CTA's last unit";
            } else {
              EXPECT_EQ(x.part, -1);
              EXPECT_GT(x.kb0, 0);
              EXPECT_EQ(u, 0) << "a later part is its CTA's first unit";
              later[size_t(x.tile)].push_back(c);
            }
          }
        }
        for (int v : seen) EXPECT_EQ(v, 1);
        for (int64_t t = 0; t < tiles; ++t) {
          EXPECT_EQ(int64_t(later[size_t(t)].size()), parts[size_t(t)]) << "tile " << t;
          for (size_t j = 0; j < later[size_t(t)].size(); ++j)
            EXPECT_EQ(later[size_t(t)][j], merger[size_t(t)] + 1 + int64_t(j)) << "tile " << t;
        }
      }
}

// The double emulation with a split tail against the definition (each part's running max from
// its own first block), every mask, cuts at several places; the split changes the result where a
// cut lies inside the keys a row sees (the comparison is not passing on a no-op), by little.
TEST(Sm90Split, EmulationMatchesTheDefinition) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t Nq = 45, Nk = 300, D = 64, sbk = 32;  // 3 tiles of 16 rows, 10 blocks
  const DefinitionInputs in(rng, Nq, Nk, D);
  for (sage_mask mask :
       {SAGE_MASK_NONE, SAGE_MASK_CAUSAL_TOP_LEFT, SAGE_MASK_CAUSAL_BOTTOM_RIGHT})
    for (const sm90::SplitTail split :
         {sm90::SplitTail{2, 10, 5}, sm90::SplitTail{3, 10, 7}, sm90::SplitTail{1, 10, 3},
          sm90::SplitTail{2, 10, 2}}) {
      SCOPED_TRACE(::testing::Message() << "mask " << mask << ", split " << split.tiles
                                        << " tiles on " << split.ctas << " CTAs");
      const Problem p{1, 1, 1, Nq, Nk, D, 0.125, mask};
      const sage_quant_config whole = definition_config(sbk, 8);
      sage_quant_config cfg = whole;
      cfg.split_tiles = int32_t(split.tiles);
      cfg.split_ctas = int32_t(split.ctas);
      std::vector<double> got(size_t(p.out_elems())), got_lse(size_t(p.lse_elems()));
      std::vector<double> base(got.size()), base_lse(got_lse.size());
      attention_quant(p, cfg, in.q.view(), in.k.view(), in.v.view(), got.data(), got_lse.data());
      attention_quant(p, whole, in.q.view(), in.k.view(), in.v.view(), base.data(),
                      base_lse.data());
      Sm90Definition def{Nq, Nk, D, 16, sbk, 8, mask, 0.125};
      def.split = split;
      std::vector<double> want, want_lse;
      def.run(in.Q, in.K, in.V, &want, &want_lse);
      ASSERT_NO_FATAL_FAILURE(expect_definition(got, got_lse, want, want_lse));
      if (split.ctas > split.tiles) {
        std::vector<float> gf(got.begin(), got.end());
        const Metrics vs_whole = compare(base.data(), gf.data(), p.out_elems());
        // P~ rounded against other running maxima (top-left causal: the split tiles' rows see
        // at most two blocks, so most cuts lie past their keys)
        if (mask != SAGE_MASK_CAUSAL_TOP_LEFT || split.tiles == 3) {
          EXPECT_GT(vs_whole.rel_l1, 1e-6);
        }
        EXPECT_LT(vs_whole.rel_l1, 5e-3);
      } else {  // a CTA a tile: nothing cut
        EXPECT_EQ(0, std::memcmp(got.data(), base.data(), got.size() * sizeof(double)));
      }
    }
}

// The split tail's knobs are validated: both zero, or 0 < split_tiles <= split_ctas, and only
// with the sm90 softmax form.
TEST(Sm90Split, InvalidKnobsAreRejectedByName) {
  sage_quant_config c = quant_preset(SAGE_VARIANT_SAGE2_8B);
  c.softmax_block_k = 128;
  EXPECT_EQ(quant_config_error(c), "");
  for (const auto& [tiles, ctas] : {std::pair{1, 0}, std::pair{0, 1}, std::pair{3, 2},
                                    std::pair{-1, 4}}) {
    c.split_tiles = tiles, c.split_ctas = ctas;
    EXPECT_NE(quant_config_error(c).find("split_tiles"), std::string::npos) << tiles << " " << ctas;
  }
  c.split_tiles = 2, c.split_ctas = 5;
  EXPECT_EQ(quant_config_error(c), "");
  c.softmax_block_k = 0;  // the mma form
  EXPECT_NE(quant_config_error(c).find("sm90"), std::string::npos);
}

TEST(Sm90Form, SoftmaxBlockEqualToBlockKIsTheDefaultBitForBit) {
  std::mt19937_64 rng(test::fresh_seed());
  const int64_t Nq = 150, Nk = 333, D = 64;
  const Fp16Tensor q = test::random_tensor(rng, 1, 2, Nq, D, 1.0f);
  const Fp16Tensor k = test::random_tensor(rng, 1, 1, Nk, D, 4.0f);
  const Fp16Tensor v = test::random_tensor(rng, 1, 1, Nk, D, 4.0f);
  for (sage_variant variant : {SAGE_VARIANT_SAGE2_8B, SAGE_VARIANT_SAGE2_4B})
    for (sage_mask mask : {SAGE_MASK_NONE, SAGE_MASK_CAUSAL_BOTTOM_RIGHT}) {
      const Problem p{1, 2, 1, Nq, Nk, D, 0.125, mask};
      sage_quant_config a = quant_preset(variant), b = a;
      b.softmax_block_k = b.block_k;
      std::vector<float> oa(size_t(p.out_elems())), ob(oa.size()), la(size_t(p.lse_elems())),
          lb(la.size());
      attention_quant(p, a, q.view(), k.view(), v.view(), oa.data(), la.data());
      attention_quant(p, b, q.view(), k.view(), v.view(), ob.data(), lb.data());
      EXPECT_EQ(0, std::memcmp(oa.data(), ob.data(), oa.size() * sizeof(float))) << variant;
      EXPECT_EQ(0, std::memcmp(la.data(), lb.data(), la.size() * sizeof(float))) << variant;
    }
}

TEST(Sm90Form, InvalidKnobsAreRejectedByName) {
  sage_quant_config c = quant_preset(SAGE_VARIANT_SAGE2_8B);  // block_k 64
  for (int32_t sbk : {0, 64, 128, 192, 1024}) {
    c.softmax_block_k = sbk;
    EXPECT_EQ(quant_config_error(c), "") << sbk;
  }
  for (int32_t sbk : {-64, 32, 100, 1 << 20}) {
    c.softmax_block_k = sbk;
    const std::string e = quant_config_error(c);
    EXPECT_NE(e.find("softmax_block_k"), std::string::npos) << sbk << ": " << e;
    EXPECT_NE(e.find(std::to_string(sbk)), std::string::npos) << e;
  }
  c = quant_preset(SAGE_VARIANT_SAGE2_8B);
  for (int32_t every : {0, 2, 4, 8, 16, 32}) {
    c.exp2_poly_every = every;
    EXPECT_EQ(quant_config_error(c), "") << every;
  }
  for (int32_t every : {-8, 1, 3, 6, 64}) {
    c.exp2_poly_every = every;
    const std::string e = quant_config_error(c);
    EXPECT_NE(e.find("exp2_poly_every"), std::string::npos) << every << ": " << e;
  }
  // Per-key-block V scales have no meaning inside a larger softmax block.
  for (sage_v_scale vs : {SAGE_V_SCALE_PER_BLOCK_CHANNEL, SAGE_V_SCALE_PER_BLOCK}) {
    c = quant_preset(SAGE_VARIANT_SAGE2_8B);
    c.v_scale = vs;
    c.softmax_block_k = 128;
    EXPECT_NE(quant_config_error(c).find("v_scale"), std::string::npos) << vs;
    c.softmax_block_k = 0;
    c.exp2_poly_every = 8;
    EXPECT_NE(quant_config_error(c).find("v_scale"), std::string::npos) << vs;
  }
  // The reference refuses them instead of computing something else.
  c = quant_preset(SAGE_VARIANT_SAGE2_8B);
  c.softmax_block_k = 96;
  const Problem p{1, 1, 1, 4, 4, 64, 0.125, SAGE_MASK_NONE};
  std::vector<uint16_t> zeros(4 * 64, 0);
  const TensorView t{zeros.data(), SAGE_DTYPE_FP16, contiguous_strides(SAGE_LAYOUT_HND, 1, 4, 64)};
  std::vector<float> o(256);
  EXPECT_THROW(attention_quant(p, c, t, t, t, o.data(), nullptr), Error);
}

using test::sm90_config;  // the planner's sm90 configuration (cpu/sm90_config.h)

// The seeded accumulator (attn/sm90/softmax.cuh): an int32 wgmma sum started at the bits of
// 1.5·2^23 holds the bits of the float 1.5·2^23 + x for every score x the INT8 values ([-127,
// 127]) can give up to D = 256 (|x| <= 256·127² < 2^22), and that float is exact.
TEST(Sm90Form, SeededScoreIsExactUpToD256) {
  int32_t magic_bits;
  std::memcpy(&magic_bits, &kMagicF, 4);
  const int32_t x_max = 256 * 127 * 127;
  EXPECT_LT(x_max, 1 << 22);
  for (const int32_t x : {x_max, -x_max, x_max - 1, -x_max + 1, 1 << 22, -(1 << 22), 0, 1, -1}) {
    const float want = kMagicF + float(x);
    EXPECT_EQ(double(want), double(kMagicF) + double(x)) << x;  // exact
    const int32_t bits = magic_bits + x;
    float got;
    std::memcpy(&got, &bits, 4);
    EXPECT_EQ(got, want) << x;
  }
}

// Granularity PER_THREAD_WGMMA with the aligned accumulator selects the sm90 form (D = 256's
// plan: softmax_block_k = block_k); the same groups as PER_THREAD_MMA at 16 rows a warp, so the
// form alone moves the result, by little. The validation follows the form.
TEST(Sm90Form, WgmmaGroupsWithTheAlignedAccumulatorSelectTheForm) {
  sage_quant_config c = sm90_config(256, 128);
  EXPECT_TRUE(sm90_softmax_form(c));
  EXPECT_EQ(quant_config_error(c), "");
  sage_quant_config mma_groups = c;
  mma_groups.granularity = SAGE_GRANULARITY_PER_THREAD_MMA;
  EXPECT_FALSE(sm90_softmax_form(mma_groups));
  sage_quant_config fp32 = c;
  fp32.pv_accum = SAGE_PV_ACCUM_FP32;
  EXPECT_FALSE(sm90_softmax_form(fp32));
  sage_quant_config block_v = c;
  block_v.v_scale = SAGE_V_SCALE_PER_BLOCK;
  EXPECT_NE(quant_config_error(block_v).find("v_scale"), std::string::npos);

  std::mt19937_64 rng(test::fresh_seed());
  const int64_t N = 333, D = 256;
  const Fp16Tensor q = test::random_tensor(rng, 1, 2, N, D, 1.0f);
  const Fp16Tensor k = test::random_tensor(rng, 1, 1, N, D, 2.0f);
  const Fp16Tensor v = test::random_tensor(rng, 1, 1, N, D, 2.0f);
  const Problem p{1, 2, 1, N, N, D, 1.0 / 16.0, SAGE_MASK_CAUSAL_BOTTOM_RIGHT};
  std::vector<float> a(size_t(p.out_elems())), b(a.size());
  attention_quant(p, c, q.view(), k.view(), v.view(), a.data(), nullptr);
  attention_quant(p, mma_groups, q.view(), k.view(), v.view(), b.data(), nullptr);
  const std::vector<double> ad(a.begin(), a.end());
  const Metrics m = compare(ad.data(), b.data(), p.out_elems());
  EXPECT_GT(m.rel_l1, 0.0);
  EXPECT_LT(m.rel_l1, 2e-3);
}

// Against float64 the sm90 configuration sits in the 8-bit band, next to the mma kernel's
// (fp32 accumulation): docs/fp8-accumulator.md measured 0.0361 vs 0.0358 rel-L1 on N(0,1) inputs
// (D = 128); smoothing V keeps the aligned accumulator's loss small on channel-biased inputs.
// The float emulation (the kernel's fp32 forms) and the double one (ideal arithmetic, same
// quantization) differ by rounding, mostly the kernel's FFMA form: its bias 1.5·2^23·f + m is
// rounded to fp32, which moves a row half's exponents by up to 0.75·f (the kernel's comment),
// ~1e-5 relative in P~, enough to flip E4M3 ties: ~3e-4 rel-L1 on flat N(0,1) inputs (3e-6
// without the FFMA form), i.e. the scale of what the GPU comparison would see without the model.
TEST(Sm90Form, Sm90ConfigurationErrorIsInTheEightBitBand) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Shape {
    int64_t N, D;
    int32_t block_q;
    float bias;
    sage_mask mask;
  };
  for (const Shape s : {Shape{1000, 128, 128, 0.0f, SAGE_MASK_NONE},
                        Shape{777, 64, 192, 4.0f, SAGE_MASK_CAUSAL_BOTTOM_RIGHT},
                        Shape{600, 128, 128, 4.0f, SAGE_MASK_CAUSAL_TOP_LEFT},
                        Shape{1000, 256, 128, 0.0f, SAGE_MASK_NONE},
                        Shape{555, 256, 128, 4.0f, SAGE_MASK_CAUSAL_BOTTOM_RIGHT}}) {
    SCOPED_TRACE("N " + std::to_string(s.N) + " D " + std::to_string(s.D));
    const Fp16Tensor q = test::random_tensor(rng, 1, 2, s.N, s.D, 0.5f * s.bias);
    const Fp16Tensor k = test::random_tensor(rng, 1, 2, s.N, s.D, s.bias);
    const Fp16Tensor v = test::random_tensor(rng, 1, 2, s.N, s.D, s.bias);
    const Problem p{1, 2, 2, s.N, s.N, s.D, 1.0 / std::sqrt(double(s.D)), s.mask};
    std::vector<double> exact(size_t(p.out_elems()));
    attention_exact(p, q.view(), k.view(), v.view(), exact.data(), nullptr);
    auto error = [&](const sage_quant_config& cfg) {
      std::vector<float> o(exact.size());
      attention_quant(p, cfg, q.view(), k.view(), v.view(), o.data(), nullptr);
      return compare(exact.data(), o.data(), p.out_elems());
    };
    sage_quant_config mma = quant_preset(SAGE_VARIANT_SAGE2_8B);
    mma.pv_accum = SAGE_PV_ACCUM_FP32;  // the mma.sync kernel on sm_90
    const sage_quant_config sm90 = sm90_config(s.D, s.block_q);
    const Metrics e_mma = error(mma), e_sm90 = error(sm90);
    std::printf("    N %lld D %lld bias %g: rel-L1 vs float64 sm90 %.5f mma %.5f\n",
                (long long)s.N, (long long)s.D, double(s.bias), e_sm90.rel_l1, e_mma.rel_l1);
    EXPECT_GT(e_sm90.cos, 0.998);
    EXPECT_LT(e_sm90.rel_l1, s.bias == 0 ? 0.05 : 0.01);
    // The aligned accumulator and the polynomial cost at most a few per cent of the error.
    EXPECT_LT(e_sm90.rel_l1, 1.06 * e_mma.rel_l1);
    EXPECT_GT(e_sm90.rel_l1, 0.94 * e_mma.rel_l1);

    std::vector<float> of(exact.size());
    std::vector<double> od(exact.size());
    attention_quant(p, sm90, q.view(), k.view(), v.view(), of.data(), nullptr);
    attention_quant(p, sm90, q.view(), k.view(), v.view(), od.data(), nullptr);
    const Metrics float_vs_double = compare(od.data(), of.data(), p.out_elems());
    EXPECT_LT(float_vs_double.rel_l1, 1e-3);
  }
}

}  // namespace
}  // namespace sage::ref
