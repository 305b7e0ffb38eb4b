// The forward-normalized backward's two small kernels, a CTA per (64-row block, query head):
// rows_kernel before the main kernel (each row's L = LSE·log2 e and D = rowsum(dO∘O) - g from the
// forward, +inf and 0 for a row that sees no key or lies past Nq; the block's dQ accumulator
// zeroed), dq_store_kernel after it (dQ = scale·acc in the caller's dtype and strides).
#pragma once

#include "bwd/fn/params.h"
#include "common/grid.h"

namespace sage::bwd::fn {

constexpr int kRowThreads = 256;

template <typename T, int D>
__global__ void __launch_bounds__(kRowThreads) rows_kernel(const Params p) {
  const int64_t bh = cta_outer_index();
  if (bh >= p.batch * p.heads_q) return;
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
  const int r = threadIdx.x / 4, part = threadIdx.x % 4;  // four threads a row
  const int64_t i = int64_t(blockIdx.x) * kRows + r;
  const bool live = i < p.seq_q && p.sees_key(i);
  float s = 0.0f;
  if (live) {
    const T* o = static_cast<const T*>(p.o) + b * p.o_st.batch + h * p.o_st.head + i * p.o_st.token;
    const T* d_o =
        static_cast<const T*>(p.d_o) + b * p.do_st.batch + h * p.do_st.head + i * p.do_st.token;
    for (int d = part; d < D; d += 4) s = __fmaf_rn(float(o[d]), float(d_o[d]), s);
  }
  s += __shfl_xor_sync(0xFFFFFFFFu, s, 1);
  s += __shfl_xor_sync(0xFFFFFFFFu, s, 2);
  if (part == 0) {
    float l2 = __int_as_float(0x7F800000), delta = 0.0f;
    if (live) {
      const float lse = p.lse[b * p.lse_st.batch + h * p.lse_st.head + i * p.lse_st.token];
      l2 = float(double(lse) * 1.4426950408889634);
      const float g =
          p.d_lse ? p.d_lse[b * p.dlse_st.batch + h * p.dlse_st.head + i * p.dlse_st.token] : 0.0f;
      delta = s - g;
    }
    p.lse2[bh * p.nq_pad + i] = l2;
    p.delta[bh * p.nq_pad + i] = delta;
  }
  // The block's D / 64 panels of dq_acc are one contiguous piece (dq_offset).
  float4* acc =
      reinterpret_cast<float4*>(p.dq_acc + bh * p.nq_pad * D + int64_t(blockIdx.x) * kRows * D);
  for (int j = threadIdx.x; j < kRows * D / 4; j += kRowThreads) acc[j] = make_float4(0, 0, 0, 0);
}

template <typename T, int D>
__global__ void __launch_bounds__(kRowThreads) dq_store_kernel(const Params p) {
  const int64_t bh = cta_outer_index();
  if (bh >= p.batch * p.heads_q) return;
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
  const float* acc = p.dq_acc + bh * p.nq_pad * D;
  T* dq = static_cast<T*>(p.dq) + b * p.dq_st.batch + h * p.dq_st.head;
  for (int j = threadIdx.x; j < kRows * D / 2; j += kRowThreads) {
    const int64_t i = int64_t(blockIdx.x) * kRows + j / (D / 2);
    const int d = 2 * (j % (D / 2));
    if (i >= p.seq_q) continue;
    const float2 x = *reinterpret_cast<const float2*>(acc + dq_offset(i, d, D));
    dq[i * p.dq_st.token + d] = T(x.x * p.scale);
    dq[i * p.dq_st.token + d + 1] = T(x.y * p.scale);
  }
}

}  // namespace sage::bwd::fn
