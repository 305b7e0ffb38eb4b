// Pre-pass kernels of the mma.sync path (sm_89+), each the GPU twin of a step of the CPU
// emulation (src/ref/attention_quant.cpp), with the same float operations in the same order where
// the result is quantized. Bytes moved (B·H·N·D elements of 2 bytes each for Q, K, V):
//   kv_stats     reads K and V once (4 bytes/element pair), writes 24 B per (head, 1k chunk, ch)
//   quant_k      reads K (2 B/elem), writes INT8 K (1 B) or INT4 (0.5 B) + 4 scales per 64 keys
//   quant_v      reads V (2 B/elem), writes E4M3 Vᵀ (1 B)
//   quant_q      reads Q twice from L1/L2 (2 B/elem from DRAM), writes INT8/INT4 Q + scales
//   delta_s      (Q smoothing only) reads K (2 B/elem), writes 4 B per (Q block, key)
// K and V are thus read twice from DRAM (stats, then quantize); issue "GPU kernels II" fuses.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/formats.h"
#include "ptx/cvt.cuh"
#include "quant/prepass.h"

namespace sage::quant {
namespace {

using mma::Plan;

struct KvStat {
  double sum_k, sum_v;
  float max_v, min_v;
};
static_assert(sizeof(KvStat) == 24, "the plan reserves 24 bytes per statistic");

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ float load(const T* base, const sage_strides& s, int64_t b, int64_t h,
                                      int64_t n, int64_t d) {
  return to_float(base[b * s.batch + h * s.head + n * s.token + d]);
}

// Per (kv head, chunk of 1024 tokens, channel): Σk, Σv in double, max v, min v.
template <typename T>
__global__ void kv_stats_kernel(const T* k, const T* v, sage_strides ks, sage_strides vs,
                                int64_t heads_kv, int64_t seq_kv, int64_t dim, int64_t chunks,
                                KvStat* out) {
  const int64_t bh = blockIdx.y, chunk = blockIdx.x, b = bh / heads_kv, h = bh % heads_kv;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
    KvStat s{0.0, 0.0, -INFINITY, INFINITY};
    const int64_t n1 = min(seq_kv, (chunk + 1) * 1024);
    for (int64_t n = chunk * 1024; n < n1; ++n) {
      s.sum_k += double(load(k, ks, b, h, n, c));
      const float x = load(v, vs, b, h, n, c);
      s.sum_v += double(x);
      s.max_v = fmaxf(s.max_v, x);
      s.min_v = fminf(s.min_v, x);
    }
    out[(bh * chunks + chunk) * dim + c] = s;
  }
}

// k_mean, v_mean (zero without smoothing), and the E4M3 scale of V - v_mean per channel.
__global__ void kv_finalize_kernel(const KvStat* stats, int64_t seq_kv, int64_t dim,
                                   int64_t chunks, bool smooth_k, bool smooth_v, float* k_mean,
                                   float* v_mean, float* v_scale, float* v_inv) {
  const int64_t bh = blockIdx.x;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
    double sk = 0, sv = 0;
    float mx = -INFINITY, mn = INFINITY;
    for (int64_t i = 0; i < chunks; ++i) {
      const KvStat s = stats[(bh * chunks + i) * dim + c];
      sk += s.sum_k;
      sv += s.sum_v;
      mx = fmaxf(mx, s.max_v);
      mn = fminf(mn, s.min_v);
    }
    const float km = smooth_k ? float(sk / double(seq_kv)) : 0.0f;
    const float vm = smooth_v ? float(sv / double(seq_kv)) : 0.0f;
    // max |fl(v - vm)| over the channel: subtraction is monotonic, so the extremes decide.
    const float amax = fmaxf(__fsub_rn(mx, vm), __fsub_rn(vm, mn));
    const QuantScale q = make_quant_scale(amax, kE4M3Max);
    k_mean[bh * dim + c] = km;
    v_mean[bh * dim + c] = vm;
    v_scale[bh * dim + c] = q.scale;
    v_inv[bh * dim + c] = q.inv;
  }
}

