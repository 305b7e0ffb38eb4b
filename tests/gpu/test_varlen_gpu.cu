// Packed variable-length batches on the GPU: every sequence of a packed call must give, bit for
// bit, what the same kernel family gives for that sequence alone as a dense call (statistics,
// quantization groups and the causal alignment are per sequence by construction, so the two
// compute the same operations in the same order). Lengths off the block sizes, empty sequences,
// Nq != Nk, GQA, both causal alignments, fp16/bf16, 8-/4-bit, output poisoned beforehand,
// Inf/NaN in one sequence. Host code; skips itself without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "gpu/attention_run.h"
#include "sage/sage.h"

namespace {

using sage::gpu_test::compute_capability;
using sage::gpu_test::to_dtype;

struct Seq {
  int64_t nq, nk;
};

// Sequences whose lengths straddle every block size (64-key blocks, 128-row Q blocks and
// statistics chunks, the sm90 kernel's 128-key blocks), with an empty one of each kind.
const std::vector<Seq> kSeqs = {{1, 1},     {17, 129},  {127, 1000}, {129, 17}, {0, 5},
                                {1000, 127}, {5, 0},    {64, 64},    {128, 256}, {300, 300}};

struct Packed {
  int64_t Hq = 4, Hkv = 2, D = 64;
  std::vector<Seq> seqs;
  std::vector<int32_t> cu_q, cu_k;
  int64_t total_q = 0, total_k = 0, max_q = 0, max_k = 0;
  std::vector<uint16_t> q, k, v;  // [total, H, D] in the call's dtype
};

Packed make_packed(std::mt19937_64& rng, const std::vector<Seq>& seqs, int64_t D, sage_dtype dtype,
                   int64_t Hq = 4, int64_t Hkv = 2) {
  Packed p;
  p.D = D, p.Hq = Hq, p.Hkv = Hkv;
  p.seqs = seqs;
  p.cu_q = {0};
  p.cu_k = {0};
  for (const Seq& s : seqs) {
    p.cu_q.push_back(int32_t(p.cu_q.back() + s.nq));
    p.cu_k.push_back(int32_t(p.cu_k.back() + s.nk));
    p.max_q = std::max(p.max_q, s.nq);
    p.max_k = std::max(p.max_k, s.nk);
  }
  p.total_q = p.cu_q.back(), p.total_k = p.cu_k.back();
  // Each sequence draws its own channel bias, so a mean taken across sequences would show.
  auto draw = [&](int64_t H, const std::vector<int32_t>& cu, float bias) {
    std::vector<uint16_t> all;
    for (size_t b = 0; b + 1 < cu.size(); ++b) {
      const int64_t n = cu[b + 1] - cu[b];
      if (n == 0) continue;
      const auto t = sage::test::random_tensor(
          rng, 1, H, n, D, sage::ref::contiguous_strides(SAGE_LAYOUT_NHD, H, n, D), bias);
      all.insert(all.end(), t.data.begin(), t.data.end());
    }
    return to_dtype(all, dtype);
  };
  p.q = draw(p.Hq, p.cu_q, 1.0f);
  p.k = draw(p.Hkv, p.cu_k, 2.0f);
  p.v = draw(p.Hkv, p.cu_k, 1.0f);
  return p;
}

struct Options {
  sage_dtype dtype = SAGE_DTYPE_FP16;
  sage_variant variant = SAGE_VARIANT_SAGE2_8B;
  sage_mask mask = SAGE_MASK_NONE;
  sage_kernel kernel = SAGE_KERNEL_MMA;
  uint32_t options = 0;
};

struct Result {
  sage_status status = SAGE_OK;
  std::string error;
  sage_plan_info plan{};
  std::vector<uint16_t> o;
  std::vector<float> lse;
};

// One call on device copies of (q, k, v) [n, H, D]: packed (cu non-null, `batch` sequences) or a
// dense NHD batch of one; o and lse poisoned first (NaN bits), copied back whole.
Result call(const Packed& p, const Options& opt, const uint16_t* q, const uint16_t* k,
            const uint16_t* v, int64_t nq, int64_t nk, const std::vector<int32_t>* cu_q,
            const std::vector<int32_t>* cu_k) {
  Result r;
  const size_t oe = size_t(nq * p.Hq * p.D), ke = size_t(nk * p.Hkv * p.D);
  DeviceBuffer dq(oe * 2), dk(ke * 2), dv(ke * 2), dout(oe * 2), dlse(size_t(nq * p.Hq) * 4),
      dcq(p.cu_q.size() * 4), dck(p.cu_k.size() * 4);
  cudaMemcpy(dq.ptr, q, oe * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dk.ptr, k, ke * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dv.ptr, v, ke * 2, cudaMemcpyHostToDevice);
  cudaMemset(dout.ptr, 0xFF, oe * 2);
  cudaMemset(dlse.ptr, 0xFF, size_t(nq * p.Hq) * 4);
  sage_attention_args a;
  sage_attention_args_init(&a);
  a.q = dq.ptr, a.k = dk.ptr, a.v = dv.ptr, a.o = dout.ptr;
  a.lse = static_cast<float*>(dlse.ptr);
  a.heads_q = p.Hq, a.heads_kv = p.Hkv, a.head_dim = p.D;
  a.layout = SAGE_LAYOUT_NHD, a.dtype = opt.dtype, a.mask = opt.mask, a.variant = opt.variant;
  a.kernel = opt.kernel, a.options = opt.options;
  if (cu_q) {
    cudaMemcpy(dcq.ptr, cu_q->data(), cu_q->size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(dck.ptr, cu_k->data(), cu_k->size() * 4, cudaMemcpyHostToDevice);
    a.cu_seqlens_q = static_cast<const int32_t*>(dcq.ptr);
    a.cu_seqlens_k = static_cast<const int32_t*>(dck.ptr);
    a.batch = int64_t(cu_q->size()) - 1;
    a.seq_q = p.max_q, a.seq_kv = p.max_k;
    a.total_q = nq, a.total_k = nk;
  } else {
    a.batch = 1, a.seq_q = nq, a.seq_kv = nk;
  }
  // lse: [Hq, total_q] packed, [1, Hq, nq] dense: the same contiguous [Hq][rows] either way.
  sage::gpu_test::run_args(&a, &r, oe, size_t(nq * p.Hq));
  return r;
}

Result run_packed(const Packed& p, const Options& opt) {
  return call(p, opt, p.q.data(), p.k.data(), p.v.data(), p.total_q, p.total_k, &p.cu_q, &p.cu_k);
}

// Sequence b alone, as a dense call (nq, nk >= 1).
Result run_dense(const Packed& p, const Options& opt, size_t b, const std::vector<uint16_t>& q,
                 const std::vector<uint16_t>& k, const std::vector<uint16_t>& v) {
  const int64_t q0 = p.cu_q[b], k0 = p.cu_k[b];
  return call(p, opt, q.data() + q0 * p.Hq * p.D, k.data() + k0 * p.Hkv * p.D,
              v.data() + k0 * p.Hkv * p.D, p.seqs[b].nq, p.seqs[b].nk, nullptr, nullptr);
}

std::string describe(const Options& o, int64_t D) {
  return std::string("D=") + std::to_string(D) + (o.dtype == SAGE_DTYPE_BF16 ? " bf16" : " fp16") +
         (o.variant == SAGE_VARIANT_SAGE2_4B ? " 4b" : " 8b") + " mask=" +
         std::to_string(int(o.mask)) + " kernel=" + std::to_string(int(o.kernel)) +
         " options=" + std::to_string(o.options);
}

// Every row of sequence b in the packed result equals the bits of the dense call on the family
// the packed call ran (AUTO may choose differently for a dense call) (o and lse); a sequence
// without keys gives o = 0 and lse = -inf (q, k, v: the packed call's inputs). Every sequence, or
// those in `only`.
void expect_per_sequence(const Packed& p, const Options& opt, const Result& packed,
                         const std::vector<uint16_t>& q, const std::vector<uint16_t>& k,
                         const std::vector<uint16_t>& v,
                         const std::vector<size_t>* only = nullptr) {
  ASSERT_EQ(packed.status, SAGE_OK) << packed.error;
  const int64_t H = p.Hq, D = p.D;
  std::vector<size_t> all;
  if (!only) {
    for (size_t b = 0; b < p.seqs.size(); ++b) all.push_back(b);
    only = &all;
  }
  for (const size_t b : *only) {
    const Seq s = p.seqs[b];
    if (s.nq == 0) continue;
    SCOPED_TRACE("sequence " + std::to_string(b) + " (Nq " + std::to_string(s.nq) + ", Nk " +
                 std::to_string(s.nk) + ")");
    const int64_t q0 = p.cu_q[b];
    if (s.nk == 0) {
      for (int64_t i = 0; i < s.nq * H * D; ++i)
        ASSERT_EQ(packed.o[size_t(q0 * H * D + i)], 0u) << "element " << i;
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < s.nq; ++i) {
          const float x = packed.lse[size_t(h * p.total_q + q0 + i)];
          ASSERT_TRUE(std::isinf(x) && x < 0) << "lse head " << h << " row " << i << " = " << x;
        }
      continue;
    }
    Options dense_opt = opt;
    dense_opt.kernel = packed.plan.kernel;
    // (Whole tiles: a dense call may split its last round's tiles, a packed one never does.)
    dense_opt.options |= SAGE_OPTION_WHOLE_TILES;
    const Result d = run_dense(p, dense_opt, b, q, k, v);
    ASSERT_EQ(d.status, SAGE_OK) << d.error;
    for (int64_t i = 0; i < s.nq * H * D; ++i)
      ASSERT_EQ(packed.o[size_t(q0 * H * D + i)], d.o[size_t(i)])
          << "o element " << i << " (row " << i / (H * D) << ", head " << i / D % H << ")";
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < s.nq; ++i)
        ASSERT_EQ(sage::test::float_bits(packed.lse[size_t(h * p.total_q + q0 + i)]),
                  sage::test::float_bits(d.lse[size_t(h * s.nq + i)]))
            << "lse head " << h << " row " << i;
  }
}

