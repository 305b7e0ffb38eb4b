// Host side of the forward-normalized backward: the caller's Q, dO, K and V as TMA maps, then
// rows_kernel, the main kernel and dq_store_kernel on the caller's stream (instantiated per head
// dim in backward_d*.cu).
#pragma once

#include <cuda_runtime.h>

#include "bwd/fn/kernel.cuh"
#include "bwd/fn/rows.cuh"
#include "common/grid.h"
#include "common/launch.h"
#include "common/tma_map.h"

namespace sage::bwd::fn {

// {D, rows, heads, batch} of 16-bit elements at `base` with element strides st, box {64, box_rows}.
inline cudaError_t make_map16(CUtensorMap* map, const void* base, int D, int64_t rows,
                              int64_t heads, int64_t batch, const sage_strides& st, int box_rows) {
  const cuuint64_t dims[4] = {cuuint64_t(D), cuuint64_t(rows), cuuint64_t(heads),
                              cuuint64_t(batch)};
  // A dimension of one takes any valid stride (TMA wants each a positive 16-byte multiple).
  auto stride = [](int64_t s, int64_t n) { return cuuint64_t(n == 1 || s == 0 ? 16 : s * 2); };
  const cuuint64_t strides[3] = {stride(st.token, rows), stride(st.head, heads),
                                 stride(st.batch, batch)};
  const cuuint32_t box[4] = {64, cuuint32_t(box_rows), 1, 1};
  return encode_tiled(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, base, dims, strides, box,
                      CU_TENSOR_MAP_SWIZZLE_128B);
}

template <typename T, int D>
cudaError_t run_typed(const Params& p, int device, cudaStream_t stream) {
  TmaMaps maps;
  cudaError_t e = make_map16(&maps.q, p.q, D, p.seq_q, p.heads_q, p.batch, p.q_st, kRows);
  if (e == cudaSuccess)
    e = make_map16(&maps.d_o, p.d_o, D, p.seq_q, p.heads_q, p.batch, p.do_st, kRows);
  if (e == cudaSuccess)
    e = make_map16(&maps.k, p.k, D, p.seq_kv, p.heads_kv, p.batch, p.k_st, kKeys);
  if (e == cudaSuccess)
    e = make_map16(&maps.v, p.v, D, p.seq_kv, p.heads_kv, p.batch, p.v_st, kKeys);
  if (e != cudaSuccess) return e;
  const int64_t bq = p.batch * p.heads_q, bk = p.batch * p.heads_kv;
  const dim3 q_grid = outer_dims(p.q_blocks, bq);
  rows_kernel<T, D><<<q_grid, kRowThreads, 0, stream>>>(p);
  constexpr int kSmem = Smem<D>::kBytes;
  const dim3 k_grid = outer_dims((p.seq_kv + kKeys - 1) / kKeys, bk);
  if (p.causal) {
    e = set_max_dynamic_smem_once<main_kernel<T, D, true>>(device, kSmem);
    if (e != cudaSuccess) return e;
    main_kernel<T, D, true><<<k_grid, kThreads, kSmem, stream>>>(p, maps);
  } else {
    e = set_max_dynamic_smem_once<main_kernel<T, D, false>>(device, kSmem);
    if (e != cudaSuccess) return e;
    main_kernel<T, D, false><<<k_grid, kThreads, kSmem, stream>>>(p, maps);
  }
  dq_store_kernel<T, D><<<q_grid, kRowThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <int D>
cudaError_t run(const Params& p, bool bf16, int device, cudaStream_t stream) {
  return bf16 ? run_typed<__nv_bfloat16, D>(p, device, stream)
              : run_typed<__half, D>(p, device, stream);
}

}  // namespace sage::bwd::fn
