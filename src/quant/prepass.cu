// Pre-pass kernels of both attention kernels (sm_89+), each the GPU twin of a step of the CPU
// emulation (src/ref/prepass.cpp), with the same float operations in the same order where
// the result is quantized. Bytes moved (B·H·N·D elements of 2 bytes each for Q, K, V):
//   kv_prepass   (sm_90+, a KV head of at most 8 chunks: PrepassPlan::kv_cluster) reads K and V
//                once (2+2 B/elem), writes the chunk statistics, INT8/INT4 K + scales and E4M3
//                Vᵀ as the next three do, in one launch
//   kv_stats     reads V (2 B/elem) and every k_mean_stride-th row of K (the smoothing mean
//                of K from a sample: ~256 rows a head with the presets), writes 24 B per (head,
//                128-token chunk, channel), in the bytes the head's Vᵀ later takes
//   kv_finalize  reads those statistics, writes 16 B per (head, channel)
//   quant_kv     reads K and V (2+2 B/elem, kept in registers), writes INT8 (1 B) or INT4
//                (0.5 B) K + 4 scales per 64 keys, and E4M3 Vᵀ (1 B)
//   quant_q      reads Q (2 B/elem; again from L2 for the mean with Q smoothing), writes
//                INT8/INT4 Q + scales (+ the block means with Q smoothing) and the LSE
//                correction (4 B/row, NaN for a poisoned row); skipped when the sm90 kernel
//                quantizes Q itself (PrepassPlan::quantize_q false: attn/sm90 producer)
// (ΔS of Q smoothing is no pre-pass product: the mma kernel forms it from the caller's K.)
// Per call: Q 2 B read, K 2 B and V 4 B read (2 B with kv_prepass), ~1 + 1 + 1 (+0.5) B written
// per element. In three launches V is read twice (its exact channel mean and range, then
// quantize): the sm90 kernel's wgmma accumulator needs V - v_mean to sum to zero
// (docs/sm90-kernel.md, Tried and rejected).
//
// Throughput notes (the kernels are memory-bound only if nothing else is slower):
// - A thread issues every load of its rows before it uses any (kv_stats, kv_prepass: a whole
//   chunk staged by cp.async), as 16-byte loads when every row of the tensor is 16-byte aligned,
//   decided once on the host by the planner: kVec (PrepassPlan::vec_kv, vec_q).
// - No fp32→fp64 conversion instruction on the hot paths (F2F.F64 issues at a small fraction of
//   the FP64 rate). The sums of kv_stats and the LSE dot product of quant_q need each fp16/bf16
//   value x as a double: its sign, exponent and mantissa bits placed in a double's fields give
//   exactly x·2^-kScaleExp (subnormals included), a power-of-two multiply (or, for sums, the
//   scale invariance of the rounding) gives x itself. Inf/NaN inputs break that and take the
//   original converting path (detected per slice or per thread).
// - Integer quantization rounds with the 1.5·2^23 addition instead of FRND + F2I, and drops the
//   clamp and NaN test where they cannot act (no NaN, finite group amax and inv); no per-element
//   branches (rows past the sequence are zeroed by a mask on the packed word).
// - Max/min that need no float rounding run on the packed 16-bit inputs (kv_stats' V range,
//   quant_q's max |q| without smoothing).
// - Grids are (blocks, batch·heads spread over y and z: common/grid.h), so any count of heads
//   launches; a CTA decodes its (b, h) once in its prologue (one division), none in a loop.
// - Every kernel is PDL-launched (launch_pdl) and waits in its prologue (pdl_enter).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "common/formats.h"
#include "common/grid.h"
#include "common/launch.h"
#include "ptx/async.cuh"
#include "ptx/barrier.cuh"
#include "ptx/cvt.cuh"
#include "quant/elements.cuh"
#include "quant/prepass.h"

