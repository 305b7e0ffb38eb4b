// The kernel-family emulations (src/ref/emulate_*.cpp) held bit for bit to the single interpreter
// they replaced (issue 32): each case runs ref::attention_quant, float and double, and hashes the
// bits of O and the LSE. The hashes (oracle_golden.inc) were produced by the interpreter as it
// stood at 3758249 (src/ref/attention_quant.cpp before the split): at commit 700d2a4, this test
// run with SAGE_ORACLE_PRINT_GOLDEN=1 prints them. Until the split was done, a verbatim copy of
// that interpreter also ran beside the families on 5,120 random configs and problems, equal bit for
// bit (commit e456563). A change to what any family computes changes a hash: a deliberate one
// regenerates the table with SAGE_ORACLE_PRINT_GOLDEN=1 and says why in its commit (the sm90
// form's running-max slack, its D = 128 polynomial share and its row sums did).
// The inputs come from a hand-written generator (splitmix64, sums of uniforms) so that the hashes
// do not depend on the standard library's distributions; they do depend on the C library's exp2
// and log2 (glibc here).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/formats.h"
#include "cpu/sm90_config.h"
#include "ref/ablations.h"
#include "ref/reference.h"

namespace sage::ref {
namespace {

struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  int64_t below(int64_t n) { return int64_t(next() % uint64_t(n)); }
  double uniform() { return double(next() >> 40) * 0x1p-24; }  // [0, 1), 24 bits: exact
  // About N(0, 1): the sum of four uniforms, centred and scaled (exact double arithmetic).
  double normal() {
    return (uniform() + uniform() + uniform() + uniform() - 2.0) * 1.7320508075688772;
  }
  template <typename T>
  const T& pick(const std::vector<T>& v) { return v[size_t(below(int64_t(v.size())))]; }
};

// One call: the problem, its config and how its inputs are drawn.
struct Case {
  std::string name;
  sage_quant_config cfg;
  int64_t B = 1, Hq = 1, Hkv = 1, Nq = 1, Nk = 1, D = 64;
  sage_mask mask = SAGE_MASK_NONE;
  sage_dtype dtype = SAGE_DTYPE_FP16;
  sage_layout layout = SAGE_LAYOUT_HND;
  double bias = 0.0;       // std of a per-(head, channel) bias (what smoothing removes)
  double outliers = 0.0;   // share of elements multiplied by 16
  bool nonfinite = false;  // one Inf and one NaN in each of Q, K, V
  uint64_t seed = 1;
};

struct Inputs {
  std::vector<uint8_t> q, k, v;
  sage_strides sq{}, sk{};
};

void store(std::vector<uint8_t>& buf, sage_dtype dt, int64_t i, double x) {
  if (dt == SAGE_DTYPE_FP32) {
    const float f = float(x);
    std::memcpy(&buf[size_t(i * 4)], &f, 4);
  } else {
    const uint16_t h = uint16_t(encode_float(dt == SAGE_DTYPE_FP16 ? kFp16 : kBf16, x, false));
    std::memcpy(&buf[size_t(i * 2)], &h, 2);
  }
}

std::vector<uint8_t> draw(Rng& rng, const Case& c, int64_t H, int64_t N, const sage_strides& s) {
  const int64_t es = c.dtype == SAGE_DTYPE_FP32 ? 4 : 2, n = c.B * H * N * c.D;
  std::vector<uint8_t> buf(size_t(n * es), 0);
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      std::vector<double> bias(size_t(c.D));
      for (double& x : bias) x = c.bias * rng.normal();
      for (int64_t t = 0; t < N; ++t)
        for (int64_t d = 0; d < c.D; ++d) {
          double x = rng.normal() + bias[size_t(d)];
          if (c.outliers > 0 && rng.uniform() < c.outliers) x *= 16;
          store(buf, c.dtype, b * s.batch + h * s.head + t * s.token + d, x);
        }
    }
  if (c.nonfinite) {
    const double bad[2] = {std::numeric_limits<double>::infinity(),
                           std::numeric_limits<double>::quiet_NaN()};
    for (double x : bad) {
      const int64_t b = rng.below(c.B), h = rng.below(H), t = rng.below(N), d = rng.below(c.D);
      store(buf, c.dtype, b * s.batch + h * s.head + t * s.token + d, x);
    }
  }
  return buf;
}

