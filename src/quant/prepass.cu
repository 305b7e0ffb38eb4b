// The pre-pass of the mma.sync and wgmma paths (sm_89+), the GPU twin of the CPU emulation's
// quantization steps (src/ref/attention_quant.cpp), with the same float operations in the same
// order where the result is quantized. One persistent kernel (prepass_kernel, below) does the
// K/V statistics, K, V and Q; a second (delta_s) only with Q smoothing. Bytes moved per element
// of B·H·N·D (2-byte inputs): Q read once (again from L2 for the mean with Q smoothing), K and V
// read once from DRAM for the statistics and again from L2 to quantize (the schedule keeps them
// there), ~1 + 1 + 1 (+0.5) B written.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
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

// ---------------------------------------------------------------------------------------------
// One kernel does the whole pre-pass but ΔS: a persistent grid of 256-thread CTAs takes work
// items in ticket order (a global atomic counter, so an item only ever waits for items with
// smaller tickets, which running CTAs hold: no deadlock whatever the residency). Three kinds:
//   stat(h, c)  K/V statistics of 256 tokens of kv head h; the CTA that finishes the last chunk
//               of h (an arrival counter) reduces the chunks in order (deterministic) into
//               k_mean, v_mean, v_scale, v_inv and publishes ready[h] (release);
//   kv(h, kb)   quantizes keys kb*64.. of h: INT8/INT4 K and E4M3 Vᵀ (waits for ready[h]);
//   q(hq, qb)   quantizes a 128-row Q block of a query head of h, with its LSE correction
//               (waits for ready[h]: the correction needs k_mean).
// Tickets run head by head with a lag: the stat items of head i, then the kv and q items of head
// i - lag, so K and V are quantized while the statistics pass has just pulled them into L2 (they
// are read once from DRAM) and the stats of a head are done by the time its kv items start.
// ---------------------------------------------------------------------------------------------

constexpr int kThreads = 256;

