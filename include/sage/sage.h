/* sage.h — the C API of libsage: quantized attention (SageAttention2 / SageAttention3).
 *
 * The contract every other face (C++, Python) goes through. Plain C99, POD structs, no CUDA
 * headers. Every function returns a sage_status; on failure sage_last_error() gives a
 * thread-local message naming the offending argument and its value.
 *
 * One call, sage_attention(), serves every backend: host pointers run the CPU reference (an exact
 * emulation of the quantized arithmetic, or float64 attention), device pointers run the GPU
 * kernels. Initialise the args with sage_attention_args_init() and set what you need. */
#ifndef SAGE_SAGE_H
#define SAGE_SAGE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define SAGE_API __declspec(dllexport)
#else
#define SAGE_API __attribute__((visibility("default")))
#endif

#define SAGE_VERSION_MAJOR 0
#define SAGE_VERSION_MINOR 1
#define SAGE_VERSION_PATCH 0

typedef enum sage_status {
  SAGE_OK = 0,
  SAGE_ERROR_INVALID_ARGUMENT = 1, /* a value is wrong: sizes, strides, enums, pointers */
  SAGE_ERROR_UNSUPPORTED = 2,      /* valid, but no kernel/backend implements this combination */
  SAGE_ERROR_CUDA = 3,             /* a CUDA runtime call failed (message has the CUDA error) */
  SAGE_ERROR_OUT_OF_MEMORY = 4,    /* host allocation failed (the CPU reference) */
  SAGE_ERROR_WORKSPACE_TOO_SMALL = 5,
  SAGE_ERROR_INTERNAL = 6
} sage_status;

typedef enum sage_dtype {
  SAGE_DTYPE_FP16 = 0,
  SAGE_DTYPE_BF16 = 1,
  SAGE_DTYPE_FP32 = 2 /* CPU reference only */
} sage_dtype;

/* What the strides default to when a tensor's strides are all zero (see sage_strides). */
typedef enum sage_layout {
  SAGE_LAYOUT_HND = 0, /* [B, H, N, D] */
  SAGE_LAYOUT_NHD = 1  /* [B, N, H, D] */
} sage_layout;

typedef enum sage_mask {
  SAGE_MASK_NONE = 0,
  SAGE_MASK_CAUSAL_BOTTOM_RIGHT = 1, /* query i sees keys j <= i + Nk - Nq (FlashAttention) */
  SAGE_MASK_CAUSAL_TOP_LEFT = 2      /* query i sees keys j <= i (torch SDPA is_causal=True) */
} sage_mask;

typedef enum sage_backend {
  SAGE_BACKEND_AUTO = 0, /* device pointers -> CUDA, host pointers -> CPU reference */
  SAGE_BACKEND_CPU = 1,  /* the CPU reference (host pointers) */
  SAGE_BACKEND_CUDA = 2  /* the GPU kernels (device pointers) */
} sage_backend;

/* Presets. CUSTOM takes sage_attention_args.quant exactly as given; every other value overwrites
 * it with the preset (sage_quant_config_init() shows what a preset holds). */
typedef enum sage_variant {
  SAGE_VARIANT_AUTO = 0,     /* what the hardware runs best (CPU: SAGE2_8B emulation) */
  SAGE_VARIANT_SAGE2_8B = 1, /* INT8 per-thread Q,K + smooth K; FP8 E4M3 P,V; two-level accum */
  SAGE_VARIANT_SAGE2_4B = 2, /* INT4 per-thread Q,K + smooth Q and K; FP8 E4M3 P,V; two-level */
  SAGE_VARIANT_EXACT = 3,    /* no quantization: float64 on the CPU */
  SAGE_VARIANT_CUSTOM = 4,   /* every knob from .quant (CPU reference: all combinations) */
  SAGE_VARIANT_SAGE3_FP4 = 5 /* SageAttention3's FP4 attention (its paper's Algorithm 1): NVFP4
                                Q,K + smooth Q and K; NVFP4 P~ (two-level) and V; CPU reference
                                only (no GPU kernel: see docs/fp4-blackwell.md) */
} sage_variant;