Problem problem_of(const Case& c) {
  Problem p;
  p.batch = c.B, p.heads_q = c.Hq, p.heads_kv = c.Hkv, p.seq_q = c.Nq, p.seq_kv = c.Nk;
  p.head_dim = c.D, p.mask = c.mask;
  p.scale = 1.0 / std::sqrt(double(c.D));
  return p;
}

Inputs inputs_of(const Case& c) {
  Rng rng{c.seed};
  Inputs in;
  in.sq = contiguous_strides(c.layout, c.Hq, c.Nq, c.D);
  in.sk = contiguous_strides(c.layout, c.Hkv, c.Nk, c.D);
  in.q = draw(rng, c, c.Hq, c.Nq, in.sq);
  in.k = draw(rng, c, c.Hkv, c.Nk, in.sk);
  in.v = draw(rng, c, c.Hkv, c.Nk, in.sk);
  return in;
}

uint64_t fnv(uint64_t h, const void* data, size_t n) {
  const auto* b = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001B3ull;
  return h;
}

// O and LSE of one case, float and double, as bits.
struct Result {
  std::vector<float> of, lf;
  std::vector<double> od, ld;
  uint64_t hash_float() const {
    return fnv(fnv(0xCBF29CE484222325ull, of.data(), of.size() * 4), lf.data(), lf.size() * 4);
  }
  uint64_t hash_double() const {
    return fnv(fnv(0xCBF29CE484222325ull, od.data(), od.size() * 8), ld.data(), ld.size() * 8);
  }
};

template <typename Fn>
Result run_case(const Case& c, Fn&& fn) {
  const Problem p = problem_of(c);
  const Inputs in = inputs_of(c);
  const TensorView q{in.q.data(), c.dtype, in.sq}, k{in.k.data(), c.dtype, in.sk},
      v{in.v.data(), c.dtype, in.sk};
  Result r;
  r.of.assign(size_t(p.out_elems()), 0.0f), r.lf.assign(size_t(p.lse_elems()), 0.0f);
  r.od.assign(size_t(p.out_elems()), 0.0), r.ld.assign(size_t(p.lse_elems()), 0.0);
  fn(p, c.cfg, q, k, v, r.of.data(), r.lf.data());
  fn(p, c.cfg, q, k, v, r.od.data(), r.ld.data());
  return r;
}

Result run_new(const Case& c) {
  return run_case(c, [](const Problem& p, const sage_quant_config& cfg, const TensorView& q,
                        const TensorView& k, const TensorView& v, auto* o, auto* l) {
    attention_quant(p, cfg, q, k, v, o, l, 2);
  });
}

// ---- The fixed cases: every family's real configs and the ablation knobs the tests turn.

// The planner's emulation configs (src/api/plan.cpp), written out: the sm90 kernel's for 1..3
// consumers of 64 rows (cpu/sm90_config.h).
sage_quant_config sm90_config(int64_t D, int consumers) {
  return test::sm90_config(D, 64 * consumers);
}
// The mma.sync kernel: two-level on sm_89/sm_120, one fp32 level on sm_90.
sage_quant_config mma_config(sage_variant variant, bool two_level) {
  sage_quant_config e = quant_preset(variant);
  e.pv_accum = two_level ? SAGE_PV_ACCUM_TWO_LEVEL : SAGE_PV_ACCUM_FP32;
  return e;
}