struct Sync {           // zeroed before each launch
  unsigned long long ticket;
  unsigned long long pad;
  // then: unsigned arrivals[bk], unsigned ready[bk]
};

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release(unsigned* p, unsigned v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

struct Args {
  const void *q, *k, *v;
  sage_strides qs, ks, vs;
  float scale;
  Plan p;
  uint8_t* ws;
  int64_t lag;  // heads between a head's stat items and its kv/q items
};

template <int D>
struct Smem {
  static constexpr int kLanes = D / 8, kTokenLanes = kThreads / kLanes;
  union {
    struct {
      double d[kTokenLanes][D];
      float f[kTokenLanes][D], f2[kTokenLanes][D];
    } stat;
    struct {
      __align__(16) uint8_t tile[D * mma::kBlockK];  // Vᵀ [channel][position]
      float group_max[8][4];
    } kv;
    struct {
      float row_max[mma::kBlockQ];
      float mean[D];
    } q;
  } u;
  float k_mean[D], v_mean[D], v_inv[D];
  unsigned long long ticket;
  int64_t stats_head;  // kv head whose k_mean/v_mean/v_inv are in k_mean.. (-1: none)
  int last;
};

// Per (kv head, chunk of kStatTokens tokens, channel): Σk, Σv (double), max v, min v. D/8 lanes
// cover a token's channels 8 at a time, the rest split the tokens; partial results are combined
// in a fixed order (deterministic).
template <typename T, int D>
__device__ void stat_item(const Args& a, Smem<D>& sm, int64_t bh, int64_t chunk) {
  constexpr int kLanes = Smem<D>::kLanes, kTokenLanes = Smem<D>::kTokenLanes;
  const Plan& p = a.p;
  const int64_t b = bh / p.heads_kv, h = bh % p.heads_kv;
  const int lane = threadIdx.x % kLanes, tl = threadIdx.x / kLanes, d0 = lane * 8;
  KvStat* dst = reinterpret_cast<KvStat*>(a.ws + p.kv_stats) + (bh * p.stat_chunks + chunk) * D;
  auto& red_d = sm.u.stat.d;
  auto& red_f = sm.u.stat.f;
  auto& red_f2 = sm.u.stat.f2;
  const int64_t n0 = chunk * mma::kStatTokens + tl, n1 = min(p.seq_kv, (chunk + 1) * mma::kStatTokens);
  // K then V (fewer live registers than both at once); each reduced through shared memory over
  // the token lanes in order: sums in double, extremes in float.
#pragma unroll 1
  for (int round = 0; round < 2; ++round) {
    const T* x = static_cast<const T*>(round == 0 ? a.k : a.v);
    const sage_strides& xs = round == 0 ? a.ks : a.vs;
    double sum[8] = {};
    float mx[8], mn[8];
    for (int i = 0; i < 8; ++i) mx[i] = -INFINITY, mn[i] = INFINITY;
#pragma unroll 8
    for (int64_t n = n0; n < n1; n += kTokenLanes) {
      float e[8];
      load8(row_ptr(x, xs, b, h, n), d0, e);
      for (int i = 0; i < 8; ++i) {
        sum[i] += double(e[i]);
        mx[i] = fmaxf(mx[i], e[i]), mn[i] = fminf(mn[i], e[i]);
      }
    }
    for (int i = 0; i < 8; ++i) {
      red_d[tl][d0 + i] = sum[i];
      red_f[tl][d0 + i] = mx[i];
      red_f2[tl][d0 + i] = mn[i];
    }
    __syncthreads();
    for (int c = threadIdx.x; c < D; c += kThreads) {
      double s = 0;
      for (int t = 0; t < kTokenLanes; ++t) s += red_d[t][c];
      if (round == 0) {
        dst[c].sum_k = s;
      } else {
        float hi = red_f[0][c], lo = red_f2[0][c];
        for (int t = 1; t < kTokenLanes; ++t) hi = fmaxf(hi, red_f[t][c]), lo = fminf(lo, red_f2[t][c]);
        dst[c].sum_v = s, dst[c].max_v = hi, dst[c].min_v = lo;
      }
    }
    __syncthreads();
  }

  // Arrival: the CTA that completes the head's last chunk reduces all chunks.
  unsigned* arrivals = reinterpret_cast<unsigned*>(a.ws + p.sync + sizeof(Sync));
  unsigned* ready = arrivals + p.batch * p.heads_kv;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0)
    sm.last = atomicAdd(&arrivals[bh], 1u) == unsigned(p.stat_chunks - 1);
  __syncthreads();
  if (!sm.last) return;
  __threadfence();
  const KvStat* all = reinterpret_cast<const KvStat*>(a.ws + p.kv_stats) + bh * p.stat_chunks * D;
  auto f32 = [&](size_t off) { return reinterpret_cast<float*>(a.ws + off) + bh * D; };
  for (int c = threadIdx.x; c < D; c += kThreads) {
    double sum_k = 0, sum_v = 0;
    float hi = -INFINITY, lo = INFINITY;
    for (int64_t i = 0; i < p.stat_chunks; ++i) {
      const KvStat* s = all + i * D + c;
      sum_k += __ldcg(&s->sum_k);
      sum_v += __ldcg(&s->sum_v);
      hi = fmaxf(hi, __ldcg(&s->max_v));
      lo = fminf(lo, __ldcg(&s->min_v));
    }
    const float km = p.smooth_k ? float(sum_k / double(p.seq_kv)) : 0.0f;
    const float vm = p.smooth_v ? float(sum_v / double(p.seq_kv)) : 0.0f;
    // max |fl(v - vm)| over the channel: subtraction is monotonic, so the extremes decide.
    const float amax = fmaxf(__fsub_rn(hi, vm), __fsub_rn(vm, lo));
    const QuantScale q = make_quant_scale(amax, kE4M3Max);
    f32(p.k_mean)[c] = km;
    f32(p.v_mean)[c] = vm;
    f32(p.v_scale)[c] = q.scale;
    f32(p.v_inv)[c] = q.inv;
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) st_release(&ready[bh], 1u);
}

// Waits until kv head bh's statistics are published, then copies them to shared memory (read
// through L2: another CTA of this grid wrote them).
template <int D>
__device__ void wait_stats(const Args& a, Smem<D>& sm, int64_t bh) {
  if (sm.stats_head == bh) return;  // uniform: read after the item's opening barrier
  const Plan& p = a.p;
  const unsigned* ready =
      reinterpret_cast<const unsigned*>(a.ws + p.sync + sizeof(Sync)) + p.batch * p.heads_kv;
  if (threadIdx.x == 0) {
    while (ld_acquire(&ready[bh]) == 0u) __nanosleep(200);
  }
  __syncthreads();
  auto f32 = [&](size_t off) { return reinterpret_cast<const float*>(a.ws + off) + bh * D; };
  for (int c = threadIdx.x; c < D; c += kThreads) {
    sm.k_mean[c] = __ldcg(f32(p.k_mean) + c);
    sm.v_mean[c] = __ldcg(f32(p.v_mean) + c);
    sm.v_inv[c] = __ldcg(f32(p.v_inv) + c);
  }
  __syncthreads();
  if (threadIdx.x == 0) sm.stats_head = bh;  // read by all after the next item's barrier
}