// Every sequence of packed calls on `kernel` (8- and 4-bit where `four_bit`), D 64 and 128,
// fp16/bf16, three masks, both K/V pre-pass paths (at D = 64 on sm_90 the three launches quantize
// on the staged grid, whose CTAs step over every sequence's blocks), against its dense call on
// the same family;
// and, in fp16, the zero-padded D = 40 and 200 (multiples of 8, not of 16: packed Q rows of
// 80 and 400 bytes a head, fused Q's TMA map at inner extent 40 and 200).
void each_sequence_equals_its_dense_call(sage_kernel kernel, bool four_bit) {
  const uint64_t seed = sage::test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int64_t D : {64, 128, 40, 200})
    for (sage_dtype dtype : {SAGE_DTYPE_FP16, SAGE_DTYPE_BF16}) {
      if (D % 16 != 0 && dtype == SAGE_DTYPE_BF16) continue;
      const Packed p = make_packed(rng, kSeqs, D, dtype);
      for (sage_variant variant : {SAGE_VARIANT_SAGE2_8B, SAGE_VARIANT_SAGE2_4B}) {
        if (variant == SAGE_VARIANT_SAGE2_4B && !four_bit) continue;
        for (sage_mask mask :
             {SAGE_MASK_NONE, SAGE_MASK_CAUSAL_BOTTOM_RIGHT, SAGE_MASK_CAUSAL_TOP_LEFT})
          for (uint32_t options : {0u, unsigned(SAGE_OPTION_PREPASS_KV_SPLIT)}) {
            const Options opt{dtype, variant, mask, kernel, options};
            SCOPED_TRACE(describe(opt, D));
            expect_per_sequence(p, opt, run_packed(p, opt), p.q, p.k, p.v);
          }
      }
    }
}

