// The sm90 launcher: builds the TMA descriptors of the pre-pass's Q, K and Vᵀ and of the caller's
// Q (the driver entry point is fetched through the runtime, so libsage links no libcuda) and
// launches the instantiation the plan names, persistent, as a programmatic dependent.
#pragma once

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "attn/sm90/kernel.cuh"
#include "attn/sm90/launch.h"
#include "attn/sm90/trace.cuh"
#include "common/launch.h"
#include "common/tma_map.h"

namespace sage::sm90 {

// A 3-D uint8 tensor map {d0 (contiguous), d1, d2} with byte strides s1, s2 and box {b0, b1, 1},
// swizzled as the wgmma operands want it (128-byte rows: 128-byte swizzle, else 64-byte).
inline cudaError_t make_map(CUtensorMap* map, const void* base, uint64_t d0, uint64_t d1,
                            uint64_t d2, uint64_t s1, uint64_t s2, uint32_t b0, uint32_t b1) {
  const cuuint64_t dims[3] = {d0, d1, d2};
  const cuuint64_t strides[2] = {s1, s2};
  const cuuint32_t box[3] = {b0, b1, 1};
  return encode_tiled(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, base, dims, strides, box,
                      b0 == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B);
}

// fused_q: the caller's 16-bit Q as a 4-D map {head_dim, Nq, Hq, B} (strides in elements, all
// positive and 16-byte multiples, as TMA requires: the planner checks; the inner extent head_dim
// has no rule of its own, and a multiple of 8 keeps a contiguous Q's strides 16-byte multiples in
// either layout, NHD's head stride being head_dim) with box {d, rows, 1, 1} (d: the kernel's head
// dim; a tile: 64 rows per consumer warpgroup), no swizzle. Elements past the tensor read as
// zeros (CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) and count in the box's bytes like the others: rows
// past Nq, and channels past a padded head_dim (< d), which the quantization then takes as the
// zero channels the pre-pass writes for K and V.
// A packed batch: {head_dim, total_q, Hq, 1} (its batch stride 0 stands in as the total's
// extent: any valid stride serves a dimension of one), each tile's rows from its sequence's first
// token; rows past a sequence's end that lie inside the tensor are the next sequence's, zeroed by
// the quantization (producer.cuh).
inline cudaError_t make_q_in_map(CUtensorMap* map, const Params& p, int d, int rows) {
  const bool packed = p.q_rows.packed();
  const cuuint64_t dims[4] = {cuuint64_t(p.head_dim),
                              cuuint64_t(packed ? p.q_rows.total : p.seq_q),
                              cuuint64_t(p.heads_q), cuuint64_t(packed ? 1 : p.batch)};
  const cuuint64_t strides[3] = {
      cuuint64_t(p.q_in_token) * 2, cuuint64_t(p.q_in_head) * 2,
      cuuint64_t(packed ? p.q_in_token * p.q_rows.total : p.q_in_batch) * 2};
  const cuuint32_t box[4] = {cuuint32_t(d), cuuint32_t(rows), 1, 1};
  return encode_tiled(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, p.q_in, dims, strides, box,
                      CU_TENSOR_MAP_SWIZZLE_NONE);
}

template <int D, typename OutT, bool kCausal, int kCons, bool kPacked, bool kSplit = false>
cudaError_t launch_one(const Params& p, const TmaMaps& maps, const LaunchConfig& cfg,
                       cudaStream_t stream) {
  using Tr = Traits<D, kCons>;
  constexpr auto kernel = attention_kernel<D, OutT, kCausal, kCons, kPacked, kSplit>;
  const cudaError_t e = set_max_dynamic_smem_once<kernel>(cfg.device, Tr::kBytesFused);
  if (e != cudaSuccess) return e;
  // Persistent: one CTA per SM (at most one per tile, or as many as share the split tail),
  // each walking its tiles (scheduler.cuh).
  const int64_t tiles = (p.seq_q + Tr::kBlockQ - 1) / Tr::kBlockQ * p.batch * p.heads_q;
  if (tiles <= 0) return cudaSuccess;
  const int64_t grid = std::max(std::min<int64_t>(tiles, cfg.sms), kSplit ? p.split_ctas : 0);
  // Programmatic dependent launch: the CTAs may start (barrier set-up) while the pre-pass's last
  // kernel drains; griddepcontrol.wait in the kernel holds every global read until it is done.
  const LaunchShape shape{dim3(unsigned(grid)), dim3(Tr::kThreads),
                          size_t(p.fused_q ? Tr::kBytesFused : Tr::kBytes)};
  const cudaError_t le = launch_pdl(kernel, shape, stream, p, maps);
  if (le != cudaSuccess) return le;
#ifdef SAGE_SM90_TRACE
  print_trace(maps.trace, D, kCausal, p.seq_kv, Tr::kBlockK);
#endif
  return cudaGetLastError();
}

template <int D, int kCons>
cudaError_t launch_with(const Params& p, const LaunchConfig& cfg, cudaStream_t stream) {
  using Tr = Traits<D, kCons>;
  TmaMaps maps;
#ifdef SAGE_SM90_TRACE
  maps.trace = trace_buffer();
#endif
  // K and Vᵀ slabs: a dense call's (batch, KV head) of nk_pad rows, or a packed batch's KV head
  // of kv_rows.pitch rows (every sequence's, each from a 128-aligned row: quant/layout.h).
  const bool packed = p.kv_rows.packed();
  const uint64_t bk = uint64_t(packed ? p.heads_kv : p.batch * p.heads_kv);
  const uint64_t nk = uint64_t(packed ? p.kv_rows.pitch : p.nk_pad);
  const uint64_t bq = uint64_t(p.batch * p.heads_q), nq = uint64_t(p.nq_pad);
  // Q and K rows as boxes of kRowBytes columns (D = 256: two panels, producer.cuh load_rows).
  cudaError_t e = p.fused_q
                      ? make_q_in_map(&maps.q_in, p, D, Tr::kBlockQ)
                      : make_map(&maps.q, p.q, D, nq, bq, D, nq * D, Tr::kRowBytes, quant::kBlockQ);
  if (e == cudaSuccess)
    e = make_map(&maps.k, p.k, D, nk, bk, D, nk * D, Tr::kRowBytes, Tr::kBlockK);
  if (e == cudaSuccess) e = make_map(&maps.v, p.v, nk, D, bk, nk, nk * D, Tr::kBlockK, D);
  if (e != cudaSuccess) return e;
  // (out: a null pointer of the output type, selecting it)
  auto run_typed = [&](auto packed_flag, auto* out) {
    constexpr bool kPacked = decltype(packed_flag)::value;
    using OutT = std::remove_pointer_t<decltype(out)>;
    if (cfg.causal) return launch_one<D, OutT, true, kCons, kPacked>(p, maps, cfg, stream);
    // The split tail's instantiations (dense, non-causal) where the plan splits: the others'
    // code stays as it was.
    if (!kPacked && p.split_tiles > 0)
      return launch_one<D, OutT, false, kCons, false, true>(p, maps, cfg, stream);
    return launch_one<D, OutT, false, kCons, kPacked>(p, maps, cfg, stream);
  };
  auto run = [&](auto packed_flag) {
    return cfg.bf16 ? run_typed(packed_flag, static_cast<__nv_bfloat16*>(nullptr))
                    : run_typed(packed_flag, static_cast<__half*>(nullptr));
  };
  // A packed batch: its own instantiations (kPacked), two consumer warpgroups only (the planner's
  // choice for it: fewer instantiations).
  if (packed) {
    if constexpr (kCons == 2) return run(std::true_type{});
    return cudaErrorInvalidConfiguration;
  }
  return run(std::false_type{});
}

template <int D>
cudaError_t launch_attention(const Params& p, const LaunchConfig& cfg, cudaStream_t stream) {
  if constexpr (D == 64) {
    if (cfg.consumers == 3) return launch_with<D, 3>(p, cfg, stream);
  }
  if (cfg.consumers != 2) return cudaErrorInvalidConfiguration;
  return launch_with<D, 2>(p, cfg, stream);
}

}  // namespace sage::sm90