typedef enum sage_qk_format {
  SAGE_QK_NONE = 0, /* Q, K kept in full precision */
  SAGE_QK_INT8 = 1,
  SAGE_QK_INT4 = 2,
  SAGE_QK_FP8_E4M3 = 3,
  /* FP4 microscaling (SageAttention3; CPU only): E2M1 in runs along head_dim, one scale per
   * run; quant.granularity does not apply (the runs are the groups). */
  SAGE_QK_NVFP4 = 4, /* runs of 16, E4M3 scale amax / 6 */
  SAGE_QK_MXFP4 = 5  /* runs of 32, E8M0 scale 2^(floor(log2 amax) - 2) (OCP MX) */
} sage_qk_format;

/* Which tokens share one quantization scale. */
typedef enum sage_granularity {
  SAGE_GRANULARITY_PER_THREAD_MMA = 0,   /* mma.sync m16n8k*: 4 warps x 32 rows, 64-key blocks */
  SAGE_GRANULARITY_PER_THREAD_WGMMA = 1, /* wgmma m64nNk32: 16 rows a warp, block_k keys; with
                                            pv_accum ALIGNED also the sm90 kernel's softmax form
                                            (the plan of its D = 256: 64-key softmax blocks) */
  SAGE_GRANULARITY_PER_TOKEN = 2,
  SAGE_GRANULARITY_PER_WARP = 3,  /* Q: rows of one warp (block_q / warps); K: per block */
  SAGE_GRANULARITY_PER_BLOCK = 4, /* one scale per Q block and per K block */
  SAGE_GRANULARITY_PER_TENSOR = 5 /* one scale per (batch, head) matrix */
} sage_granularity;

typedef enum sage_pv_format {
  SAGE_PV_NONE = 0,     /* P~ and V in full precision (fp32 P~, V as given) */
  SAGE_PV_FP16 = 1,     /* P~ and V rounded to fp16 */
  SAGE_PV_FP8_E4M3 = 2, /* P~ x 448 and V / v_scale in E4M3 */
  SAGE_PV_FP8_E5M2 = 3, /* P~ x 57344 and V / v_scale in E5M2 */
  SAGE_PV_INT8 = 4,     /* P~ x 127 and V / v_scale in INT8 (static P scale, as the paper) */
  /* FP4 microscaling (SageAttention3; CPU only): P~ in runs of keys within a key block, V in
   * runs of keys per channel (the reduction dimension of P~·V); needs block_k a multiple of the
   * run, softmax_block_k 0 (or block_k), exp2_poly_every 0, v_scale PER_CHANNEL (ignored). */
  SAGE_PV_NVFP4 = 5,        /* NVFP4, P~ two-level: each row of a key block first scaled to
                               [0, 448 x 6] by an fp32 s_P1 = rowmax / 2688 (applied to the
                               block's P·V product), then NVFP4; needs the accumulator flushed
                               every key block (pv_accum FP32, or TWO_LEVEL with interval 1) */
  SAGE_PV_NVFP4_DIRECT = 6, /* NVFP4, P~ in [0, 1] quantized directly (SageAttention3, Tab. 1(b)) */
  SAGE_PV_MXFP4 = 7         /* MXFP4 (runs of 32, E8M0 scales), P~ directly: a power-of-two
                               scale has no mantissa for a first level to fill */
} sage_pv_format;

typedef enum sage_v_scale {
  SAGE_V_SCALE_PER_CHANNEL = 0,       /* from max |V[:, c] - v_mean[c]| over the sequence:
                                         with V smoothing that max; without, the larger of
                                         twice its max over K's mean sample of the tokens
                                         (k_mean_tokens) and the max itself, so that the
                                         pre-pass quantizes V without reading all of it first */
  SAGE_V_SCALE_PER_BLOCK_CHANNEL = 1, /* max |V[block, c]| per key block (a flush every block) */
  SAGE_V_SCALE_PER_BLOCK = 2          /* one power of two per key block (all channels), folded
                                         into P~'s exponent: any pv_accum; FP8_E4M3 V only */
} sage_v_scale;

typedef enum sage_pv_accum {
  SAGE_PV_ACCUM_FP32 = 0,     /* a true fp32 accumulator */
  SAGE_PV_ACCUM_HW = 1,       /* the MMA's own accumulator over the whole sequence (FP22-like) */
  SAGE_PV_ACCUM_TWO_LEVEL = 2, /* MMA accumulator for pv_flush_interval key blocks, then fp32 */
  SAGE_PV_ACCUM_ALIGNED = 3    /* the MMA accumulator over the whole sequence, each product of an
                                  MMA step (accum_chunk keys) aligned to the step's largest addend
                                  and truncated to accum_mantissa_bits: the sm_90 wgmma E4M3 model
                                  (docs/fp8-accumulator.md); CPU reference only */
} sage_pv_accum;

