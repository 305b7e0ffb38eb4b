// GoogleTest suites Varlen*: packed variable-length batches (sage_attention_args.cu_seqlens_*) on
// the CPU reference. A packed call equals a dense call per sequence bit for bit (each sequence is
// its own problem: smoothing and quantization never cross a sequence), float64 agrees with a naive
// attention written here, the LSE is [Hq, total_q], empty sequences follow the dense call's fully
// masked rows, each bad argument is named, and the planner's packed GPU plan and row layout.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "api/plan.h"
#include "common/test_util.h"
#include "ref/reference.h"
#include "sage/sage.h"

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

using sage::test::fresh_seed;

int64_t elem_bytes(sage_dtype d) {
  return d == SAGE_DTYPE_FP32 ? 4 : 2;
}

// A packed batch: q, o [total_q, Hq, D], k, v [total_k, Hkv, D] (NHD, contiguous), lse
// [Hq, total_q]; outputs start poisoned.
struct Packed {
  int64_t hq, hkv, d;
  sage_dtype dtype;
  std::vector<int32_t> cu_q{0}, cu_k{0};
  int64_t max_q = 1, max_k = 1;
  std::vector<uint8_t> q, k, v, o;
  std::vector<float> lse;

  Packed(const std::vector<int>& lens_q, const std::vector<int>& lens_k, int64_t hq_, int64_t hkv_,
         int64_t d_, sage_dtype dtype_, std::mt19937_64& rng)
      : hq(hq_), hkv(hkv_), d(d_), dtype(dtype_) {
    for (size_t b = 0; b < lens_q.size(); ++b) {
      cu_q.push_back(cu_q.back() + lens_q[b]);
      cu_k.push_back(cu_k.back() + lens_k[b]);
      max_q = std::max<int64_t>(max_q, lens_q[b]);
      max_k = std::max<int64_t>(max_k, lens_k[b]);
    }
    q = random(total_q() * hq * d, rng);
    k = random(total_k() * hkv * d, rng);
    v = random(total_k() * hkv * d, rng);
    o.assign(q.size(), 0xAB);
    lse.assign(size_t(hq * total_q()), -123.0f);
  }
  int64_t batch() const { return int64_t(cu_q.size()) - 1; }
  int64_t total_q() const { return cu_q.back(); }
  int64_t total_k() const { return cu_k.back(); }

  std::vector<uint8_t> random(int64_t n, std::mt19937_64& rng) const {
    std::vector<uint8_t> x(size_t(n * elem_bytes(dtype)));
    std::normal_distribution<double> normal(0.0, 1.0);
    for (int64_t i = 0; i < n; ++i) sage::ref::store_element(x.data(), dtype, i, normal(rng));
    return x;
  }

  sage_attention_args args(sage_variant variant, sage_mask mask) {
    sage_attention_args a;
    sage_attention_args_init(&a);
    a.q = q.data(), a.k = k.data(), a.v = v.data(), a.o = o.data(), a.lse = lse.data();
    a.batch = batch(), a.heads_q = hq, a.heads_kv = hkv, a.head_dim = d;
    a.seq_q = max_q, a.seq_kv = max_k;
    a.layout = SAGE_LAYOUT_NHD;
    a.dtype = dtype;
    a.mask = mask;
    a.variant = variant;
    a.backend = SAGE_BACKEND_CPU;
    a.cu_seqlens_q = cu_q.data(), a.cu_seqlens_k = cu_k.data();
    a.total_q = total_q(), a.total_k = total_k();
    return a;
  }

  double o_at(int64_t t, int64_t h, int64_t c) const {
    return sage::ref::load_element(o.data(), dtype, (t * hq + h) * d + c);
  }
  uint32_t o_bits(int64_t t, int64_t h, int64_t c) const {
    uint32_t w = 0;
    const int64_t es = elem_bytes(dtype);
    std::memcpy(&w, o.data() + ((t * hq + h) * d + c) * es, size_t(es));
    return w;
  }
};