namespace sage::quant {
namespace {

using Plan = PrepassPlan;

// Programmatic dependent launch (sm_90+; nothing below): every pre-pass kernel is launched with
// programmatic stream serialization (launch_pdl, common/launch.h), so it may start while the
// previous kernel of the stream (a pre-pass kernel, or the caller's kernel that wrote Q/K/V) is
// still running. It therefore waits for that kernel's completion and memory before its first
// global access (griddepcontrol.wait), and then at once lets the next kernel's CTAs be scheduled
// as SMs free up (griddepcontrol.launch_dependents), which in turn wait in their own prologue.
// Every kernel of the chain waits before it touches memory, so each sees all the kernels before
// it complete.
__device__ __forceinline__ void pdl_enter() {
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
}

struct KvStat {
  double sum_k, sum_v;
  float max_v, min_v;
};
static_assert(sizeof(KvStat) == kKvStatBytes, "the plan reserves 24 bytes per statistic");

// The byte offset of (b, h)'s Vᵀ in the workspace's Vᵀ region: channel c's keys start c·pitch
// bytes later (quant/layout.h, SeqRows).
__device__ __forceinline__ int64_t v_base(const SeqRows& rows, int64_t b, int64_t h,
                                          const SeqSpan& s, int D) {
  return (b * rows.batch_rows + h * rows.pitch) * D + s.ws0;
}

// A (sequence, KV head)'s chunk statistics, in the bytes its Vᵀ later takes (PrepassPlan::
// kv_stats): dense [chunk][channel] from the start of the head's Vᵀ; packed, statistic (chunk,
// channel) at the first 24 bytes of that chunk's 128 columns in that channel's Vᵀ row (a packed
// head's Vᵀ bytes are not contiguous; these are the sequence's own columns all the same).
struct StatView {
  uint8_t* base;
  int64_t chunk_step, channel_step;
  __device__ KvStat* at(int64_t chunk, int64_t c) const {
    return reinterpret_cast<KvStat*>(base + chunk * chunk_step + c * channel_step);
  }
};
__device__ __forceinline__ StatView stat_view(KvStat* stats, const SeqRows& rows, int64_t b,
                                              int64_t h, const SeqSpan& s, int D) {
  uint8_t* base = reinterpret_cast<uint8_t*>(stats) + v_base(rows, b, h, s, D);
  return rows.packed() ? StatView{base, kStatTokens, rows.pitch}
                       : StatView{base, D * kKvStatBytes, kKvStatBytes};
}

template <typename T>
__device__ __forceinline__ const T* row_ptr(const T* base, const sage_strides& s, int64_t b,
                                            int64_t h, int64_t n) {
  return base + b * s.batch + h * s.head + n * s.token;
}

// Elements p[0..7] as raw bits: one 16-byte read-only load (not kept in L1: every input byte is
// read once per kernel) when kVec, else eight 2-byte loads (rows need only 2-byte alignment).
template <bool kVec, typename T>
__device__ __forceinline__ uint4 load_raw8(const T* p) {
  uint4 w;
  if constexpr (kVec) {
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
        : "l"(p));
  } else {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(p);
    w.x = s[0] | (uint32_t(s[1]) << 16);
    w.y = s[2] | (uint32_t(s[3]) << 16);
    w.z = s[4] | (uint32_t(s[5]) << 16);
    w.w = s[6] | (uint32_t(s[7]) << 16);
  }
  return w;
}

// Elements p[0..N-1] (N = 4 or 8) as raw bits, two a word: load_raw8, or one 8-byte load. (No
// 16: a head dim that is a multiple of 8 may end half-way through 16 elements, so wider reads
// are pieces of 8, each tested against it: load_block_global.)
template <bool kVec, int N, typename T>
__device__ __forceinline__ void load_raw(const T* p, uint32_t (&w)[N / 2]) {
  static_assert(N == 4 || N == 8, "4 or 8 elements");
  if constexpr (N == 8) {
    const uint4 x = load_raw8<kVec>(p);
    w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
  } else if constexpr (kVec) {
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
  } else {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(p);
    w[0] = s[0] | (uint32_t(s[1]) << 16);
    w[1] = s[2] | (uint32_t(s[3]) << 16);
  }
}

// ---- Staging a chunk of K/V rows in shared memory --------------------------------------------
// Rows of a chunk sit at a pitch of 2·D + 16 bytes (the 16 spread the rows that quant_kv_block's
// V groups read together over the banks: at most two-way conflicts), K rows then V rows. At
// D = 256 a stage holds half a chunk (66 KB; a whole one, 132 KB, exceeds the 99 KB a CTA may
// have on sm_89 and sm_120): kv_stats stages and sums a chunk in two parts, and the one-launch
// kv_prepass, which keeps a whole chunk staged, is planned for D <= 128 only.
template <int D>
struct Stage {
  static constexpr int kPitch = 2 * D + 16;
  static constexpr int kRows = D <= 128 ? kStatTokens : kStatTokens / 2;  // rows a stage holds
  static constexpr int kV = kRows * kPitch;           // V's offset
  static constexpr int kBytes = 2 * kV;               // K and V: 70 KB at D = 128
};

// 16 bytes from global to shared memory: cp.async (in flight with every other copy of the
// thread until stage_rows' wait) when every row is 16-byte aligned, else eight 2-byte loads.
template <bool kVec, typename T>
__device__ __forceinline__ void copy16(uint8_t* dst, const T* src) {
  if constexpr (kVec)
    ptx::cp_async_16(dst, src);
  else
    *reinterpret_cast<uint4*>(dst) = load_raw8<false>(src);
}

// Stages the chunk's rows n0 + r (r < kStatTokens) of K and V: V's every row, K's every row when
// all_k, else only the rows the K mean samples (n % k_stride == 0); rows past `rows` (the
// sequence's end) are zero-filled, and so are the channels from `dim` (the caller's head dim) to
// D. 256 threads: D/8 lanes a row, each a 16-byte piece (wholly inside dim: a multiple of 8).
template <typename T, int D, bool kVec>
__device__ __forceinline__ void stage_rows(const T* k, const T* v, const sage_strides& ks,
                                           const sage_strides& vs, int dim, int b, int h,
                                           int64_t tok0, int64_t n0, int rows, uint32_t k_stride,
                                           bool all_k, uint8_t* smem) {
  constexpr int kPieces = D / 8, kRowStep = 256 / kPieces;
  const int piece = threadIdx.x % kPieces;
  const bool real = piece * 8 < dim;  // a piece of the caller's channels, not zero padding
  int r = threadIdx.x / kPieces;
  // (Pointers to rows past the sequence are formed, never read.)
  const T* k_row = row_ptr(k, ks, b, h, tok0 + n0 + r) + piece * 8;
  const T* v_row = row_ptr(v, vs, b, h, tok0 + n0 + r) + piece * 8;
  const int64_t k_step = int64_t(kRowStep) * ks.token, v_step = int64_t(kRowStep) * vs.token;
  // Whether K's mean samples row n0 + r, as a running residue (no division per row).
  uint32_t residue = uint32_t((n0 + r) % int64_t(k_stride));
  const uint32_t residue_step = uint32_t(kRowStep) % k_stride;
  for (; r < Stage<D>::kRows; r += kRowStep) {
    uint8_t* kd = smem + r * Stage<D>::kPitch + piece * 16;
    uint8_t* vd = kd + Stage<D>::kV;
    if (r < rows && real) {
      copy16<kVec>(vd, v_row);
      if (all_k || residue == 0u) copy16<kVec>(kd, k_row);
    } else {
      *reinterpret_cast<uint4*>(vd) = *reinterpret_cast<uint4*>(kd) = make_uint4(0u, 0u, 0u, 0u);
    }
    k_row += k_step, v_row += v_step;
    residue += residue_step;
    if (residue >= k_stride) residue -= k_stride;
  }
  if constexpr (kVec) {
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
  }
  __syncthreads();
}

// ---- Statistics of a chunk -------------------------------------------------------------------
// Per (kv head, chunk of kStatTokens tokens, channel): Σk over the chunk's tokens n with
// n % k_stride == 0 (K's mean sample), Σv (double), max v, min v. 256 threads: a thread takes a
// channel pair (one 32-bit word of a staged row) and one of kSlices = 512/D token slices (rows
// r ≡ slice mod kSlices of the chunk, in order; K: the sampled rows i ≡ slice mod kSlices); the
// slices are then added in order (fixed order: deterministic, no atomics). The sums run on
// scaled_double values (x·2^-kScaleExp exactly for finite x: no fp32→fp64 conversion; the final
// multiply by 2^kScaleExp gives the converting sum's bits). Max and min run on packed pairs in the
// input format (exact). An Inf/NaN element counts as a zero everywhere (docs/c-api.md,
// "Non-finite inputs"), so the statistics of a head stay finite and the rows it poisons are marked instead.
template <typename T, int D>
struct ChunkStats {
  using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
  static constexpr int kWords = D / 2, kSlices = 256 / kWords;
  double sk[2] = {0, 0}, sv[2] = {0, 0};
  T2 mx = T2(T(-INFINITY), T(-INFINITY)), mn = T2(T(INFINITY), T(INFINITY));

