// Pre-pass kernels of the mma.sync path (sm_89+), each the GPU twin of a step of the CPU
// emulation (src/ref/attention_quant.cpp), with the same float operations in the same order where
// the result is quantized. Bytes moved (B·H·N·D elements of 2 bytes each for Q, K, V):
//   kv_stats     reads K and V (2+2 B/elem), writes 24 B per (head, 256-token chunk, channel)
//   quant_k      reads K (2 B/elem, kept in registers), writes INT8 (1 B) or INT4 (0.5 B) K
//                + 4 scales per 64 keys
//   quant_v      reads V (2 B/elem), writes E4M3 Vᵀ (1 B)
//   quant_q      reads Q (2 B/elem; again from L2 for the mean with Q smoothing), writes
//                INT8/INT4 Q + scales + the LSE correction (4 B/row)
//   delta_s      (Q smoothing only) reads K (2 B/elem), writes 4 B per (Q block, key)
// Per call: Q 2 B read, K and V 4 B each read, ~1 + 1 + 1 (+0.5) B written per element.
// K and V are thus read twice from DRAM (stats, then quantize); issue "GPU kernels II" fuses.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

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

__device__ __forceinline__ float to_float(__half x) {
  return __half2float(x);
}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ const T* row_ptr(const T* base, const sage_strides& s, int64_t b,
                                            int64_t h, int64_t n) {
  return base + b * s.batch + h * s.head + n * s.token;
}