// Sequence b of `p` as its own dense call (batch 1, NHD): o [1, nq, Hq, D], lse [1, Hq, nq].
struct Dense {
  std::vector<uint8_t> o;
  std::vector<float> lse;
};
Dense dense_call(const Packed& p, int64_t b, sage_variant variant, sage_mask mask) {
  const int64_t q0 = p.cu_q[b], nq = p.cu_q[b + 1] - q0, k0 = p.cu_k[b], nk = p.cu_k[b + 1] - k0,
                es = elem_bytes(p.dtype);
  Dense r;
  r.o.assign(size_t(nq * p.hq * p.d * es), 0);
  r.lse.assign(size_t(p.hq * nq), 0.0f);
  sage_attention_args a;
  sage_attention_args_init(&a);
  a.q = p.q.data() + q0 * p.hq * p.d * es;
  a.k = p.k.data() + k0 * p.hkv * p.d * es;
  a.v = p.v.data() + k0 * p.hkv * p.d * es;
  a.o = r.o.data(), a.lse = r.lse.data();
  a.batch = 1, a.heads_q = p.hq, a.heads_kv = p.hkv, a.head_dim = p.d;
  a.seq_q = nq, a.seq_kv = nk;
  a.layout = SAGE_LAYOUT_NHD;
  a.dtype = p.dtype;
  a.mask = mask;
  a.variant = variant;
  a.backend = SAGE_BACKEND_CPU;
  EXPECT_EQ(sage_attention(&a), SAGE_OK) << sage_last_error();
  return r;
}

const char* variant_name(sage_variant v) {
  return v == SAGE_VARIANT_SAGE2_8B   ? "SAGE2_8B"
         : v == SAGE_VARIANT_SAGE2_4B ? "SAGE2_4B"
                                      : "EXACT";
}
const char* mask_name(sage_mask m) {
  return m == SAGE_MASK_NONE                  ? "none"
         : m == SAGE_MASK_CAUSAL_BOTTOM_RIGHT ? "bottom-right"
                                              : "top-left";
}

// Lengths off every block size, with empty sequences on either side: (1, 17), (17, 1), (100, 100),
// (0, 5), (64, 130), (9, 0).
const std::vector<int> kLensQ = {1, 17, 100, 0, 64, 9}, kLensK = {17, 1, 100, 5, 130, 0};

// Every sequence's rows equal its dense call's bits; a sequence with queries but no keys gives
// the dense call's fully masked rows (o = 0, lse = -inf).
void expect_matches_dense(const Packed& p, sage_variant variant, sage_mask mask) {
  const int64_t es = elem_bytes(p.dtype);
  for (int64_t b = 0; b < p.batch(); ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b));
    const int64_t q0 = p.cu_q[b], nq = p.cu_q[b + 1] - q0, nk = p.cu_k[b + 1] - p.cu_k[b];
    if (nq == 0) continue;
    if (nk == 0) {
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t h = 0; h < p.hq; ++h) {
          EXPECT_EQ(p.lse[size_t(h * p.total_q() + q0 + i)], -kInf);
          for (int64_t c = 0; c < p.d; ++c) ASSERT_EQ(p.o_at(q0 + i, h, c), 0.0);
        }
      continue;
    }
    const Dense dense = dense_call(p, b, variant, mask);
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t h = 0; h < p.hq; ++h) {
        const float want = dense.lse[size_t(h * nq + i)],
                    got = p.lse[size_t(h * p.total_q() + q0 + i)];
        ASSERT_EQ(std::memcmp(&want, &got, sizeof want), 0)
            << "lse row " << i << " head " << h << ": " << got << " vs dense " << want;
        for (int64_t c = 0; c < p.d; ++c) {
          uint32_t w = 0;
          std::memcpy(&w, dense.o.data() + ((i * p.hq + h) * p.d + c) * es, size_t(es));
          ASSERT_EQ(p.o_bits(q0 + i, h, c), w) << "o row " << i << " head " << h << " ch " << c;
        }
      }
  }
}

TEST(Varlen, PackedEqualsDenseCallPerSequence) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed = " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (sage_variant variant : {SAGE_VARIANT_SAGE2_8B, SAGE_VARIANT_SAGE2_4B, SAGE_VARIANT_EXACT})
    for (sage_mask mask :
         {SAGE_MASK_NONE, SAGE_MASK_CAUSAL_BOTTOM_RIGHT, SAGE_MASK_CAUSAL_TOP_LEFT}) {
      SCOPED_TRACE(std::string(variant_name(variant)) + ", causal " + mask_name(mask));
      Packed p(kLensQ, kLensK, /*hq=*/4, /*hkv=*/2, /*d=*/32, SAGE_DTYPE_FP16, rng);
      sage_attention_args a = p.args(variant, mask);
      ASSERT_EQ(sage_attention(&a), SAGE_OK) << sage_last_error();
      expect_matches_dense(p, variant, mask);
    }
}