  // Adds the staged rows [0, rows) into this thread's slice: scaled_double sums first; a slice
  // whose rows held an Inf or NaN redoes their sums converting every value (times 2^-kScaleExp,
  // so the final multiply gives the converting sum's bits).
  __device__ void accumulate(const uint8_t* smem, int rows, int64_t n0, uint32_t k_stride) {
    const int word = threadIdx.x % kWords, slice = threadIdx.x / kWords;
    const uint8_t* kcol = smem + word * 4;
    const uint8_t* vcol = kcol + Stage<D>::kV;
    // K: the sampled rows of the chunk are r = first + i·k_stride; this slice takes i ≡ slice.
    const int64_t first = (int64_t(k_stride) - n0 % k_stride) % k_stride;
    const int64_t k_first = first + int64_t(slice) * k_stride;
    const int64_t k_step = int64_t(kSlices) * k_stride;
    // The sums so far (D = 256 stages a chunk in two parts, one call each): a part that holds an
    // Inf or NaN redoes its own rows from them, not the earlier part's.
    const double sk0[2] = {sk[0], sk[1]}, sv0[2] = {sv[0], sv[1]};
    const T2 mx0 = mx, mn0 = mn;
    uint32_t bad = 0u;
#pragma unroll 4
    for (int r = slice; r < rows; r += kSlices) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(vcol + r * Stage<D>::kPitch);
      bad |= special2<T>(w);
      sv[0] += scaled_double_lo<T>(w);
      sv[1] += scaled_double_hi<T>(w);
      const T2 x = *reinterpret_cast<const T2*>(&w);
      mx = __hmax2(mx, x), mn = __hmin2(mn, x);
    }
    for (int64_t r = k_first; r < rows; r += k_step) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(kcol + r * Stage<D>::kPitch);
      bad |= special2<T>(w);
      sk[0] += scaled_double_lo<T>(w);
      sk[1] += scaled_double_hi<T>(w);
    }
    if (bad == 0u) return;
    // A slice that held an Inf or NaN redoes its sums and range with those elements as zeros
    // (zero_special2), as the quantizers take them.
    sv[0] = sv0[0], sv[1] = sv0[1], sk[0] = sk0[0], sk[1] = sk0[1];
    mx = mx0, mn = mn0;
    for (int r = slice; r < rows; r += kSlices) {
      const uint32_t w = zero_special2<T>(*reinterpret_cast<const uint32_t*>(vcol + r * Stage<D>::kPitch));
      sv[0] += scaled_double_lo<T>(w);
      sv[1] += scaled_double_hi<T>(w);
      const T2 x = *reinterpret_cast<const T2*>(&w);
      mx = __hmax2(mx, x), mn = __hmin2(mn, x);
    }
    for (int64_t r = k_first; r < rows; r += k_step) {
      const uint32_t w = zero_special2<T>(*reinterpret_cast<const uint32_t*>(kcol + r * Stage<D>::kPitch));
      sk[0] += scaled_double_lo<T>(w);
      sk[1] += scaled_double_hi<T>(w);
    }
  }
  // Adds the slices in order and writes the chunk's statistics (D of them, at dst.at(chunk, c)).
  // `red`: kStatRed doubles of shared memory; ends with a __syncthreads.
  __device__ void write(double* red, const StatView& dst, int64_t chunk) const {
    const int word = threadIdx.x % kWords, slice = threadIdx.x / kWords;
    static_assert(kSlices * D == 512, "kStatRed's layout");
    double* rk = red;                                  // Σk [slice][channel]
    double* rv = red + 512;                            // Σv [slice][channel]
    float* rm = reinterpret_cast<float*>(red + 1024);  // [2][slice][channel]: max, min
    const float2 a = to_float2(mx), z = to_float2(mn);
    const int c = 2 * word, at = slice * D + c;
    rk[at] = __dmul_rn(sk[0], Bits<T>::kUnscale), rk[at + 1] = __dmul_rn(sk[1], Bits<T>::kUnscale);
    rv[at] = __dmul_rn(sv[0], Bits<T>::kUnscale), rv[at + 1] = __dmul_rn(sv[1], Bits<T>::kUnscale);
    rm[at] = a.x, rm[at + 1] = a.y;
    rm[kSlices * D + at] = z.x, rm[kSlices * D + at + 1] = z.y;
    __syncthreads();
    for (int ch = threadIdx.x; ch < D; ch += blockDim.x) {
      KvStat s{rk[ch], rv[ch], rm[ch], rm[kSlices * D + ch]};
      for (int t = 1; t < kSlices; ++t) {
        s.sum_k += rk[t * D + ch];
        s.sum_v += rv[t * D + ch];
        s.max_v = fmaxf(s.max_v, rm[t * D + ch]);
        s.min_v = fminf(s.min_v, rm[kSlices * D + t * D + ch]);
      }
      *dst.at(chunk, ch) = s;
    }
    __syncthreads();
  }
};
// Shared memory of ChunkStats::write, in doubles: Σk and Σv [kSlices][D] (512 each), then max
// and min as floats [2][kSlices][D] (512 doubles' room).
constexpr int kStatRed = 1536;

// The chunk statistics of one KV head reduced in chunk order: k_mean (over the k_samples sampled
// tokens), v_mean (zero without smoothing), and the E4M3 scale of V - v_mean, for channel c.
// kv_finalize_kernel and kv_prepass_kernel both call it.
struct ChannelFinal {
  float k_mean, v_mean, v_scale, v_inv;
};
__device__ __forceinline__ ChannelFinal finalize_channel(const StatView& stats, int64_t chunks,
                                                         int64_t c, int64_t seq_kv,
                                                         int64_t k_samples, bool smooth_k,
                                                         bool smooth_v) {
  constexpr int kBatch = 8;  // the statistics of kBatch chunks are loaded before their sums
  double sk = 0, sv = 0;
  float mx = -INFINITY, mn = INFINITY;
  for (int64_t i0 = 0; i0 < chunks; i0 += kBatch) {
    KvStat s[kBatch];
    for (int u = 0; u < kBatch; ++u)
      if (i0 + u < chunks) s[u] = *stats.at(i0 + u, c);
    for (int u = 0; u < kBatch; ++u) {
      if (i0 + u >= chunks) break;
      sk += s[u].sum_k;
      sv += s[u].sum_v;
      mx = fmaxf(mx, s[u].max_v);
      mn = fminf(mn, s[u].min_v);
    }
  }
  // A packed batch's sequence may have no keys: zero means and a zero channel's scale (nothing
  // reads them; they stay finite).
  const float km = smooth_k && k_samples > 0 ? float(sk / double(k_samples)) : 0.0f;
  const float vm = smooth_v && seq_kv > 0 ? float(sv / double(seq_kv)) : 0.0f;
  // max |fl(v - vm)| over the channel: subtraction is monotonic, so the extremes decide.
  const float amax = seq_kv > 0 ? fmaxf(__fsub_rn(mx, vm), __fsub_rn(vm, mn)) : 0.0f;
  const QuantScale q = make_quant_scale(amax, kE4M3Max);
  return {km, vm, q.scale, q.inv};
}

