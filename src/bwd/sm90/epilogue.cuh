// The epilogue of SageBwd's Hopper main kernel. Per query block, dQ += dS^·K^ into the
// workspace's fp32 accumulator: one 64-channel panel at a time, staged in shared memory in
// dq_acc's own layout (dq_offset), each warp's 16 rows of a panel 4 KB in one piece there and in
// dq_acc, added by one bulk reduction a warp, or in deterministic mode by plain adds on this
// CTA's turn (dq_order.cuh). A warp touches only its own rows of the staging panel. At the end,
// dK (times the softmax scale) and dV in the caller's dtype and strides.
#pragma once

#include "bwd/dq_order.cuh"
#include "bwd/params.h"
#include "bwd/sm90/mainloop.cuh"
#include "bwd/sm90/scheduler.cuh"
#include "bwd/sm90/smem.h"
#include "common/fragment.cuh"
#include "ptx/async.cuh"
#include "ptx/atomic.cuh"
#include "ptx/tma.cuh"

namespace sage::bwd::sm90 {

template <typename T, int D, bool kCausal>
struct Epilogue {
  using S = Smem<D>;
  const MainParams& p;
  uint8_t* const smem;
  const CtaWork& w;

  __device__ void dq(const Block& b, const Mainloop<T, D, kCausal>& m) const {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
    const int qa = warp * 16 + lane / 4;  // this thread's rows of the block: qa and qa + 8
    const float* qpsi_s = reinterpret_cast<const float*>(smem + S::kQpsi);
    const float sa = qpsi_s[qa] * m.k_scale, sb = qpsi_s[qa + 8] * m.k_scale;
    float* dq_s = reinterpret_cast<float*>(smem + S::kDq);
    const TileTurn turn{p.dq_turn, int(b.bh * p.q_blocks + b.qb), int(w.kb)};
    if (p.deterministic) turn.wait(/*leader=*/threadIdx.x == 0);
#pragma unroll
    for (int h = 0; h < D / 64; ++h) {
      int acc[32];
      m.dq_product(h, acc);
      if (lane == 0) ptx::bulk_wait_read<0>();  // the last reduction has read this warp's rows
      __syncwarp();
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const int d = Frag::pair(n, t);
        *reinterpret_cast<float2*>(dq_s + qa * 64 + dq_col(qa, d)) =
            make_float2(float(acc[Frag::reg(n, 0)]) * sa, float(acc[Frag::reg(n, 1)]) * sa);
        *reinterpret_cast<float2*>(dq_s + (qa + 8) * 64 + dq_col(qa + 8, d)) =
            make_float2(float(acc[Frag::reg(n, 2)]) * sb, float(acc[Frag::reg(n, 3)]) * sb);
      }
      const float* rows_s = dq_s + warp * 16 * 64;
      float* rows_g = p.dq_acc + b.bh * p.nq_pad * D + dq_offset(b.i0 + warp * 16, h * 64, D);
      __syncwarp();
      if (p.deterministic) {
#pragma unroll 4
        for (int i = 2 * lane; i < 16 * 64; i += 64)
          turn.add2(rows_g + i, rows_s[i], rows_s[i + 1]);
        __syncwarp();  // every lane has read its values before the next panel's stores
      } else {
        ptx::fence_proxy_async_smem();
        __syncwarp();
        if (lane == 0) {
          ptx::bulk_reduce_add(rows_g, rows_s, 16 * 64 * 4);
          ptx::bulk_commit();
        }
      }
    }
    if (p.deterministic) turn.pass(/*leader=*/threadIdx.x == 0);
  }

  // After the last block: the bulk reductions done, then dK and dV out.
  __device__ void dk_dv(const Mainloop<T, D, kCausal>& m) const {
    if (threadIdx.x % 32 == 0) ptx::bulk_wait<0>();
    ptx::cp_async_wait<0>();
    T* dkp = static_cast<T*>(p.dk) + w.b * p.dk_st.batch + w.hkv * p.dk_st.head;
    T* dvp = static_cast<T*>(p.dv) + w.b * p.dv_st.batch + w.hkv * p.dv_st.head;
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t key = half == 0 ? m.key_a : m.key_b;
      if (key >= p.seq_kv) continue;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const int d = Frag::pair(n, t), i = Frag::reg(n, 2 * half);
        dkp[key * p.dk_st.token + d] = T(m.dk[i] * p.scale);
        dkp[key * p.dk_st.token + d + 1] = T(m.dk[i + 1] * p.scale);
        dvp[key * p.dv_st.token + d] = T(m.dv_at(i));
        dvp[key * p.dv_st.token + d + 1] = T(m.dv_at(i + 1));
      }
    }
  }
};

}  // namespace sage::bwd::sm90