// K smoothing's mean, V's mean and every scale stay inside a sequence: a huge channel bias on
// sequence 0's keys and values leaves every other sequence's bits unchanged.
TEST(Varlen, NothingCrossesSequences) {
  std::mt19937_64 rng(fresh_seed());
  Packed p({33, 70, 20}, {40, 90, 3}, 2, 1, 64, SAGE_DTYPE_FP16, rng);
  sage_quant_config cfg;
  sage_quant_config_init(&cfg, SAGE_VARIANT_SAGE2_4B);
  cfg.smooth = SAGE_SMOOTH_Q | SAGE_SMOOTH_K | SAGE_SMOOTH_V;
  sage_attention_args a = p.args(SAGE_VARIANT_CUSTOM, SAGE_MASK_CAUSAL_BOTTOM_RIGHT);
  a.quant = cfg;
  ASSERT_EQ(sage_attention(&a), SAGE_OK) << sage_last_error();
  const std::vector<uint8_t> before = p.o;
  const std::vector<float> lse_before = p.lse;
  for (int64_t t = 0; t < p.cu_k[1]; ++t)
    for (int64_t c = 0; c < p.hkv * p.d; ++c) {
      const int64_t i = t * p.hkv * p.d + c;
      sage::ref::store_element(p.k.data(), p.dtype, i,
                               sage::ref::load_element(p.k.data(), p.dtype, i) + 40.0 + c % 7);
      sage::ref::store_element(p.v.data(), p.dtype, i,
                               sage::ref::load_element(p.v.data(), p.dtype, i) - 30.0);
    }
  ASSERT_EQ(sage_attention(&a), SAGE_OK) << sage_last_error();
  const size_t row_bytes = size_t(p.hq * p.d * 2);
  EXPECT_NE(std::memcmp(before.data(), p.o.data(), size_t(p.cu_q[1]) * row_bytes), 0);
  EXPECT_EQ(std::memcmp(before.data() + p.cu_q[1] * row_bytes, p.o.data() + p.cu_q[1] * row_bytes,
                        before.size() - p.cu_q[1] * row_bytes),
            0);
  for (int64_t h = 0; h < p.hq; ++h)
    for (int64_t t = p.cu_q[1]; t < p.total_q(); ++t)
      EXPECT_EQ(lse_before[size_t(h * p.total_q() + t)], p.lse[size_t(h * p.total_q() + t)]);
}

// float64 varlen against attention written from the definition, per sequence and per alignment.
TEST(Varlen, ExactMatchesNaiveFloat64) {
  std::mt19937_64 rng(fresh_seed());
  for (sage_mask mask :
       {SAGE_MASK_NONE, SAGE_MASK_CAUSAL_BOTTOM_RIGHT, SAGE_MASK_CAUSAL_TOP_LEFT}) {
    SCOPED_TRACE(std::string("causal ") + mask_name(mask));
    Packed p(kLensQ, kLensK, 6, 2, 24, SAGE_DTYPE_FP32, rng);
    sage_attention_args a = p.args(SAGE_VARIANT_EXACT, mask);
    a.scale = 0.3f;
    ASSERT_EQ(sage_attention(&a), SAGE_OK) << sage_last_error();
    auto ld = [&](const std::vector<uint8_t>& x, int64_t i) {
      return double(sage::ref::load_element(x.data(), p.dtype, i));
    };
    for (int64_t b = 0; b < p.batch(); ++b) {
      const int64_t q0 = p.cu_q[b], nq = p.cu_q[b + 1] - q0, k0 = p.cu_k[b],
                    nk = p.cu_k[b + 1] - k0;
      for (int64_t h = 0; h < p.hq; ++h) {
        const int64_t hk = h / (p.hq / p.hkv);
        for (int64_t i = 0; i < nq; ++i) {
          int64_t visible = nk;
          if (mask == SAGE_MASK_CAUSAL_BOTTOM_RIGHT)
            visible = std::clamp<int64_t>(i + 1 + nk - nq, 0, nk);
          if (mask == SAGE_MASK_CAUSAL_TOP_LEFT) visible = std::min<int64_t>(i + 1, nk);
          std::vector<double> s(static_cast<size_t>(visible));
          double mx = -kInf;
          for (int64_t j = 0; j < visible; ++j) {
            double dot = 0;
            for (int64_t c = 0; c < p.d; ++c)
              dot += ld(p.q, ((q0 + i) * p.hq + h) * p.d + c) *
                     ld(p.k, ((k0 + j) * p.hkv + hk) * p.d + c);
            s[size_t(j)] = 0.3 * dot;
            mx = std::max(mx, s[size_t(j)]);
          }
          double sum = 0;
          for (double& x : s) sum += (x = std::exp(x - mx));
          const float lse = p.lse[size_t(h * p.total_q() + q0 + i)];
          if (visible == 0) {
            EXPECT_EQ(lse, -kInf);
          } else {
            EXPECT_NEAR(lse, mx + std::log(sum), 1e-5);
          }
          for (int64_t c = 0; c < p.d; ++c) {
            double want = 0;
            for (int64_t j = 0; j < visible; ++j)
              want += s[size_t(j)] * ld(p.v, ((k0 + j) * p.hkv + hk) * p.d + c);
            want = visible ? want / sum : 0.0;
            ASSERT_NEAR(p.o_at(q0 + i, h, c), want, 1e-6 + 1e-6 * std::abs(want))
                << "sequence " << b << " head " << h << " row " << i << " ch " << c;
          }
        }
      }
    }
  }
}

