// SageAttention3's FP4 attention on fp16 tensor cores (sm_89+; fp4.h says what and why). Each
// step is the CPU emulation's (src/ref/emulate_fp4.cpp with the SAGE3_FP4 config) with the
// same float operations, in the same order where a result is quantized: the NVFP4 codecs are
// the reference's own (common/formats.h, host and device), exp2 is taken in double and rounded
// (the host's exp2f is within half an ulp), and no multiply-add is contracted (__f*_rn).
// What differs: the tensor cores' fp32 sums (Q^·K^ per 64 channels, P^·V^ per 64 keys; the
// emulation sums each exactly) and the order of a row's sum of P~ (a float sum, ~1e-7).
//   prep_k    one CTA per KV head: K's channel mean over the sampled tokens (double, in order)
//   quant_k   K - k_mean in NVFP4 runs of 16 channels, dequantized to fp16; the first bad key
//   quant_v   V in NVFP4 runs of 16 keys per channel, dequantized to fp16, transposed
//   prep_q    per 128-row block: Q's mean, each row's LSE shift (NaN: poisoned), Q - q_mean in
//             NVFP4 runs of 16 channels, fp16
//   attention 4 warps of 16 rows; per 64-key block ΔS (double dots of q_mean with K - k_mean
//             read from the caller's K), S = Q^·K^ on the tensor cores, the online softmax, P~ to
//             NVFP4 with its per-row first level, O += (P^·V^)·s_P1
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <type_traits>

#include "attn/epilogue.cuh"
#include "common/formats.h"
#include "common/fragment.cuh"
#include "common/grid.h"
#include "fp4/fp4.h"
#include "ptx/mma.cuh"
#include "quant/layout.h"