/* Which GPU kernel family runs a CUDA call (sage_attention_args.kernel). AUTO is the plan's
 * choice; the others force a family (tests and benchmarks compare them) and are refused with
 * SAGE_ERROR_UNSUPPORTED where that family has no kernel for the arguments or the GPU. */
typedef enum sage_kernel {
  SAGE_KERNEL_AUTO = 0, /* sm_90: the wgmma kernel where it applies (8-bit Q·K, no Q smoothing),
                           else the mma.sync kernel */
  SAGE_KERNEL_MMA = 1,  /* the portable mma.sync kernel (sm_89, sm_90, sm_120) */
  SAGE_KERNEL_SM90 = 2, /* the Hopper wgmma kernel (sm_90a) */
  SAGE_KERNEL_FP4 = 3   /* SageAttention3's FP4 arithmetic on fp16 tensor cores (sm_89+), the
                           kernel of variant SAGE3_FP4: reported by the plan, never forced */
} sage_kernel;

/* sage_attention_args.options flags. */
#define SAGE_OPTION_PREPASS_Q 1u /* sm90: Q quantized by the pre-pass instead of inside the kernel */
#define SAGE_OPTION_PREPASS_KV_SPLIT 2u /* K/V pre-pass in three launches (statistics, finalize,
                                           quantize) where it would run as one cluster launch
                                           (with V smoothing; without it the pre-pass starts
                                           from a sample of the tokens either way) */
#define SAGE_OPTION_WHOLE_TILES 4u /* sm90: no split tail: the last round's tiles run whole, one
                                      CTA each (sage_quant_config.split_tiles) */
#define SAGE_OPTION_PREPASS_KV_BLOCKS 8u /* the three-launch K/V pre-pass quantizes with a CTA per
                                            64-key block, not the staged grid that pipelines
                                            them (the same bits) */

/* Smoothing flags: quantize X - mean(X) over tokens instead of X, and add the mean's part back
 * exactly (K: a constant per score row, which the softmax ignores and the LSE adds back; Q: ΔS
 * on the scores; V: v_mean on O, each row of P summing to 1). */
#define SAGE_SMOOTH_Q 1u
#define SAGE_SMOOTH_K 2u
#define SAGE_SMOOTH_V 4u

typedef struct sage_quant_config {
  sage_qk_format qk_format;
  sage_granularity granularity;
  uint32_t smooth;         /* SAGE_SMOOTH_* flags */
  sage_pv_format pv_format;
  sage_v_scale v_scale;
  sage_pv_accum pv_accum;
  int32_t pv_flush_interval; /* key blocks per flush of the MMA accumulator (TWO_LEVEL), >= 1 */
  int32_t accum_mantissa_bits; /* mantissa bits the MMA accumulator keeps (CPU model; 13 = FP22) */
  int32_t accum_chunk;         /* keys summed exactly inside one MMA before the truncating add */
  int32_t block_q;             /* query rows a CTA owns (softmax tile, Q smoothing, per-block) */
  int32_t block_k;             /* keys per streamed block */
  int32_t warps;               /* warps sharing block_q (per-warp / per-thread MMA groups) */
  int32_t k_mean_tokens; /* K's smoothing mean over tokens 0, s, 2s, ... < N, s = max(1,
                            N / k_mean_tokens) (integer division); 0: every token. V's mean
                            always takes every token (the sm90 kernel's accumulator needs V - v_mean
                            to sum to zero over the sequence); without V smoothing V's scale is
                            bounded from the same sample (SAGE_V_SCALE_PER_CHANNEL), and 0 makes
                            the GPU pre-pass read every row first, a CTA a head */
  int32_t softmax_block_k; /* keys per online-softmax block, a multiple of block_k (the sm90
                              kernel: 128-key softmax blocks over 64-key K scale groups);
                              0: block_k */
  int32_t exp2_poly_every; /* 0: every 2^x on the hardware's ex2; n in {2, 4, 8, 16, 32}: in a
                              softmax block that every key of the tile's rows sees, score (row r,
                              key j) takes a degree-3 polynomial 2^x when (4·((j mod 128) / 8) +
                              2·((r mod 16) / 8) + j mod 2) mod n = n - 1: register i mod n = n - 1
                              of the wgmma accumulator (the sm90 kernel: 32 at D = 128) */
  int32_t split_tiles; /* the sm90 kernel's split tail (sage_plan_info.emulation sets it; the
                          sm90 softmax form only): the call's last split_tiles tiles of block_q
                          rows (numbered batch, head, query block) have their softmax blocks
                          cut into split_ctas ranges of near-equal length in that order; each
                          part of a tile runs its online softmax and P·V accumulator from a
                          fresh state, and the parts' (m, l, O) are merged in order at the end.
                          0: none (then split_ctas is 0 too); else split_tiles <= split_ctas */
  int32_t split_ctas;
} sage_quant_config;