// The LSE's strides are honoured ([total_q, Hq] here), and omitting it changes no bit of o.
TEST(Varlen, LseStridesAndOptional) {
  std::mt19937_64 rng(fresh_seed());
  Packed p({5, 40}, {12, 40}, 3, 3, 16, SAGE_DTYPE_FP16, rng);
  sage_attention_args a = p.args(SAGE_VARIANT_SAGE2_8B, SAGE_MASK_NONE);
  ASSERT_EQ(sage_attention(&a), SAGE_OK) << sage_last_error();
  const std::vector<uint8_t> o = p.o;
  const std::vector<float> lse = p.lse;
  std::vector<float> token_major(lse.size(), 0.0f);
  a.lse = token_major.data();
  a.lse_strides = {0, 1, p.hq};
  ASSERT_EQ(sage_attention(&a), SAGE_OK) << sage_last_error();
  for (int64_t h = 0; h < p.hq; ++h)
    for (int64_t t = 0; t < p.total_q(); ++t)
      EXPECT_EQ(token_major[size_t(t * p.hq + h)], lse[size_t(h * p.total_q() + t)]);
  a.lse = nullptr;
  a.lse_strides = {};
  std::fill(p.o.begin(), p.o.end(), uint8_t(0));
  ASSERT_EQ(sage_attention(&a), SAGE_OK) << sage_last_error();
  EXPECT_EQ(p.o, o);
}