namespace sage::fp4 {
namespace {

constexpr float kNaN = __builtin_nanf("");

template <typename T>
__device__ __forceinline__ float load(const void* base, const sage_strides& s, int64_t b, int64_t h,
                                      int64_t n, int64_t d) {
  const T* p = static_cast<const T*>(base) + b * s.batch + h * s.head + n * s.token + d;
  if constexpr (std::is_same_v<T, __half>)
    return __half2float(*p);
  else
    return __bfloat162float(*p);
}
// An element as a float with an Inf/NaN taken as zero (its rows are poisoned: docs/c-api.md);
// *bad, when given, is set if it was one.
template <typename T>
__device__ __forceinline__ float load_finite(const void* base, const sage_strides& s, int64_t b,
                                             int64_t h, int64_t n, int64_t d,
                                             bool* bad = nullptr) {
  const float x = load<T>(base, s, b, h, n, d);
  const bool finite = isfinite(x);
  if (bad && !finite) *bad = true;
  return finite ? x : 0.0f;
}

// One NVFP4 run (16 floats) quantized and dequantized in place, as ref::quantize_fp4.
__device__ __forceinline__ void nvfp4_run(float (&x)[16]) {
  constexpr MicroscaleFormat kNv = kNvfp4;  // local copies: device code takes the values
  constexpr FloatFormat kE2m1 = kE2M1;
  float amax = 0.0f;
  for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(x[i]));
  const float scale = fp4_scale_value(kNv, fp4_scale_code(kNv, amax));
  for (int i = 0; i < 16; ++i) x[i] = __fmul_rn(decode_float(kE2m1, fp4_encode(x[i], scale)), scale);
}

// The emulation's dot<double>: eight interleaved partial sums, added pairwise at the end.
template <typename A, typename B>
__device__ __forceinline__ double dot8(A a, B b, int64_t n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += double(a(i + l)) * double(b(i + l));
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

__device__ __forceinline__ int64_t visible(const Params& p, int64_t row) {
  return quant::RowSight{p.seq_kv, p.causal_offset, p.causal}.visible(row);
}

template <typename T>
__global__ void prep_k_kernel(Params p) {
  const int64_t bhk = blockIdx.x, b = bhk / p.heads_kv, h = bhk % p.heads_kv;
  const Layout& L = p.layout;
  float* k_mean = reinterpret_cast<float*>(p.workspace + L.k_mean) + bhk * p.head_dim;
  if (threadIdx.x == 0) reinterpret_cast<unsigned long long*>(p.workspace + L.kv_bad)[bhk] =
      quant::kKvBadNone;
  for (int64_t c = threadIdx.x; c < p.head_dim; c += blockDim.x) {
    double s = 0;
    int64_t count = 0;
    for (int64_t n = 0; n < p.seq_kv; n += p.k_mean_stride, ++count)
      s += double(load_finite<T>(p.k, p.ks, b, h, n, c));
    k_mean[c] = p.smooth_k ? float(s / double(count)) : 0.0f;
  }
}

// A thread per (key, run of 16 channels).
template <typename T>
__global__ void quant_k_kernel(Params p) {
  const Layout& L = p.layout;
  const int64_t bhk = cta_outer_index(), b = bhk / p.heads_kv, h = bhk % p.heads_kv;
  if (bhk >= p.batch * p.heads_kv) return;
  const int runs = int(p.head_dim / 16);
  const int64_t key = blockIdx.x * (blockDim.x / runs) + threadIdx.x / runs;
  const int run = threadIdx.x % runs;
  if (key >= L.nk_pad) return;
  const float* km = reinterpret_cast<const float*>(p.workspace + L.k_mean) + bhk * p.head_dim;
  __half* dst = reinterpret_cast<__half*>(p.workspace + L.k) + (bhk * L.nk_pad + key) * p.head_dim;
  float x[16];
  bool bad = false;
  for (int i = 0; i < 16; ++i) {
    const int64_t c = run * 16 + i;
    x[i] = 0.0f;
    if (key < p.seq_kv) {
      x[i] = __fsub_rn(load_finite<T>(p.k, p.ks, b, h, key, c, &bad), km[c]);
    }
  }
  if (key < p.seq_kv) nvfp4_run(x);
  for (int i = 0; i < 16; ++i) dst[run * 16 + i] = __float2half_rn(x[i]);
  if (bad)
    atomicMin(reinterpret_cast<unsigned long long*>(p.workspace + L.kv_bad) + bhk,
              static_cast<unsigned long long>(key));
}

// A thread per (channel, run of 16 keys).
template <typename T>
__global__ void quant_v_kernel(Params p) {
  const Layout& L = p.layout;
  const int64_t bhk = cta_outer_index(), b = bhk / p.heads_kv, h = bhk % p.heads_kv;
  if (bhk >= p.batch * p.heads_kv) return;
  const int64_t c = threadIdx.x, key0 = int64_t(blockIdx.x) * 16;
  if (c >= p.head_dim) return;
  float x[16];
  int64_t first_bad = -1;
  for (int i = 0; i < 16; ++i) {
    const int64_t key = key0 + i;
    x[i] = 0.0f;
    if (key < p.seq_kv) {
      bool bad = false;
      x[i] = load_finite<T>(p.v, p.vs, b, h, key, c, &bad);
      if (bad && first_bad < 0) first_bad = key;
    }
  }
  nvfp4_run(x);  // keys past Nk are zeros: they change no run's amax
  __half* dst = reinterpret_cast<__half*>(p.workspace + L.vt) + (bhk * p.head_dim + c) * L.nk_pad;
  for (int i = 0; i < 16; ++i) dst[key0 + i] = __float2half_rn(x[i]);
  if (first_bad >= 0)
    atomicMin(reinterpret_cast<unsigned long long*>(p.workspace + L.kv_bad) + bhk,
              static_cast<unsigned long long>(first_bad));
}

// One CTA (128 threads, a row each) per 128-row Q block.
template <typename T>
__global__ void prep_q_kernel(Params p) {
  const Layout& L = p.layout;
  const int64_t bh = cta_outer_index(), b = bh / p.heads_q, h = bh % p.heads_q;
  if (bh >= p.batch * p.heads_q) return;
  const int64_t bhk = b * p.heads_kv + h / (p.heads_q / p.heads_kv);
  const int64_t r0 = int64_t(blockIdx.x) * kBlockQ, r1 = min(p.seq_q, r0 + kBlockQ);
  const int64_t D = p.head_dim;
  __shared__ float mean[128];
  float* q_mean = reinterpret_cast<float*>(p.workspace + L.q_mean) + (bh * L.q_blocks + blockIdx.x) * D;
  for (int64_t c = threadIdx.x; c < D; c += blockDim.x) {
    double s = 0;
    for (int64_t r = r0; r < r1; ++r) s += double(load_finite<T>(p.q, p.qs, b, h, r, c));
    mean[c] = p.smooth_q ? float(s / double(r1 - r0)) : 0.0f;
    q_mean[c] = mean[c];
  }
  __syncthreads();
  const int64_t row = r0 + threadIdx.x;
  __half* dst = reinterpret_cast<__half*>(p.workspace + L.q) + (bh * L.nq_pad + row) * D;
  if (row >= p.seq_q) {
    for (int64_t c = 0; c < D; ++c) dst[c] = __float2half_rn(0.0f);
    return;
  }
  const float* km = reinterpret_cast<const float*>(p.workspace + L.k_mean) + bhk * D;
  bool bad = false;
  const double shift = p.scale * dot8([&](int64_t c) { return load_finite<T>(p.q, p.qs, b, h, row, c, &bad); },
                                      [&](int64_t c) { return km[c]; }, D);
  const unsigned long long kv_bad =
      reinterpret_cast<const unsigned long long*>(p.workspace + L.kv_bad)[bhk];
  const bool poisoned = quant::RowSight{p.seq_kv, p.causal_offset, p.causal}.poisoned(row, bad, kv_bad);
  reinterpret_cast<float*>(p.workspace + L.lse_shift)[bh * p.seq_q + row] =
      poisoned ? kNaN : float(shift);
  for (int run = 0; run < D / 16; ++run) {
    float x[16];
    for (int i = 0; i < 16; ++i)
      x[i] = __fsub_rn(load_finite<T>(p.q, p.qs, b, h, row, run * 16 + i), mean[run * 16 + i]);
    nvfp4_run(x);
    for (int i = 0; i < 16; ++i) dst[run * 16 + i] = __float2half_rn(x[i]);
  }
}

__device__ __forceinline__ uint32_t ld32(const __half* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}
__device__ __forceinline__ uint32_t pack_half2(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ float exp2_rounded(float x) {  // the host's exp2f, within half an ulp
  return float(exp2(double(x)));
}

// 4 warps, 16 query rows each (a 64-row CTA inside one 128-row Q block).
template <typename T, int D>
__global__ void __launch_bounds__(128) attention_kernel(Params p) {
  const Layout& L = p.layout;
  const int64_t bh = cta_outer_index(), b = bh / p.heads_q, h = bh % p.heads_q;
  if (bh >= p.batch * p.heads_q) return;
  const int64_t bhk = b * p.heads_kv + h / (p.heads_q / p.heads_kv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t first = int64_t(blockIdx.x) * 64, row_a = first + warp * 16 + g;
  const int64_t qblk = first / kBlockQ;
  const float scale_log2 = float(p.scale * 1.4426950408889634);
  __shared__ float qm[D];
  __shared__ float ds[kBlockK];
  const float* q_mean = reinterpret_cast<const float*>(p.workspace + L.q_mean) + (bh * L.q_blocks + qblk) * D;
  const float* km = reinterpret_cast<const float*>(p.workspace + L.k_mean) + bhk * D;
  for (int c = threadIdx.x; c < D; c += blockDim.x) qm[c] = q_mean[c];

  const __half* qh = reinterpret_cast<const __half*>(p.workspace + L.q) + (bh * L.nq_pad) * D;
  const __half* kh = reinterpret_cast<const __half*>(p.workspace + L.k) + (bhk * L.nk_pad) * D;
  const __half* vt = reinterpret_cast<const __half*>(p.workspace + L.vt) + (bhk * D) * L.nk_pad;
  uint32_t qf[D / 16][4];
  for (int s = 0; s < D / 16; ++s) {
    qf[s][0] = ld32(qh + row_a * D + 16 * s + 2 * t);
    qf[s][1] = ld32(qh + (row_a + 8) * D + 16 * s + 2 * t);
    qf[s][2] = ld32(qh + row_a * D + 16 * s + 2 * t + 8);
    qf[s][3] = ld32(qh + (row_a + 8) * D + 16 * s + 2 * t + 8);
  }
  int64_t n_row[2] = {visible(p, row_a), visible(p, row_a + 8)};
  float m[2] = {-INFINITY, -INFINITY};
  // A poisoned row (its LSE shift NaN: prep_q) starts its sum from NaN, which reaches its output
  // and LSE (attn::row_poison's rule).
  const float* shift = reinterpret_cast<const float*>(p.workspace + L.lse_shift) + bh * p.seq_q;
  float l[2];
  for (int r = 0; r < 2; ++r)
    l[r] = row_a + 8 * r < p.seq_q && isnan(shift[row_a + 8 * r]) ? kNaN : 0.0f;
  float o[D / 8][4];
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  const int64_t last = min(p.seq_q, first + 64) - 1;
  const int64_t keys = visible(p, last);  // the keys the CTA's last row sees: every row's at most

  for (int64_t j0 = 0; j0 < keys; j0 += kBlockK) {
    __syncthreads();  // ds of the previous block read by everyone (and qm written)
    if (threadIdx.x < kBlockK) {
      const int64_t j = j0 + threadIdx.x;
      float d = 0.0f;
      if (j < p.seq_kv && p.smooth_q)
        d = float(dot8([&](int64_t c) { return qm[c]; },
                       [&](int64_t c) {
                         return __fsub_rn(load_finite<T>(p.k, p.ks, b, h / (p.heads_q / p.heads_kv), j, c), km[c]);
                       },
                       D));
      ds[threadIdx.x] = d;
    }
    __syncthreads();
    // S = Q^·K^: each 64-channel slice in a fresh accumulator, then added in fp32 (the
    // emulation's k64 MMA steps).
    float s[8][4];
    for (int nt = 0; nt < 8; ++nt) {
      const __half* krow = kh + (j0 + 8 * nt + g) * D;
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
      for (int c0 = 0; c0 < D; c0 += 64) {
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int st = c0 / 16; st < c0 / 16 + 4; ++st) {
          const uint32_t bfr[2] = {ld32(krow + 16 * st + 2 * t), ld32(krow + 16 * st + 2 * t + 8)};
          ptx::mma_m16n8k16_f16<false>(acc, qf[st], bfr, acc);
        }
        for (int e = 0; e < 4; ++e) s[nt][e] = __fadd_rn(s[nt][e], acc[e]);
      }
    }
    float row_max[2] = {-INFINITY, -INFINITY};
    for (int nt = 0; nt < 8; ++nt)
      for (int e = 0; e < 4; ++e) {
        const int r = Frag::half(e);
        const int64_t key = Frag::at_col(j0, nt, e, t);
        const float x = __fmul_rn(__fadd_rn(s[nt][e], ds[key - j0]), scale_log2);
        s[nt][e] = key < n_row[r] ? x : -INFINITY;
        row_max[r] = fmaxf(row_max[r], s[nt][e]);
      }
    float alpha[2], level1[2];
    bool live[2];
    for (int r = 0; r < 2; ++r) {
      row_max[r] = fmaxf(row_max[r], __shfl_xor_sync(0xffffffffu, row_max[r], 1));
      row_max[r] = fmaxf(row_max[r], __shfl_xor_sync(0xffffffffu, row_max[r], 2));
      live[r] = j0 < n_row[r];
      const float m_new = live[r] ? fmaxf(m[r], row_max[r]) : m[r];
      alpha[r] = live[r] ? exp2_rounded(__fsub_rn(m[r], m_new)) : 1.0f;
      level1[r] = live[r] ? __fdiv_rn(exp2_rounded(__fsub_rn(row_max[r], m_new)), kE4M3Max * kE2M1Max)
                          : 0.0f;
      m[r] = m_new;
    }
    // P~ = 2^(s - m), its row sums, then the two-level NVFP4: P~ / s_P1 in runs of 16 keys.
    float row_sum[2] = {0.0f, 0.0f};
    for (int nt = 0; nt < 8; ++nt)
      for (int e = 0; e < 4; ++e) {
        const int r = Frag::half(e);
        const float pt = s[nt][e] == -INFINITY ? 0.0f : exp2_rounded(__fsub_rn(s[nt][e], m[r]));
        row_sum[r] = __fadd_rn(row_sum[r], pt);
        s[nt][e] = level1[r] > 0.0f ? __fdiv_rn(pt, level1[r]) : pt;  // the emulation's p /= s_P1
      }
    for (int r = 0; r < 2; ++r) {
      row_sum[r] = __fadd_rn(row_sum[r], __shfl_xor_sync(0xffffffffu, row_sum[r], 1));
      row_sum[r] = __fadd_rn(row_sum[r], __shfl_xor_sync(0xffffffffu, row_sum[r], 2));
      if (live[r]) l[r] = __fadd_rn(__fmul_rn(l[r], alpha[r]), row_sum[r]);
    }
    uint32_t pf[4][4];  // P^ as the A operand of the four k16 steps
    constexpr MicroscaleFormat kNv = kNvfp4;
    constexpr FloatFormat kE2m1 = kE2M1;
    for (int run = 0; run < 4; ++run)
      for (int r = 0; r < 2; ++r) {
        float amax = 0.0f;
        for (int u = 0; u < 2; ++u)
          amax = fmaxf(amax, fmaxf(fabsf(s[2 * run + u][2 * r]), fabsf(s[2 * run + u][2 * r + 1])));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        const float scale = fp4_scale_value(kNv, fp4_scale_code(kNv, amax));
        for (int u = 0; u < 2; ++u)
          for (int e = 0; e < 2; ++e) {
            float& x = s[2 * run + u][2 * r + e];
            x = __fmul_rn(decode_float(kE2m1, fp4_encode(x, scale)), scale);
          }
        pf[run][r] = pack_half2(s[2 * run][2 * r], s[2 * run][2 * r + 1]);
        pf[run][2 + r] = pack_half2(s[2 * run + 1][2 * r], s[2 * run + 1][2 * r + 1]);
      }
    // O = O·alpha + (P^·V^)·s_P1, the block's product in a fresh fp32 accumulator.
    for (int dn = 0; dn < D / 8; ++dn) {
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const __half* vrow = vt + (dn * 8 + g) * L.nk_pad + j0;
      for (int st = 0; st < 4; ++st) {
        const uint32_t bfr[2] = {ld32(vrow + 16 * st + 2 * t), ld32(vrow + 16 * st + 2 * t + 8)};
        ptx::mma_m16n8k16_f16<false>(acc, pf[st], bfr, acc);
      }
      for (int e = 0; e < 4; ++e) {
        const int r = Frag::half(e);
        if (live[r]) o[dn][e] = __fadd_rn(__fmul_rn(o[dn][e], alpha[r]), __fmul_rn(acc[e], level1[r]));
      }
    }
  }

  // Finalize: O / l (+ v_mean, 0: V is not smoothed), LSE = (m + log2 l)·ln 2 + the shift.
  for (int r = 0; r < 2; ++r) {
    const int64_t row = row_a + 8 * r;
    if (row >= p.seq_q) continue;
    const bool empty = n_row[r] == 0;
    const float inv = empty ? 0.0f : __fdiv_rn(1.0f, l[r]);
    T* dst = static_cast<T*>(p.o) + b * p.o_batch + h * p.o_head + row * p.o_token;
    for (int dn = 0; dn < D / 8; ++dn) {
      const int c = Frag::pair(dn, t);
      const float x0 = empty ? 0.0f : __fadd_rn(__fmul_rn(o[dn][2 * r], inv), 0.0f);
      const float x1 = empty ? 0.0f : __fadd_rn(__fmul_rn(o[dn][2 * r + 1], inv), 0.0f);
      attn::store2<T>(dst + c, x0, x1);
    }
    if (p.lse && t == 0)
      p.lse[b * p.lse_batch + h * p.lse_head + row * p.lse_token] =
          empty ? -INFINITY
                : __fadd_rn(float((double(m[r]) + log2(double(l[r]))) * 0.6931471805599453),
                            reinterpret_cast<const float*>(p.workspace + L.lse_shift)[bh * p.seq_q + row]);
  }
}

template <typename T>
cudaError_t run_typed(const Params& p, cudaStream_t st) {
  const Layout& L = p.layout;
  // batch·heads over the grids' y and z (common/grid.h); prep_k's along x (the backend refuses
  // more than 2^31 - 1).
  const int64_t bk = p.batch * p.heads_kv, bq = p.batch * p.heads_q;
  const int runs = int(p.head_dim / 16);
  prep_k_kernel<T><<<unsigned(bk), 128, 0, st>>>(p);
  quant_k_kernel<T><<<outer_dims(L.nk_pad * runs / 256 + 1, bk), 256, 0, st>>>(p);
  quant_v_kernel<T><<<outer_dims(L.nk_pad / 16, bk), 128, 0, st>>>(p);
  prep_q_kernel<T><<<outer_dims(L.q_blocks, bq), 128, 0, st>>>(p);
  const dim3 grid = outer_dims((p.seq_q + 63) / 64, bq);
  if (p.head_dim == 64)
    attention_kernel<T, 64><<<grid, 128, 0, st>>>(p);
  else
    attention_kernel<T, 128><<<grid, 128, 0, st>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t run(const Params& p, cudaStream_t stream) {
  return p.bf16 ? run_typed<__nv_bfloat16>(p, stream) : run_typed<__half>(p, stream);
}

}  // namespace sage::fp4