// Stores 8 quantized values of a row starting at element d0: INT8 one per byte, INT4 two per
// byte with the lower element in the low nibble (the MMA operand order).
template <int kBits>
__device__ __forceinline__ void store8(uint8_t* row, int64_t d0, const int (&v)[8]) {
  if constexpr (kBits == 8) {
    uint32_t w[2] = {0u, 0u};
    for (int i = 0; i < 8; ++i) w[i / 4] |= (uint32_t(v[i]) & 0xFFu) << (8 * (i % 4));
    *reinterpret_cast<uint2*>(row + d0) = make_uint2(w[0], w[1]);
  } else {
    uint32_t w = 0u;
    for (int i = 0; i < 8; ++i) w |= (uint32_t(v[i]) & 0xFu) << (4 * i);
    *reinterpret_cast<uint32_t*>(row + d0 / 2) = w;
  }
}

// One CTA per 64-key block: thread j owns key j; the 4 groups are keys {8i+2t, 8i+2t+1}.
template <typename T, int kBits>
__global__ void quant_k_kernel(const T* k, sage_strides ks, int64_t heads_kv, int64_t seq_kv,
                               int64_t dim, const float* k_mean, int64_t nk_pad,
                               int64_t row_bytes, int64_t k_blocks, uint8_t* kq, float* k_scale) {
  constexpr int qmax = kBits == 8 ? kInt8Max : kInt4Max;
  __shared__ float group_max[2][4];
  const int64_t bh = blockIdx.y, kb = blockIdx.x, b = bh / heads_kv, h = bh % heads_kv;
  const int j = threadIdx.x, lane = j % 32, warp = j / 32;
  const int64_t key = kb * mma::kBlockK + j;
  const bool valid = key < seq_kv;
  const float* mean = k_mean + bh * dim;
  float amax = 0.0f;
  if (valid)
    for (int64_t d = 0; d < dim; ++d)
      amax = fmaxf(amax, fabsf(__fsub_rn(load(k, ks, b, h, key, d), mean[d])));
  // Keys of one group inside a warp differ in bits 0, 3 and 4 of the lane.
  for (int m : {1, 8, 16}) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  const int t = (j % 8) / 2;
  if (lane < 8 && lane % 2 == 0) group_max[warp][t] = amax;
  __syncthreads();
  amax = fmaxf(group_max[0][t], group_max[1][t]);
  const QuantScale s = make_quant_scale(amax, float(qmax));
  if (j < 8 && j % 2 == 0) k_scale[(bh * k_blocks + kb) * mma::kKGroups + t] = s.scale;
  uint8_t* dst = kq + (bh * nk_pad + key) * row_bytes;
  for (int64_t d0 = 0; d0 < dim; d0 += 8) {
    int vals[8];
    for (int i = 0; i < 8; ++i)
      vals[i] = valid ? quantize_int(__fsub_rn(load(k, ks, b, h, key, d0 + i), mean[d0 + i]),
                                     s.inv, qmax)
                      : 0;
    store8<kBits>(dst, d0, vals);
  }
}

// One CTA per 64-key block: E4M3 of (V - v_mean) / v_scale, written transposed ([channel][key])
// with the keys of each 32-chunk in MMA operand order (v_position_of_key).
template <typename T>
__global__ void quant_v_kernel(const T* v, sage_strides vs, int64_t heads_kv, int64_t seq_kv,
                               int64_t dim, const float* v_mean, const float* v_inv,
                               int64_t nk_pad, uint8_t* vq) {
  extern __shared__ uint8_t tile[];  // [dim][64]
  const int64_t bh = blockIdx.y, kb = blockIdx.x, b = bh / heads_kv, h = bh % heads_kv;
  for (int64_t i = threadIdx.x; i < dim * mma::kBlockK; i += blockDim.x) {
    const int64_t key = i / dim, c = i % dim;  // consecutive threads: consecutive channels
    const int64_t n = kb * mma::kBlockK + key;
    uint8_t code = 0;
    if (n < seq_kv) {
      const float x = __fsub_rn(load(v, vs, b, h, n, c), v_mean[bh * dim + c]);
      code = uint8_t(ptx::cvt_e4m3x2(__fmul_rn(x, v_inv[bh * dim + c]), 0.0f) & 0xFFu);
    }
    tile[c * mma::kBlockK + (key / 32) * 32 + mma::v_position_of_key(int(key % 32))] = code;
  }
  __syncthreads();
  // Rows of 64 bytes, 16 bytes a thread.
  for (int64_t i = threadIdx.x; i < dim * 4; i += blockDim.x) {
    const int64_t c = i / 4, part = i % 4;
    *reinterpret_cast<uint4*>(vq + (bh * dim + c) * nk_pad + kb * mma::kBlockK + part * 16) =
        *reinterpret_cast<const uint4*>(tile + c * mma::kBlockK + part * 16);
  }
}

