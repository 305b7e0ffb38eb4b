// A consumer warpgroup of the forward-normalized backward's main kernel: 64 of the CTA's keys as
// the M rows of its products (thread (warp, g, t) holds keys 16·warp + g and + 8). Per query block
// of 64:
//   Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (both operands K-major in shared memory), one batch
//   Pᵀ = 2^(Sᵀ·scale·log2 e - L) (masked), dSᵀ = Pᵀ∘(dPᵀ - D), each rounded to the dtype as the
//     A fragments of the next products (the accumulator's layout is the 16-bit A fragment's)
//   dV += Pᵀ·dO and dK += dSᵀ·Q (A from registers, B MN-major: the stage's own Q and dO), and
//     dSᵀ into shared memory
//   dQ = dS·K over the CTA's 128 keys for one 64-channel panel a warpgroup (both warpgroups' dSᵀ,
//     M-major, and K, N-major), into the workspace's accumulator (epilogue.cuh).
// dV and dK accumulate in place in fp32 registers over every block: no scale changes along a sum.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "bwd/fn/scheduler.cuh"
#include "bwd/fn/smem.h"
#include "bwd/sm90/smem.h"  // swz
#include "ptx/barrier.cuh"
#include "ptx/math.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"

namespace sage::bwd::fn {

template <typename T, int D, bool kCausal>
struct Mainloop {
  using S = Smem<D>;
  static constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  static constexpr int kP = S::kPanels;
  const Params& p;
  Barriers& bar;
  uint8_t* const smem;
  const int wg, warp, lane, g, t;  // consumer warpgroup (0, 1), its warp, lane = 4g + t
  const int64_t key_a;             // this thread's keys: key_a and key_a + 8
  float dk[kP][32], dv[kP][32];    // [channel panel][accumulator]
  float dq[32];                    // the block's dQ panel (warpgroups 0 .. kP - 1)
  const uint64_t desc0;            // the descriptor of the tile at smem's first byte

  __device__ Mainloop(const Params& params, Barriers& b, uint8_t* sm, const CtaWork& w)
      : p(params),
        bar(b),
        smem(sm),
        wg(threadIdx.x / 128 - 1),
        warp(threadIdx.x / 32 % 4),
        lane(threadIdx.x % 32),
        g(threadIdx.x % 32 / 4),
        t(threadIdx.x % 4),
        key_a(w.k0 + 64 * (threadIdx.x / 128 - 1) + 16 * (threadIdx.x / 32 % 4) +
              threadIdx.x % 32 / 4),
        desc0(ptx::wgmma_desc<128>(sm)) {
#pragma unroll
    for (int h = 0; h < kP; ++h)
#pragma unroll
      for (int i = 0; i < 32; ++i) dk[h][i] = dv[h][i] = 0.0f;
  }

  // Whether this warpgroup computes a dQ panel (panel wg): both at D = 128 (known at compile
  // time, so that dQ's accumulator is not live across blocks), the first at D = 64.
  __device__ __forceinline__ bool has_dq() const {
    return kP == 2 || wg == 0;
  }

  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    if constexpr (kBf16) {
      const __nv_bfloat162 x = __floats2bfloat162_rn(lo, hi);
      return *reinterpret_cast<const uint32_t*>(&x);
    } else {
      const __half2 x = __floats2half2_rn(lo, hi);
      return *reinterpret_cast<const uint32_t*>(&x);
    }
  }
  static __device__ __forceinline__ void mma_ss(float (&d)[32], uint64_t a, uint64_t b, bool acc) {
    if constexpr (kBf16)
      ptx::wgmma_m64n64k16_bf16_ss(d, a, b, acc);
    else
      ptx::wgmma_m64n64k16_f16_ss(d, a, b, acc);
  }
  static __device__ __forceinline__ void mma_rs_mn(float (&d)[32], const uint32_t (&a)[4],
                                                   uint64_t b) {
    if constexpr (kBf16)
      ptx::wgmma_m64n64k16_bf16_rs_mn(d, a, b, true);
    else
      ptx::wgmma_m64n64k16_f16_rs_mn(d, a, b, true);
  }
  static __device__ __forceinline__ void mma_ss_mn(float (&d)[32], uint64_t a, uint64_t b,
                                                   bool acc) {
    if constexpr (kBf16)
      ptx::wgmma_m64n64k16_bf16_ss_mn(d, a, b, acc);
    else
      ptx::wgmma_m64n64k16_f16_ss_mn(d, a, b, acc);
  }
  // The descriptor of the 128-byte-swizzled tile at byte `offset` of the CTA's shared memory:
  // the base's descriptor once, each operand's a constant or a stage's offset added (the start
  // address is its low field, in 16-byte units: every offset here is a multiple of 16 and the
  // sum stays inside the field).
  __device__ __forceinline__ uint64_t desc(int offset) const {
    return desc0 + uint64_t(offset >> 4);
  }

