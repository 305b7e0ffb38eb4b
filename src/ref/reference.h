// sage::ref — the CPU reference, the oracle every GPU kernel is checked against. Plain C++17,
// no CUDA. Two entry points: float64 attention, and a faithful emulation of quantized attention
// with every knob of sage_quant_config (include/sage/sage.h). Both read strided fp16/bf16/fp32
// inputs.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/exp2_poly.h"
#include "common/formats.h"
#include "sage/sage.h"

namespace sage::ref {

// A strided [B, H, N, D] tensor on the host: element (b, h, n, d) sits at
// data + b*strides.batch + h*strides.head + n*strides.token + d (in elements of dtype).
struct TensorView {
  const void* data = nullptr;
  sage_dtype dtype = SAGE_DTYPE_FP32;
  sage_strides strides{0, 0, 0};
};

struct Problem {
  int64_t batch = 1, heads_q = 1, heads_kv = 1, seq_q = 1, seq_kv = 1, head_dim = 64;
  double scale = 0.0;  // resolved softmax scale (never 0 here)
  sage_mask mask = SAGE_MASK_NONE;

  int64_t group_ratio() const { return heads_q / heads_kv; }
  // Keys visible to query i are j < visible_keys(i) (0 = a fully masked row).
  int64_t visible_keys(int64_t i) const;
  int64_t out_elems() const { return batch * heads_q * seq_q * head_dim; }
  int64_t lse_elems() const { return batch * heads_q * seq_q; }
};

// Contiguous strides of a [B, H, N, D] tensor stored in `layout`.
sage_strides contiguous_strides(sage_layout layout, int64_t heads, int64_t seq, int64_t dim);

// Reads one (b, h) matrix [rows, dim] as float.
std::vector<float> load_matrix(const TensorView& t, int64_t b, int64_t h, int64_t rows,
                               int64_t dim);
float load_element(const void* data, sage_dtype dtype, int64_t offset);
// The float64 references' dot product (four partial sums in a fixed order: the same bits on every
// run and machine).
double dot_f64(const double* a, const double* b, int64_t n);
// Writes x rounded to dtype (round to nearest even) at data + offset.
void store_element(void* data, sage_dtype dtype, int64_t offset, double x);

// float64 attention of the given (already dtype-rounded) inputs: out is contiguous
// [B, Hq, Nq, D]; lse (optional) contiguous [B, Hq, Nq], natural log; fully masked rows give
// out = 0 and lse = -inf.
void attention_exact(const Problem& p, const TensorView& q, const TensorView& k,
                     const TensorView& v, double* out, double* lse, int threads = 0);

// The quantized attention of `cfg` emulated step by step as the GPU kernels compute it: the
// emulation of the kernel family the config stands for (attention_quant.cpp picks it;
// emulate_mma.cpp, emulate_sm90.cpp, emulate_fp4.cpp). Same output conventions as
// attention_exact. The float version keeps every unquantized value in fp32 as the GPU does; the
// double version applies the same quantization with ideal arithmetic around it.
void attention_quant(const Problem& p, const sage_quant_config& cfg, const TensorView& q,
                     const TensorView& k, const TensorView& v, float* out, float* lse,
                     int threads = 0);
void attention_quant(const Problem& p, const sage_quant_config& cfg, const TensorView& q,
                     const TensorView& k, const TensorView& v, double* out, double* lse,
                     int threads = 0);

// The quantization config a variant stands for (CUSTOM and AUTO give the SAGE2_8B one).
sage_quant_config quant_preset(sage_variant variant);
// Empty when `cfg` is usable, else a message naming the bad field and its value.
std::string quant_config_error(const sage_quant_config& cfg);
// Whether `cfg` asks for the sm90 (wgmma) kernel's softmax form (emulate_sm90.cpp): softmax
// blocks over several K blocks, the polynomial 2^x, or the wgmma kernel's own groups with its
// accumulator (granularity PER_THREAD_WGMMA with pv_accum ALIGNED: the kernel at D = 256, whose
// softmax block is its 64-key K block).
bool sm90_softmax_form(const sage_quant_config& cfg);
// The stride s of the tokens 0, s, 2s, ... < tokens that K's smoothing mean averages
// (sage_quant_config.k_mean_tokens; 1 = every token).
int64_t mean_token_stride(int64_t tokens, int32_t k_mean_tokens);

// Which tokens share a quantization scale. The pattern repeats every `span` tokens (a block);
// token t is in group (t / span) * groups_per_span + group_of[t % span]. span == 0 means one group
// for the whole sequence (per-tensor).
struct GroupLayout {
  int64_t span = 0;
  int groups_per_span = 1;
  std::vector<int> group_of;

  int64_t group(int64_t t) const;
  int64_t num_groups(int64_t n) const;