// Each bad packed argument: INVALID_ARGUMENT, a message naming it, o and lse untouched.
TEST(VarlenErrors, EachNamesItsArgument) {
  std::mt19937_64 rng(fresh_seed());
  Packed p({3, 8}, {4, 8}, 2, 2, 16, SAGE_DTYPE_FP16, rng);
  struct Case {
    const char* name;
    const char* names;
    std::function<void(sage_attention_args&, std::vector<int32_t>&, std::vector<int32_t>&)> edit;
  };
  const std::vector<Case> cases = {
      {"only cu_seqlens_q", "cu_seqlens_k",
       [](auto& a, auto&, auto&) { a.cu_seqlens_k = nullptr; }},
      {"only cu_seqlens_k", "cu_seqlens_q",
       [](auto& a, auto&, auto&) { a.cu_seqlens_q = nullptr; }},
      {"HND layout", "layout", [](auto& a, auto&, auto&) { a.layout = SAGE_LAYOUT_HND; }},
      {"total_q 0", "total_q", [](auto& a, auto&, auto&) { a.total_q = 0; }},
      {"total_k 0", "total_k", [](auto& a, auto&, auto&) { a.total_k = 0; }},
      {"a batch stride", "q_strides",
       [](auto& a, auto&, auto&) {
         a.q_strides = {64, 16, 32};
       }},
      {"lse batch stride", "lse_strides",
       [](auto& a, auto&, auto&) {
         a.lse_strides = {11, 11, 1};
       }},
      {"cu_seqlens_q not from 0", "cu_seqlens_q", [](auto&, auto& q, auto&) { q[0] = 1; }},
      {"cu_seqlens_k decreasing", "cu_seqlens_k", [](auto&, auto&, auto& k) { k[2] = 3; }},
      {"last entry != total_q", "total_q", [](auto& a, auto&, auto&) { a.total_q = 10; }},
      {"last entry != total_k", "total_k", [](auto& a, auto&, auto&) { a.total_k = 11; }},
      {"sequence longer than seq_q", "seq_q", [](auto& a, auto&, auto&) { a.seq_q = 7; }},
      {"sequence longer than seq_kv", "seq_kv", [](auto& a, auto&, auto&) { a.seq_kv = 5; }},
      {"o overlaps cu_seqlens_q", "cu_seqlens_q",
       [](auto& a, auto& q, auto&) {
         a.cu_seqlens_q = reinterpret_cast<int32_t*>(a.o);
         (void)q;
       }},
  };
  const std::vector<uint8_t> o0 = p.o;
  const std::vector<float> lse0 = p.lse;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<int32_t> cu_q = p.cu_q, cu_k = p.cu_k;
    sage_attention_args a = p.args(SAGE_VARIANT_SAGE2_8B, SAGE_MASK_NONE);
    a.cu_seqlens_q = cu_q.data(), a.cu_seqlens_k = cu_k.data();
    c.edit(a, cu_q, cu_k);
    EXPECT_EQ(sage_attention(&a), SAGE_ERROR_INVALID_ARGUMENT);
    const std::string msg = sage_last_error();
    EXPECT_NE(msg.find(c.names), std::string::npos) << msg;
    if (std::getenv("SAGE_PRINT_ERRORS")) std::printf("%s\n", msg.c_str());
    EXPECT_EQ(p.o, o0);
    EXPECT_EQ(p.lse, lse0);
    // The queries validate exactly as the call does.
    size_t bytes = 1;
    EXPECT_EQ(sage_attention_workspace_size(&a, &bytes), SAGE_ERROR_INVALID_ARGUMENT);
  }
  // Valid packed args on the CPU: no workspace, a CPU plan.
  sage_attention_args a = p.args(SAGE_VARIANT_SAGE2_8B, SAGE_MASK_NONE);
  size_t bytes = 1;
  EXPECT_EQ(sage_attention_workspace_size(&a, &bytes), SAGE_OK) << sage_last_error();
  EXPECT_EQ(bytes, 0u);
  sage_plan_info info{};
  info.struct_size = sizeof info;
  EXPECT_EQ(sage_attention_plan(&a, &info), SAGE_OK) << sage_last_error();
  EXPECT_EQ(info.backend, SAGE_BACKEND_CPU);
}

// The planner takes packed batches on the GPU (a described H100: a CUDA call needs device
// pointers; the GPU suite runs them): AUTO the wgmma kernel (fused Q), mma.sync when forced, a
// workspace sized by the totals and the batch (each sequence padded to 128 rows, not to
// max_seqlen), every CTA's sequence found on the device.
TEST(VarlenPlan, PackedBatchesRunOnTheWgmmaKernel) {
  std::mt19937_64 rng(fresh_seed());
  Packed p({64, 128, 0, 5}, {64, 128, 7, 0}, 2, 2, 128, SAGE_DTYPE_FP16, rng);
  sage_attention_args a = p.args(SAGE_VARIANT_SAGE2_8B, SAGE_MASK_NONE);
  sage::api::Resolved r;
  ASSERT_EQ(sage::api::validate(&a, &r), SAGE_OK) << sage_last_error();
  ASSERT_TRUE(r.packed());
  const sage::api::Device h100{0, 90, 132, 8};
  sage::api::Plan plan;
  ASSERT_EQ(sage::api::make_plan(r, a, h100, &plan), SAGE_OK) << sage_last_error();
  EXPECT_EQ(plan.family, sage::api::Family::kSm90);
  EXPECT_TRUE(plan.fused_q);
  EXPECT_FALSE(plan.prefer_sdpa);
  // The workspace below is mma.sync's (its pre-pass quantizes Q too).
  a.kernel = SAGE_KERNEL_MMA;
  ASSERT_EQ(sage::api::make_plan(r, a, h100, &plan), SAGE_OK) << sage_last_error();
  EXPECT_EQ(plan.family, sage::api::Family::kMma);
  const sage::quant::PrepassPlan& w = plan.prepass;
  EXPECT_TRUE(w.q_rows.packed());
  EXPECT_EQ(w.q_rows.pitch, sage::quant::packed_pitch(p.total_q(), p.batch()));
  EXPECT_EQ(w.kv_rows.pitch, sage::quant::packed_pitch(p.total_k(), p.batch()));
  EXPECT_EQ(w.q_blocks, 1);  // the longest sequence's (the grid's extent)
  EXPECT_EQ(w.k_blocks, 2);
  // K̂: Hkv · pitch rows of D bytes (INT8).
  EXPECT_GE(w.k_scale - w.k, size_t(2 * w.kv_rows.pitch * 128));
  EXPECT_LT(w.k_scale - w.k, size_t(2 * w.kv_rows.pitch * 128) + 256);
  // The same call forced onto the wgmma kernel, or in FP4: refused naming what.
  // The wgmma kernel when forced (validation on host pointers refuses a forced GPU family: the
  // planner sees the args as a CUDA call would pass them): fused Q, two consumers; with the
  // pre-pass's Q, or on another GPU, refused naming the kernel.
  a.kernel = SAGE_KERNEL_SM90;
  ASSERT_EQ(sage::api::make_plan(r, a, h100, &plan), SAGE_OK) << sage_last_error();
  EXPECT_EQ(plan.family, sage::api::Family::kSm90);
  EXPECT_TRUE(plan.fused_q);
  EXPECT_EQ(plan.consumers, 2);
  EXPECT_EQ(plan.block_q, 128);
  a.options = SAGE_OPTION_PREPASS_Q;
  EXPECT_EQ(sage::api::make_plan(r, a, h100, &plan), SAGE_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(sage_last_error()).find("kernel = SM90"), std::string::npos)
      << sage_last_error();
  a.options = 0;
  EXPECT_EQ(sage::api::make_plan(r, a, sage::api::Device{0, 89, 128, 0}, &plan),
            SAGE_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(sage_last_error()).find("kernel = SM90"), std::string::npos)
      << sage_last_error();
  a.kernel = SAGE_KERNEL_AUTO;
  a.variant = SAGE_VARIANT_SAGE3_FP4;
  r.quant = sage::ref::quant_preset(SAGE_VARIANT_SAGE3_FP4);
  EXPECT_EQ(sage::api::make_plan(r, a, h100, &plan), SAGE_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(sage_last_error()).find("cu_seqlens_q"), std::string::npos)
      << sage_last_error();
}