// One CTA (128 threads) per 128-row Q block: optional block mean, the LSE correction
// scale·q·k_mean, then per-thread groups (rows {g, g+8} of each 16-row warp slice).
template <typename T, int kBits>
__global__ void quant_q_kernel(const T* q, sage_strides qs, int64_t heads_q, int64_t heads_kv,
                               int64_t seq_q, int64_t dim, bool smooth_q, float scale,
                               const float* k_mean, int64_t nq_pad, int64_t row_bytes,
                               int64_t q_blocks, uint8_t* qq, float* q_scale, float* q_mean,
                               float* lse_shift) {
  constexpr int qmax = kBits == 8 ? kInt8Max : kInt4Max;
  extern __shared__ float mean[];  // [dim]
  const int64_t bh = blockIdx.y, qb = blockIdx.x, b = bh / heads_q, h = bh % heads_q;
  const int64_t r0 = qb * mma::kBlockQ, r1 = min(seq_q, r0 + mma::kBlockQ);
  const float* km = k_mean + (b * heads_kv + h / (heads_q / heads_kv)) * dim;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
    float m = 0.0f;
    if (smooth_q) {
      double s = 0;
      for (int64_t r = r0; r < r1; ++r) s += double(load(q, qs, b, h, r, c));
      m = float(s / double(r1 - r0));
      q_mean[(bh * q_blocks + qb) * dim + c] = m;
    }
    mean[c] = m;
  }
  __syncthreads();
  const int r = threadIdx.x;
  const int64_t row = r0 + r;
  const bool valid = row < seq_q;
  float amax = 0.0f;
  if (valid) {
    double shift = 0;
    for (int64_t d = 0; d < dim; ++d) {
      const float x = load(q, qs, b, h, row, d);
      shift += double(x) * double(km[d]);
      amax = fmaxf(amax, fabsf(__fsub_rn(x, mean[d])));
    }
    lse_shift[bh * seq_q + row] = float(double(scale) * shift);
  }
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 8));  // partner row r ^ 8
  const QuantScale s = make_quant_scale(amax, float(qmax));
  if (r % 16 < 8) q_scale[(bh * q_blocks + qb) * mma::kQGroups + (r / 16) * 8 + r % 8] = s.scale;
  uint8_t* dst = qq + (bh * nq_pad + row) * row_bytes;
  for (int64_t d0 = 0; d0 < dim; d0 += 8) {
    int vals[8];
    for (int i = 0; i < 8; ++i)
      vals[i] = valid ? quantize_int(__fsub_rn(load(q, qs, b, h, row, d0 + i), mean[d0 + i]),
                                     s.inv, qmax)
                      : 0;
    store8<kBits>(dst, d0, vals);
  }
}

// ΔS[Q block][key] = q_mean · (k - k_mean) for every Q block of the query heads of a KV head.
template <typename T>
__global__ void delta_s_kernel(const T* k, sage_strides ks, int64_t heads_q, int64_t heads_kv,
                               int64_t seq_kv, int64_t dim, const float* k_mean,
                               const float* q_mean, int64_t q_blocks, int64_t nk_pad,
                               float* delta_s) {
  const int64_t bhk = blockIdx.y, b = bhk / heads_kv, hk = bhk % heads_kv;
  const int64_t key = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (key >= nk_pad) return;
  const int64_t ratio = heads_q / heads_kv;
  for (int64_t hq = hk * ratio; hq < (hk + 1) * ratio; ++hq) {
    const int64_t bh = b * heads_q + hq;
    for (int64_t qb = 0; qb < q_blocks; ++qb) {
      double acc = 0;
      if (key < seq_kv) {
        const float* qm = q_mean + (bh * q_blocks + qb) * dim;
        for (int64_t d = 0; d < dim; ++d)
          acc += double(qm[d]) *
                 double(__fsub_rn(load(k, ks, b, hk, key, d), k_mean[bhk * dim + d]));
      }
      delta_s[(bh * q_blocks + qb) * nk_pad + key] = float(acc);
    }
  }
}

