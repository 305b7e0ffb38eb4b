// The emulation of SageBwd (SageAttention3 paper, Algorithm 3), the backward kernel's family, with
// a switch per matmul between INT8 with per-block scales ψ and the input dtype with fp32
// accumulation; its config, preset and ψ. Host code; mirrors src/bwd. The float64 gradients (the
// truth) are backward_exact.cpp.
//
// The exact backward takes P from the forward's LSE and D = rowsum(dO∘O) from its O. The
// emulation takes neither: its forward quantized Q and K otherwise (and its O carries FP8 error),
// so exp(S_bwd - LSE_fwd) is no normalized softmax and dO·O_fwd is not Σ_j P_ij·dP_ij;
// on peaked rows either error is exponential in |S| or cancels the whole gradient. A stats pass
// computes each row's own normalizer L and D = Σ_j P_ij·dP_ij from the very scores and dP the
// main pass uses, so every row of P sums to 1 and rowsum(dS) = dL/dLSE.
//
// K smoothing: K^ quantizes K - k̄ (k̄ the channel mean over all keys). S then lacks q_i·k̄ on
// row i, a per-row constant that the row's own L drops too, so P is unchanged. dQ = dS·(K - k̄) +
// rowsum(dS)·k̄ and rowsum(dS_i) = g_i (the gradient on the LSE, zero without one): dQ adds g_i·k̄
// back. dK = dSᵀ·Q and dV = Pᵀ·dO never see K. So smoothing changes no gradient in exact
// arithmetic, and under quantization ψ(K - k̄) has a finer step wherever K has a channel bias.
//
// The check: a score's INT8 error has variance (Δq²·|k_j|² + Δk²·|q_i|²)·scale²/12 (Δ the ψ steps,
// k_j = K_j - k̄); σ_i² is its P-weighted mean over row i. A head whose root mean square σ
// exceeds SAGE_BWD_MAX_SCORE_ERROR gets gradients whose cosine to float64 can fall under 0.999
// (docs/backward.md): the call's gradients are NaN and the verdict says so.
#include <algorithm>
#include <cmath>
#include <limits>

#include "common/error.h"
#include "common/formats.h"
#include "ref/reference.h"