// A row held by 4 threads (part p holds 8-channel chunks p, p+4, ...), kept in registers
// between the max pass and the quantize pass: one read per element.
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

// Keys kb*64 .. kb*64+63 of kv head bh. K: 4 threads a key; the 4 groups are keys
// {8i+2t, 8i+2t+1}. V: E4M3 of (V - v_mean) / v_scale, written transposed ([channel][key]) with
// the keys of each 32-chunk in MMA operand order (v_position_of_key).
template <typename T, int D, int kBits>
__device__ void kv_block(const Args& a, Smem<D>& sm, int64_t bh, int64_t kb) {
  constexpr int qmax = kBits == 8 ? kInt8Max : kInt4Max;
  const Plan& p = a.p;
  const int64_t b = bh / p.heads_kv, h = bh % p.heads_kv;
  {
    const T* k = static_cast<const T*>(a.k);
    const int j = threadIdx.x / 4, part = threadIdx.x % 4, warp = threadIdx.x / 32;
    const int64_t key = kb * mma::kBlockK + j;
    const bool valid = key < p.seq_kv;
    RowPart<D> rp;
    float amax = 0.0f;
    if (valid)
      load_row_part<T, D>(row_ptr(k, a.ks, b, h, key), sm.k_mean, part, &rp, &amax, nullptr,
                          nullptr);
    // The 4 parts of a key, then its pair key (j ^ 1 is 4 lanes away): one group in this warp.
    for (int m : {1, 2, 4}) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
    const int t = (j % 8) / 2;
    if (threadIdx.x % 8 == 0) sm.u.kv.group_max[warp][t] = amax;
    __syncthreads();
    amax = 0.0f;
    for (int w = 0; w < 8; ++w) amax = fmaxf(amax, sm.u.kv.group_max[w][t]);
    const QuantScale s = make_quant_scale(amax, float(qmax));
    if (threadIdx.x < 32 && threadIdx.x % 8 == 0)
      reinterpret_cast<float*>(a.ws + p.k_scale)[(bh * p.k_blocks + kb) * mma::kKGroups + t] =
          s.scale;
    store_row_part<D, kBits>(a.ws + p.k + (bh * p.nk_pad + key) * (D * kBits / 8), part, rp,
                             s.inv, valid);
  }
  {
    const T* v = static_cast<const T*>(a.v);
    uint8_t* tile = sm.u.kv.tile;
    // A warp takes 32 consecutive keys of one 8-channel slice: its byte stores into a tile row
    // then land in 8 words (4 bytes each), not 16 rows of one bank.
    constexpr int kIters = mma::kBlockK * D / 8 / kThreads;
    static_assert(kIters * kThreads == mma::kBlockK * D / 8, "whole iterations");
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int i = threadIdx.x + it * kThreads;
      const int key = i % mma::kBlockK, d0 = (i / mma::kBlockK) * 8;
      const int64_t n = kb * mma::kBlockK + key;
      float x[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (n < p.seq_kv) load8(row_ptr(v, a.vs, b, h, n), d0, x);
      const int pos = (key / 32) * 32 + mma::v_position_of_key(key % 32);
      for (int e = 0; e < 8; e += 2) {
        const int c = d0 + e;
        const uint16_t pair =
            n < p.seq_kv
                ? ptx::cvt_e4m3x2(__fmul_rn(__fsub_rn(x[e], sm.v_mean[c]), sm.v_inv[c]),
                                  __fmul_rn(__fsub_rn(x[e + 1], sm.v_mean[c + 1]), sm.v_inv[c + 1]))
                : uint16_t(0);
        tile[c * mma::kBlockK + pos] = uint8_t(pair & 0xFFu);
        tile[(c + 1) * mma::kBlockK + pos] = uint8_t(pair >> 8);
      }
    }
    __syncthreads();
    uint8_t* vq = a.ws + p.v;
    for (int i = threadIdx.x; i < D * 4; i += kThreads) {  // rows of 64 bytes, 16 bytes a thread
      const int c = i / 4, part = i % 4;
      *reinterpret_cast<uint4*>(vq + (bh * D + c) * p.nk_pad + kb * mma::kBlockK + part * 16) =
          *reinterpret_cast<const uint4*>(tile + c * mma::kBlockK + part * 16);
    }
  }
}

// kKvItemBlocks consecutive 64-key blocks of kv head bh.
constexpr int kKvItemBlocks = 2;

