// Staging K/V rows in shared memory: kv_stats stages the rows its statistics read; the
// one-launch kv_prepass keeps the whole chunk staged through statistics and quantization; the
// staged quant_kv stages 64-key blocks, the next block's copies in flight while it quantizes one.
// (Included only by quant/prepass.cu, the pre-pass's one translation unit: the code sits in
// that file's anonymous namespace, so the kernels stay internal to it.)
#pragma once

#include "ptx/async.cuh"
#include "quant/prepass/common.cuh"

namespace sage::quant {
namespace {

// Rows of a chunk sit at a pitch of 2·D + 16 bytes (the 16 spread the rows that quant_kv_block's
// V groups read together over the banks: at most two-way conflicts), K rows then V rows. At
// D = 256 a stage holds half a chunk (66 KB; a whole one, 132 KB, exceeds the 99 KB a CTA may
// have on sm_89 and sm_120): kv_stats stages and sums a chunk in two parts, and the one-launch
// kv_prepass, which keeps a whole chunk staged, is planned for D <= 128 only. The staged
// quant_kv's stage is a 64-key block (Stage<D, kBlockK>).
template <int D, int kRowsN = D <= 128 ? kStatTokens : kStatTokens / 2>
struct Stage {
  static constexpr int kPitch = 2 * D + 16;
  static constexpr int kRows = kRowsN;                // rows a stage holds
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

// Issues the copies of rows n0 + r (r < S::kRows) of K and V into stage S at smem: V's every
// row, K's every row when all_k, else only the rows the K mean samples (n % k_stride == 0); rows
// past `rows` (the sequence's end) are zero-filled, and so are the channels from `dim` (the
// caller's head dim) to D. 256 threads: D/8 lanes a row, each a 16-byte piece (wholly inside dim:
// a multiple of 8). With kVec the copies are cp.async, not yet committed: the caller commits and
// waits (stage_rows, or the staged quant_kv's pipeline), then meets the CTA at a barrier before
// reading; the zero fills are plain stores, visible after that barrier too.
template <typename T, int D, bool kVec, typename S = Stage<D>>
__device__ __forceinline__ void issue_rows(const T* k, const T* v, const sage_strides& ks,
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
  uint32_t residue = all_k ? 0u : uint32_t((n0 + r) % int64_t(k_stride));
  const uint32_t residue_step = all_k ? 0u : uint32_t(kRowStep) % k_stride;
  for (; r < S::kRows; r += kRowStep) {
    uint8_t* kd = smem + r * S::kPitch + piece * 16;
    uint8_t* vd = kd + S::kV;
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
}

// Stages the chunk's rows (issue_rows into Stage<D>) and waits for them: on return every thread
// may read them.
template <typename T, int D, bool kVec>
__device__ __forceinline__ void stage_rows(const T* k, const T* v, const sage_strides& ks,
                                           const sage_strides& vs, int dim, int b, int h,
                                           int64_t tok0, int64_t n0, int rows, uint32_t k_stride,
                                           bool all_k, uint8_t* smem) {
  issue_rows<T, D, kVec>(k, v, ks, vs, dim, b, h, tok0, n0, rows, k_stride, all_k, smem);
  if constexpr (kVec) {
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
  }
  __syncthreads();
}

}  // namespace
}  // namespace sage::quant