std::vector<Case> golden_cases() {
  std::vector<Case> cases;
  uint64_t seed = 100;
  auto add = [&](const std::string& name, const sage_quant_config& cfg, int64_t Nq, int64_t Nk,
                 int64_t D, sage_mask mask, auto&& tweak) {
    Case c;
    c.name = name, c.cfg = cfg, c.Nq = Nq, c.Nk = Nk, c.D = D, c.mask = mask;
    c.B = 1, c.Hq = 2, c.Hkv = 1, c.bias = 0.5, c.seed = seed++;
    tweak(c);
    cases.push_back(c);
  };
  auto none = [](Case&) {};
  const sage_mask masks[] = {SAGE_MASK_NONE, SAGE_MASK_CAUSAL_TOP_LEFT,
                             SAGE_MASK_CAUSAL_BOTTOM_RIGHT};
  const char* mask_name[] = {"none", "causal-tl", "causal-br"};
  for (int m = 0; m < 3; ++m) {
    const std::string mn = mask_name[m];
    for (const int64_t D : {64, 128, 256})
      for (const int consumers : {1, 2, 3}) {
        if (D == 256 && consumers == 3) continue;
        add("sm90 D" + std::to_string(D) + " x" + std::to_string(consumers) + " " + mn,
            sm90_config(D, consumers), 203, 333, D, masks[m], none);
      }
    add("mma 8b two-level " + mn, mma_config(SAGE_VARIANT_SAGE2_8B, true), 259, 197, 64,
        masks[m], none);
    add("mma 8b fp32 " + mn, mma_config(SAGE_VARIANT_SAGE2_8B, false), 197, 259, 128, masks[m],
        none);
    add("mma 4b two-level " + mn, mma_config(SAGE_VARIANT_SAGE2_4B, true), 150, 150, 72,
        masks[m], none);
    add("mma 4b fp32 " + mn, mma_config(SAGE_VARIANT_SAGE2_4B, false), 129, 300, 64, masks[m],
        none);
    add("fp4 sage3 " + mn, quant_preset(SAGE_VARIANT_SAGE3_FP4), 200, 177, 64, masks[m], none);
  }
  // GQA, batches, layouts, dtypes, outliers and non-finite inputs on each family.
  const std::pair<const char*, sage_quant_config> fam[] = {
      {"sm90 D128", sm90_config(128, 2)},
      {"mma 8b", mma_config(SAGE_VARIANT_SAGE2_8B, true)},
      {"fp4", quant_preset(SAGE_VARIANT_SAGE3_FP4)}};
  for (const auto& [name, cfg] : fam) {
    add(std::string(name) + " gqa nhd bf16", cfg, 77, 190, 128, SAGE_MASK_CAUSAL_BOTTOM_RIGHT,
        [](Case& c) {
          c.B = 2, c.Hq = 4, c.Hkv = 2, c.layout = SAGE_LAYOUT_NHD, c.dtype = SAGE_DTYPE_BF16;
        });
    add(std::string(name) + " outliers fp32", cfg, 140, 140, 64, SAGE_MASK_NONE, [](Case& c) {
      c.outliers = 0.01, c.dtype = SAGE_DTYPE_FP32, c.bias = 3;
    });
    add(std::string(name) + " non-finite", cfg, 130, 260, 64, SAGE_MASK_CAUSAL_TOP_LEFT,
        [](Case& c) { c.nonfinite = true, c.Hq = 3, c.Hkv = 3; });
    add(std::string(name) + " one key", cfg, 33, 1, 64, SAGE_MASK_NONE, none);
    add(std::string(name) + " more queries than keys", cfg, 300, 70, 64,
        SAGE_MASK_CAUSAL_BOTTOM_RIGHT, none);
  }
  // The ablation rows of `sage accuracy` (the knobs the tests turn: groups, formats, smoothing,
  // V scales, accumulators, FP4 formats and P~ levels).
  int row = 0;
  for (const AblationRow& a : paper_ablations()) {
    add("ablation " + std::to_string(row) + " " + a.label, a.cfg, 180, 230, 64,
        row % 2 ? SAGE_MASK_CAUSAL_BOTTOM_RIGHT : SAGE_MASK_NONE, none);
    ++row;
  }
  // Knobs no row turns: the sm90 form's own ablations (polynomial shares, softmax blocks, other
  // accumulators, Q smoothing, formats), and the mma form's odd tiles.
  for (const int every : {2, 4, 16}) {
    sage_quant_config c = sm90_config(64, 2);
    c.exp2_poly_every = every;
    add("sm90 poly every " + std::to_string(every), c, 150, 400, 64, SAGE_MASK_CAUSAL_TOP_LEFT,
        none);
  }
  {
    sage_quant_config c = sm90_config(64, 1);
    c.softmax_block_k = 256;
    add("sm90 softmax block 256", c, 100, 500, 64, SAGE_MASK_CAUSAL_BOTTOM_RIGHT, none);
    c.pv_accum = SAGE_PV_ACCUM_TWO_LEVEL, c.pv_flush_interval = 2;
    add("sm90 form two-level every 2", c, 100, 500, 64, SAGE_MASK_NONE, none);
    c.pv_accum = SAGE_PV_ACCUM_HW;
    add("sm90 form hw accumulator", c, 100, 500, 64, SAGE_MASK_NONE, none);
    c.pv_accum = SAGE_PV_ACCUM_FP32;
    c.smooth |= SAGE_SMOOTH_Q;
    add("sm90 form fp32 smooth q", c, 100, 500, 64, SAGE_MASK_CAUSAL_TOP_LEFT, none);
    c.qk_format = SAGE_QK_FP8_E4M3, c.pv_format = SAGE_PV_FP16;
    add("sm90 form fp8 qk fp16 pv", c, 100, 300, 64, SAGE_MASK_NONE, none);
    c.qk_format = SAGE_QK_NVFP4, c.pv_format = SAGE_PV_INT8;
    add("sm90 form nvfp4 qk int8 pv", c, 100, 300, 64, SAGE_MASK_NONE, none);
  }
  {
    sage_quant_config c = mma_config(SAGE_VARIANT_SAGE2_8B, true);
    c.block_q = 64, c.warps = 4, c.block_k = 32, c.accum_chunk = 16, c.k_mean_tokens = 0;
    add("mma tile 64x32", c, 111, 222, 40, SAGE_MASK_CAUSAL_TOP_LEFT, none);
    c.v_scale = SAGE_V_SCALE_PER_BLOCK;
    add("mma pow2 v scale", c, 111, 222, 40, SAGE_MASK_CAUSAL_BOTTOM_RIGHT, none);
    c.v_scale = SAGE_V_SCALE_PER_BLOCK_CHANNEL;
    add("mma block-channel v scale", c, 111, 222, 40, SAGE_MASK_NONE, none);
    c = quant_preset(SAGE_VARIANT_SAGE3_FP4);
    c.pv_format = SAGE_PV_MXFP4, c.pv_accum = SAGE_PV_ACCUM_HW, c.block_k = 96;
    add("fp4 mxfp4 hw accumulator", c, 150, 250, 64, SAGE_MASK_NONE, none);
    c.pv_format = SAGE_PV_NVFP4_DIRECT, c.pv_accum = SAGE_PV_ACCUM_ALIGNED, c.block_k = 32;
    add("fp4 nvfp4 direct aligned", c, 150, 250, 64, SAGE_MASK_CAUSAL_TOP_LEFT, none);
    c.pv_format = SAGE_PV_NVFP4, c.pv_accum = SAGE_PV_ACCUM_TWO_LEVEL, c.qk_format = SAGE_QK_INT8;
    add("fp4 pv int8 qk", c, 150, 250, 64, SAGE_MASK_NONE, none);
  }
  return cases;
}