/* Strides in elements for the batch, head and token dimensions; the last (head_dim, or nothing for
 * LSE) is contiguous. All zero = contiguous in args.layout (LSE: contiguous [B, Hq, Nq]). */
typedef struct sage_strides {
  int64_t batch;
  int64_t head;
  int64_t token;
} sage_strides;

typedef struct sage_attention_args {
  size_t struct_size; /* sizeof(sage_attention_args), set by sage_attention_args_init */

  const void* q; /* [B, Hq, Nq, D] (HND) or [B, Nq, Hq, D] (NHD), dtype */
  const void* k; /* [B, Hkv, Nk, D] or [B, Nk, Hkv, D] */
  const void* v; /* same shape as k */
  void* o;       /* same shape as q, dtype; must not overlap the inputs */
  float* lse;    /* optional [B, Hq, Nq] fp32: natural log of the softmax denominator; NULL = off */

  int64_t batch;
  int64_t heads_q;
  int64_t heads_kv; /* heads_q % heads_kv == 0 (GQA/MQA) */
  int64_t seq_q;
  int64_t seq_kv;
  int64_t head_dim; /* 1..256 (the CPU reference); the GPU kernels take multiples of 8 from 8
                       to 256 (64, 128 and 256 natively, the others zero-padded up to them:
                       sage_plan_info.kernel_head_dim), the GPU backward and the FP4 kernel
                       64 and 128 */

  sage_layout layout;
  sage_strides q_strides, k_strides, v_strides, o_strides, lse_strides;
  sage_dtype dtype; /* of q, k, v and o */

  float scale;     /* softmax scale; 0 = 1/sqrt(head_dim) */
  sage_mask mask;

  sage_variant variant;
  sage_quant_config quant; /* used when variant == SAGE_VARIANT_CUSTOM */

  sage_backend backend;
  void* stream;          /* cudaStream_t for the CUDA backend; NULL = the default stream */
  void* workspace;       /* device memory of sage_attention_workspace_size() bytes (CUDA) */
  size_t workspace_size;
  int32_t num_threads;   /* CPU reference threads; 0 = all hardware threads */
  sage_kernel kernel;    /* CUDA: which kernel family (AUTO: the plan's choice) */
  uint32_t options;      /* SAGE_OPTION_* flags */

  /* Packed variable-length batches (FlashAttention's varlen conventions). Both NULL: the dense
   * layout above. Both set: `batch` sequences packed token after token; sequence b holds query
   * tokens cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1 and keys cu_seqlens_k[b] .. cu_seqlens_k[b+1]-1.
   * Each sequence is its own attention problem: causal alignment (either mask), K and V
   * smoothing means and every quantization group are per sequence, never across sequences.
   *   layout must be NHD: q, o are [total_q, Hq, D], k, v [total_k, Hkv, D] (strides.head and
   *     .token as usual; strides.batch must be 0, the sequences are located by cu_seqlens).
   *   lse (optional) is [Hq, total_q] fp32 (FlashAttention's varlen LSE): lse_strides.head and
   *     .token, .batch 0; all zero = contiguous.
   *   cu_seqlens_* are int32 [batch + 1]: start at 0, non-decreasing, end at total_*. They live
   *     on the backend's side; the CPU backend checks their contents; the CUDA backend never
   *     reads them on the host (no synchronization: a call can be captured in a CUDA graph and
   *     replayed with new contents of the same batch size, within seq_q, seq_kv and total_*),
   *     so total_* give the extents to validate. On the GPU, contents that break the
   *     conventions leave rows unwritten or wrong, never memory outside the tensors touched.
   *   seq_q, seq_kv are the longest sequence's lengths (max_seqlen_q, max_seqlen_k): every
   *     sequence must fit in them (the GPU grids are sized by them).
   *   A sequence with no queries writes nothing; one with queries but no keys gives o = 0 and
   *     lse = -inf for its rows, as a fully masked row of the dense call.
   * The CUDA backend runs packed batches on the wgmma kernel on sm_90 (AUTO or SM90: 8-bit, no Q
   * smoothing, Q rows 16-byte aligned, no SAGE_OPTION_PREPASS_Q), else on the mma.sync kernel
   * (8-bit and 4-bit, not FP4; kernel = MMA forces it): each sequence gives the bits the same kernel gives it as a dense
   * call of batch 1 with SAGE_OPTION_WHOLE_TILES (a packed call never splits its tiles). The workspace holds each sequence's rows padded to a multiple of 128 (no
   * padding to seq_q/seq_kv): docs/c-api.md, "Device memory". */
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;
  int64_t total_q; /* query tokens in all sequences (rows of q and o), >= 1 */
  int64_t total_k; /* key tokens in all sequences (rows of k and v), >= 1 */
} sage_attention_args;