// A sequence longer than a K/V pre-pass cluster holds (8 chunks of 128 keys), so the packed
// call's K/V statistics take the three-launch path, beside short ones; Q smoothing's ΔS (4-bit)
// reads the caller's K at each sequence's offset.
void long_and_short_sequences(sage_kernel kernel, bool four_bit) {
  const uint64_t seed = sage::test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<Seq> seqs = {{33, 2100}, {2049, 2049}, {1, 7}, {700, 1500}, {0, 3000}};
  for (sage_variant variant : {SAGE_VARIANT_SAGE2_8B, SAGE_VARIANT_SAGE2_4B}) {
    if (variant == SAGE_VARIANT_SAGE2_4B && !four_bit) continue;
    for (sage_mask mask : {SAGE_MASK_NONE, SAGE_MASK_CAUSAL_BOTTOM_RIGHT}) {
      const Packed p = make_packed(rng, seqs, 128, SAGE_DTYPE_BF16);
      const Options opt{SAGE_DTYPE_BF16, variant, mask, kernel, 0u};
      SCOPED_TRACE(describe(opt, 128));
      expect_per_sequence(p, opt, run_packed(p, opt), p.q, p.k, p.v);
    }
  }
}

// An Inf/NaN in one sequence's K, V or Q follows the non-finite rule within that sequence (as
// its dense call does, bit for bit) and leaves every other sequence as the clean call has it.
void non_finite_input_stays_in_its_sequence(sage_kernel kernel, bool four_bit) {
  const uint64_t seed = sage::test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const Packed clean = make_packed(rng, kSeqs, 64, SAGE_DTYPE_FP16);
  const size_t bad_k = 2, bad_q = 9;  // sequence 2: K row 500 (Nk 1000); 9: Q row 150
  for (sage_variant variant : {SAGE_VARIANT_SAGE2_8B, SAGE_VARIANT_SAGE2_4B}) {
    if (variant == SAGE_VARIANT_SAGE2_4B && !four_bit) continue;
    for (sage_mask mask :
         {SAGE_MASK_NONE, SAGE_MASK_CAUSAL_BOTTOM_RIGHT, SAGE_MASK_CAUSAL_TOP_LEFT}) {
      const Options opt{SAGE_DTYPE_FP16, variant, mask, kernel, 0u};
      SCOPED_TRACE(describe(opt, 64));
      Packed p = clean;
      const int64_t D = p.D;
      p.k[size_t(((p.cu_k[bad_k] + 500) * p.Hkv + 1) * D + 3)] = 0x7E00;  // NaN (fp16)
      p.v[size_t(((p.cu_k[bad_k] + 900) * p.Hkv + 0) * D + 5)] = 0x7C00;  // +Inf
      p.q[size_t(((p.cu_q[bad_q] + 150) * p.Hq + 2) * D + 7)] = 0xFC00;   // -Inf
      const Result got = run_packed(p, opt), ref = run_packed(clean, opt);
      ASSERT_EQ(got.status, SAGE_OK) << got.error;
      ASSERT_EQ(ref.status, SAGE_OK) << ref.error;
      // The poisoned sequences: as their dense calls (same bad elements), bit for bit.
      expect_per_sequence(p, opt, got, p.q, p.k, p.v);
      // The others: the clean call's bits.
      const int64_t H = p.Hq;
      for (size_t b = 0; b < p.seqs.size(); ++b) {
        if (b == bad_k || b == bad_q) continue;
        const int64_t q0 = p.cu_q[b], n = p.seqs[b].nq;
        for (int64_t i = q0 * H * D; i < (q0 + n) * H * D; ++i)
          ASSERT_EQ(got.o[size_t(i)], ref.o[size_t(i)]) << "sequence " << b << " element " << i;
      }
      // And the rule is visible: sequence 2's rows that see key 500 or 900 are NaN (top-left,
      // its 127 queries see keys 0..126 only, and stay finite).
      if (mask == SAGE_MASK_CAUSAL_TOP_LEFT) continue;
      bool any_nan = false;
      for (int64_t i = 0; i < p.seqs[bad_k].nq * H * D; ++i) {
        const uint16_t x = got.o[size_t(p.cu_q[bad_k] * H * D + i)];
        any_nan |= (x & 0x7C00) == 0x7C00 && (x & 0x03FF) != 0;
      }
      EXPECT_TRUE(any_nan);
    }
  }
}