// ---- K/V quantization of a 64-key block ------------------------------------------------------
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
  // Zeroes the thread's Inf/NaN elements (they count as zeros, as in the statistics) and lowers
  // the head's first bad key (*kv_bad, kKvBadNone when there is none) to the first key that held
  // one: quant_q and the sm90 kernel's Q quantization mark the rows that see it.
  template <typename T>
  __device__ void zero_special_keys(int64_t key0, unsigned long long* kv_bad) {
    unsigned long long first = kKvBadNone;
    if (zero_special<T>(kr) != 0u) first = static_cast<unsigned long long>(key0 + key());
    uint32_t v_bad = 0u;
    for (int u = 0; u < 4; ++u)
      for (int i = 0; i < kW / 2; ++i) v_bad |= special2<T>(vr[u][i]);
    if (v_bad != 0u)  // rare: which rows, and their zeroing
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

// Loads the block at stage row r0 (kv_prepass_kernel: rows past the sequence were zero-filled).
template <int D>
__device__ __forceinline__ KvBlock<D> load_block_staged(const uint8_t* smem, int r0, int64_t key0,
                                                        int64_t seq_kv) {
  using B = KvBlock<D>;
  B x;
  const uint8_t* krow = smem + (r0 + B::key()) * Stage<D>::kPitch;
  for (int ci = 0; ci < B::kChunks; ++ci)
    x.kr[ci] = *reinterpret_cast<const uint4*>(krow + (ci * 4 + B::part()) * 16);
  for (int u = 0; u < 4; ++u) {
    const uint8_t* vrow = smem + Stage<D>::kV + (r0 + B::vkey(u)) * Stage<D>::kPitch +
                          B::slice() * B::kW * 2;
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

// Quantizes and stores block kb of the (sequence, KV head) whose K̂ rows start at row krow0 and
// whose Vᵀ at byte vcol0 (channel pitch `pitch`: quant/layout.h, SeqRows). km, vm, vi: the head's
// k_mean, v_mean and 1/v_scale in shared memory; group_max: [8][4] floats of shared memory (one
// __syncthreads inside: a caller that loops over blocks alternates two). x holds no Inf/NaN
// (KvBlock::zero_special_keys), and k_mean is finite, so K's max is taken on the bits of
// |k - k_mean| (non-negative floats order as their bits), and with a finite group amax and inv
// quantize_bits' clamp and NaN test cannot act (see quant_q) and are skipped.
template <typename T, int D, int kBits>
__device__ __forceinline__ void quant_kv_block(const KvBlock<D>& x, int64_t kb, int64_t krow0,
                                               int64_t vcol0, int64_t pitch, const float* km,
                                               const float* vm, const float* vi,
                                               float (*group_max)[4], int64_t seq_kv,
                                               uint8_t* kq, float* k_scale, uint8_t* vq) {
  using B = KvBlock<D>;
  constexpr float qmax = kBits == 8 ? float(kInt8Max) : float(kInt4Max);
  const int j = B::key(), part = B::part(), warp = threadIdx.x / 32;
  const int64_t key = kb * kBlockK + j;
  const bool valid = key < seq_kv;

  // K: max |k - k_mean| of the part, then over the 4 parts of a key and its pair key (j ^ 1 is
  // 4 lanes away): one group in this warp.
  uint32_t abits = 0u;
  for (int ci = 0; ci < B::kChunks; ++ci) {
    const float4 m0 = *reinterpret_cast<const float4*>(&km[(ci * 4 + part) * 8]);
    const float4 m1 = *reinterpret_cast<const float4*>(&km[(ci * 4 + part) * 8 + 4]);
    const float mk[8] = {m0.x, m0.y, m0.z, m0.w, m1.x, m1.y, m1.z, m1.w};
    for (int e = 0; e < 8; ++e)
      abits = max(abits, __float_as_uint(fabsf(__fsub_rn(elem_float<T>(x.kr[ci], e), mk[e]))));
  }
  float amax = valid ? __uint_as_float(abits) : 0.0f;
  for (int m : {1, 2, 4}) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  const int t = (j % 8) / 2;
  if (threadIdx.x % 8 == 0) group_max[warp][t] = amax;

  // V: E4M3 pairs (keys vkey0, vkey0 + 1) and (vkey0 + 8, vkey0 + 9) of each channel, one word.
  {
    const int sl = B::slice();
    uint8_t* vdst = vq + vcol0 + int64_t(sl * B::kW) * pitch + kb * kBlockK + 4 * B::group();
    for (int e = 0; e < B::kW; ++e) {
      const int c = sl * B::kW + e;
      const float m = vm[c], s = vi[c];
      auto val = [&](int u) {
        const uint32_t bits = (e % 2) ? x.vr[u][e / 2] >> 16 : x.vr[u][e / 2] & 0xFFFFu;
        return __fmul_rn(__fsub_rn(Bits<T>::to_float(bits), m), s);
      };
      const uint32_t lo = ptx::cvt_e4m3x2(val(0), val(1)), hi = ptx::cvt_e4m3x2(val(2), val(3));
      *reinterpret_cast<uint32_t*>(vdst + int64_t(e) * pitch) =
          __byte_perm(lo, hi, 0x5410) & x.vkeep;
    }
  }
  __syncthreads();

  amax = 0.0f;
  for (int w = 0; w < 8; ++w) amax = fmaxf(amax, group_max[w][t]);
  const QuantScale s = make_quant_scale(amax, qmax);
  if (threadIdx.x < 32 && threadIdx.x % 8 == 0)
    k_scale[(krow0 / kBlockK + kb) * kKGroups + t] = s.scale;
  const bool fast = finite_scale(amax, s.inv);
  const uint32_t keep = valid ? 0xFFFFFFFFu : 0u;
  quantize_store_row_part<T, D, kBits>(
      kq + (krow0 + key) * (D * kBits / 8), x.kr,
      [&](float y, int c) { return __fsub_rn(y, km[c]); }, part, s.inv, qmax, fast, keep);
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

// ---- The kernels -----------------------------------------------------------------------------
// K/V in one launch (PrepassPlan::kv_cluster): one CTA per chunk of kStatTokens tokens, one
// cluster per KV head (grid (chunks, batch·heads over y and z), cluster (chunks, 1, 1)). Each CTA
// stages its chunk's K and V rows (every byte read from memory once), writes the chunk's
// statistics, meets the rest of its cluster at the cluster barrier, reduces the head's statistics
// itself (the kv_finalize step: k_mean, v_mean, V's scale; the cluster's first CTA also stores
// them for the attention kernel and quant_q), and quantizes its staged rows.
template <typename T, int D, int kBits, bool kVec>
__global__ void __launch_bounds__(256, D <= 64 ? 3 : 2)
    kv_prepass_kernel(const T* k, const T* v, sage_strides ks, sage_strides vs, int dim,
                      int64_t heads_kv, int64_t bk, SeqRows kv_rows, int32_t k_mean_tokens,
                      bool smooth_k, bool smooth_v, KvStat* stats, float* k_mean, float* v_mean,
                      float* v_scale, float* v_inv, unsigned* tile_counter,
                      unsigned long long* kv_bad, uint8_t* kq, float* k_scale, uint8_t* vq) {
  static_assert(Stage<D>::kRows == kStatTokens, "a whole chunk staged (D <= 128)");
  pdl_enter();
  extern __shared__ __align__(16) uint8_t stage[];
  __shared__ double red[kStatRed];
  __shared__ float group_max[2][8][4];
  __shared__ __align__(16) float km[D];
  __shared__ __align__(16) float vm[D];
  __shared__ __align__(16) float vi[D];
  // (A cluster shares its outer index: one past bk returns whole, before either barrier.)
  const int64_t bh = cta_outer_index();
  if (bh >= bk) return;
  const BatchHead bhd = batch_head(bh, heads_kv);
  const int b = int(bhd.b), h = int(bhd.h);
  // The sequence's keys (a packed batch's sequence b; the grid covers the longest, and a CTA past
  // this one's end has no rows but still meets its cluster at both barriers).
  const SeqSpan sp = kv_rows.span(b);
  const int64_t seq_kv = sp.len, chunks = (seq_kv + kStatTokens - 1) / kStatTokens;
  const int64_t k_blocks = (seq_kv + kBlockK - 1) / kBlockK;
  const uint32_t k_stride = uint32_t(k_mean_stride_of(seq_kv, k_mean_tokens));
  const int64_t k_samples = (seq_kv + k_stride - 1) / k_stride;
  const int64_t chunk = blockIdx.x, n0 = chunk * kStatTokens;
  const int rows = int(max(int64_t(0), min(int64_t(kStatTokens), seq_kv - n0)));
  stage_rows<T, D, kVec>(k, v, ks, vs, dim, b, h, sp.tok0, n0, rows, k_stride, true, stage);
  ChunkStats<T, D> st;
  st.accumulate(stage, rows, n0, k_stride);
  const StatView hs = stat_view(stats, kv_rows, b, h, sp, D);
  if (chunk < chunks) st.write(red, hs, chunk);  // (CTA-uniform)
  if (chunk == 0 && threadIdx.x == 0) kv_bad[bh] = kKvBadNone;  // lowered after the barrier
  __threadfence();
  ptx::cluster_sync();  // every chunk's statistics of the head are written
  if (threadIdx.x < D) {
    const int c = threadIdx.x;
    const ChannelFinal f =
        finalize_channel(hs, chunks, c, seq_kv, k_samples, smooth_k, smooth_v);
    km[c] = f.k_mean, vm[c] = f.v_mean, vi[c] = f.v_inv;
    if (chunk == 0) {
      const int64_t at = int64_t(bh) * D + c;
      k_mean[at] = f.k_mean, v_mean[at] = f.v_mean, v_scale[at] = f.v_scale, v_inv[at] = f.v_inv;
    }
  }
  // The attention kernel's tile counters start at zero (it leaves them so; this covers a fresh
  // workspace).
  if (bh == 0 && chunk == 0 && threadIdx.x < 2) tile_counter[threadIdx.x] = 0u;
  __syncthreads();
  // The statistics live in the head's Vᵀ rows, which the quantization below overwrites: every
  // CTA of the cluster has read them first.
  ptx::cluster_sync();
  constexpr int kBlocks = kStatTokens / kBlockK;
  const int64_t krow0 = kv_rows.row0(b, h, sp), vcol0 = v_base(kv_rows, b, h, sp, D);
  for (int i = 0; i < kBlocks; ++i) {
    const int64_t kb = chunk * kBlocks + i;
    if (kb >= k_blocks) break;
    KvBlock<D> x = load_block_staged<D>(stage, i * kBlockK, kb * kBlockK, seq_kv);
    x.template zero_special_keys<T>(kb * kBlockK, kv_bad + bh);
    quant_kv_block<T, D, kBits>(x, kb, krow0, vcol0, kv_rows.pitch, km, vm, vi, group_max[i % 2],
                                seq_kv, kq, k_scale, vq);
    zero_v_tail<D>(kv_rows, kb, k_blocks, vcol0, vq);
  }
}

// The three-launch path's statistics: kv_prepass_kernel's first step alone (V's rows and the
// rows K's mean samples staged).
template <typename T, int D, bool kVec>
__global__ void __launch_bounds__(256, 2)
    kv_stats_kernel(const T* k, const T* v, sage_strides ks, sage_strides vs, int dim,
                    int64_t heads_kv, int64_t bk, SeqRows kv_rows, int32_t k_mean_tokens,
                    KvStat* stats) {
  pdl_enter();
  extern __shared__ __align__(16) uint8_t stage[];
  __shared__ double red[kStatRed];
  const int64_t bh = cta_outer_index();
  if (bh >= bk) return;
  const BatchHead bhd = batch_head(bh, heads_kv);
  const int b = int(bhd.b), h = int(bhd.h);
  const SeqSpan sp = kv_rows.span(b);
  const int64_t chunk = blockIdx.x, n0 = chunk * kStatTokens;
  if (n0 >= sp.len) return;  // past this sequence's keys (a packed batch)
  const int rows = int(min(int64_t(kStatTokens), sp.len - n0));
  const uint32_t k_stride = uint32_t(k_mean_stride_of(sp.len, k_mean_tokens));
  ChunkStats<T, D> st;
  constexpr int kRows = Stage<D>::kRows;
  if constexpr (kRows == kStatTokens) {
    stage_rows<T, D, kVec>(k, v, ks, vs, dim, b, h, sp.tok0, n0, rows, k_stride, false, stage);
    st.accumulate(stage, rows, n0, k_stride);
  } else {
    // D = 256: the chunk in parts of kRows. A thread's slice sums the same V rows in the same
    // order as in one part (kRows is a multiple of kSlices); K's sampled rows are dealt to the
    // slices from each part's first, so a slice may take other ones, and the chunk's Σk adds the
    // same rows grouped otherwise (exact in double for fp16/bf16 values of moderate range, as
    // the emulation's sum assumes).
    static_assert(kRows % ChunkStats<T, D>::kSlices == 0, "slices keep their rows across parts");
    for (int r0 = 0; r0 < rows; r0 += kRows) {
      if (r0 > 0) __syncthreads();  // every thread has summed the previous part
      const int part_rows = min(kRows, rows - r0);
      stage_rows<T, D, kVec>(k, v, ks, vs, dim, b, h, sp.tok0, n0 + r0, part_rows, k_stride,
                             false, stage);
      st.accumulate(stage, part_rows, n0 + r0, k_stride);
    }
  }
  st.write(red, stat_view(stats, kv_rows, b, h, sp, D), chunk);
}

// The three-launch path's finalize: one CTA per (sequence, KV head), a thread per channel.
template <int D>
__global__ void __launch_bounds__(128)
    kv_finalize_kernel(KvStat* stats, SeqRows kv_rows, int64_t heads_kv, int32_t k_mean_tokens,
                       bool smooth_k, bool smooth_v, float* k_mean, float* v_mean,
                       float* v_scale, float* v_inv, unsigned* tile_counter,
                       unsigned long long* kv_bad) {
  pdl_enter();
  // The attention kernel's tile counters start at zero (it leaves them so; this covers a fresh
  // workspace).
  if (blockIdx.x == 0 && threadIdx.x < 2) tile_counter[threadIdx.x] = 0u;
  const int64_t bh = blockIdx.x, b = bh / heads_kv, h = bh % heads_kv;
  const SeqSpan sp = kv_rows.span(b);
  const int64_t seq_kv = sp.len, chunks = (seq_kv + kStatTokens - 1) / kStatTokens;
  const int64_t k_stride = k_mean_stride_of(seq_kv, k_mean_tokens);
  const int64_t k_samples = (seq_kv + k_stride - 1) / k_stride;
  const StatView hs = stat_view(stats, kv_rows, b, h, sp, D);
  if (threadIdx.x == 0) kv_bad[bh] = kKvBadNone;  // quant_kv lowers it
  for (int64_t c = threadIdx.x; c < D; c += blockDim.x) {
    const ChannelFinal f =
        finalize_channel(hs, chunks, c, seq_kv, k_samples, smooth_k, smooth_v);
    k_mean[bh * D + c] = f.k_mean;
    v_mean[bh * D + c] = f.v_mean;
    v_scale[bh * D + c] = f.v_scale;
    v_inv[bh * D + c] = f.v_inv;
  }
}

// The three-launch path's quantization: one CTA (256 threads) per 64-key block, K and V loaded
// together (the loads of both in flight at once) before the head's means and scales.
// At D = 256 a thread holds twice the K and V words: two CTAs an SM (128 registers; at three,
// ptxas spilled ~0.5 KB a thread).
template <typename T, int D, int kBits, bool kVec>
__global__ void __launch_bounds__(256, D <= 64 ? 4 : D <= 128 ? 3 : 2)
    quant_kv_kernel(const T* k, const T* v, sage_strides ks, sage_strides vs, int dim,
                    int64_t heads_kv, int64_t bk, SeqRows kv_rows, const float* k_mean,
                    const float* v_mean, const float* v_inv, unsigned long long* kv_bad,
                    uint8_t* kq, float* k_scale, uint8_t* vq) {
  pdl_enter();
  __shared__ float group_max[8][4];
  __shared__ __align__(16) float km[D];
  __shared__ __align__(16) float vm[D];
  __shared__ __align__(16) float vi[D];
  const int64_t bh = cta_outer_index();
  if (bh >= bk) return;
  const BatchHead bhd = batch_head(bh, heads_kv);
  const int b = int(bhd.b), h = int(bhd.h);
  const SeqSpan sp = kv_rows.span(b);
  const int64_t kb = blockIdx.x, seq_kv = sp.len;
  if (kb * kBlockK >= seq_kv) return;  // past this sequence's keys (a packed batch)
  KvBlock<D> x = load_block_global<T, D, kVec>(k, v, ks, vs, dim, b, h, sp.tok0, kb, seq_kv);
  x.template zero_special_keys<T>(kb * kBlockK, kv_bad + bh);
  if (threadIdx.x < D) {
    const int c = threadIdx.x;
    km[c] = k_mean[int64_t(bh) * D + c];
    vm[c] = v_mean[int64_t(bh) * D + c];
    vi[c] = v_inv[int64_t(bh) * D + c];
  }
  __syncthreads();
  const int64_t vcol0 = v_base(kv_rows, b, h, sp, D);
  quant_kv_block<T, D, kBits>(x, kb, kv_rows.row0(b, h, sp), vcol0, kv_rows.pitch, km, vm, vi,
                              group_max, seq_kv, kq, k_scale, vq);
  zero_v_tail<D>(kv_rows, kb, (seq_kv + kBlockK - 1) / kBlockK, vcol0, vq);
}

// One CTA (512 threads, 4 a row) per 128-row Q block: optional block mean (kSmooth), the LSE
// correction scale·q·k_mean, then per-thread groups (rows {g, g+8} of each 16-row warp slice).
// A thread's row loads are issued first (in flight during the mean); q·k_mean is summed in double
// in channel order of the part, with each q value from scaled_double (one exact multiply by 2^s)
// and k_mean from a double copy in shared memory. Inf/NaN elements count as zeros (in the mean
// too); a row that holds one, or that sees a key of the head's first bad one (kv_bad) or later,
// gets a NaN LSE shift, which the attention epilogue turns into a NaN row. Without smoothing the
// row's max |q| is taken on the raw bits (|x| orders as its bits do). The quantization skips
// quantize_bits' clamp and NaN test where neither can act: every |x - mean| of the group is at
// most its finite amax, so with a finite inv |y| <= qmax·(1+2^-24)^2 rounds into [-qmax, qmax],
// and no operand is NaN.
// (At D = 256, one CTA an SM: 128 registers for the row's 32 words.)
template <typename T, int D, int kBits, bool kVec, bool kSmooth>
__global__ void __launch_bounds__(512, D <= 128 ? 2 : 1)
    quant_q_kernel(const T* q, sage_strides qs, int dim, int heads_kv, int group_ratio, int64_t bq,
                   SeqRows q_rows, SeqRows kv_rows, SeqRows shift_rows, float scale,
                   const float* k_mean, const unsigned long long* kv_bad, RowSight sight,
                   bool bottom_right, uint8_t* qq, float* q_scale, float* q_mean,
                   float* lse_shift) {
  pdl_enter();
  constexpr float qmax = kBits == 8 ? float(kInt8Max) : float(kInt4Max);
  constexpr int kChunks = D / 32;
  __shared__ float mean[kSmooth ? D : 1];
  __shared__ __align__(16) double km_d[D];
  __shared__ float row_max[kBlockQ];
  const int64_t bh = cta_outer_index();
  if (bh >= bq) return;
  const BatchHead bhd = batch_head(bh, int64_t(heads_kv) * group_ratio);
  const int b = int(bhd.b), h = int(bhd.h);
  const int64_t qb = blockIdx.x;
  const int64_t r0 = qb * kBlockQ;
  // This sequence's query rows (a packed batch's sequence b: the grid covers the longest) and,
  // for a packed batch, the keys its rows see (its own length and causal alignment).
  const SeqSpan sq = q_rows.span(b);
  const int64_t seq_q = sq.len;
  if (r0 >= seq_q) return;
  if (q_rows.packed()) {
    const int64_t nk = kv_rows.span(b).len;
    sight.seq_kv = nk;
    sight.causal_offset = bottom_right ? nk - seq_q : 0;
  }
  const int64_t qrow0 = q_rows.row0(b, h, sq), srow0 = shift_rows.row0(b, h, sq);
  const int64_t bhk = int64_t(b) * heads_kv + h / group_ratio;
  const float* km = k_mean + bhk * D;
  const int r = threadIdx.x / 4, part = threadIdx.x % 4;
  const int64_t row = r0 + r;
  const bool valid = row < seq_q;
  uint4 raw[kChunks];
  for (int ci = 0; ci < kChunks; ++ci) {  // channels from dim to D: zeros (whole chunks)
    const int d0 = (ci * 4 + part) * 8;
    raw[ci] = make_uint4(0u, 0u, 0u, 0u);
    if (valid && d0 < dim) raw[ci] = load_raw8<kVec>(row_ptr(q, qs, b, h, sq.tok0 + row) + d0);
  }
  if (threadIdx.x < D) {
    const int c = threadIdx.x;
    km_d[c] = double(km[c]);
    if constexpr (kSmooth) {
      const int64_t r1 = min(seq_q, r0 + kBlockQ);
      double s = 0;
      for (int64_t rr = r0; rr < r1 && c < dim; ++rr) {  // a padded channel's mean is 0
        const float x = to_float(row_ptr(q, qs, b, h, sq.tok0 + rr)[c]);
        s += isfinite(x) ? double(x) : 0.0;
      }
      const float m = float(s / double(r1 - r0));
      q_mean[(qrow0 / kBlockQ + qb) * D + c] = m;
      mean[c] = m;
    }
  }
  __syncthreads();
  // x - mean, or x itself without smoothing (x - 0 is x, -0 included).
  auto centered = [&](float x, int c) { return kSmooth ? __fsub_rn(x, mean[c]) : x; };

  int row_bad = zero_special<T>(raw) != 0u;
  float amax = 0.0f;
  if constexpr (!kSmooth) {
    // max |x| on the bits: both halves of a word at once (unsigned 16-bit lanes).
    uint32_t m2 = 0u;
    for (int ci = 0; ci < kChunks; ++ci) {
      m2 = __vmaxu2(m2, raw[ci].x & 0x7FFF7FFFu);
      m2 = __vmaxu2(m2, raw[ci].y & 0x7FFF7FFFu);
      m2 = __vmaxu2(m2, raw[ci].z & 0x7FFF7FFFu);
      m2 = __vmaxu2(m2, raw[ci].w & 0x7FFF7FFFu);
    }
    amax = Bits<T>::to_float(max(m2 & 0xFFFFu, m2 >> 16));
  } else if (valid) {
    // Rows past seq_q stay out of the group max: their zeroed raw words centre to -mean, which
    // would otherwise set the scale of a group {g, g+8} shared with a valid row (the emulation
    // groups only rows < seq_q).
    for (int ci = 0; ci < kChunks; ++ci)
      for (int e = 0; e < 8; ++e) {
        const float x = elem_float<T>(raw[ci], e);
        amax = fmaxf(amax, fabsf(centered(x, (ci * 4 + part) * 8 + e)));
      }
  }
  double shift = 0;
  for (int ci = 0; ci < kChunks; ++ci) {
    const double2* kd = reinterpret_cast<const double2*>(&km_d[(ci * 4 + part) * 8]);
    for (int e2 = 0; e2 < 4; ++e2) {
      const double2 k2 = kd[e2];
      const uint32_t w = e2 == 0 ? raw[ci].x : e2 == 1 ? raw[ci].y : e2 == 2 ? raw[ci].z : raw[ci].w;
      const double lo = __dmul_rn(scaled_double_lo<T>(w), Bits<T>::kUnscale);
      const double hi = __dmul_rn(scaled_double_hi<T>(w), Bits<T>::kUnscale);
      shift = __fma_rn(lo, k2.x, shift);  // x·k_mean is exact
      shift = __fma_rn(hi, k2.y, shift);
    }
  }
  for (int m : {1, 2}) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
    shift += __shfl_xor_sync(0xffffffffu, shift, m);
    row_bad |= __shfl_xor_sync(0xffffffffu, row_bad, m);
  }
  if (part == 0) {
    row_max[r] = amax;
    if (valid)
      lse_shift[srow0 + row] =
          sight.poisoned(row, row_bad != 0, kv_bad[bhk]) ? __int_as_float(0x7FC00000)
                                                         : float(double(scale) * shift);
  }
  __syncthreads();
  amax = fmaxf(row_max[r], row_max[r ^ 8]);  // the group: rows {g, g+8} of a 16-row slice
  const QuantScale s = make_quant_scale(amax, qmax);
  if (part == 0 && r % 16 < 8)
    q_scale[(qrow0 / kBlockQ + qb) * kQGroups + (r / 16) * 8 + r % 8] = s.scale;
  const bool fast = finite_scale(amax, s.inv);
  const uint32_t keep = valid ? 0xFFFFFFFFu : 0u;
  quantize_store_row_part<T, D, kBits>(qq + (qrow0 + row) * (D * kBits / 8), raw,
                                       centered, part, s.inv, qmax, fast, keep);
}

template <typename T, int D>
cudaError_t launch_dim(const Plan& p, const PrepassInputs& in, uint8_t* ws, int device,
                       cudaStream_t st) {
  const T* q = static_cast<const T*>(in.q);
  const T* k = static_cast<const T*>(in.k);
  const T* v = static_cast<const T*>(in.v);
  const int64_t bk = p.batch * p.heads_kv, bq = p.batch * p.heads_q;
  const int heads_q = int(p.heads_q), heads_kv = int(p.heads_kv);
  // The caller's channels (<= D, a multiple of 8): the kernels read these and write the rest of
  // D as zero channels (layout.h, PrepassPlan::channels).
  const int dim = int(p.channels);
  // (blocks, batch·heads_kv over y and z: common/grid.h).
  auto kv_grid = [&](int64_t blocks) { return outer_dims(blocks, bk); };
  auto f32 = [&](size_t off) { return reinterpret_cast<float*>(ws + off); };
  KvStat* stats = reinterpret_cast<KvStat*>(ws + p.kv_stats);
  unsigned* tile_counter = reinterpret_cast<unsigned*>(ws + p.tile_counter);
  auto* kv_bad = reinterpret_cast<unsigned long long*>(ws + p.kv_bad);

  cudaError_t err = cudaSuccess;
  auto check = [&](cudaError_t e) {
    if (err == cudaSuccess) err = e;
  };
  // K and V: one launch (a cluster per head), or statistics, finalize and quantization.
  auto kv = [&](auto bits, auto vec) {
    constexpr int kBits = decltype(bits)::value;
    constexpr bool kVec = decltype(vec)::value;
    if constexpr (Stage<D>::kRows == kStatTokens) {  // (the planner plans none at D = 256)
      if (p.kv_cluster > 0) {
        constexpr auto kernel = kv_prepass_kernel<T, D, kBits, kVec>;
        check(set_max_dynamic_smem_once<kernel>(device, Stage<D>::kBytes));
        LaunchShape shape{kv_grid(p.stat_chunks), dim3(256), size_t(Stage<D>::kBytes)};
        shape.cluster = unsigned(p.kv_cluster);
        check(launch_pdl(kernel, shape, st, k, v, in.k_strides, in.v_strides, dim, p.heads_kv, bk,
                         p.kv_rows, p.k_mean_tokens, p.smooth_k, p.smooth_v, stats, f32(p.k_mean),
                         f32(p.v_mean), f32(p.v_scale), f32(p.v_inv), tile_counter, kv_bad,
                         ws + p.k, f32(p.k_scale), ws + p.v));
        return;
      }
    }
    constexpr auto stats_kernel = kv_stats_kernel<T, D, kVec>;
    check(set_max_dynamic_smem_once<stats_kernel>(device, Stage<D>::kBytes));
    check(launch_pdl(stats_kernel, {kv_grid(p.stat_chunks), dim3(256), size_t(Stage<D>::kBytes)},
                     st, k, v, in.k_strides, in.v_strides, dim, p.heads_kv, bk, p.kv_rows,
                     p.k_mean_tokens, stats));
    if (err != cudaSuccess) return;
    // A thread per channel, at most 128 (the kernel's bound; D = 256 loops twice). One CTA per
    // (sequence, KV head) along x (up to 2^31 - 1: the backend refuses more).
    check(launch_pdl(kv_finalize_kernel<D>, {dim3(unsigned(bk)), dim3(D < 128 ? D : 128)}, st,
                     stats, p.kv_rows, p.heads_kv, p.k_mean_tokens, p.smooth_k, p.smooth_v,
                     f32(p.k_mean), f32(p.v_mean), f32(p.v_scale), f32(p.v_inv), tile_counter,
                     kv_bad));
    if (err != cudaSuccess) return;
    check(launch_pdl(quant_kv_kernel<T, D, kBits, kVec>, {kv_grid(p.k_blocks), dim3(256)}, st, k, v,
                     in.k_strides, in.v_strides, dim, p.heads_kv, bk, p.kv_rows, f32(p.k_mean),
                     f32(p.v_mean), f32(p.v_inv), kv_bad, ws + p.k, f32(p.k_scale), ws + p.v));
  };
  auto quant = [&](auto bits, auto vkv, auto vq) {
    constexpr int kBits = decltype(bits)::value;
    kv(bits, vkv);
    if (err != cudaSuccess || !p.quantize_q) return;  // the sm90 kernel quantizes Q itself
    auto qk = p.smooth_q ? quant_q_kernel<T, D, kBits, decltype(vq)::value, true>
                         : quant_q_kernel<T, D, kBits, decltype(vq)::value, false>;
    check(launch_pdl(qk, {outer_dims(p.q_blocks, bq), dim3(512)}, st, q, in.q_strides, dim,
                     heads_kv, heads_q / heads_kv, bq, p.q_rows, p.kv_rows, p.shift_rows, in.scale,
                     f32(p.k_mean), kv_bad, in.sight, in.bottom_right, ws + p.q, f32(p.q_scale),
                     p.smooth_q ? f32(p.q_mean) : nullptr, f32(p.lse_shift)));
  };
  auto with_vec = [&](auto bits) {
    // The loads' width, as planned (PrepassPlan::vec_kv, vec_q).
    if (p.vec_kv && p.vec_q)
      quant(bits, std::true_type{}, std::true_type{});
    else if (p.vec_kv)
      quant(bits, std::true_type{}, std::false_type{});
    else if (p.vec_q)
      quant(bits, std::false_type{}, std::true_type{});
    else
      quant(bits, std::false_type{}, std::false_type{});
  };
  if (p.bits == 8)
    with_vec(std::integral_constant<int, 8>{});
  else
    with_vec(std::integral_constant<int, 4>{});
  return err;
}

template <typename T>
cudaError_t launch_all(const Plan& p, const PrepassInputs& in, uint8_t* ws, int device,
                       cudaStream_t st) {
  const cudaError_t e = p.head_dim == 64    ? launch_dim<T, 64>(p, in, ws, device, st)
                        : p.head_dim == 128 ? launch_dim<T, 128>(p, in, ws, device, st)
                                            : launch_dim<T, 256>(p, in, ws, device, st);
  const cudaError_t last = cudaGetLastError();  // also clears a launch error just returned
  return e != cudaSuccess ? e : last;
}

}  // namespace

int max_kv_cluster(int device) {
  // Portable clusters only: 16-CTA clusters (non-portable on the H100) measured slower than the
  // three launches at N = 2048 (docs/sm90-kernel.md, Tried 41). The largest instantiation
  // (D = 128: 70 KB of staged rows a CTA) decides for all.
  constexpr int kCluster = 8;
  constexpr auto kernel = kv_prepass_kernel<__half, 128, 8, true>;
  if (set_max_dynamic_smem_once<kernel>(device, Stage<128>::kBytes) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  LaunchShape shape{dim3(unsigned(kCluster)), dim3(256), size_t(Stage<128>::kBytes)};
  shape.cluster = unsigned(kCluster);
  cudaLaunchAttribute attr[2];
  const cudaLaunchConfig_t cfg = launch_config(shape, nullptr, attr);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess && clusters > 0)
    return kCluster;
  cudaGetLastError();
  return 0;
}

cudaError_t run_prepass(const Plan& plan, const PrepassInputs& in, uint8_t* workspace, int device,
                        cudaStream_t stream) {
  return in.dtype == SAGE_DTYPE_BF16
             ? launch_all<__nv_bfloat16>(plan, in, workspace, device, stream)
             : launch_all<__half>(plan, in, workspace, device, stream);
}

}  // namespace sage::quant