/* What sage_attention() will do with a set of args, decided once by the library's planner
 * (sage_attention_plan): the backend and kernel, its tile, the workspace, whether a dense fp16
 * SDPA measured faster for this shape on this GPU, and the quantization config whose CPU
 * emulation computes exactly what the call runs. */
typedef struct sage_plan_info {
  size_t struct_size;      /* sizeof(sage_plan_info): set by the caller */
  sage_backend backend;    /* CPU or CUDA */
  sage_kernel kernel;      /* CUDA: MMA or SM90; AUTO for the CPU backend */
  int32_t block_q;         /* query rows per tile (CTA) */
  int32_t block_k;         /* keys per streamed block */
  int32_t fused_q;         /* 1: the kernel quantizes Q itself (no pre-pass for Q) */
  int32_t launches;        /* kernels launched per call */
  int32_t prefer_sdpa;     /* 1: on this GPU a dense fp16 SDPA (cuDNN) is predicted faster for
                              this call's batch, heads, lengths, head dim and mask (the
                              crossover model fitted to measurements, src/api/plan.cpp), or
                              this kind of GPU was never measured (every call: Ada, Blackwell):
                              the SDPA drop-in hands such calls to torch; sage_attention() still
                              runs them */
  size_t workspace_size;   /* bytes of device workspace (sage_attention_workspace_size) */
  sage_quant_config emulation; /* the config whose CPU emulation (SAGE_VARIANT_CUSTOM on host
                                  pointers) computes what this call runs, accumulator included */
  int64_t kernel_head_dim; /* the head dim the call computes at: CUDA, the kernel's native 64,
                              128 or 256 (head_dim padded with zero channels: the Q·K and P·V
                              work of kernel_head_dim, estimated to cost about
                              kernel_head_dim / head_dim times a native head_dim's); the CPU
                              backend, head_dim */
  int32_t has_backward;    /* 1: sage_backward (its preset) runs the backward of this call here
                              (CUDA: head dims 64 and 128; the CPU reference: any), so a training
                              call can take both passes from the library */
  int32_t prefer_sdpa_training; /* 1: for a training call (this forward and SageBwd's backward)
                                   SDPA measured faster, or was never measured slower (the same
                                   table): the SDPA drop-in trains such calls with torch */
  int64_t sdpa_below;      /* CUDA: on this GPU every call with a query or key length under this
                              has prefer_sdpa set, whatever its batch, heads, head dim and mask
                              (the crossover model's least routed length; INT64_MAX on a kind
                              of GPU never measured), so a router can hand such calls to SDPA
                              unplanned; the CPU backend: 0 */
} sage_plan_info;

/* ---- The backward pass: SageBwd (SageAttention3 paper, Algorithm 3) -----------------------------
 * dQ, dK, dV of O = softmax(Q·Kᵀ·scale + mask)·V from Q, K, V, the forward's O and LSE, and dO.
 * SageBwd recomputes S = Q·Kᵀ and P = exp(S - LSE) and runs five matmuls; each can be INT8 with
 * per-block scales (ψ: one scale max|x|/127 per block_q x D, block_k x D or block_q x block_k
 * tile) or stay in the input dtype with fp32 accumulation. The paper's choice is every matmul
 * but dO·Vᵀ in INT8 (SAGE_BWD_INT8_DEFAULT): dP = dO·Vᵀ is the product whose error reaches dQ and
 * dK through dS over the whole sequence. */