  static GroupLayout per_tensor();
  static GroupLayout per_block(int64_t block);
  static GroupLayout per_token(int64_t block);
  static GroupLayout per_rows(int64_t block, int64_t rows);  // consecutive runs of `rows` tokens
  // Q rows of an MMA accumulator: a warp owns rows_per_warp consecutive rows (a multiple of 16);
  // lane group g = lane/4 holds rows {g, g+8, g+16, ...} of its warp (the mma.sync C fragment,
  // src/ptx/mma.cuh).
  static GroupLayout thread_q(int64_t block_q, int64_t rows_per_warp);
  // K columns of an MMA accumulator: lane t = lane%4 holds keys {8j+2t, 8j+2t+1} (the same
  // fragment).
  static GroupLayout thread_k(int64_t block_k);
};

// A [rows][dim] matrix quantized in groups of rows (one scale a group): values holds the quantized
// numbers (integers for INT8/INT4, E4M3 values for FP8; x itself for SAGE_QK_NONE) and scale
// the dequantization factor of each row's group: x ~ values * scale, delta = amax / qmax. For
// the FP4 formats values are already dequantized (each run of a row times its own scale) and
// scale is 1.
template <typename Real>
struct QuantizedGroups {
  std::vector<Real> values;
  std::vector<Real> scale;  // [rows]
};
template <typename Real>
QuantizedGroups<Real> quantize_groups(const std::vector<Real>& x, int64_t rows, int64_t dim,
                                      const GroupLayout& layout, sage_qk_format format);

// ---- FP4 microscaling (SageAttention3 paper §3.1; microscale.cpp) ----
// The run format of a Q·K or P·V format (nullptr: not FP4).
const MicroscaleFormat* qk_microscale(sage_qk_format f);
const MicroscaleFormat* pv_microscale(sage_pv_format f);
// n values x[0], x[stride], ... quantized in runs of f.block (16 or 32) from x[0]; the last run
// may be shorter (a kernel pads it with zeros). out[i * stride] (may alias x) receives the
// dequantized value, E2M1 code x scale, exact in float; codes (optional, [n]) the E2M1 codes and
// scale_codes (optional, one a run) the E4M3 or E8M0 scale codes. A run holding a NaN or an
// infinity dequantizes to NaN (cvt's .satfinite would make it finite).
void quantize_fp4(const float* x, int64_t n, int64_t stride, const MicroscaleFormat& f, float* out,
                  uint8_t* codes = nullptr, uint8_t* scale_codes = nullptr);
// The same in place on Real values (rounded to float first, as the GPU's fp32 registers).
template <typename Real>
void round_fp4(Real* x, int64_t n, int64_t stride, const MicroscaleFormat& f);

// The Q and K layouts a config implies.
GroupLayout q_group_layout(const sage_quant_config& cfg);
GroupLayout k_group_layout(const sage_quant_config& cfg);

// One step of the sm_90 wgmma E4M3 accumulator as measured (docs/fp8-accumulator.md): the
// running value and the step's products are each cut, toward zero, to the grid of the largest of
// them with `bits` bits after its leading one, summed exactly, and held in fp32.
// (SAGE_PV_ACCUM_ALIGNED; accum_chunk products a step.)
double mma_aligned_step(double acc, const double* products, int n, int bits);

// The sm90 kernel's polynomial 2^x (sage_quant_config.exp2_poly_every): the float overload is the
// kernel's own function (common/exp2_poly.h); the double one evaluates the same polynomial in
// double (the double emulation's ideal arithmetic).
using sage::exp2_poly;
double exp2_poly(double x);
// Whether score (row, key) takes exp2_poly when every `every`-th accumulator register does
// (sage.h, exp2_poly_every; every <= 0: never). Rows and keys are absolute indices.
bool exp2_poly_at(int64_t row, int64_t key, int every);

// The exponent e of SAGE_V_SCALE_PER_BLOCK for a key block whose largest |V - v_mean| (over its
// keys and every channel) is amax: V^ = E4M3(V / 2^e) with amax / 2^e in [128, 256), under E4M3's
// 448 with the top of its range used (below 128 only for amax < 2^-113, where e stops at -120).
// 0 when amax is zero, subnormal, inf or NaN.
int v_block_exponent(float amax);

// ---- Backward (backward.cpp) ----
// o and lse are the forward's outputs, contiguous [B, Hq, Nq, D] and [B, Hq, Nq] (natural log,
// -inf for a fully masked row); d_o has q's shape; d_lse (optional, contiguous [B, Hq, Nq]) is a
// gradient reaching the LSE: dS = P∘(dP - D + d_lse). dq is written contiguous [B, Hq, Nq, D], dk
// and dv contiguous [B, Hkv, Nk, D] (summed over each GQA group).
void attention_backward_exact(const Problem& p, const TensorView& q, const TensorView& k,
                              const TensorView& v, const double* o, const double* lse,
                              const TensorView& d_o, double* dq, double* dk, double* dv,
                              int threads = 0, const double* d_lse = nullptr);
// What the backward's own softmax statistics and its accuracy check found (backward.cpp).
struct BackwardCheck {
  // Per (batch, q head, row), contiguous [B, Hq, Nq]: the row's log2-sum-exp of its own INT8
  // scores (+inf: no visible key), D = Σ_j P_ij·dP_ij − dL/dLSE_i, and σ², the P-weighted
  // variance estimate of its scores' quantization error (natural-log units squared).
  std::vector<float> lse2, delta;
  std::vector<double> sigma2;
  std::vector<double> head_error;  // [B, Hq]: the root mean square of σ over the head's rows
  // The product check: per head ([B, Hq] for dQ, [B, Hkv] for dK and dV), the estimated 1 - cos
  // of the gradient from its INT8 products' rounding (each uniform within its ψ step, from the
  // unquantized P and dS; INT8 dO·Vᵀ through dS): Σ variance / ‖gradient‖² / 2. The e4m3
  // products are not estimated.
  std::vector<double> dq_error, dk_error, dv_error;
  // some head_error > SAGE_BWD_MAX_SCORE_ERROR or some product estimate >
  // SAGE_BWD_MAX_GRAD_ERROR (or NaN)
  bool untrusted = false;
};
// SageBwd (SageAttention3 paper, Algorithm 3) as the GPU computes it, every unquantized value in
// fp32. The preset takes neither the forward's O nor its LSE: each row's softmax normalizer and D
// come from the backward's own scores (so P sums to 1 over each row and rowsum(dS) = dL/dLSE), and
// when the check finds the INT8 scores too coarse the gradients are NaN (check->untrusted).
// cfg.normalizer SAGE_BWD_NORM_FORWARD (S in 16 bits) takes them instead: fwd_lse [B·Hq][Nq]
// (natural log) and fwd_o [B·Hq][Nq][D], contiguous (a 16-bit forward's, whose P the recomputed
// S reproduces to fp32 rounding); D = dO·O − g. O's rounding to the dtype reaches dS through D
// (on a peaked row dP_ij − D_i nearly cancels for the dominant key) as in any 16-bit backward
// that reads its forward's O; the product check does not estimate it.
//
// fp8 (SAGE_BWD_INT8_PDO / _DSK / _DSQ bits; they override cfg.int8 for those products): the
// product in e4m3 with scales that stay fixed along its summed dimension, so that a kernel's
// accumulator can sum every block in place (docs/backward.md, "The e4m3 products"). Per query i,
// from the stats pass: the row max m_i, μ_i = 2^(m_i - L'_i) = 1 / Σ_j 2^(x_ij - m_i) and
// W_i = max_j e_ij·|dP_ij| + |D_i| (e_ij = 2^(x_ij - m_i)), a bound on max_j |dS_ij| / μ_i. Then
// P_ij = e_ij·μ_i, P̄ = e4m3(448·e_ij), dS̄ = e4m3(e_ij·(dP_ij - D_i)·448 / W_i), and the other
// operand takes the row's factor: dO_i·μ_i / 448 (dV), Q_i·μ_i·W_i / 448 (dK), with one scale per
// channel over the KV head's queries (448 / their max); dQ's K - k̄ takes one per channel over the
// keys, and its per-query μ_i·W_i / 448 multiplies the sum. With SAGE_BWD_NORM_FORWARD there is
// no stats pass: only dV's e4m3 form is taken, with the forward's L as each row's max (e = P,
// μ_i = 1: P̄ = e4m3(448·P)); dK's and dQ's, which need W_i, are refused. Not yet a GPU kernel's:
// the reference of the design.
void attention_backward_quant(const Problem& p, const sage_backward_config& cfg,
                              const TensorView& q, const TensorView& k, const TensorView& v,
                              const TensorView& d_o, float* dq, float* dk, float* dv,
                              int threads = 0, const float* d_lse = nullptr,
                              BackwardCheck* check = nullptr, uint32_t fp8 = 0,
                              const float* fwd_o = nullptr, const float* fwd_lse = nullptr);
sage_backward_config backward_preset();
// Empty when `cfg` is usable, else a message naming the bad field and its value.
std::string backward_config_error(const sage_backward_config& cfg);

// The rows of each partial sum of the smoothing means k̄ and q̄ (the GPU pre-pass's chunk: src/bwd's
// sum_kernel sums each chunk in row order in fp32, mean_kernel adds the chunks in order and
// divides by the row count in fp32; attention_backward_quant forms both the same way, bit for
// bit).
inline constexpr int64_t kBwdSumChunk = 256;

// ψ of the backward: the scale of a block whose largest |x| is amax. Unlike make_quant_scale, a
// NaN amax gives a NaN scale and an infinite one an infinite scale (inverse 0), so a non-finite
// input makes the dequantized products non-finite instead of vanishing.
struct BwdScale {
  float scale, inv;
};
BwdScale bwd_scale(float amax);
// max that keeps a NaN (std::max and fmaxf drop it).
float nan_max(float a, float b);

struct Metrics {
  double cos = 0, rel_l1 = 0, rmse = 0, max_abs = 0;
};
// Accuracy of `x` against `ref` (metrics.cpp), over n elements.
Metrics compare(const double* ref, const float* x, int64_t n);
Metrics compare(const double* ref, const double* x, int64_t n);

// Runs fn(i) for i in [0, n) on `threads` threads (0 = hardware concurrency). Exceptions thrown
// by fn are rethrown (the first one) after all threads stop.
void parallel_for(int64_t n, int threads, const std::function<void(int64_t)>& fn);

}  // namespace sage::ref