// The packed workspace rows: every sequence gets at least 128·⌈len/128⌉ rows of its own, starts
// 128-aligned, and the last one ends within packed_pitch (total + 128·batch, rounded), for
// fresh random lengths (zeros and multiples of 128 included) — what keeps one sequence's K̂, V̂ᵀ,
// statistics and Q̂ out of another's. The span read back clamps bad cu_seqlens into the tensors.
TEST(VarlenPlan, PackedRowsNeverOverlapAndFitThePitch) {
  std::mt19937_64 rng(fresh_seed());
  for (int trial = 0; trial < 200; ++trial) {
    const int batch = 1 + int(rng() % 80);
    std::vector<int32_t> cu{0};
    int64_t longest = 0;
    for (int b = 0; b < batch; ++b) {
      const int kind = int(rng() % 4);
      const int len = kind == 0 ? 0 : kind == 1 ? 128 * int(rng() % 5) : int(rng() % 3000);
      cu.push_back(cu.back() + len);
      longest = std::max<int64_t>(longest, len);
    }
    const int64_t total = cu.back();
    sage::quant::SeqRows rows{cu.data(), longest, total,
                              sage::quant::packed_pitch(total, batch), 0};
    int64_t end = 0;
    for (int b = 0; b < batch; ++b) {
      const sage::quant::SeqSpan s = rows.span(b);
      ASSERT_EQ(s.tok0, cu[size_t(b)]);
      ASSERT_EQ(s.len, cu[size_t(b) + 1] - cu[size_t(b)]);
      ASSERT_EQ(s.ws0 % 128, 0);
      ASSERT_GE(s.ws0, end) << "sequence " << b << " overlaps the previous one";
      end = s.ws0 + (s.len + 127) / 128 * 128;
      ASSERT_LE(end, rows.pitch) << "sequence " << b;
    }
  }
  // Lengths the caller got wrong stay inside [0, total] and max_seqlen.
  const std::vector<int32_t> bad = {5, -3, 1000};
  sage::quant::SeqRows rows{bad.data(), 100, 50, sage::quant::packed_pitch(50, 2), 0};
  for (int b = 0; b < 2; ++b) {
    const sage::quant::SeqSpan s = rows.span(b);
    EXPECT_GE(s.tok0, 0);
    EXPECT_GE(s.len, 0);
    EXPECT_LE(s.tok0 + s.len, 50);
    EXPECT_LE(s.ws0 + (s.len + 127) / 128 * 128, rows.pitch);
  }
}

}  // namespace