// Elements d0..d0+7 of a row as float: one 16-byte load when the row allows it, else eight.
template <typename T>
__device__ __forceinline__ void load8(const T* row, int64_t d0, float (&x)[8]) {
  const T* p = row + d0;
  if ((reinterpret_cast<uintptr_t>(p) & 15u) == 0) {
    const uint4 w = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&w);
    for (int i = 0; i < 8; ++i) x[i] = to_float(e[i]);
  } else {
    for (int i = 0; i < 8; ++i) x[i] = to_float(p[i]);
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

// Per (kv head, chunk of kStatTokens tokens, channel): Σk, Σv (double), max v, min v. 256
// threads: D/8 lanes cover a token's channels 8 at a time, the rest split the tokens; partial
// results are combined in a fixed order (deterministic).
template <typename T, int D>
__global__ void __launch_bounds__(256)
    kv_stats_kernel(const T* k, const T* v, sage_strides ks, sage_strides vs, int64_t heads_kv,
                    int64_t seq_kv, int64_t chunks, KvStat* out) {
  constexpr int kLanes = D / 8, kTokenLanes = 256 / kLanes;
  __shared__ double red_d[kTokenLanes][D];
  __shared__ float red_f[kTokenLanes][D];
  const int64_t bh = blockIdx.y, chunk = blockIdx.x, b = bh / heads_kv, h = bh % heads_kv;
  const int lane = threadIdx.x % kLanes, tl = threadIdx.x / kLanes, d0 = lane * 8;
  double sk[8] = {}, sv[8] = {};
  float mx[8], mn[8];
  for (int i = 0; i < 8; ++i) mx[i] = -INFINITY, mn[i] = INFINITY;
  const int64_t n1 = min(seq_kv, (chunk + 1) * mma::kStatTokens);
  for (int64_t n = chunk * mma::kStatTokens + tl; n < n1; n += kTokenLanes) {
    float kx[8], vx[8];
    load8(row_ptr(k, ks, b, h, n), d0, kx);
    load8(row_ptr(v, vs, b, h, n), d0, vx);
    for (int i = 0; i < 8; ++i) {
      sk[i] += double(kx[i]), sv[i] += double(vx[i]);
      mx[i] = fmaxf(mx[i], vx[i]), mn[i] = fminf(mn[i], vx[i]);
    }
  }
  KvStat* dst = out + (bh * chunks + chunk) * D;
  // Four rounds through shared memory, each summed over the token lanes in order.
  for (int round = 0; round < 4; ++round) {
    for (int i = 0; i < 8; ++i) {
      if (round == 0) red_d[tl][d0 + i] = sk[i];
      if (round == 1) red_d[tl][d0 + i] = sv[i];
      if (round == 2) red_f[tl][d0 + i] = mx[i];
      if (round == 3) red_f[tl][d0 + i] = mn[i];
    }
    __syncthreads();
    for (int c = threadIdx.x; c < D; c += 256) {
      if (round < 2) {
        double s = 0;
        for (int t = 0; t < kTokenLanes; ++t) s += red_d[t][c];
        if (round == 0)
          dst[c].sum_k = s;
        else
          dst[c].sum_v = s;
      } else {
        float m = red_f[0][c];
        for (int t = 1; t < kTokenLanes; ++t)
          m = round == 2 ? fmaxf(m, red_f[t][c]) : fminf(m, red_f[t][c]);
        if (round == 2)
          dst[c].max_v = m;
        else
          dst[c].min_v = m;
      }
    }
    __syncthreads();
  }
}

// k_mean, v_mean (zero without smoothing), and the E4M3 scale of V - v_mean per channel.
__global__ void kv_finalize_kernel(const KvStat* stats, int64_t seq_kv, int64_t dim, int64_t chunks,
                                   bool smooth_k, bool smooth_v, float* k_mean, float* v_mean,
                                   float* v_scale, float* v_inv) {
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

// A row held by 4 threads (part p holds 8-channel chunks p, p+4, ...), kept in registers
// between the max pass and the quantize pass: one DRAM read per element.
template <int D>
struct RowPart {
  static constexpr int kChunks = D / 32;
  float x[kChunks][8];
};

template <typename T, int D>
__device__ __forceinline__ void load_row_part(const T* row, const float* mean, int part,
                                              RowPart<D>* rp, float* amax, double* dot_with,
                                              const float* other) {
  for (int ci = 0; ci < RowPart<D>::kChunks; ++ci) {
    const int d0 = (ci * 4 + part) * 8;
    float raw[8];
    load8(row, d0, raw);
    for (int i = 0; i < 8; ++i) {
      if (dot_with) *dot_with += double(raw[i]) * double(other[d0 + i]);
      rp->x[ci][i] = __fsub_rn(raw[i], mean[d0 + i]);
      *amax = fmaxf(*amax, fabsf(rp->x[ci][i]));
    }
  }
}

template <int D, int kBits>
__device__ __forceinline__ void store_row_part(uint8_t* dst, int part, const RowPart<D>& rp,
                                               float inv, bool valid) {
  constexpr int qmax = kBits == 8 ? kInt8Max : kInt4Max;
  for (int ci = 0; ci < RowPart<D>::kChunks; ++ci) {
    int vals[8];
    for (int i = 0; i < 8; ++i) vals[i] = valid ? quantize_int(rp.x[ci][i], inv, qmax) : 0;
    store8<kBits>(dst, (ci * 4 + part) * 8, vals);
  }
}

// One CTA (256 threads, 4 a key) per 64-key block; the 4 groups are keys {8i+2t, 8i+2t+1}.
template <typename T, int D, int kBits>
__global__ void __launch_bounds__(256)
    quant_k_kernel(const T* k, sage_strides ks, int64_t heads_kv, int64_t seq_kv,
                   const float* k_mean, int64_t nk_pad, int64_t k_blocks, uint8_t* kq,
                   float* k_scale) {
  constexpr int qmax = kBits == 8 ? kInt8Max : kInt4Max;
  __shared__ float group_max[8][4];
  const int64_t bh = blockIdx.y, kb = blockIdx.x, b = bh / heads_kv, h = bh % heads_kv;
  const int j = threadIdx.x / 4, part = threadIdx.x % 4, warp = threadIdx.x / 32;
  const int64_t key = kb * mma::kBlockK + j;
  const bool valid = key < seq_kv;
  RowPart<D> rp;
  float amax = 0.0f;
  if (valid)
    load_row_part<T, D>(row_ptr(k, ks, b, h, key), k_mean + bh * D, part, &rp, &amax, nullptr,
                        nullptr);
  // The 4 parts of a key, then its pair key (j ^ 1 is 4 lanes away): one group in this warp.
  for (int m : {1, 2, 4}) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  const int t = (j % 8) / 2;
  if (threadIdx.x % 8 == 0) group_max[warp][t] = amax;
  __syncthreads();
  amax = 0.0f;
  for (int w = 0; w < 8; ++w) amax = fmaxf(amax, group_max[w][t]);
  const QuantScale s = make_quant_scale(amax, float(qmax));
  if (threadIdx.x < 32 && threadIdx.x % 8 == 0)
    k_scale[(bh * k_blocks + kb) * mma::kKGroups + t] = s.scale;
  store_row_part<D, kBits>(kq + (bh * nk_pad + key) * (D * kBits / 8), part, rp, s.inv, valid);
}

// One CTA per 64-key block: E4M3 of (V - v_mean) / v_scale, written transposed ([channel][key])
// with the keys of each 32-chunk in MMA operand order (v_position_of_key).
template <typename T, int D>
__global__ void __launch_bounds__(256)
    quant_v_kernel(const T* v, sage_strides vs, int64_t heads_kv, int64_t seq_kv,
                   const float* v_mean, const float* v_inv, int64_t nk_pad, uint8_t* vq) {
  __shared__ __align__(16) uint8_t tile[D * mma::kBlockK];  // [channel][position]
  const int64_t bh = blockIdx.y, kb = blockIdx.x, b = bh / heads_kv, h = bh % heads_kv;
  const float* vm = v_mean + bh * D;
  const float* vi = v_inv + bh * D;
  // A warp takes 32 consecutive keys of one 8-channel slice: its byte stores into a tile row
  // then land in 8 words (4 bytes each), not 16 rows of one bank (a 16-way conflict when a warp
  // walked along the channels of two keys).
  for (int i = threadIdx.x; i < mma::kBlockK * D / 8; i += 256) {
    const int key = i % mma::kBlockK, d0 = (i / mma::kBlockK) * 8;
    const int64_t n = kb * mma::kBlockK + key;
    float x[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (n < seq_kv) load8(row_ptr(v, vs, b, h, n), d0, x);
    const int pos = (key / 32) * 32 + mma::v_position_of_key(key % 32);
    for (int e = 0; e < 8; e += 2) {
      const int c = d0 + e;
      const uint16_t pair =
          n < seq_kv ? ptx::cvt_e4m3x2(__fmul_rn(__fsub_rn(x[e], vm[c]), vi[c]),
                                       __fmul_rn(__fsub_rn(x[e + 1], vm[c + 1]), vi[c + 1]))
                     : uint16_t(0);
      tile[c * mma::kBlockK + pos] = uint8_t(pair & 0xFFu);
      tile[(c + 1) * mma::kBlockK + pos] = uint8_t(pair >> 8);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < D * 4; i += 256) {  // rows of 64 bytes, 16 bytes a thread
    const int c = i / 4, part = i % 4;
    *reinterpret_cast<uint4*>(vq + (bh * D + c) * nk_pad + kb * mma::kBlockK + part * 16) =
        *reinterpret_cast<const uint4*>(tile + c * mma::kBlockK + part * 16);
  }
}

// One CTA (512 threads, 4 a row) per 128-row Q block: optional block mean, the LSE correction
// scale·q·k_mean, then per-thread groups (rows {g, g+8} of each 16-row warp slice).
template <typename T, int D, int kBits>
__global__ void __launch_bounds__(512)
    quant_q_kernel(const T* q, sage_strides qs, int64_t heads_q, int64_t heads_kv, int64_t seq_q,
                   bool smooth_q, float scale, const float* k_mean, int64_t nq_pad,
                   int64_t q_blocks, uint8_t* qq, float* q_scale, float* q_mean, float* lse_shift) {
  constexpr int qmax = kBits == 8 ? kInt8Max : kInt4Max;
  __shared__ float mean[D];
  __shared__ float row_max[mma::kBlockQ];
  const int64_t bh = blockIdx.y, qb = blockIdx.x, b = bh / heads_q, h = bh % heads_q;
  const int64_t r0 = qb * mma::kBlockQ, r1 = min(seq_q, r0 + mma::kBlockQ);
  const float* km = k_mean + (b * heads_kv + h / (heads_q / heads_kv)) * D;
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    float m = 0.0f;
    if (smooth_q) {
      double s = 0;
      for (int64_t r = r0; r < r1; ++r) s += double(to_float(row_ptr(q, qs, b, h, r)[c]));
      m = float(s / double(r1 - r0));
      q_mean[(bh * q_blocks + qb) * D + c] = m;
    }
    mean[c] = m;
  }
  __syncthreads();
  const int r = threadIdx.x / 4, part = threadIdx.x % 4;
  const int64_t row = r0 + r;
  const bool valid = row < seq_q;
  RowPart<D> rp;
  float amax = 0.0f;
  double shift = 0;
  if (valid) load_row_part<T, D>(row_ptr(q, qs, b, h, row), mean, part, &rp, &amax, &shift, km);
  for (int m : {1, 2}) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
    shift += __shfl_xor_sync(0xffffffffu, shift, m);
  }
  if (part == 0) {
    row_max[r] = amax;
    if (valid) lse_shift[bh * seq_q + row] = float(double(scale) * shift);
  }
  __syncthreads();
  amax = fmaxf(row_max[r], row_max[r ^ 8]);  // the group: rows {g, g+8} of a 16-row slice
  const QuantScale s = make_quant_scale(amax, float(qmax));
  if (part == 0 && r % 16 < 8)
    q_scale[(bh * q_blocks + qb) * mma::kQGroups + (r / 16) * 8 + r % 8] = s.scale;
  store_row_part<D, kBits>(qq + (bh * nq_pad + row) * (D * kBits / 8), part, rp, s.inv, valid);
}

// ΔS[Q block][key] = q_mean · (k - k_mean) for every Q block of the query heads of a KV head;
// a thread keeps its key's smoothed row (in shared memory, padded against bank conflicts) and
// walks the Q blocks, whose means every thread reads at the same address (a broadcast).
template <typename T, int D>
__global__ void __launch_bounds__(64)
    delta_s_kernel(const T* k, sage_strides ks, int64_t heads_q, int64_t heads_kv, int64_t seq_kv,
                   const float* k_mean, const float* q_mean, int64_t q_blocks, int64_t nk_pad,
                   float* delta_s) {
  __shared__ float rows[64][D + 1];
  const int64_t bhk = blockIdx.y, b = bhk / heads_kv, hk = bhk % heads_kv;
  const int64_t key = blockIdx.x * 64 + threadIdx.x;  // nk_pad is a multiple of 64
  float* x = rows[threadIdx.x];
  for (int d0 = 0; d0 < D; d0 += 8) {
    float raw[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (key < seq_kv) load8(row_ptr(k, ks, b, hk, key), d0, raw);
    for (int i = 0; i < 8; ++i)
      x[d0 + i] = key < seq_kv ? __fsub_rn(raw[i], k_mean[bhk * D + d0 + i]) : 0.0f;
  }
  const int64_t ratio = heads_q / heads_kv;
  for (int64_t hq = hk * ratio; hq < (hk + 1) * ratio; ++hq) {
    const int64_t bh = b * heads_q + hq;
    for (int64_t qb = 0; qb < q_blocks; ++qb) {
      const float* qm = q_mean + (bh * q_blocks + qb) * D;
      double acc = 0;
      for (int d = 0; d < D; ++d) acc += double(qm[d]) * double(x[d]);
      delta_s[(bh * q_blocks + qb) * nk_pad + key] = float(acc);
    }
  }
}

template <typename T, int D>
cudaError_t launch_dim(const Plan& p, const PrepassInputs& in, uint8_t* ws, cudaStream_t st) {
  const T* q = static_cast<const T*>(in.q);
  const T* k = static_cast<const T*>(in.k);
  const T* v = static_cast<const T*>(in.v);
  const unsigned bk = unsigned(p.batch * p.heads_kv), bq = unsigned(p.batch * p.heads_q);
  auto f32 = [&](size_t off) { return reinterpret_cast<float*>(ws + off); };
  KvStat* stats = reinterpret_cast<KvStat*>(ws + p.kv_stats);

  kv_stats_kernel<T, D><<<dim3(unsigned(p.stat_chunks), bk), 256, 0, st>>>(
      k, v, in.k_strides, in.v_strides, p.heads_kv, p.seq_kv, p.stat_chunks, stats);
  kv_finalize_kernel<<<bk, D, 0, st>>>(stats, p.seq_kv, D, p.stat_chunks, p.smooth_k, p.smooth_v,
                                       f32(p.k_mean), f32(p.v_mean), f32(p.v_scale), f32(p.v_inv));
  const dim3 kgrid(unsigned(p.k_blocks), bk);
  auto qk = [&](auto bits) {
    constexpr int kBits = decltype(bits)::value;
    quant_k_kernel<T, D, kBits><<<kgrid, 256, 0, st>>>(k, in.k_strides, p.heads_kv, p.seq_kv,
                                                       f32(p.k_mean), p.nk_pad, p.k_blocks,
                                                       ws + p.k, f32(p.k_scale));
    quant_q_kernel<T, D, kBits><<<dim3(unsigned(p.q_blocks), bq), 512, 0, st>>>(
        q, in.q_strides, p.heads_q, p.heads_kv, p.seq_q, p.smooth_q, in.scale, f32(p.k_mean),
        p.nq_pad, p.q_blocks, ws + p.q, f32(p.q_scale), p.smooth_q ? f32(p.q_mean) : nullptr,
        f32(p.lse_shift));
  };
  if (p.bits == 8)
    qk(std::integral_constant<int, 8>{});
  else
    qk(std::integral_constant<int, 4>{});
  quant_v_kernel<T, D><<<kgrid, 256, 0, st>>>(v, in.v_strides, p.heads_kv, p.seq_kv, f32(p.v_mean),
                                              f32(p.v_inv), p.nk_pad, ws + p.v);
  if (p.smooth_q)
    delta_s_kernel<T, D><<<dim3(unsigned(p.nk_pad / 64), bk), 64, 0, st>>>(
        k, in.k_strides, p.heads_q, p.heads_kv, p.seq_kv, f32(p.k_mean), f32(p.q_mean), p.q_blocks,
        p.nk_pad, f32(p.delta_s));
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_all(const Plan& p, const PrepassInputs& in, uint8_t* ws, cudaStream_t st) {
  return p.head_dim == 64 ? launch_dim<T, 64>(p, in, ws, st) : launch_dim<T, 128>(p, in, ws, st);
}

}  // namespace

cudaError_t run_prepass(const Plan& plan, const PrepassInputs& in, uint8_t* workspace,
                        cudaStream_t stream) {
  return in.dtype == SAGE_DTYPE_BF16 ? launch_all<__nv_bfloat16>(plan, in, workspace, stream)
                                     : launch_all<__half>(plan, in, workspace, stream);
}

}  // namespace sage::quant