template <typename T>
cudaError_t launch_all(const Plan& p, const PrepassInputs& in, uint8_t* ws, cudaStream_t st) {
  const T* q = static_cast<const T*>(in.q);
  const T* k = static_cast<const T*>(in.k);
  const T* v = static_cast<const T*>(in.v);
  const int64_t bk = p.batch * p.heads_kv, bq = p.batch * p.heads_q, D = p.head_dim;
  auto f32 = [&](size_t off) { return reinterpret_cast<float*>(ws + off); };
  KvStat* stats = reinterpret_cast<KvStat*>(ws + p.kv_stats);

  kv_stats_kernel<T><<<dim3(unsigned(p.stat_chunks), unsigned(bk)), unsigned(D), 0, st>>>(
      k, v, in.k_strides, in.v_strides, p.heads_kv, p.seq_kv, D, p.stat_chunks, stats);
  kv_finalize_kernel<<<unsigned(bk), unsigned(D), 0, st>>>(
      stats, p.seq_kv, D, p.stat_chunks, p.smooth_k, p.smooth_v, f32(p.k_mean), f32(p.v_mean),
      f32(p.v_scale), f32(p.v_inv));
  const dim3 kgrid(unsigned(p.k_blocks), unsigned(bk));
  if (p.bits == 8)
    quant_k_kernel<T, 8><<<kgrid, mma::kBlockK, 0, st>>>(k, in.k_strides, p.heads_kv, p.seq_kv,
                                                         D, f32(p.k_mean), p.nk_pad, p.row_bytes,
                                                         p.k_blocks, ws + p.k, f32(p.k_scale));
  else
    quant_k_kernel<T, 4><<<kgrid, mma::kBlockK, 0, st>>>(k, in.k_strides, p.heads_kv, p.seq_kv,
                                                         D, f32(p.k_mean), p.nk_pad, p.row_bytes,
                                                         p.k_blocks, ws + p.k, f32(p.k_scale));
  quant_v_kernel<T><<<kgrid, 256, size_t(D * mma::kBlockK), st>>>(
      v, in.v_strides, p.heads_kv, p.seq_kv, D, f32(p.v_mean), f32(p.v_inv), p.nk_pad, ws + p.v);
  const dim3 qgrid(unsigned(p.q_blocks), unsigned(bq));
  float* q_mean = p.smooth_q ? f32(p.q_mean) : nullptr;
  if (p.bits == 8)
    quant_q_kernel<T, 8><<<qgrid, mma::kBlockQ, size_t(D) * 4, st>>>(
        q, in.q_strides, p.heads_q, p.heads_kv, p.seq_q, D, p.smooth_q, in.scale, f32(p.k_mean),
        p.nq_pad, p.row_bytes, p.q_blocks, ws + p.q, f32(p.q_scale), q_mean, f32(p.lse_shift));
  else
    quant_q_kernel<T, 4><<<qgrid, mma::kBlockQ, size_t(D) * 4, st>>>(
        q, in.q_strides, p.heads_q, p.heads_kv, p.seq_q, D, p.smooth_q, in.scale, f32(p.k_mean),
        p.nq_pad, p.row_bytes, p.q_blocks, ws + p.q, f32(p.q_scale), q_mean, f32(p.lse_shift));
  if (p.smooth_q)
    delta_s_kernel<T><<<dim3(unsigned((p.nk_pad + 127) / 128), unsigned(bk)), 128, 0, st>>>(
        k, in.k_strides, p.heads_q, p.heads_kv, p.seq_kv, D, f32(p.k_mean), q_mean, p.q_blocks,
        p.nk_pad, f32(p.delta_s));
  return cudaGetLastError();
}

}  // namespace

cudaError_t run_prepass(const Plan& plan, const PrepassInputs& in, uint8_t* workspace,
                        cudaStream_t stream) {
  return in.dtype == SAGE_DTYPE_BF16 ? launch_all<__nv_bfloat16>(plan, in, workspace, stream)
                                     : launch_all<__half>(plan, in, workspace, stream);
}

}  // namespace sage::quant