// More sequences than a grid row holds (70000 × 1 head > 65535: the kernels' y and z carry
// sequences × heads, common/grid.h), each of 1-3 queries and 1-3 keys (the workspace gives each
// sequence's rows a 128-row start: ~1.8 GB on mma.sync): every output row written (o and lse
// poisoned first; a row that sees no key is o = 0, lse = -inf), and the sequences around the
// grid's seams (0, 65534..65536, the last) and a random sample equal, bit for bit, their dense
// calls on the family the packed call ran.
void seventy_thousand_sequences(sage_kernel kernel) {
  const uint64_t seed = sage::test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::vector<Seq> seqs(70000);
  for (Seq& s : seqs) s = {int64_t(1 + rng() % 3), int64_t(1 + rng() % 3)};
  const Packed p = make_packed(rng, seqs, 64, SAGE_DTYPE_FP16, /*Hq=*/1, /*Hkv=*/1);
  std::vector<size_t> picks = {0, 1, 65534, 65535, 65536, seqs.size() - 1};
  for (int i = 0; i < 20; ++i) picks.push_back(size_t(rng() % seqs.size()));
  for (sage_mask mask : {SAGE_MASK_NONE, SAGE_MASK_CAUSAL_BOTTOM_RIGHT}) {
    const Options opt{SAGE_DTYPE_FP16, SAGE_VARIANT_SAGE2_8B, mask, kernel, 0u};
    SCOPED_TRACE(describe(opt, 64));
    const Result r = run_packed(p, opt);
    ASSERT_EQ(r.status, SAGE_OK) << r.error;
    for (size_t i = 0; i < r.o.size(); ++i)
      ASSERT_NE(r.o[i] & 0x7C00, 0x7C00) << "o element " << i << " not written";
    for (size_t i = 0; i < r.lse.size(); ++i)
      ASSERT_FALSE(std::isnan(r.lse[i])) << "lse row " << i << " not written";
    expect_per_sequence(p, opt, r, p.q, p.k, p.v, &picks);
  }
}