#define SAGE_BWD_INT8_QK 1u   /* S = Q·Kᵀ (recomputed) */
#define SAGE_BWD_INT8_PDO 2u  /* dV += Pᵀ·dO */
#define SAGE_BWD_INT8_DOV 4u  /* dP = dO·Vᵀ */
#define SAGE_BWD_INT8_DSK 8u  /* dQ += dS·K */
#define SAGE_BWD_INT8_DSQ 16u /* dK += dSᵀ·Q */
#define SAGE_BWD_INT8_DEFAULT (SAGE_BWD_INT8_QK | SAGE_BWD_INT8_PDO | SAGE_BWD_INT8_DSK | \
                               SAGE_BWD_INT8_DSQ)

/* sage_backward_args.options flags. */
/* The accuracy check of the 8-bit backward: per query head, the root mean square over its rows of
 * the estimated error of the INT8 scores (natural-log units, each row weighted by its own P) may
 * not exceed this; past it the call's gradients are NaN and *untrusted is 1 (docs/backward.md). */
#define SAGE_BWD_MAX_SCORE_ERROR 0.04f
/* And per head, each gradient's estimated 1 - cos from the rounding of its INT8 products (the CPU
 * reference computes it; the GPU kernels, whose preset the score check refuses first on every
 * input class measured, do not yet): past it, the same. */
#define SAGE_BWD_MAX_GRAD_ERROR 1e-3f

#define SAGE_BWD_OPTION_DETERMINISTIC 1u /* CUDA: dQ summed over key blocks in a fixed order
                                            (no atomics): the same bits on every run. The CPU
                                            reference is deterministic either way. */

typedef struct sage_backward_config {
  uint32_t int8;   /* SAGE_BWD_INT8_* flags: which matmuls are INT8 */
  uint32_t smooth; /* SAGE_SMOOTH_K and/or SAGE_SMOOTH_Q: quantize K - mean(K), Q - mean(Q) (each
                      exact: docs/backward.md); the preset has both */
  int32_t block_q; /* query rows of one ψ block (Q, dO; P and dS tiles are block_q x block_k) */
  int32_t block_k; /* key rows of one ψ block (K) */
  sage_granularity granularity; /* of P and dS within a block_q x block_k tile: PER_BLOCK (the
                                   paper: one scale a tile) or PER_TOKEN (the scales that factor
                                   out of each product: P and dS per key for dV = Pᵀ·dO and
                                   dK = dSᵀ·Q, dS per query for dQ = dS·K) */
  uint32_t channel_scales; /* SAGE_BWD_INT8_DSQ and/or SAGE_BWD_INT8_DSK: that product's INT8 Q
                              (dK = dSᵀ·Q) or K - k̄ (dQ = dS·K) takes one scale per (block,
                              channel) instead of one per block: constant along the summed
                              dimension, so it factors out of the product as the per-token dS
                              scales do, and an outlier channel no longer coarsens the others.
                              0 in the preset; CPU only */
  uint32_t normalizer; /* SAGE_BWD_NORM_OWN (the preset): P and D = Σ P·dP from the backward's own
                          scores (a statistics pass); SAGE_BWD_NORM_FORWARD: P = exp(S - lse) and
                          D = rowsum(dO∘O) - g from the forward's lse and o, which must then be
                          given (a 16-bit forward's: S must be computed as it did, so not with
                          SAGE_BWD_INT8_QK). CUDA: with int8 = 0 (every product in the dtype) on
                          sm_90's wgmma kernel, without Q smoothing or the deterministic option;
                          otherwise CPU only */
} sage_backward_config;

#define SAGE_BWD_NORM_OWN 0u
#define SAGE_BWD_NORM_FORWARD 1u