namespace sage::ref {
namespace {

constexpr double kLog2e = 1.4426950408889634;

// fp32 dot product with independent partial sums; exact when both operands are INT8 values
// (every partial sum stays below 2^24 for head dims and blocks up to 512).
float dot32(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  for (; i < n; ++i) acc[0] += a[i] * b[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// The channel means of rows [n][D] as the GPU pre-pass forms them (kBwdSumChunk): an fp32 sum
// per chunk of rows in row order, the chunks' sums added in order, then / n in fp32; zeros when
// not `on`. Not a more accurate mean: the kernels' own order, bit for bit (see the callers).
std::vector<float> channel_mean(const std::vector<float>& x, int64_t n, int64_t D, bool on) {
  std::vector<float> mean(size_t(D), 0.0f);
  if (!on) return mean;
  std::vector<float> part(static_cast<size_t>(D));
  for (int64_t c0 = 0; c0 < n; c0 += kBwdSumChunk) {
    std::fill(part.begin(), part.end(), 0.0f);
    for (int64_t r = c0; r < std::min(n, c0 + kBwdSumChunk); ++r)
      for (int64_t d = 0; d < D; ++d) part[size_t(d)] += x[size_t(r * D + d)];
    for (int64_t d = 0; d < D; ++d) mean[size_t(d)] += part[size_t(d)];
  }
  for (int64_t d = 0; d < D; ++d) mean[size_t(d)] /= float(n);
  return mean;
}

}  // namespace

BwdScale bwd_scale(float amax) {
  if (std::isnan(amax)) return {amax, 0.0f};  // the dequantized products come out NaN
  if (!(amax > 0.0f)) return {0.0f, 0.0f};
  return {amax / float(kInt8Max), float(kInt8Max) / amax};  // inf: scale inf, inv 0 -> NaN out
}

float nan_max(float a, float b) {
  return (std::isnan(a) || std::isnan(b)) ? std::numeric_limits<float>::quiet_NaN()
                                          : std::max(a, b);
}

sage_backward_config backward_preset() {
  sage_backward_config c{};
  c.int8 = SAGE_BWD_INT8_DEFAULT;
  // Q smoothing too: with a channel bias in Q, ψ(K)'s error times the mean query is the same on
  // every row of a key's column, which dK = dSᵀ·Q sums coherently (docs/backward.md).
  c.smooth = SAGE_SMOOTH_K | SAGE_SMOOTH_Q;
  c.block_q = 64;
  c.block_k = 64;
  // Per token, not the paper's per block: at N = 2k, D = 128 (N(0,1)) dQ's cosine against
  // float64 is 0.99979 against 0.99882 (rel-L1 2.0 % against 4.9 %), at no extra cost in the
  // kernel's reductions (tests/cpu/test_backward.cpp).
  c.granularity = SAGE_GRANULARITY_PER_TOKEN;
  return c;
}

std::string backward_config_error(const sage_backward_config& c) {
  const uint32_t all = SAGE_BWD_INT8_QK | SAGE_BWD_INT8_PDO | SAGE_BWD_INT8_DOV |
                       SAGE_BWD_INT8_DSK | SAGE_BWD_INT8_DSQ;
  if (c.int8 & ~all)
    return "config.int8 = 0x" + std::to_string(c.int8) + " has unknown flag bits";
  if (c.smooth & ~uint32_t(SAGE_SMOOTH_K | SAGE_SMOOTH_Q))
    return "config.smooth = " + std::to_string(c.smooth) +
           " is invalid (the backward smooths Q and K: SAGE_SMOOTH_Q, SAGE_SMOOTH_K or both)";
  if (enum_value(c.granularity) != SAGE_GRANULARITY_PER_BLOCK &&
      enum_value(c.granularity) != SAGE_GRANULARITY_PER_TOKEN)
    return "config.granularity = " + std::to_string(enum_value(c.granularity)) +
           " is invalid for the backward (PER_BLOCK or PER_TOKEN)";
  if (c.block_q < 1 || c.block_q > 512)
    return "config.block_q = " + std::to_string(c.block_q) + " is outside 1..512";
  if (c.block_k < 1 || c.block_k > 512)
    return "config.block_k = " + std::to_string(c.block_k) + " is outside 1..512";
  if (c.channel_scales & ~uint32_t(SAGE_BWD_INT8_DSQ | SAGE_BWD_INT8_DSK))
    return "config.channel_scales = 0x" + std::to_string(c.channel_scales) +
           " names a product without a per-channel operand (SAGE_BWD_INT8_DSQ, _DSK)";
  if (c.normalizer != SAGE_BWD_NORM_OWN && c.normalizer != SAGE_BWD_NORM_FORWARD)
    return "config.normalizer = " + std::to_string(c.normalizer) +
           " is invalid (SAGE_BWD_NORM_OWN or SAGE_BWD_NORM_FORWARD)";
  // The forward's LSE normalizes exp(S) only where S is the forward's own: a 16-bit forward's S
  // recomputed in 16 bits. INT8 scores against it leave rows of P that do not sum to 1, by an
  // error exponential in the scores' (docs/backward.md, "Its own normalizer").
  if (c.normalizer == SAGE_BWD_NORM_FORWARD && (c.int8 & SAGE_BWD_INT8_QK))
    return "config.normalizer = SAGE_BWD_NORM_FORWARD needs S in 16 bits (no SAGE_BWD_INT8_QK): "
           "the forward's LSE normalizes only the scores it computed";
  return {};
}

namespace {

// One matrix quantized with one ψ scale per block of `block` rows (values are integers).
struct BlockQuant {
  std::vector<float> values;  // [rows][dim]
  std::vector<float> scale;   // [blocks]
};

BlockQuant psi_rows(const std::vector<float>& x, int64_t rows, int64_t dim, int64_t block) {
  BlockQuant r;
  r.values.resize(x.size());
  const int64_t blocks = (rows + block - 1) / block;
  r.scale.resize(size_t(blocks));
  for (int64_t bl = 0; bl < blocks; ++bl) {
    const int64_t r0 = bl * block, r1 = std::min(rows, r0 + block);
    float amax = 0.0f;
    for (int64_t i = r0 * dim; i < r1 * dim; ++i) amax = nan_max(amax, std::fabs(x[size_t(i)]));
    const BwdScale s = bwd_scale(amax);
    r.scale[size_t(bl)] = s.scale;
    for (int64_t i = r0 * dim; i < r1 * dim; ++i)
      r.values[size_t(i)] = float(quantize_int(x[size_t(i)], s.inv, kInt8Max));
  }
  return r;
}

// The same with one scale per (block, channel): scale [blocks][dim].
BlockQuant psi_rows_channels(const std::vector<float>& x, int64_t rows, int64_t dim,
                             int64_t block) {
  BlockQuant r;
  r.values.resize(x.size());
  const int64_t blocks = (rows + block - 1) / block;
  r.scale.resize(size_t(blocks * dim));
  for (int64_t bl = 0; bl < blocks; ++bl) {
    const int64_t r0 = bl * block, r1 = std::min(rows, r0 + block);
    for (int64_t d = 0; d < dim; ++d) {
      float amax = 0.0f;
      for (int64_t i = r0; i < r1; ++i) amax = nan_max(amax, std::fabs(x[size_t(i * dim + d)]));
      const BwdScale s = bwd_scale(amax);
      r.scale[size_t(bl * dim + d)] = s.scale;
      for (int64_t i = r0; i < r1; ++i)
        r.values[size_t(i * dim + d)] =
            float(quantize_int(x[size_t(i * dim + d)], s.inv, kInt8Max));
    }
  }
  return r;
}

// Σ_d Δ_d² of each block of a BlockQuant (its steps' squares over the channels): of psi_rows'
// (one scale a block: D·Δ²) or, per_channel, of psi_rows_channels'. The product check's weight
// of an operand's rounding.
std::vector<double> step2_sums(const BlockQuant& b, int64_t blocks, int64_t dim,
                               bool per_channel) {
  std::vector<double> r(size_t(blocks), 0.0);
  for (int64_t bl = 0; bl < blocks; ++bl) {
    if (per_channel) {
      for (int64_t d = 0; d < dim; ++d) {
        const double x = b.scale[size_t(bl * dim + d)];
        r[size_t(bl)] += x * x;
      }
    } else {
      const double x = b.scale[size_t(bl)];
      r[size_t(bl)] = double(dim) * x * x;
    }
  }
  return r;
}

// The e4m3 products' per-channel scale over values whose largest |x| is amax: mul takes x into
// e4m3's range, inv undoes it. A NaN amax gives NaN, an infinite one mul 0 and inv infinity, so a
// non-finite input makes the gradients non-finite instead of vanishing; all zeros stay zero.
struct Fp8Scale {
  float mul, inv;
};
Fp8Scale fp8_scale(float amax) {
  if (std::isnan(amax)) return {amax, amax};
  if (!(amax > 0.0f)) return {0.0f, 0.0f};
  return {kE4M3Max / amax, amax / kE4M3Max};
}
float e4m3(float x) { return round_float(kE4M3, x); }

float round_to(sage_dtype dtype, float x) {
  switch (dtype) {
    case SAGE_DTYPE_FP16: return round_fp16(x);
    case SAGE_DTYPE_BF16: return round_bf16(x);
    default: return x;
  }
}

}  // namespace

void attention_backward_quant(const Problem& p, const sage_backward_config& cfg,
                              const TensorView& q, const TensorView& k, const TensorView& v,
                              const TensorView& d_o, float* dq, float* dk, float* dv, int threads,
                              const float* d_lse, BackwardCheck* check, uint32_t fp8,
                              const float* fwd_o, const float* fwd_lse) {
  if (const std::string e = backward_config_error(cfg); !e.empty())
    throw Error{SAGE_ERROR_INVALID_ARGUMENT, e};
  const bool fwd_norm = cfg.normalizer == SAGE_BWD_NORM_FORWARD;
  if (fwd_norm && (fwd_o == nullptr || fwd_lse == nullptr))
    throw Error{SAGE_ERROR_INVALID_ARGUMENT,
                "config.normalizer = SAGE_BWD_NORM_FORWARD needs the forward's o and lse"};
  if (fwd_norm && (fp8 & ~uint32_t(SAGE_BWD_INT8_PDO)))
    throw Error{SAGE_ERROR_INVALID_ARGUMENT,
                "the e4m3 dK and dQ take their scales from the statistics pass, which "
                "SAGE_BWD_NORM_FORWARD does not run (its e4m3 dV takes P itself: 448·P)"};
  const uint32_t fp8_products = SAGE_BWD_INT8_PDO | SAGE_BWD_INT8_DSK | SAGE_BWD_INT8_DSQ;
  if (fp8 & ~fp8_products)
    throw Error{SAGE_ERROR_INVALID_ARGUMENT, "fp8 = 0x" + std::to_string(fp8) +
                                                 " names a product that has no e4m3 form"};
  const int64_t D = p.head_dim, Nq = p.seq_q, Nk = p.seq_kv, G = p.group_ratio();
  const int64_t bq = cfg.block_q, bk = cfg.block_k;
  const int64_t q_blocks = (Nq + bq - 1) / bq, k_blocks = (Nk + bk - 1) / bk;
  const bool f8_pdo = fp8 & SAGE_BWD_INT8_PDO, f8_dsk = fp8 & SAGE_BWD_INT8_DSK,
             f8_dsq = fp8 & SAGE_BWD_INT8_DSQ, f8 = fp8 != 0;
  const bool i8_qk = cfg.int8 & SAGE_BWD_INT8_QK,
             i8_pdo = (cfg.int8 & SAGE_BWD_INT8_PDO) && !f8_pdo,
             i8_dov = cfg.int8 & SAGE_BWD_INT8_DOV,
             i8_dsk = (cfg.int8 & SAGE_BWD_INT8_DSK) && !f8_dsk,
             i8_dsq = (cfg.int8 & SAGE_BWD_INT8_DSQ) && !f8_dsq;
  const bool smooth_k = (cfg.smooth & SAGE_SMOOTH_K) && (i8_qk || i8_dsk || f8_dsk);
  // Q smoothing: both products that read Q take Q - q̄ (q̄ the head's mean query) and the exact
  // terms come back in fp32: key j's score gains q̄·(K_j - k̄) (q̄·K_j where the scores are not
  // INT8: that path reads K as it is; k̄·q̄ is the same for every score of the head, so it drops
  // out of the softmax), and dK_j gains q̄·Σ_i dS_ij from the unquantized dS. Applied whenever
  // asked, quantized or not, so that its algebra is testable in fp32 arithmetic.
  const bool smooth_q = cfg.smooth & SAGE_SMOOTH_Q;
  const bool per_token = cfg.granularity == SAGE_GRANULARITY_PER_TOKEN;
  // Per (block, channel) scales of dK's Q and dQ's K - k̄ (where those products are INT8).
  const bool ch_dsq = i8_dsq && (cfg.channel_scales & SAGE_BWD_INT8_DSQ),
             ch_dsk = i8_dsk && (cfg.channel_scales & SAGE_BWD_INT8_DSK);
  const sage_dtype dt = q.dtype;
  const float scale_log2 = float(p.scale * kLog2e);
  const size_t dims = size_t(D);

  // Pre-pass, per (batch, q head): Q, Q^, dO, dO^, |Q_i|²; per (batch, kv head): K, k̄, K^, V,
  // |K_j - k̄|².
  struct QSide {
    std::vector<float> q, d_o, lse2, delta;
    std::vector<float> rowmax, mu, u;  // e4m3 products: m_i, μ_i and 448 / W_i (0 when W_i = 0)
    std::vector<float> o_bar, q_bar;   // e4m3 operands of dV and dK [Nq][D]
    std::vector<double> norm2, sigma2;
    std::vector<double> do_norm2;  // ‖dO_i‖² (the product check's dV term)
    std::vector<float> q_mean;     // q̄ [D] (zero without Q smoothing)
    std::vector<float> key_term2;  // Q smoothing: key j's exact score term, log2 units [Nk]
    BlockQuant q8, do8;
    BlockQuant q8c;                // dK's Q with per-(block, channel) scales (ch_dsq)
    std::vector<double> q_step2;   // Σ_d Δ_d² of dK's Q per block (the product check)
  };
  struct KSide {
    std::vector<float> k, v;
    BlockQuant k8, v8;
    std::vector<float> k_mean;
    std::vector<float> k_bar;                // e4m3 (K - k̄)·mul of dQ [Nk][D]
    std::vector<float> o_inv, q_inv, k_inv;  // the e4m3 operands' per-channel inv [D]
    std::vector<double> norm2, v_norm2;      // ‖K_j - k̄‖², ‖V_j‖²
    BlockQuant k8c;                          // dQ's K - k̄ per (block, channel) (ch_dsk)
    std::vector<double> k_step2;             // Σ_d Δ_d² of dQ's K - k̄ per block
  };
  // Score x_ij (log2 units, K smoothing's per-row constant left out) and dP_ij of one query row
  // and key, as the stats pass and the main pass both take them (ib, jb: their ψ blocks).
  struct ScoreDp {
    float x, dp;
  };
  auto score_dp = [&](const QSide& qs, const KSide& ks, int64_t i, int64_t j) {
    const int64_t ib = i / bq, jb = j / bk;
    const float qk_scale = i8_qk ? qs.q8.scale[size_t(ib)] * ks.k8.scale[size_t(jb)] : 1.0f;
    const float dov_scale = i8_dov ? qs.do8.scale[size_t(ib)] * ks.v8.scale[size_t(jb)] : 1.0f;
    const float sij = i8_qk ? dot32(qs.q8.values.data() + i * D, ks.k8.values.data() + j * D, D)
                            : dot32(qs.q.data() + i * D, ks.k.data() + j * D, D);
    const float dp = i8_dov ? dot32(qs.do8.values.data() + i * D, ks.v8.values.data() + j * D, D) *
                                  dov_scale
                            : dot32(qs.d_o.data() + i * D, ks.v.data() + j * D, D);
    if (smooth_q)  // (one rounding, as the kernels' fma)
      return ScoreDp{std::fma(sij, qk_scale * scale_log2, qs.key_term2[size_t(j)]), dp};
    return ScoreDp{sij * (qk_scale * scale_log2), dp};
  };
  std::vector<KSide> kside(size_t(p.batch * p.heads_kv));
  parallel_for(int64_t(kside.size()), threads, [&](int64_t bkv) {
    KSide& s = kside[size_t(bkv)];
    s.k = load_matrix(k, bkv / p.heads_kv, bkv % p.heads_kv, Nk, D);
    s.v = load_matrix(v, bkv / p.heads_kv, bkv % p.heads_kv, Nk, D);
    // k̄ exactly as the GPU pre-pass forms it (kBwdSumChunk): an fp32 sum per chunk of keys in
    // key order, the chunks' sums added in order, then / Nk in fp32. Not a more accurate mean: one
    // ulp of k̄ can move a K - k̄ that sits near a rounding tie of ψ to the other INT8 value, and
    // that one element shifts key j's score by Q^_i,d·c on every query row of the KV head (the
    // same sign on all of them where Q has a channel bias), so the key's whole column of P and
    // dS, and through each row's normalizer every other key's, move together: on a key that
    // draws much of the attention, far more than all the GPU's other differences from its
    // emulation in dK and dV. Formed the same way, K^ and its scales are the GPU's bit for bit.
    s.k_mean = channel_mean(s.k, Nk, D, smooth_k);
    std::vector<float> ks(s.k.size());
    s.norm2.assign(size_t(Nk), 0.0);
    for (int64_t j = 0; j < Nk; ++j)
      for (int64_t d = 0; d < D; ++d) {
        const float x = s.k[size_t(j * D + d)] - s.k_mean[size_t(d)];
        ks[size_t(j * D + d)] = x;
        s.norm2[size_t(j)] += double(x) * x;
      }
    s.k8 = psi_rows(ks, Nk, D, bk);
    if (ch_dsk) s.k8c = psi_rows_channels(ks, Nk, D, bk);
    s.k_step2 = step2_sums(ch_dsk ? s.k8c : s.k8, k_blocks, D, ch_dsk);
    if (i8_dov) {
      s.v8 = psi_rows(s.v, Nk, D, bk);
      s.v_norm2.assign(size_t(Nk), 0.0);
      for (int64_t j = 0; j < Nk; ++j)
        for (int64_t d = 0; d < D; ++d)
          s.v_norm2[size_t(j)] += double(s.v[size_t(j * D + d)]) * s.v[size_t(j * D + d)];
    }
  });
  std::vector<QSide> qside(size_t(p.batch * p.heads_q));
  parallel_for(int64_t(qside.size()), threads, [&](int64_t bh) {
    QSide& s = qside[size_t(bh)];
    const int64_t b = bh / p.heads_q, kv = b * p.heads_kv + (bh % p.heads_q) / G;
    s.q = load_matrix(q, b, bh % p.heads_q, Nq, D);
    s.d_o = load_matrix(d_o, b, bh % p.heads_q, Nq, D);
    const KSide& ks = kside[size_t(kv)];
    // q̄ in the GPU pre-pass's order (as k̄, and for the same reason: an ulp of q̄ can flip an
    // element of Q^ at a rounding tie), then Q - q̄ in fp32, and each key's q̄·(K_j - k̄) as one
    // fma chain over the channels in order, times scale·log2 e.
    s.q_mean = channel_mean(s.q, Nq, D, smooth_q);
    if (smooth_q) {
      for (int64_t i = 0; i < Nq; ++i)
        for (int64_t d = 0; d < D; ++d) s.q[size_t(i * D + d)] -= s.q_mean[size_t(d)];
      s.key_term2.resize(size_t(Nk));
      for (int64_t j = 0; j < Nk; ++j) {
        float acc = 0.0f;
        for (int64_t d = 0; d < D; ++d)
          acc = std::fma(s.q_mean[size_t(d)],
                         ks.k[size_t(j * D + d)] - (i8_qk ? ks.k_mean[size_t(d)] : 0.0f), acc);
        s.key_term2[size_t(j)] = acc * scale_log2;
      }
    }
    s.q8 = psi_rows(s.q, Nq, D, bq);
    if (ch_dsq) s.q8c = psi_rows_channels(s.q, Nq, D, bq);
    s.q_step2 = step2_sums(ch_dsq ? s.q8c : s.q8, q_blocks, D, ch_dsq);
    s.do8 = psi_rows(s.d_o, Nq, D, bq);
    s.lse2.assign(size_t(Nq), std::numeric_limits<float>::infinity());
    s.delta.assign(size_t(Nq), 0.0f);
    s.norm2.assign(size_t(Nq), 0.0);
    s.sigma2.assign(size_t(Nq), 0.0);
    s.do_norm2.assign(size_t(Nq), 0.0);
    if (f8) {
      s.rowmax.assign(size_t(Nq), -std::numeric_limits<float>::infinity());
      s.mu.assign(size_t(Nq), 0.0f);
      s.u.assign(size_t(Nq), 0.0f);
    }
    // The stats pass: row i's scores x_ij (log2 units) and dP_ij exactly as the main pass computes
    // them, then L = max + log2 Σ 2^(x - max) (+inf with no visible key: every P = 0) and
    // D = Σ P·dP - g. NaN anywhere in the row makes L NaN (never dropped by the max).
    std::vector<float> x(static_cast<size_t>(Nk)), dp(static_cast<size_t>(Nk));
    for (int64_t i = 0; i < Nq; ++i) {
      const float* qi = s.q.data() + i * D;
      const float* doi = s.d_o.data() + i * D;
      for (int64_t d = 0; d < D; ++d) {
        s.norm2[size_t(i)] += double(qi[d]) * qi[d];
        s.do_norm2[size_t(i)] += double(doi[d]) * doi[d];
      }
      const int64_t ib = i / bq, visible = std::min(Nk, p.visible_keys(i));
      if (visible <= 0) continue;
      if (fwd_norm) {
        // The forward's normalizer (log2 units) and D = dO·O - g from its O (summed in double: a
        // kernel's fp32 sum differs from it by its own rounding only).
        const float* oi = fwd_o + (bh * Nq + i) * D;
        double dsum = 0.0;
        for (int64_t d = 0; d < D; ++d) dsum += double(doi[d]) * oi[d];
        const float g = d_lse ? d_lse[bh * Nq + i] : 0.0f;
        s.lse2[size_t(i)] = float(double(fwd_lse[bh * Nq + i]) * kLog2e);
        s.delta[size_t(i)] = float(dsum) - g;
        if (f8) {  // e4m3 dV without a statistics pass: e = P (the row's max taken as its L)
          s.rowmax[size_t(i)] = s.lse2[size_t(i)];
          s.mu[size_t(i)] = 1.0f;
        }
        continue;
      }
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < visible; ++j) {
        const ScoreDp sd = score_dp(s, ks, i, j);
        x[size_t(j)] = sd.x;
        dp[size_t(j)] = sd.dp;
        m = nan_max(m, sd.x);
      }
      double l = 0.0, dsum = 0.0, ak = 0.0, aq = 0.0;
      for (int64_t j = 0; j < visible; ++j) {
        const double e = std::exp2(double(x[size_t(j)]) - double(m));
        const double dk_step = ks.k8.scale[size_t(j / bk)];
        l += e;
        dsum += e * dp[size_t(j)];
        ak += e * ks.norm2[size_t(j)];
        aq += e * dk_step * dk_step;
      }
      const float g = d_lse ? d_lse[bh * Nq + i] : 0.0f;
      s.lse2[size_t(i)] = float(double(m) + std::log2(l));
      s.delta[size_t(i)] = float(dsum / l) - g;
      if (f8) {
        float wmax = 0.0f;  // max_j e_ij·|dP_ij|
        for (int64_t j = 0; j < visible; ++j)
          wmax = nan_max(wmax, std::exp2(x[size_t(j)] - m) * std::fabs(dp[size_t(j)]));
        const float w = wmax + std::fabs(s.delta[size_t(i)]);
        s.rowmax[size_t(i)] = m;
        s.mu[size_t(i)] = float(1.0 / l);
        s.u[size_t(i)] = w > 0.0f || std::isnan(w) ? kE4M3Max / w : 0.0f;
      }
      if (i8_qk) {
        const double dq_step = s.q8.scale[size_t(ib)];
        s.sigma2[size_t(i)] = p.scale * p.scale / 12.0 *
                              (dq_step * dq_step * ak / l + s.norm2[size_t(i)] * aq / l);
      }
    }
  });

  // The e4m3 products' other operands, per KV head: dO_i·μ_i (dV) and Q_i·μ_i·W_i / 448 (dK) with
  // one scale per channel over the group's queries (the products sum over them), K - k̄ (dQ) with
  // one per channel over the keys.
  if (f8)
    parallel_for(int64_t(kside.size()), threads, [&](int64_t bkv) {
      KSide& ks = kside[size_t(bkv)];
      const int64_t h0 = (bkv / p.heads_kv) * p.heads_q + (bkv % p.heads_kv) * G;
      auto prepare = [&](bool on, std::vector<float> QSide::*out, std::vector<float>& inv,
                         auto value) {
        if (!on) return;
        std::vector<float> amax(dims, 0.0f);
        for (int64_t h = h0; h < h0 + G; ++h)
          for (int64_t i = 0; i < Nq; ++i)
            for (int64_t d = 0; d < D; ++d)
              amax[size_t(d)] =
                  nan_max(amax[size_t(d)], std::fabs(value(qside[size_t(h)], i, d)));
        std::vector<float> mul(dims);
        inv.resize(dims);
        for (int64_t d = 0; d < D; ++d) {
          const Fp8Scale sc = fp8_scale(amax[size_t(d)]);
          mul[size_t(d)] = sc.mul;
          inv[size_t(d)] = sc.inv;
        }
        for (int64_t h = h0; h < h0 + G; ++h) {
          QSide& qs = qside[size_t(h)];
          (qs.*out).resize(size_t(Nq * D));
          for (int64_t i = 0; i < Nq; ++i)
            for (int64_t d = 0; d < D; ++d)
              (qs.*out)[size_t(i * D + d)] = e4m3(value(qs, i, d) * mul[size_t(d)]);
        }
      };
      prepare(f8_pdo, &QSide::o_bar, ks.o_inv, [&](const QSide& qs, int64_t i, int64_t d) {
        return qs.d_o[size_t(i * D + d)] * qs.mu[size_t(i)];
      });
      // μ_i·W_i / 448 = μ_i / u_i (0 where W_i = 0: that row's dS is 0)
      prepare(f8_dsq, &QSide::q_bar, ks.q_inv, [&](const QSide& qs, int64_t i, int64_t d) {
        const float u = qs.u[size_t(i)];
        return u != 0.0f ? qs.q[size_t(i * D + d)] * (qs.mu[size_t(i)] / u) : 0.0f;
      });
      if (f8_dsk) {
        std::vector<float> amax(dims, 0.0f);
        for (int64_t j = 0; j < Nk; ++j)
          for (int64_t d = 0; d < D; ++d)
            amax[size_t(d)] = nan_max(amax[size_t(d)], std::fabs(ks.k[size_t(j * D + d)] -
                                                                   ks.k_mean[size_t(d)]));
        ks.k_inv.resize(dims);
        ks.k_bar.resize(size_t(Nk * D));
        for (int64_t d = 0; d < D; ++d) {
          const Fp8Scale sc = fp8_scale(amax[size_t(d)]);
          ks.k_inv[size_t(d)] = sc.inv;
          for (int64_t j = 0; j < Nk; ++j)
            ks.k_bar[size_t(j * D + d)] =
                e4m3((ks.k[size_t(j * D + d)] - ks.k_mean[size_t(d)]) * sc.mul);
        }
      }
    });

  // One (query block, key block) tile of one q head: P, dS and their INT8 forms. Per block, one
  // ψ scale covers the tile; per token, each product gets the scales that factor out of its sum:
  // dV = Pᵀ·dO and dK = dSᵀ·Q sum over queries, so P and dS take one scale per key (column);
  // dQ = dS·K sums over keys, so dS takes one scale per query (row) there.
  struct Tile {
    int64_t r0, r1, c0, c1;
    std::vector<float> P, dS, P8, dS8_row, dS8_col;  // [rows][cols]
    std::vector<float> p_scale, ds_row_scale, ds_col_scale;  // [cols], [rows], [cols]
    bool empty = true;  // every entry masked: contributes nothing (the kernel skips it)
  };
  auto tile = [&](int64_t bh, int64_t ib, int64_t jb, Tile& t) {
    const int64_t kv = (bh / p.heads_q) * p.heads_kv + (bh % p.heads_q) / G;
    const QSide& qs = qside[size_t(bh)];
    const KSide& ks = kside[size_t(kv)];
    t.r0 = ib * bq;
    t.r1 = std::min(Nq, t.r0 + bq);
    t.c0 = jb * bk;
    t.c1 = std::min(Nk, t.c0 + bk);
    const int64_t rows = t.r1 - t.r0, cols = t.c1 - t.c0;
    t.P.assign(size_t(rows * cols), 0.0f);
    t.dS.assign(t.P.size(), 0.0f);
    t.P8.assign(t.P.size(), 0.0f);
    t.dS8_row.assign(t.P.size(), 0.0f);
    t.empty = true;
    std::vector<float> p_max(size_t(cols), 0.0f), ds_col_max(size_t(cols), 0.0f),
        ds_row_max(size_t(rows), 0.0f);
    for (int64_t i = t.r0; i < t.r1; ++i) {
      const int64_t visible = std::min(t.c1, p.visible_keys(i));
      for (int64_t j = t.c0; j < visible; ++j) {
        t.empty = false;
        const ScoreDp sd = score_dp(qs, ks, i, j);
        const int64_t r = i - t.r0, c = j - t.c0;
        // (e4m3 products: P = e·μ with e = 2^(x - m), whose 448·e is P̄ and e·(dP - D)·u dS̄)
        const float e = f8 ? std::exp2(sd.x - qs.rowmax[size_t(i)]) : 0.0f;
        const float pij = f8 ? e * qs.mu[size_t(i)] : std::exp2(sd.x - qs.lse2[size_t(i)]);
        const float ds = pij * (sd.dp - qs.delta[size_t(i)]);
        if (f8_pdo) t.P8[size_t(r * cols + c)] = e4m3(e * kE4M3Max);
        if (f8_dsk || f8_dsq)
          t.dS8_row[size_t(r * cols + c)] =
              e4m3(e * (sd.dp - qs.delta[size_t(i)]) * qs.u[size_t(i)]);
        t.P[size_t(r * cols + c)] = pij;
        t.dS[size_t(r * cols + c)] = ds;
        p_max[size_t(c)] = nan_max(p_max[size_t(c)], pij);
        ds_col_max[size_t(c)] = nan_max(ds_col_max[size_t(c)], std::fabs(ds));
        ds_row_max[size_t(r)] = nan_max(ds_row_max[size_t(r)], std::fabs(ds));
      }
    }
    if (!per_token) {  // one scale for the whole tile
      float pm = 0.0f, dm = 0.0f;
      for (float x : p_max) pm = nan_max(pm, x);
      for (float x : ds_col_max) dm = nan_max(dm, x);
      std::fill(p_max.begin(), p_max.end(), pm);
      std::fill(ds_col_max.begin(), ds_col_max.end(), dm);
      std::fill(ds_row_max.begin(), ds_row_max.end(), dm);
    }
    t.p_scale.resize(size_t(cols));
    t.ds_col_scale.resize(size_t(cols));
    t.ds_row_scale.resize(size_t(rows));
    std::vector<float> p_inv(size_t(cols), 0.0f), dc_inv(size_t(cols), 0.0f), dr_inv(size_t(rows), 0.0f);
    for (int64_t c = 0; c < cols; ++c) {
      const BwdScale ps = bwd_scale(p_max[size_t(c)]), ds = bwd_scale(ds_col_max[size_t(c)]);
      t.p_scale[size_t(c)] = ps.scale;
      p_inv[size_t(c)] = ps.inv;
      t.ds_col_scale[size_t(c)] = ds.scale;
      dc_inv[size_t(c)] = ds.inv;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const BwdScale ds = bwd_scale(ds_row_max[size_t(r)]);
      t.ds_row_scale[size_t(r)] = ds.scale;
      dr_inv[size_t(r)] = ds.inv;
    }
    t.dS8_col.resize(t.P.size());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const size_t x = size_t(r * cols + c);
        if (!f8_pdo)
          t.P8[x] = i8_pdo ? float(quantize_int(t.P[x], p_inv[size_t(c)], kInt8Max))
                           : round_to(dt, t.P[x]);
        // (one dS̄ serves both e4m3 products: its scale is the query's)
        t.dS8_col[x] = f8_dsq   ? t.dS8_row[x]
                       : i8_dsq ? float(quantize_int(t.dS[x], dc_inv[size_t(c)], kInt8Max))
                                : round_to(dt, t.dS[x]);
        if (!f8_dsk)
          t.dS8_row[x] = i8_dsk ? float(quantize_int(t.dS[x], dr_inv[size_t(r)], kInt8Max))
                                : round_to(dt, t.dS[x]);
      }
  };