#define SAGE_REQUIRE_SM89()                                                              \
  do {                                                                                   \
    SAGE_REQUIRE_GPU();                                                                  \
    if (compute_capability() < 89) GTEST_SKIP() << "no SageAttention2 kernel below sm_89"; \
  } while (0)
#define SAGE_REQUIRE_SM90()                                                               \
  do {                                                                                    \
    SAGE_REQUIRE_GPU();                                                                   \
    if (compute_capability() != 90) GTEST_SKIP() << "the wgmma kernel runs on sm_90 only"; \
  } while (0)

// The mma.sync family (forced, and AUTO, which must pick a family that takes packed batches).
TEST(GpuVarlen, EachSequenceEqualsItsDenseCall) {
  SAGE_REQUIRE_SM89();
  each_sequence_equals_its_dense_call(SAGE_KERNEL_MMA, true);
  each_sequence_equals_its_dense_call(SAGE_KERNEL_AUTO, true);
}
TEST(GpuVarlen, LongAndShortSequencesTogether) {
  SAGE_REQUIRE_SM89();
  long_and_short_sequences(SAGE_KERNEL_MMA, true);
}
TEST(GpuVarlen, NonFiniteInputStaysInItsSequence) {
  SAGE_REQUIRE_SM89();
  non_finite_input_stays_in_its_sequence(SAGE_KERNEL_MMA, true);
}