typedef struct sage_backward_args {
  size_t struct_size; /* sizeof(sage_backward_args), set by sage_backward_args_init */

  const void* q, *k, *v; /* the forward's inputs, shapes as in sage_attention_args */
  const void* o;         /* the forward's output, q's shape, and its LSE, [B, Hq, Nq] fp32 */
  const float* lse;      /* (natural log): read by variant EXACT and by config.normalizer
                            SAGE_BWD_NORM_FORWARD only (may be NULL otherwise): the preset
                            recomputes each row's normalizer from its own scores */
  const void* d_o;       /* dL/dO, q's shape */
  const float* d_lse;    /* optional dL/dLSE, [B, Hq, Nq] fp32 (NULL: zero): a gradient that
                            reaches the LSE output (merging partial attentions) */
  void* dq;              /* outputs dL/dQ, dL/dK, dL/dV in dtype: shapes of q, k, v; they must */
  void* dk;              /* not overlap each other or an input (dK and dV are summed over the */
  void* dv;              /* query heads of a GQA group) */

  int64_t batch, heads_q, heads_kv, seq_q, seq_kv, head_dim;
  sage_layout layout;
  sage_strides q_strides, k_strides, v_strides, o_strides, lse_strides, do_strides, dlse_strides,
      dq_strides, dk_strides, dv_strides;
  sage_dtype dtype; /* of q, k, v, o, d_o, dq, dk, dv */

  float scale; /* softmax scale; 0 = 1/sqrt(head_dim) */
  sage_mask mask;

  sage_variant variant; /* AUTO: SageBwd as the hardware runs it; EXACT: float64 (CPU only);
                           CUSTOM: .config as given (the CPU runs any; CUDA refuses a config its
                           kernel does not compute) */
  sage_backward_config config;

  sage_backend backend;
  void* stream;
  void* workspace; /* device memory of sage_backward_workspace_size() bytes (CUDA) */
  size_t workspace_size;
  int32_t num_threads; /* CPU reference threads; 0 = all */
  uint32_t options;    /* SAGE_BWD_OPTION_* flags */
  sage_kernel kernel;  /* CUDA: AUTO (sm_90: the wgmma kernel, else mma.sync), MMA or SM90 */
  int32_t* untrusted;  /* optional, one int32 (device memory for CUDA, host for the CPU): written 0
                          when the 8-bit gradients passed the accuracy check, 1 when they did not
                          (a head's estimated score error was over SAGE_BWD_MAX_SCORE_ERROR, or
                          on the CPU a gradient's product estimate over SAGE_BWD_MAX_GRAD_ERROR:
                          docs/backward.md). On 1, dq, dk and dv hold NaN: compute this call's
                          gradients in 16 bits instead. The check runs with or without it. */
} sage_backward_args;

/* Library version, e.g. "0.1.0". */
SAGE_API const char* sage_version(void);
SAGE_API void sage_version_numbers(int* major, int* minor, int* patch);

/* Thread-local message describing the last failure on this thread ("" after success). */
SAGE_API const char* sage_last_error(void);
SAGE_API const char* sage_status_string(sage_status status);

/* Defaults: HND, fp16, no mask, AUTO variant and backend, quant = the SAGE2_8B preset. */
SAGE_API sage_status sage_attention_args_init(sage_attention_args* args);
/* Fill a quantization config with a preset. AUTO and CUSTOM give the SAGE2_8B config (the
 * starting point of a custom one). */
SAGE_API sage_status sage_quant_config_init(sage_quant_config* config, sage_variant variant);

/* Bytes of device workspace sage_attention() needs for these args (0 for the CPU backend): the
 * quantized K and V with their scales and means; where the kernel does not quantize Q itself, the
 * quantized Q with its scales and 4 bytes a query row (its LSE shift), else those 4 bytes only
 * where the LSE is asked for (lse != NULL); Q's block means with Q smoothing. docs/c-api.md,
 * "Device memory", gives the formula. */
SAGE_API sage_status sage_attention_workspace_size(const sage_attention_args* args,
                                                   size_t* bytes);

/* The plan of a call: validates `args` exactly as sage_attention() does and describes what it
 * would run (info->struct_size must be sizeof(sage_plan_info)). Touches no tensor memory. */
SAGE_API sage_status sage_attention_plan(const sage_attention_args* args, sage_plan_info* info);

/* Validate the args and run attention. Writes o (and lse); never touches the inputs. */
SAGE_API sage_status sage_attention(const sage_attention_args* args);

/* Defaults: HND, fp16, no mask, AUTO variant and backend, config = SageBwd's (block 64 x 64,
 * Q and K smoothed, every matmul but dO·Vᵀ in INT8). */
SAGE_API sage_status sage_backward_args_init(sage_backward_args* args);
/* Bytes of device workspace sage_attention_backward() needs for these args (0 on the CPU). */
SAGE_API sage_status sage_backward_workspace_size(const sage_backward_args* args, size_t* bytes);
/* Validate the args and write dq, dk, dv; never touches the inputs. */
SAGE_API sage_status sage_attention_backward(const sage_backward_args* args);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* SAGE_SAGE_H */