template <typename T, int D, int kBits>
__device__ void kv_item(const Args& a, Smem<D>& sm, int64_t bh, int64_t item) {
  wait_stats(a, sm, bh);
  for (int i = 0; i < kKvItemBlocks; ++i) {
    const int64_t kb = item * kKvItemBlocks + i;
    if (kb >= a.p.k_blocks) break;
    if (i > 0) __syncthreads();  // the tile and group maxima are reused
    kv_block<T, D, kBits>(a, sm, bh, kb);
  }
}

// A 128-row block of query head bq (64 rows at a time, 4 threads a row): optional block mean,
// the LSE correction scale·q·k_mean, then per-thread groups (rows {g, g+8} of each 16-row warp
// slice).
template <typename T, int D, int kBits>
__device__ void q_item(const Args& a, Smem<D>& sm, int64_t bq, int64_t qb) {
  constexpr int qmax = kBits == 8 ? kInt8Max : kInt4Max;
  const Plan& p = a.p;
  const T* q = static_cast<const T*>(a.q);
  const int64_t b = bq / p.heads_q, h = bq % p.heads_q;
  wait_stats(a, sm, b * p.heads_kv + h / (p.heads_q / p.heads_kv));
  const int64_t r0 = qb * mma::kBlockQ, r1 = min(p.seq_q, r0 + mma::kBlockQ);
  for (int c = threadIdx.x; c < D; c += kThreads) {
    float m = 0.0f;
    if (p.smooth_q) {
      double s = 0;
      for (int64_t r = r0; r < r1; ++r) s += double(to_float(row_ptr(q, a.qs, b, h, r)[c]));
      m = float(s / double(r1 - r0));
      reinterpret_cast<float*>(a.ws + p.q_mean)[(bq * p.q_blocks + qb) * D + c] = m;
    }
    sm.u.q.mean[c] = m;
  }
  __syncthreads();
  float* q_scale = reinterpret_cast<float*>(a.ws + p.q_scale);
  float* lse_shift = reinterpret_cast<float*>(a.ws + p.lse_shift);
#pragma unroll 1
  for (int half = 0; half < 2; ++half) {
    const int r = half * 64 + threadIdx.x / 4, part = threadIdx.x % 4;
    const int64_t row = r0 + r;
    const bool valid = row < p.seq_q;
    RowPart<D> rp;
    float amax = 0.0f;
    double shift = 0;
    if (valid)
      load_row_part<T, D>(row_ptr(q, a.qs, b, h, row), sm.u.q.mean, part, &rp, &amax, &shift,
                          sm.k_mean);
    for (int m : {1, 2}) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
      shift += __shfl_xor_sync(0xffffffffu, shift, m);
    }
    if (part == 0) {
      sm.u.q.row_max[r] = amax;
      if (valid) lse_shift[bq * p.seq_q + row] = float(double(a.scale) * shift);
    }
    __syncthreads();
    amax = fmaxf(sm.u.q.row_max[r], sm.u.q.row_max[r ^ 8]);  // rows {g, g+8} of a 16-row slice
    const QuantScale s = make_quant_scale(amax, float(qmax));
    if (part == 0 && r % 16 < 8)
      q_scale[(bq * p.q_blocks + qb) * mma::kQGroups + (r / 16) * 8 + r % 8] = s.scale;
    store_row_part<D, kBits>(a.ws + p.q + (bq * p.nq_pad + row) * (D * kBits / 8), part, rp,
                             s.inv, valid);
  }
}

