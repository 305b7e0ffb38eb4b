// K/V quantization of a 64-key block: the block in registers (KvBlock), loaded from global
// memory (quant_kv) or from a staged chunk (kv_prepass), then INT8/INT4 K + scales and E4M3 Vᵀ.
// (Included only by quant/prepass.cu, the pre-pass's one translation unit: the code sits in
// that file's anonymous namespace, so the kernels stay internal to it.)
#pragma once

#include "ptx/cvt.cuh"
#include "quant/elements.cuh"
#include "quant/prepass/common.cuh"
#include "quant/prepass/stage.cuh"

namespace sage::quant {
namespace {

// 256 threads a block. K: 4 threads a key (part p holds 8-channel chunks p, p+4, ...), kept in
// registers between the max pass and the quantize pass; the 4 groups are keys {8i+2t, 8i+2t+1}.
// V: E4M3 of (V - v_mean) / v_scale, written transposed ([channel][key]) with the keys of each
// 32-chunk in MMA operand order (v_position_of_key): positions 4g..4g+3 of a block hold keys
// 16(g/4) + 2(g%4) + {0, 1, 8, 9}, so a thread takes such a 4-key group for a slice of W = D/16
// channels and stores one 4-byte word per channel; the 16 groups of a slice are 16 lanes of a
// warp, whose words make the channel's 64-byte row.
template <int D>
struct KvBlock {
  static constexpr int kChunks = D / 32, kW = D / 16;
  uint4 kr[kChunks];
  uint32_t vr[4][kW / 2];  // rows vkey0 + {0, 1, 8, 9}, kW elements each
  uint32_t vkeep = 0u;     // byte u: 0xFF when key vkey0 + {0, 1, 8, 9}[u] exists
  __device__ static int key() { return threadIdx.x / 4; }
  __device__ static int part() { return threadIdx.x % 4; }
  __device__ static int group() { return threadIdx.x % 16; }                       // V: g
  __device__ static int slice() { return threadIdx.x / 32 * 2 + threadIdx.x % 32 / 16; }  // V: sl
  __device__ static int vkey(int u) {  // V row u of the thread's group, in the block
    const int g = group();
    return 16 * (g / 4) + 2 * (g % 4) + (u % 2) + 8 * (u / 2);
  }
  // The 16 bits of V row u's element e (of the thread's kW channels).
  __device__ uint32_t v_bits(int u, int e) const {
    return (e % 2) ? vr[u][e / 2] >> 16 : vr[u][e / 2] & 0xFFFFu;
  }
  // Zeroes the thread's Inf/NaN elements (they count as zeros, as in the statistics) and lowers
  // the head's first bad key (*kv_bad, kKvBadNone when there is none) to the first key that held
  // one: quant_q and the sm90 kernel's Q quantization mark the rows that see it.
  template <typename T>
  __device__ void zero_special_keys(int64_t key0, unsigned long long* kv_bad) {
    unsigned long long first = kKvBadNone;
    uint32_t k_acc = 0u;
    for (int ci = 0; ci < kChunks; ++ci) {
      k_acc = special_fold<T>(k_acc, kr[ci].x), k_acc = special_fold<T>(k_acc, kr[ci].y);
      k_acc = special_fold<T>(k_acc, kr[ci].z), k_acc = special_fold<T>(k_acc, kr[ci].w);
    }
    if (special2<T>(k_acc) != 0u) {  // rare: the zeroing
      zero_special<T>(kr);
      first = static_cast<unsigned long long>(key0 + key());
    }
    uint32_t v_acc = 0u;
    for (int u = 0; u < 4; ++u)
      for (int i = 0; i < kW / 2; ++i) v_acc = special_fold<T>(v_acc, vr[u][i]);
    if (special2<T>(v_acc) != 0u)  // rare: which rows, and their zeroing
      for (int u = 0; u < 4; ++u) {
        uint32_t bad = 0u;
        for (int i = 0; i < kW / 2; ++i) {
          bad |= special2<T>(vr[u][i]);
          vr[u][i] = zero_special2<T>(vr[u][i]);
        }
        const auto n = static_cast<unsigned long long>(key0 + vkey(u));
        if (bad != 0u && n < first) first = n;
      }
    if (first != kKvBadNone) atomicMin(kv_bad, first);
  }
};

// Loads block kb (keys from the sequence's start, token tok0 of the caller's tensors) from global
// memory (quant_kv_kernel): every load of the thread is issued first. Channels from `dim` (the
// caller's head dim, a multiple of 8) to D are zeros: a K chunk (8 channels) and a V slice of
// D/16 = 4 or 8 channels lie wholly inside dim or wholly past it; D = 256's slice of 16 straddles
// dim where dim % 16 == 8 (136, 200, ...), so it is read as two pieces of 8, each only if inside.
template <typename T, int D, bool kVec>
__device__ __forceinline__ KvBlock<D> load_block_global(const T* k, const T* v,
                                                        const sage_strides& ks,
                                                        const sage_strides& vs, int dim, int b,
                                                        int h, int64_t tok0, int64_t kb,
                                                        int64_t seq_kv) {
  using B = KvBlock<D>;
  B x;
  const int64_t key = kb * kBlockK + B::key();
  for (int ci = 0; ci < B::kChunks; ++ci) {
    const int d0 = (ci * 4 + B::part()) * 8;
    x.kr[ci] = make_uint4(0u, 0u, 0u, 0u);
    if (key < seq_kv && d0 < dim)
      x.kr[ci] = load_raw8<kVec>(row_ptr(k, ks, b, h, tok0 + key) + d0);
  }
  const int v0 = B::slice() * B::kW;  // the slice's first channel
  for (int u = 0; u < 4; ++u) {
    const int64_t n = kb * kBlockK + B::vkey(u);
    for (int i = 0; i < B::kW / 2; ++i) x.vr[u][i] = 0u;
    if (n < seq_kv) {
      const T* vrow = row_ptr(v, vs, b, h, tok0 + n) + v0;
      if constexpr (B::kW <= 8) {
        if (v0 < dim) load_raw<kVec, B::kW>(vrow, x.vr[u]);
      } else {
        for (int i = 0; i < B::kW / 8; ++i)
          if (v0 + 8 * i < dim) {
            const uint4 w = load_raw8<kVec>(vrow + 8 * i);
            x.vr[u][4 * i] = w.x, x.vr[u][4 * i + 1] = w.y;
            x.vr[u][4 * i + 2] = w.z, x.vr[u][4 * i + 3] = w.w;
          }
      }
      x.vkeep |= 0xFFu << (8 * u);
    }
  }
  return x;
}

// Loads the block at row r0 of stage S (kv_prepass_kernel: a chunk's stage; the staged
// quant_kv: a block's; rows past the sequence were zero-filled).
template <int D, typename S = Stage<D>>
__device__ __forceinline__ KvBlock<D> load_block_staged(const uint8_t* smem, int r0, int64_t key0,
                                                        int64_t seq_kv) {
  using B = KvBlock<D>;
  B x;
  const uint8_t* krow = smem + (r0 + B::key()) * S::kPitch;
  for (int ci = 0; ci < B::kChunks; ++ci)
    x.kr[ci] = *reinterpret_cast<const uint4*>(krow + (ci * 4 + B::part()) * 16);
  for (int u = 0; u < 4; ++u) {
    const uint8_t* vrow = smem + S::kV + (r0 + B::vkey(u)) * S::kPitch + B::slice() * B::kW * 2;
    if constexpr (B::kW >= 8) {
      for (int i = 0; i < B::kW / 8; ++i) {
        const uint4 w = *reinterpret_cast<const uint4*>(vrow + 16 * i);
        x.vr[u][4 * i] = w.x, x.vr[u][4 * i + 1] = w.y;
        x.vr[u][4 * i + 2] = w.z, x.vr[u][4 * i + 3] = w.w;
      }
    } else {
      const uint2 w = *reinterpret_cast<const uint2*>(vrow);
      x.vr[u][0] = w.x, x.vr[u][1] = w.y;
    }
    if (key0 + B::vkey(u) < seq_kv) x.vkeep |= 0xFFu << (8 * u);
  }
  return x;
}

// The E4M3 Vᵀ of block kb (pairs of keys vkey0, vkey0 + 1 and vkey0 + 8, vkey0 + 9 of each
// channel, one word) with the head's v_mean and 1/v_scale (vm, vi); quant_kv_block's V, and the
// re-quantization of a head whose V lay past its sampled bound (fix_v).
template <typename T, int D>
__device__ __forceinline__ void quant_v_block(const KvBlock<D>& x, int64_t kb, int64_t vcol0,
                                              int64_t pitch, const float* vm, const float* vi,
                                              uint8_t* vq) {
  using B = KvBlock<D>;
  const int sl = B::slice();
  uint8_t* vdst = vq + vcol0 + int64_t(sl * B::kW) * pitch + kb * kBlockK + 4 * B::group();
  for (int e = 0; e < B::kW; ++e) {
    const int c = sl * B::kW + e;
    const float m = vm[c], s = vi[c];
    auto val = [&](int u) { return __fmul_rn(__fsub_rn(Bits<T>::to_float(x.v_bits(u, e)), m), s); };
    const uint32_t lo = ptx::cvt_e4m3x2(val(0), val(1)), hi = ptx::cvt_e4m3x2(val(2), val(3));
    *reinterpret_cast<uint32_t*>(vdst + int64_t(e) * pitch) = __byte_perm(lo, hi, 0x5410) & x.vkeep;
  }
}

// Whether some |v| of the thread's V words (no Inf/NaN: zero_special_keys) lies past its
// channel's bound (this head's v_sample_bound per channel, `bound`). Without V smoothing
// |v - v_mean| is |v| exactly, and a float bound compares with a 16-bit value as its conversion
// to the 16-bit format does (exact for a bound that is 4x a 16-bit value; +inf past the
// format's range, which no finite value exceeds), so the test runs on packed pairs: a max of
// the four keys and one compare a channel pair.
template <typename T, int D>
__device__ __forceinline__ bool v_past_bound(const KvBlock<D>& x, const float* bound) {
  using B = KvBlock<D>;
  using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
  const float* b = bound + B::slice() * B::kW;
  unsigned past = 0u;
  for (int i = 0; i < B::kW / 2; ++i) {
    T2 m = __habs2(*reinterpret_cast<const T2*>(&x.vr[0][i]));
    for (int u = 1; u < 4; ++u) m = __hmax2(m, __habs2(*reinterpret_cast<const T2*>(&x.vr[u][i])));
    T2 lim;
    if constexpr (std::is_same_v<T, __half>)
      lim = __floats2half2_rn(b[2 * i], b[2 * i + 1]);
    else
      lim = __floats2bfloat162_rn(b[2 * i], b[2 * i + 1]);
    past |= __hgt2_mask(m, lim);
  }
  return past != 0u;
}

// A block with a V value past its channel's bound: the exact max of each such channel's |v| over
// the block goes into the head's v_amax (float bits: non-negative floats order as their bits),
// and the head is marked for fix_v.
template <typename T, int D>
__device__ __forceinline__ void note_v_past_bound(const KvBlock<D>& x, const VCheck& vc) {
  using B = KvBlock<D>;
  const int c0 = B::slice() * B::kW;
  for (int e = 0; e < B::kW; ++e) {
    float a = 0.0f;
    for (int u = 0; u < 4; ++u) a = fmaxf(a, fabsf(Bits<T>::to_float(x.v_bits(u, e))));
    if (a > vc.bound[c0 + e]) atomicMax(vc.amax + c0 + e, __float_as_uint(a));
  }
  if (threadIdx.x == 0) atomicOr(vc.over, 1u);
}

// Quantizes and stores block kb of the (sequence, KV head) whose K̂ rows start at row krow0 and
// whose Vᵀ at byte vcol0 (channel pitch `pitch`: quant/layout.h, SeqRows). km, vm, vi: the head's
// k_mean, v_mean and 1/v_scale in shared memory; group_max: [8][4] floats of shared memory (one
// __syncthreads inside: a caller that loops over blocks alternates two). x holds no Inf/NaN
// (KvBlock::zero_special_keys), and k_mean is finite, so K's max is taken on the bits of
// |k - k_mean| (non-negative floats order as their bits), and with a finite group amax and inv
// quantize_bits' clamp and NaN test cannot act (see quant_q) and are skipped.
template <typename T, int D, int kBits, bool kCheck = false>
__device__ __forceinline__ void quant_kv_block(const KvBlock<D>& x, int64_t kb, int64_t krow0,
                                               int64_t vcol0, int64_t pitch, const float* km,
                                               const float* vm, const float* vi,
                                               float (*group_max)[4], int64_t seq_kv,
                                               uint8_t* kq, float* k_scale, uint8_t* vq,
                                               VCheck vcheck = {}) {
  using B = KvBlock<D>;
  constexpr float qmax = kBits == 8 ? float(kInt8Max) : float(kInt4Max);
  const int j = B::key(), part = B::part(), warp = threadIdx.x / 32;
  const int64_t key = kb * kBlockK + j;
  const bool valid = key < seq_kv;

  // K: k - k_mean (kept for the quantization after the barrier), max |k - k_mean| of the part,
  // then over the 4 parts of a key and its pair key (j ^ 1 is 4 lanes away): one group in this
  // warp.
  float kc[B::kChunks][8];
  uint32_t abits = 0u;
  for (int ci = 0; ci < B::kChunks; ++ci) {
    const float4 m0 = *reinterpret_cast<const float4*>(&km[(ci * 4 + part) * 8]);
    const float4 m1 = *reinterpret_cast<const float4*>(&km[(ci * 4 + part) * 8 + 4]);
    const float mk[8] = {m0.x, m0.y, m0.z, m0.w, m1.x, m1.y, m1.z, m1.w};
    for (int e = 0; e < 8; ++e) {
      kc[ci][e] = __fsub_rn(elem_float<T>(x.kr[ci], e), mk[e]);
      abits = max(abits, __float_as_uint(fabsf(kc[ci][e])));
    }
  }
  float amax = valid ? __uint_as_float(abits) : 0.0f;
  for (int m : {1, 2, 4}) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  const int t = (j % 8) / 2;
  if (threadIdx.x % 8 == 0) group_max[warp][t] = amax;

  quant_v_block<T, D>(x, kb, vcol0, pitch, vm, vi, vq);
  // The check of V's sampled bound (kCheck: PrepassPlan::kv_sampled) rides on the barrier the
  // K scales need anyway; a block with a value past its channel's bound (rare) notes it after.
  bool past = false;
  if constexpr (kCheck)
    past = __syncthreads_or(v_past_bound<T, D>(x, vcheck.bound));
  else
    __syncthreads();

  amax = 0.0f;
  for (int w = 0; w < 8; ++w) amax = fmaxf(amax, group_max[w][t]);
  const QuantScale s = make_quant_scale(amax, qmax);
  if (threadIdx.x < 32 && threadIdx.x % 8 == 0)
    k_scale[(krow0 / kBlockK + kb) * kKGroups + t] = s.scale;
  const bool fast = finite_scale(amax, s.inv);
  const uint32_t keep = valid ? 0xFFFFFFFFu : 0u;
  uint8_t* const krow = kq + (krow0 + key) * (D * kBits / 8);
  for (int ci = 0; ci < B::kChunks; ++ci)
    quantize_store8<kBits>(krow, (ci * 4 + part) * 8, kc[ci], s.inv, qmax, fast, keep, RowPlace{});
  if constexpr (kCheck)
    if (past) note_v_past_bound<T, D>(x, vcheck);
}

// A packed batch's sequence whose keys end in the first half of a 128-key block (kb, its last
// 64-key block, even): the sm90 kernel's TMA reads Vᵀ in 128-key blocks, so the second half's
// columns, the sequence's own padding that nothing else writes, are zeroed. A masked key's P̃ is
// 0, but 0·NaN of stale workspace bytes would not be. (Its K̂ rows there may hold anything: their
// scores are masked, and their scale group is never read.) A dense call's Vᵀ ends at nk_pad,
// where TMA reads zeros past the tensor.
template <int D>
__device__ __forceinline__ void zero_v_tail(const SeqRows& rows, int64_t kb, int64_t k_blocks,
                                            int64_t vcol0, uint8_t* vq) {
  if (!rows.packed() || kb != k_blocks - 1 || kb % 2 != 0) return;
  const int64_t col0 = (kb + 1) * kBlockK;
  for (int i = threadIdx.x; i < D * (kBlockK / 16); i += blockDim.x) {
    const int c = i / (kBlockK / 16), part = i % (kBlockK / 16);
    *reinterpret_cast<uint4*>(vq + vcol0 + c * rows.pitch + col0 + part * 16) =
        make_uint4(0u, 0u, 0u, 0u);
  }
}

}  // namespace
}  // namespace sage::quant