  // The product check: each INT8 product's rounding taken as uniform within its ψ steps, the
  // variance it adds to its gradient (summed over the gradient's entries) per task, from the
  // unquantized P and dS. ‖x‖² of an operand row and its step Δ give Δ²/12 per element.
  const double scale2 = p.scale * p.scale, d12 = double(D) / 12.0;
  // dP = dO·Vᵀ in INT8 (an ablation): the variance of δdP_ij, whose error reaches dS as P·δdP
  // and through it dK (times ‖Q_i - q̄‖²) and dQ (times ‖K_j - k̄‖²).
  auto dp_var = [&](const QSide& qs, const KSide& ks, int64_t i, int64_t j) {
    const double sd = qs.do8.scale[size_t(i / bq)], sv = ks.v8.scale[size_t(j / bk)];
    return (sd * sd * ks.v_norm2[size_t(j)] + qs.do_norm2[size_t(i)] * sv * sv) / 12.0;
  };
  std::vector<double> var_dk(size_t(p.batch * p.heads_kv * k_blocks), 0.0), var_dv(var_dk.size()),
      var_dq(size_t(p.batch * p.heads_q * q_blocks), 0.0);

  // dK, dV: one task per (batch, kv head, key block), over the group's heads and query blocks.
  parallel_for(p.batch * p.heads_kv * k_blocks, threads, [&](int64_t item) {
    const int64_t bkv = item / k_blocks, jb = item % k_blocks;
    const int64_t b = bkv / p.heads_kv, hkv = bkv % p.heads_kv;
    const int64_t c0 = jb * bk, cols = std::min(Nk, c0 + bk) - c0;
    std::vector<float> ak(size_t(cols * D), 0.0f), av(ak.size(), 0.0f), part(dims);
    double vk = 0.0, vv = 0.0;
    // Q smoothing: Σ_i dS_ij over one head's queries, and (e4m3 dK only, whose sum is scaled on
    // the way out) the q̄ terms kept apart from ak.
    std::vector<float> colsum(static_cast<size_t>(cols)), q_term(f8_dsq ? ak.size() : 0, 0.0f);
    Tile t;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t bh = b * p.heads_q + hkv * G + g;
      const QSide& qs = qside[size_t(bh)];
      std::fill(colsum.begin(), colsum.end(), 0.0f);
      for (int64_t ib = 0; ib < q_blocks; ++ib) {
        tile(bh, ib, jb, t);
        if (t.empty) continue;
        const int64_t rows = t.r1 - t.r0;
        if (smooth_q)
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < cols; ++c) colsum[size_t(c)] += t.dS[size_t(r * cols + c)];
        // dV = Pᵀ·dO: P's step per key, dO's per block; dK = dSᵀ·Q: dS's per key, Q's per block.
        const double do_step = i8_pdo ? qs.do8.scale[size_t(ib)] : 0.0,
                     q_step2 = i8_dsq ? qs.q_step2[size_t(ib)] : 0.0;
        for (int64_t r = 0; r < rows; ++r) {
          const size_t i = size_t(t.r0 + r);
          for (int64_t c = 0; c < cols; ++c) {
            const double pij = t.P[size_t(r * cols + c)], dsij = t.dS[size_t(r * cols + c)];
            if (i8_pdo) {
              const double ps = t.p_scale[size_t(c)];
              vv += ps * ps / 12.0 * qs.do_norm2[i] + pij * pij * d12 * do_step * do_step;
            }
            if (i8_dsq) {
              const double ds = t.ds_col_scale[size_t(c)];
              vk += (ds * ds / 12.0 * qs.norm2[i] + dsij * dsij * q_step2 / 12.0) * scale2;
            }
            if (i8_dov)
              vk += pij * pij * dp_var(qs, kside[size_t(bkv)], t.r0 + r, t.c0 + c) *
                    qs.norm2[i] * scale2;
          }
        }
        for (int64_t c = 0; c < cols; ++c) {
          // dV_j += Pᵀ·dO over this tile's rows: one block product, then scaled into fp32.
          std::fill(part.begin(), part.end(), 0.0f);
          for (int64_t r = 0; r < rows; ++r) {
            const float pv = t.P8[size_t(r * cols + c)];
            if (pv == 0.0f) continue;
            const float* src = f8_pdo   ? qs.o_bar.data() + (t.r0 + r) * D
                               : i8_pdo ? qs.do8.values.data() + (t.r0 + r) * D
                                        : qs.d_o.data() + (t.r0 + r) * D;
            for (int64_t d = 0; d < D; ++d) part[size_t(d)] += pv * src[d];
          }
          const float pdo_scale = i8_pdo ? t.p_scale[size_t(c)] * qs.do8.scale[size_t(ib)] : 1.0f;
          for (int64_t d = 0; d < D; ++d) av[size_t(c * D + d)] += part[size_t(d)] * pdo_scale;
          // dK_j += dSᵀ·Q.
          std::fill(part.begin(), part.end(), 0.0f);
          for (int64_t r = 0; r < rows; ++r) {
            const size_t at = size_t(r * cols + c);
            const float ds = t.dS8_col[at];
            if (ds == 0.0f) continue;
            const float* src = f8_dsq   ? qs.q_bar.data() + (t.r0 + r) * D
                               : ch_dsq ? qs.q8c.values.data() + (t.r0 + r) * D
                               : i8_dsq ? qs.q8.values.data() + (t.r0 + r) * D
                                        : qs.q.data() + (t.r0 + r) * D;
            for (int64_t d = 0; d < D; ++d) part[size_t(d)] += ds * src[d];
          }
          const float dsq_scale =
              i8_dsq ? t.ds_col_scale[size_t(c)] * (ch_dsq ? 1.0f : qs.q8.scale[size_t(ib)])
                     : 1.0f;
          const float* q_ch = ch_dsq ? qs.q8c.scale.data() + ib * D : nullptr;
          for (int64_t d = 0; d < D; ++d)
            ak[size_t(c * D + d)] += part[size_t(d)] * (q_ch ? dsq_scale * q_ch[d] : dsq_scale);
        }
      }
      // dSᵀ·Q = dSᵀ·(Q - q̄) + (Σ_i dS_i)ᵀ·q̄, added after each head as the kernels do.
      if (smooth_q)
        for (int64_t c = 0; c < cols; ++c)
          for (int64_t d = 0; d < D; ++d)
            (f8_dsq ? q_term : ak)[size_t(c * D + d)] +=
                colsum[size_t(c)] * qs.q_mean[size_t(d)];
    }
    // e4m3: dV's 448·e and per-channel mul come out here, and dK's per-channel mul (its dS̄ =
    // e·(dP - D)·u pairs with Q·μ / u, so no 448 is left); every block summed in place.
    const KSide& kv_side = kside[size_t(bkv)];
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t d = 0; d < D; ++d) {
        const int64_t at = (bkv * Nk + c0 + c) * D + d;
        const float k_out = f8_dsq ? kv_side.q_inv[size_t(d)] : 1.0f;
        const float v_out = f8_pdo ? kv_side.o_inv[size_t(d)] / kE4M3Max : 1.0f;
        const float sum = ak[size_t(c * D + d)] * k_out;
        dk[at] = (f8_dsq ? sum + q_term[size_t(c * D + d)] : sum) * float(p.scale);
        dv[at] = av[size_t(c * D + d)] * v_out;
      }
    var_dk[size_t(item)] = vk;
    var_dv[size_t(item)] = vv;
  });

  // dQ: one task per (batch, q head, query block), over the key blocks.
  parallel_for(p.batch * p.heads_q * q_blocks, threads, [&](int64_t item) {
    const int64_t bh = item / q_blocks, ib = item % q_blocks;
    const int64_t kv = (bh / p.heads_q) * p.heads_kv + (bh % p.heads_q) / G;
    const KSide& ks = kside[size_t(kv)];
    const int64_t r0 = ib * bq, rows = std::min(Nq, r0 + bq) - r0;
    std::vector<float> acc(size_t(rows * D), 0.0f), part(dims);
    double vq = 0.0;
    Tile t;
    for (int64_t jb = 0; jb < k_blocks; ++jb) {
      tile(bh, ib, jb, t);
      if (t.empty) continue;
      const int64_t cols = t.c1 - t.c0;
      if (i8_dsk || i8_dov) {  // dQ = dS·K: dS's step per query, K's per block; δdP as above
        const double k_step2 = i8_dsk ? ks.k_step2[size_t(jb)] : 0.0;
        for (int64_t r = 0; r < rows; ++r) {
          const double ds = i8_dsk ? t.ds_row_scale[size_t(r)] : 0.0;
          for (int64_t c = 0; c < cols; ++c) {
            const double dsij = t.dS[size_t(r * cols + c)], pij = t.P[size_t(r * cols + c)];
            const double kn2 = ks.norm2[size_t(t.c0 + c)];
            vq += (ds * ds / 12.0 * kn2 + dsij * dsij * k_step2 / 12.0) * scale2;
            if (i8_dov)
              vq += pij * pij * dp_var(qside[size_t(bh)], ks, r0 + r, t.c0 + c) * kn2 * scale2;
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float dsk_scale =
            i8_dsk ? t.ds_row_scale[size_t(r)] * (ch_dsk ? 1.0f : ks.k8.scale[size_t(jb)]) : 1.0f;
        std::fill(part.begin(), part.end(), 0.0f);
        for (int64_t c = 0; c < cols; ++c) {
          const size_t at = size_t(r * cols + c);
          const float ds = t.dS8_row[at];
          if (ds == 0.0f) continue;
          const float* src = f8_dsk   ? ks.k_bar.data() + (t.c0 + c) * D
                             : ch_dsk ? ks.k8c.values.data() + (t.c0 + c) * D
                             : i8_dsk ? ks.k8.values.data() + (t.c0 + c) * D
                                      : ks.k.data() + (t.c0 + c) * D;
          for (int64_t d = 0; d < D; ++d) part[size_t(d)] += ds * src[d];
        }
        const float* k_ch = ch_dsk ? ks.k8c.scale.data() + jb * D : nullptr;
        for (int64_t d = 0; d < D; ++d)
          acc[size_t(r * D + d)] += part[size_t(d)] * (k_ch ? dsk_scale * k_ch[d] : dsk_scale);
      }
    }
    // K^ holds K - k̄: dS·K = dS·(K - k̄) + rowsum(dS)·k̄, and rowsum(dS_i) is d_lse_i (zero
    // without a gradient on the LSE): that term is added back exactly. A row that sees no key
    // has no dS (its LSE is the constant -inf): nothing to add. With the forward's normalizer
    // the computed dS_i sums to d_lse_i - δD_i (δD_i: D's error from O's rounding), and adding
    // d_lse_i·k̄ rather than that sum leaves dQ_i off by -δD_i·Σ_j P_ij (K_j - k̄) instead of
    // -δD_i·Σ_j P_ij K_j: the channel bias k̄ drops out of the error.
    // e4m3: dS = dS̄·μ_i·W_i / 448 = dS̄·μ_i / u_i, and K - k̄ comes back by its inv.
    const QSide& qs = qside[size_t(bh)];
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r0 + r;
      const bool seen = p.visible_keys(i) > 0 && Nk > 0;
      const float g = d_lse && (i8_dsk || f8_dsk) && seen ? d_lse[bh * Nq + i] : 0.0f;
      const float a = f8_dsk && qs.u[size_t(i)] != 0.0f ? qs.mu[size_t(i)] / qs.u[size_t(i)]
                                                        : (f8_dsk ? 0.0f : 1.0f);
      for (int64_t d = 0; d < D; ++d) {
        const float sum = f8_dsk ? acc[size_t(r * D + d)] * (a * ks.k_inv[size_t(d)])
                                 : acc[size_t(r * D + d)];
        dq[(bh * Nq + i) * D + d] = (sum + g * ks.k_mean[size_t(d)]) * float(p.scale);
      }
    }
    var_dq[size_t(item)] = vq;
  });

  // The verdict: per head, the root mean square of σ over its rows that see a key; and per head
  // and gradient, the product check's estimate of 1 - cos: its variance over the gradient's
  // squared norm, halved (independent errors; 0 where it adds none).
  BackwardCheck local;
  BackwardCheck& c = check ? *check : local;
  c.head_error.assign(qside.size(), 0.0);
  c.untrusted = false;
  int64_t rows = 0;
  for (int64_t i = 0; i < Nq; ++i) rows += p.visible_keys(i) > 0 && Nk > 0;
  for (size_t bh = 0; bh < qside.size(); ++bh) {
    double sum = 0.0;
    for (double x : qside[bh].sigma2) sum += x;
    c.head_error[bh] = rows ? std::sqrt(sum / double(rows)) : 0.0;
    if (!(c.head_error[bh] <= double(SAGE_BWD_MAX_SCORE_ERROR))) c.untrusted = true;
  }
  auto estimate = [](double var, const float* g, int64_t n) {
    if (var == 0.0) return 0.0;
    double norm = 0.0;
    for (int64_t x = 0; x < n; ++x) norm += double(g[x]) * g[x];
    return var / norm / 2.0;  // (a zero gradient with error: inf; NaN stays NaN)
  };
  const int64_t kv_heads = p.batch * p.heads_kv, q_heads = p.batch * p.heads_q;
  c.dq_error.assign(size_t(q_heads), 0.0);
  c.dk_error.assign(size_t(kv_heads), 0.0);
  c.dv_error.assign(size_t(kv_heads), 0.0);
  for (int64_t h = 0; h < q_heads; ++h) {
    double v = 0.0;
    for (int64_t ib = 0; ib < q_blocks; ++ib) v += var_dq[size_t(h * q_blocks + ib)];
    c.dq_error[size_t(h)] = estimate(v, dq + h * Nq * D, Nq * D);
  }
  for (int64_t h = 0; h < kv_heads; ++h) {
    double vk = 0.0, vv = 0.0;
    for (int64_t jb = 0; jb < k_blocks; ++jb) {
      vk += var_dk[size_t(h * k_blocks + jb)];
      vv += var_dv[size_t(h * k_blocks + jb)];
    }
    c.dk_error[size_t(h)] = estimate(vk, dk + h * Nk * D, Nk * D);
    c.dv_error[size_t(h)] = estimate(vv, dv + h * Nk * D, Nk * D);
  }
  for (const std::vector<double>* e : {&c.dq_error, &c.dk_error, &c.dv_error})
    for (double x : *e)
      if (!(x <= double(SAGE_BWD_MAX_GRAD_ERROR))) c.untrusted = true;
  if (check) {
    c.lse2.clear();
    c.delta.clear();
    c.sigma2.clear();
    for (const QSide& s : qside) {
      c.lse2.insert(c.lse2.end(), s.lse2.begin(), s.lse2.end());
      c.delta.insert(c.delta.end(), s.delta.begin(), s.delta.end());
      c.sigma2.insert(c.sigma2.end(), s.sigma2.begin(), s.sigma2.end());
    }
  }
  if (c.untrusted) {  // never a gradient the check could not stand behind
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::fill(dq, dq + p.out_elems(), nan);
    std::fill(dk, dk + p.batch * p.heads_kv * Nk * D, nan);
    std::fill(dv, dv + p.batch * p.heads_kv * Nk * D, nan);
  }
}

}  // namespace sage::ref
