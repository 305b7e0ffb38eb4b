// The epilogue of the forward-normalized backward's main kernel. Per query block, a warpgroup's
// dQ panel (64 queries x 64 channels) into the workspace's fp32 accumulator: staged in shared
// memory in dq_acc's own layout (dq_offset), each warp's 16 rows 4 KB in one piece, added by one
// bulk reduction a warp. At the end, dK (times the softmax scale) and dV in the caller's dtype
// and strides.
#pragma once

#include "bwd/fn/mainloop.cuh"
#include "ptx/atomic.cuh"
#include "ptx/barrier.cuh"
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

  // After the last block: the reductions done, then dK (times the softmax scale) and dV out,
  // zeros for keys no query saw. Each goes through shared memory (the warpgroup's own Q and dO
  // stage, free once both warpgroups are done) so that a warp writes whole 16-byte pieces of
  // rows; where the caller's rows are not 16-byte aligned, pairs straight from the registers.
  __device__ void dk_dv(const CtaWork& w, const Mainloop<T, D, kCausal>& m) const {
    if (m.lane == 0) ptx::bulk_wait<0>();
    T* dkp = static_cast<T*>(p.dk) + w.b * p.dk_st.batch + w.hkv * p.dk_st.head;
    T* dvp = static_cast<T*>(p.dv) + w.b * p.dv_st.batch + w.hkv * p.dv_st.head;
    const bool aligned =
        reinterpret_cast<uintptr_t>(dkp) % 16 == 0 && reinterpret_cast<uintptr_t>(dvp) % 16 == 0 &&
        (p.dk_st.token * sizeof(T)) % 16 == 0 && (p.dv_st.token * sizeof(T)) % 16 == 0;
    if (!aligned) {
      store_pairs(dkp, p.dk_st.token, m.dk, p.scale, m);
      store_pairs(dvp, p.dv_st.token, m.dv, 1.0f, m);
      return;
    }
    // Both warpgroups read the last block's stage: each has waited for its own products, and
    // after this barrier for the other's too (the producer loads nothing more).
    ptx::named_bar_sync(1, 256);
    uint8_t* const ks = smem + S::q_stage(m.wg);  // 64 keys x D of the dtype, each
    uint8_t* const vs = smem + S::do_stage(m.wg);
    stage(ks, m.dk, p.scale, m);
    stage(vs, m.dv, 1.0f, m);
    ptx::named_bar_sync(2 + m.wg, 128);  // the warpgroup's rows are staged (ids 2, 3: 1 is the
                                         // loop's)
    constexpr int kChunks = D * 2 / 16;  // 16-byte pieces a row
    const int tid = threadIdx.x % 128;
#pragma unroll
    for (int j = 0; j < 64 * kChunks / 128; ++j) {
      const int i = j * 128 + tid, r = i / kChunks, c = i % kChunks;
      const int64_t key = w.k0 + 64 * m.wg + r;
      if (key >= p.seq_kv) continue;
      const int at = r * D * 2 + ((c ^ (r & 7)) << 4);
      *reinterpret_cast<uint4*>(dkp + key * p.dk_st.token + c * 8) =
          *reinterpret_cast<const uint4*>(ks + at);
      *reinterpret_cast<uint4*>(dvp + key * p.dv_st.token + c * 8) =
          *reinterpret_cast<const uint4*>(vs + at);
    }
  }

 private:
  // A thread's pairs of an accumulator (times s, in the dtype) into a warpgroup's [64][D] rows in
  // shared memory, each row's 16-byte pieces XORed with row % 8 (the warp's eight rows a store
  // fall in distinct banks).
  __device__ void stage(uint8_t* rows, const float (&x)[S::kPanels][32], float s,
                        const Mainloop<T, D, kCausal>& m) const {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 16 * m.warp + m.g + 8 * r;
#pragma unroll
      for (int h = 0; h < S::kPanels; ++h)
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          const int d = 64 * h + 8 * n + 2 * m.t, i = 4 * n + 2 * r;
          const int at = row * D * 2 + (((d >> 3) ^ (row & 7)) << 4) + (d & 7) * 2;
          *reinterpret_cast<uint32_t*>(rows + at) =
              Mainloop<T, D, kCausal>::pack(x[h][i] * s, x[h][i + 1] * s);
        }
    }
  }
  // The same pairs straight to global memory, two elements at a time.
  __device__ void store_pairs(T* out, int64_t token, const float (&x)[S::kPanels][32], float s,
                              const Mainloop<T, D, kCausal>& m) const {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t key = m.key_a + 8 * r;
      if (key >= p.seq_kv) continue;
#pragma unroll
      for (int h = 0; h < S::kPanels; ++h)
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          const int d = 64 * h + 8 * n + 2 * m.t, i = 4 * n + 2 * r;
          out[key * token + d] = T(x[h][i] * s);
          out[key * token + d + 1] = T(x[h][i + 1] * s);
        }
    }
  }
};

}  // namespace sage::bwd::fn