template <typename T, int D, int kBits>
__global__ void __launch_bounds__(kThreads, 2) prepass_kernel(const Args a) {
  __shared__ Smem<D> sm;
  const Plan& p = a.p;
  const int64_t heads = p.batch * p.heads_kv;
  const int64_t kv_items = (p.k_blocks + kKvItemBlocks - 1) / kKvItemBlocks;
  const int64_t ls = p.stat_chunks, lk = kv_items;
  const int64_t lag = min(a.lag, heads);
  // Ticket layout. K/V phase: steps 0 .. lag-1 hold stat items only; steps lag .. heads-1 the
  // stat items of head i then the kv items of head i - lag; the last lag steps kv items only.
  // Then the Q items (every kv head's statistics are done or nearly by then; Q traffic kept out
  // of the window in which K and V must stay in L2).
  const int64_t t_head = lag * ls, t_mid = t_head + (heads - lag) * (ls + lk);
  const int64_t t_q = t_mid + lag * lk;
  const int64_t total = t_q + p.batch * p.heads_q * p.q_blocks;
  auto* sync = reinterpret_cast<Sync*>(a.ws + p.sync);
  // Thread 0 claims the next ticket while the current item runs (its latency off the path).
  unsigned long long next = 0;
  if (threadIdx.x == 0) {
    sm.ticket = atomicAdd(&sync->ticket, 1ull);
    sm.stats_head = -1;
  }
  for (;;) {
    __syncthreads();  // the previous item is done with shared memory; sm.ticket is set
    const int64_t t = int64_t(sm.ticket);
    if (t >= total) break;
    if (threadIdx.x == 0) next = atomicAdd(&sync->ticket, 1ull);
    if (t < t_head) {
      stat_item<T, D>(a, sm, t / ls, t % ls);
    } else if (t < t_mid) {
      const int64_t i = lag + (t - t_head) / (ls + lk), r = (t - t_head) % (ls + lk);
      if (r < ls)
        stat_item<T, D>(a, sm, i, r);
      else
        kv_item<T, D, kBits>(a, sm, i - lag, r - ls);
    } else if (t < t_q) {
      kv_item<T, D, kBits>(a, sm, heads - lag + (t - t_mid) / lk, (t - t_mid) % lk);
    } else {
      q_item<T, D, kBits>(a, sm, (t - t_q) / p.q_blocks, (t - t_q) % p.q_blocks);
    }
    __syncthreads();  // everyone has read sm.ticket
    if (threadIdx.x == 0) sm.ticket = next;
  }
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

// Persistent CTAs for the fused kernel on the current device (cached per device).
template <typename T, int D, int kBits>
cudaError_t resident_ctas(int* n) {
  static int cached[64] = {};
  int dev = 0, sms = 0, per_sm = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev < 64 && cached[dev] > 0) return *n = cached[dev], cudaSuccess;
  e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e == cudaSuccess)
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, prepass_kernel<T, D, kBits>,
                                                      kThreads, 0);
  if (e != cudaSuccess) return e;
  *n = sms * std::max(per_sm, 1);
  if (dev < 64) cached[dev] = *n;
  return cudaSuccess;
}

size_t sync_bytes(const Plan& p) {
  return sizeof(Sync) + size_t(p.batch * p.heads_kv) * 2 * sizeof(unsigned);
}

template <typename T, int D>
cudaError_t launch_dim(const Plan& p, const PrepassInputs& in, uint8_t* ws, cudaStream_t st) {
  const int64_t heads = p.batch * p.heads_kv;
  cudaError_t e = cudaMemsetAsync(ws + p.sync, 0, sync_bytes(p), st);
  if (e != cudaSuccess) return e;
  Args a{in.q, in.k, in.v, in.q_strides, in.k_strides, in.v_strides, in.scale, p, ws, 1};
  auto run = [&](auto bits) {
    constexpr int kBits = decltype(bits)::value;
    int ctas = 0;
    const cudaError_t oe = resident_ctas<T, D, kBits>(&ctas);
    if (oe != cudaSuccess) return oe;
    // Lag: about one round of the grid between a head's stat items and its kv items (so the
    // former are done when the latter start), but at most ~12 MB of K/V traffic in between (read
    // by the stat items, read again and written by the kv items), which L2 keeps.
    const int64_t kv_items = (p.k_blocks + kKvItemBlocks - 1) / kKvItemBlocks;
    const int64_t per_head = p.stat_chunks + kv_items;
    const int64_t head_traffic = p.seq_kv * D * (4 * int64_t(sizeof(T)) + 2);
    const int64_t lag = std::min((ctas + per_head - 1) / per_head,
                                 (int64_t(12) << 20) / std::max<int64_t>(1, head_traffic));
    a.lag = std::max<int64_t>(1, lag);
    const int64_t items = heads * per_head + p.batch * p.heads_q * p.q_blocks;
    const unsigned grid = unsigned(std::min<int64_t>(ctas, items));
    prepass_kernel<T, D, kBits><<<grid, kThreads, 0, st>>>(a);
    return cudaGetLastError();
  };
  e = p.bits == 8 ? run(std::integral_constant<int, 8>{}) : run(std::integral_constant<int, 4>{});
  if (e != cudaSuccess) return e;
  if (p.smooth_q)
    delta_s_kernel<T, D><<<dim3(unsigned(p.nk_pad / 64), unsigned(heads)), 64, 0, st>>>(
        static_cast<const T*>(in.k), in.k_strides, p.heads_q, p.heads_kv, p.seq_kv,
        reinterpret_cast<const float*>(ws + p.k_mean), reinterpret_cast<const float*>(ws + p.q_mean),
        p.q_blocks, p.nk_pad, reinterpret_cast<float*>(ws + p.delta_s));
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
