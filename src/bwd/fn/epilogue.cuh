// The epilogue of the forward-normalized backward's main kernel. Per query block, a warpgroup's
// dQ panel (64 queries x 64 channels) into the workspace's fp32 accumulator: staged in shared
// memory in dq_acc's own layout (dq_offset), each warp's 16 rows 4 KB in one piece, added by one
// bulk reduction a warp. At the end, dK (times the softmax scale) and dV in the caller's dtype
// and strides.
#pragma once

#include "bwd/fn/mainloop.cuh"
#include "ptx/atomic.cuh"
#include "ptx/tma.cuh"

namespace sage::bwd::fn {

template <typename T, int D, bool kCausal>
struct Epilogue {
  using S = Smem<D>;
  const Params& p;
  uint8_t* const smem;

  __device__ void dq(const BlockWalk& walk, const Mainloop<T, D, kCausal>& m) const {
    if (!m.has_dq()) return;
    float* dq_s = reinterpret_cast<float*>(smem + S::kDq + m.wg * S::kDqPanel);
    const int qa = 16 * m.warp + m.g;           // this thread's rows of the block: qa and qa + 8
    if (m.lane == 0) ptx::bulk_wait_read<0>();  // the last reduction has read this warp's rows
    __syncwarp();
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      const int d = 8 * n + 2 * m.t;
      *reinterpret_cast<float2*>(dq_s + qa * 64 + dq_col(qa, d)) =
          make_float2(m.dq[4 * n], m.dq[4 * n + 1]);
      *reinterpret_cast<float2*>(dq_s + (qa + 8) * 64 + dq_col(qa + 8, d)) =
          make_float2(m.dq[4 * n + 2], m.dq[4 * n + 3]);
    }
    ptx::fence_proxy_async_smem();
    __syncwarp();
    if (m.lane == 0) {
      const int64_t row = int64_t(walk.qb) * kRows + 16 * m.warp;
      ptx::bulk_reduce_add(p.dq_acc + walk.bh * p.nq_pad * D + dq_offset(row, 64 * m.wg, D),
                           dq_s + 16 * m.warp * 64, 16 * 64 * 4);
      ptx::bulk_commit();
    }
  }

  // After the last block: the reductions done, then dK and dV out (zeros for keys no query saw).
  __device__ void dk_dv(const CtaWork& w, const Mainloop<T, D, kCausal>& m) const {
    if (m.lane == 0) ptx::bulk_wait<0>();
    T* dkp = static_cast<T*>(p.dk) + w.b * p.dk_st.batch + w.hkv * p.dk_st.head;
    T* dvp = static_cast<T*>(p.dv) + w.b * p.dv_st.batch + w.hkv * p.dv_st.head;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t key = m.key_a + 8 * r;
      if (key >= p.seq_kv) continue;
#pragma unroll
      for (int h = 0; h < S::kPanels; ++h)
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          const int d = 64 * h + 8 * n + 2 * m.t, i = 4 * n + 2 * r;
          dkp[key * p.dk_st.token + d] = T(m.dk[h][i] * p.scale);
          dkp[key * p.dk_st.token + d + 1] = T(m.dk[h][i + 1] * p.scale);
          dvp[key * p.dv_st.token + d] = T(m.dv[h][i]);
          dvp[key * p.dv_st.token + d + 1] = T(m.dv[h][i + 1]);
        }
    }
  }
};

}  // namespace sage::bwd::fn