// The wgmma kernel's packed path (kernel = SM90 forced; 8-bit): its own suite, so that it can be
// run (or left out) on its own: --gtest_filter='GpuVarlenSm90.*'.
TEST(GpuVarlenSm90, EachSequenceEqualsItsDenseCall) {
  SAGE_REQUIRE_SM90();
  each_sequence_equals_its_dense_call(SAGE_KERNEL_SM90, false);
}
TEST(GpuVarlenSm90, LongAndShortSequencesTogether) {
  SAGE_REQUIRE_SM90();
  long_and_short_sequences(SAGE_KERNEL_SM90, false);
}
TEST(GpuVarlenSm90, NonFiniteInputStaysInItsSequence) {
  SAGE_REQUIRE_SM90();
  non_finite_input_stays_in_its_sequence(SAGE_KERNEL_SM90, false);
}

// 70000 sequences (common/grid.h), mma.sync and AUTO (the wgmma kernel on sm_90).
TEST(GpuGridLimitsVarlen, SeventyThousandSequences) {
  SAGE_REQUIRE_SM89();
  seventy_thousand_sequences(SAGE_KERNEL_MMA);
  seventy_thousand_sequences(SAGE_KERNEL_AUTO);
}

// The plan of a packed call: its workspace grows with the total token counts, not with
// batch · max_seqlen; AUTO picks mma.sync, SM90 is taken only with fused Q.
TEST(GpuVarlen, PlanAndErrors) {
  SAGE_REQUIRE_SM89();
  sage_attention_args a;
  sage_attention_args_init(&a);
  DeviceBuffer buf(64 << 20), cu(4 * 65);
  a.q = a.k = a.v = buf.ptr;
  a.o = static_cast<char*>(buf.ptr) + (32 << 20);
  a.layout = SAGE_LAYOUT_NHD, a.heads_q = a.heads_kv = 1, a.head_dim = 64;
  a.cu_seqlens_q = a.cu_seqlens_k = static_cast<const int32_t*>(cu.ptr);
  a.batch = 64, a.seq_q = a.seq_kv = 8192, a.total_q = a.total_k = 64 * 128 + 8192;
  size_t ws = 0;
  ASSERT_EQ(sage_attention_workspace_size(&a, &ws), SAGE_OK) << sage_last_error();
  // K̂ + V̂ᵀ of (total + 128 · (batch + 1)) rows of 64 bytes each, with scales and statistics:
  // far below 64 · 8192 rows.
  EXPECT_LT(ws, size_t(4) * (a.total_k + 128 * 65) * 64) << ws;
  sage_plan_info info{};
  info.struct_size = sizeof info;
  ASSERT_EQ(sage_attention_plan(&a, &info), SAGE_OK) << sage_last_error();
  // AUTO: the wgmma kernel on sm_90 (fused Q), mma.sync elsewhere.
  EXPECT_EQ(info.kernel, compute_capability() == 90 ? SAGE_KERNEL_SM90 : SAGE_KERNEL_MMA);
  a.kernel = SAGE_KERNEL_SM90;
  a.options = SAGE_OPTION_PREPASS_Q;  // the wgmma kernel takes packed batches with fused Q only
  EXPECT_EQ(sage_attention_workspace_size(&a, &ws), SAGE_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(sage_last_error()).find("kernel = SM90"), std::string::npos)
      << sage_last_error();
  if (compute_capability() == 90) {
    a.options = 0;
    ASSERT_EQ(sage_attention_plan(&a, &info), SAGE_OK) << sage_last_error();
    EXPECT_EQ(info.kernel, SAGE_KERNEL_SM90);
    EXPECT_EQ(info.fused_q, 1);
    EXPECT_EQ(info.block_q, 128);  // two consumer warpgroups for packed batches
  }
}

}  // namespace