  // Query block `walk` (the it-th of the CTA): every product but the dQ store (epilogue.cuh).
  __device__ void block(const BlockWalk& walk, int64_t it) {
    const int s = int(it & 1);
    const int64_t i0 = int64_t(walk.qb) * kRows;
    ptx::mbar_wait(&bar.full[s], uint32_t((it >> 1) & 1));

    // The block's operand descriptors; each product's steps add compile-time offsets.
    const uint64_t k_d = desc(S::kK + wg * 64 * 128), v_d = desc(S::kV + wg * 64 * 128);
    const uint64_t q_d = desc(S::q_stage(s)), do_d = desc(S::do_stage(s));
    const auto at = [](int offset) { return uint64_t(offset >> 4); };
    float x[32], dp[32];
    ptx::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
      mma_ss(x, k_d + at((ks / 4) * S::kKeyPanel + (ks % 4) * 32),
             q_d + at((ks / 4) * S::kRowPanel + (ks % 4) * 32), ks > 0);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
      mma_ss(dp, v_d + at((ks / 4) * S::kKeyPanel + (ks % 4) * 32),
             do_d + at((ks / 4) * S::kRowPanel + (ks % 4) * 32), ks > 0);
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    ptx::wgmma_fence_regs(x);
    ptx::wgmma_fence_regs(dp);

    // Pᵀ and dSᵀ = Pᵀ∘(dPᵀ - D) (p_and_ds). A block every one of whose queries sees every key
    // of this warpgroup (the usual one: away from the causal diagonal and the Nk edge) skips the
    // mask's compares.
    const float* rows_s = reinterpret_cast<const float*>(smem + S::lse_stage(s)) + 2 * t;
    const int64_t last_key = key_a - 16 * warp - g + 63;  // this warpgroup's last key
    uint32_t pf[4][4], sf[4][4];
    if (last_key < p.seq_kv && (!kCausal || i0 + p.causal_offset >= last_key)) {
      p_and_ds<false>(x, dp, rows_s, i0, pf, sf);
    } else {
      p_and_ds<true>(x, dp, rows_s, i0, pf, sf);
    }

    // dV += Pᵀ·dO and dK += dSᵀ·Q over the block's 64 queries (four k16 steps, 16 rows each of
    // the MN-major B: the stage's own dO and Q), one 64-channel panel an instruction.
    ptx::wgmma_fence();
#pragma unroll
    for (int h = 0; h < kP; ++h)
#pragma unroll
      for (int j = 0; j < 4; ++j) mma_rs_mn(dv[h], pf[j], do_d + at(h * S::kRowPanel + j * 2048));
#pragma unroll
    for (int h = 0; h < kP; ++h)
#pragma unroll
      for (int j = 0; j < 4; ++j) mma_rs_mn(dk[h], sf[j], q_d + at(h * S::kRowPanel + j * 2048));
    ptx::wgmma_commit();

    // dSᵀ into shared memory, [key][query] in 128-byte swizzled rows (this warpgroup's 64 rows of
    // the block's tile): registers (j, r) hold query columns 16j + 8(r >> 1) + 2t, +1 of row
    // g + 8(r & 1).
    const int ds = S::kDs + int(it & 1) * S::kDsTile;
    const int row = 64 * wg + 16 * warp + g;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        *reinterpret_cast<uint32_t*>(
            smem + ds + sm90::swz<128>(row + 8 * (r & 1), 2 * (16 * j + 8 * (r >> 1) + 2 * t))) =
            sf[j][r];
    ptx::fence_proxy_async_smem();
    ptx::named_bar_sync(1, 256);  // both warpgroups' dSᵀ are in

    // dQ's panel wg = dS·K over the CTA's 128 keys (eight k16 steps of 16 keys).
    if (has_dq()) {
      const uint64_t ds_d = desc(ds), kq_d = desc(S::kK + wg * S::kKeyPanel);
      ptx::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kKeys / 16; ++ks)
        mma_ss_mn(dq, ds_d + at(ks * 2048), kq_d + at(ks * 2048), ks > 0);
      ptx::wgmma_commit();
    }
    ptx::wgmma_wait<0>();
#pragma unroll
    for (int h = 0; h < kP; ++h) {
      ptx::wgmma_fence_regs(dv[h]);
      ptx::wgmma_fence_regs(dk[h]);
    }
    ptx::wgmma_fence_regs(dq);
    // Every thread releases its own reads of the stage's L and D (an arrive releases only the
    // arriving thread's accesses).
    ptx::mbar_arrive(&bar.empty[s]);
  }

  // Pᵀ and dSᵀ = Pᵀ∘(dPᵀ - D) of the block, each pair of a row rounded to the dtype at once as the
  // A fragments of dV's and dK's products (the accumulator's layout is the 16-bit A fragment's:
  // registers (j, r) hold columns 16j + 8(r >> 1) + 2t, +1 of row g + 8(r & 1)). kMasked: key r
  // is seen by the block's query column c only when it is a key of the call and, causal,
  // i0 + c + offset >= key; rows past Nq have L = +inf (P = 0) either way.
  template <bool kMasked>
  __device__ __forceinline__ void p_and_ds(const float (&x)[32], const float (&dp)[32],
                                           const float* rows_s, int64_t i0, uint32_t (&pf)[4][4],
                                           uint32_t (&sf)[4][4]) const {
    int first[2] = {0, 0};
    if constexpr (kMasked) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t key = key_a + 8 * r;
        const int64_t f = key >= p.seq_kv ? kRows : (kCausal ? key - p.causal_offset - i0 : 0);
        first[r] = int(min(int64_t(kRows), max(int64_t(0), f)));
      }
    }
    const float c2 = p.scale_log2;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int n = 2 * j + (r >> 1), i = 8 * j + 2 * r, c = 8 * n + 2 * t;
        const float2 l = *reinterpret_cast<const float2*>(rows_s + 8 * n);          // L
        const float2 d = *reinterpret_cast<const float2*>(rows_s + kRows + 8 * n);  // D
        float p0 = ptx::ex2(__fmaf_rn(x[i], c2, -l.x)),
              p1 = ptx::ex2(__fmaf_rn(x[i + 1], c2, -l.y));
        if constexpr (kMasked) {
          const int f = first[r & 1];
          p0 = c >= f ? p0 : 0.0f;
          p1 = c + 1 >= f ? p1 : 0.0f;
        }
        pf[j][r] = pack(p0, p1);
        sf[j][r] = pack(p0 * (dp[i] - d.x), p1 * (dp[i + 1] - d.y));
      }
  }
};

}  // namespace sage::bwd::fn