struct Golden {
  const char* name;
  uint64_t hash_float, hash_double;
};
// Produced by the interpreter at 3758249 (see the file comment).
const Golden kGolden[] = {
#include "cpu/oracle_golden.inc"
};

TEST(OracleFamilies, GoldenHashesOfTheInterpreterTheyReplaced) {
  const std::vector<Case> cases = golden_cases();
  if (std::getenv("SAGE_ORACLE_PRINT_GOLDEN")) {
    for (const Case& c : cases) {
      const Result r = run_new(c);
      std::printf("    {\"%s\", 0x%016llxull, 0x%016llxull},\n", c.name.c_str(),
                  (unsigned long long)r.hash_float(), (unsigned long long)r.hash_double());
    }
    GTEST_SKIP() << "printed the table";
  }
  ASSERT_EQ(sizeof kGolden / sizeof kGolden[0], cases.size())
      << "the case list and the table differ";
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    ASSERT_EQ(c.name, kGolden[i].name);
    ASSERT_EQ(quant_config_error(c.cfg), "") << c.name;
    const Result r = run_new(c);
    EXPECT_EQ(r.hash_float(), kGolden[i].hash_float) << c.name << " (float)";
    EXPECT_EQ(r.hash_double(), kGolden[i].hash_double) << c.name << " (double)";
  }
}

}  // namespace
}  // namespace sage::ref
