// The sm90 launcher: builds the TMA descriptors of the pre-pass's Q, K and Vᵀ (driver entry point
// fetched through the runtime, so libsage links no libcuda) and launches one instantiation.
#pragma once

#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <tuple>

#include "attn/sm90/attention.cuh"
#include "attn/sm90/launch.h"
#include "common/launch.h"

// SAGE_SM90_PDL=0 (a measurement build) launches without programmatic dependent launch.
#ifndef SAGE_SM90_PDL
#define SAGE_SM90_PDL 1
#endif

namespace sage::sm90 {

inline PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      ptr = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// A tiled tensor map of `rank` dimensions (dims[0] contiguous, strides in bytes for the others),
// element strides 1, the given swizzle; reads past the tensor fill zeros.
inline cudaError_t encode_tiled(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank,
                                const void* base, const cuuint64_t* dims, const cuuint64_t* strides,
                                const cuuint32_t* box, CUtensorMapSwizzle swizzle) {
  const auto fn = encode_fn();
  if (!fn) return cudaErrorNotSupported;
  const cuuint32_t elem[5] = {1, 1, 1, 1, 1};
  const CUresult r = fn(map, type, rank, const_cast<void*>(base), dims, strides, box, elem,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

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

// fused_q: the caller's 16-bit Q as a 4-D map {D, Nq, Hq, B} (strides in elements, all positive
// and 16-byte multiples: cuda_backend checks) with box {D, rows, 1, 1} (a tile: 64 per consumer
// warpgroup), no swizzle; rows past Nq read as zeros.
inline cudaError_t make_q_in_map(CUtensorMap* map, const mma::AttnParams& p, int d, int rows) {
  const cuuint64_t dims[4] = {cuuint64_t(d), cuuint64_t(p.seq_q), cuuint64_t(p.heads_q),
                              cuuint64_t(p.batch)};
  const cuuint64_t strides[3] = {cuuint64_t(p.q_in_token) * 2, cuuint64_t(p.q_in_head) * 2,
                                 cuuint64_t(p.q_in_batch) * 2};
  const cuuint32_t box[4] = {cuuint32_t(d), cuuint32_t(rows), 1, 1};
  return encode_tiled(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, p.q_in, dims, strides, box,
                      CU_TENSOR_MAP_SWIZZLE_NONE);
}

#ifdef SAGE_SM90_TRACE
// The trace buffer (zeroed before each launch) and the per-phase mean cycles of the traced warps
// (blocks 4 .. the last traced; tiles 1 .. kTraceTiles-2), printed on the third launch of each
// (D, mask, Nk) so the caches and clocks are warm.
inline uint32_t* trace_buffer() {
  static uint32_t* buf = [] {
    void* ptr = nullptr;
    return cudaMalloc(&ptr, kTraceWords * 4) == cudaSuccess ? static_cast<uint32_t*>(ptr) : nullptr;
  }();
  if (buf) cudaMemset(buf, 0, kTraceWords * 4);
  return buf;
}
inline void print_trace(const uint32_t* dev, int d, bool causal, int64_t seq_kv) {
  static std::map<std::tuple<int, bool, int64_t>, int> calls;
  if (++calls[{d, causal, seq_kv}] != 3) return;
  static uint32_t all[kTraceWords];
  const cudaError_t se = cudaDeviceSynchronize();
  const cudaError_t ce =
      dev ? cudaMemcpy(all, dev, sizeof all, cudaMemcpyDeviceToHost) : cudaErrorMemoryAllocation;
  if (se != cudaSuccess || ce != cudaSuccess) {
    std::fprintf(stderr, "[trace] read failed: %s / %s\n", cudaGetErrorString(se),
                 cudaGetErrorString(ce));
    return;
  }
  auto ev = [&](int c, int w, int kb) {
    return all + ((c * kTraceWarps + w) * kTraceBlocks + kb) * kTraceEvents;
  };
  auto tev = [&](int c, int w, int it) {
    return all + kTraceCtas * kTraceWarps * kTraceBlocks * kTraceEvents +
           ((c * kTraceWarps + w) * kTraceTiles + it) * kTileEvents;
  };
  const int nb = int(std::min<int64_t>(kTraceBlocks, (seq_kv + kBlockK - 1) / kBlockK - 1));
  const char* names[7] = {"seed+wait K+QK issue",
                          "wait V+PV issue",
                          "wait QK",
                          "softmax",
                          "wait PV",
                          "rescale+pack",
                          "step"};
  double sum[7] = {};
  int n = 0;
  for (int c = 0; c < kTraceCtas; ++c)
    for (int w = 0; w < kTraceWarps; ++w)
      for (int kb = 4; kb < nb; ++kb) {
        const uint32_t* e = ev(c, w, kb);
        if (e[6] == 0) continue;
        for (int i = 0; i < 6; ++i) sum[i] += double(e[i + 1] - e[i]);
        sum[6] += double(e[6] - e[0]);
        ++n;
      }
  std::fprintf(stderr, "[trace] D=%d causal=%d Nk=%lld, mean cycles over %d warp-blocks:", d,
               int(causal), (long long)seq_kv, n);
  for (int i = 0; i < 7; ++i) std::fprintf(stderr, " %s %.0f;", names[i], n ? sum[i] / n : 0.0);
  std::fprintf(stderr, "\n");
  const char* tnames[7] = {"gap from last epilogue", "read tile", "wait Q",  "block 0",
                           "blocks 1..n-1",          "last PV",   "epilogue"};
  double ts[7] = {};
  int tn = 0;
  for (int c = 0; c < kTraceCtas; ++c)
    for (int w = 0; w < kTraceWarps; ++w)
      for (int it = 1; it < kTraceTiles - 1; ++it) {
        const uint32_t *e = tev(c, w, it), *prev = tev(c, w, it - 1);
        if (e[6] == 0 || prev[6] == 0) continue;
        ts[0] += double(e[0] - prev[6]);
        for (int i = 1; i < 7; ++i) ts[i] += double(e[i] - e[i - 1]);
        ++tn;
      }
  std::fprintf(stderr, "[trace] tiles, mean cycles over %d warp-tiles:", tn);
  for (int i = 0; i < 7; ++i) std::fprintf(stderr, " %s %.0f;", tnames[i], tn ? ts[i] / tn : 0.0);
  for (int w : {0, 4}) {
    std::fprintf(stderr, "\n[trace] tile 0, CTA 0 warp %d:", w);
    const uint32_t* e = tev(0, w, 0);
    for (int i = 1; i < 7; ++i) std::fprintf(stderr, " %s %d;", tnames[i], int(e[i] - e[i - 1]));
  }
  std::fprintf(stderr, "\n");
}
#endif

template <int D, typename OutT, bool kCausal, int kCons>
cudaError_t launch_one(const mma::AttnParams& p, const TmaMaps& maps, cudaStream_t stream) {
  using Sm = Smem<D, kCons>;
  const int smem = p.fused_q ? Sm::kBytesFused : Sm::kBytes;
  auto kernel = attention_kernel<D, OutT, kCausal, kCons>;
  const cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Sm::kBytesFused);
  if (e != cudaSuccess) return e;
  // Persistent: one CTA per SM (at most one per tile), each walking its tiles (attention.cuh).
  const int64_t tiles =
      (p.seq_q + Cfg<kCons>::kBlockQ - 1) / Cfg<kCons>::kBlockQ * p.batch * p.heads_q;
  if (tiles <= 0) return cudaSuccess;
  int sms = 0, device = 0;
  cudaError_t e2 = cudaGetDevice(&device);
  if (e2 == cudaSuccess) e2 = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e2 != cudaSuccess) return e2;
  // Programmatic dependent launch: the CTAs may start (barrier set-up) while the pre-pass's last
  // kernel drains; griddepcontrol.wait in the kernel holds every global read until it is done.
  const cudaError_t le = launch_pdl(kernel,
                                    {dim3(unsigned(std::min<int64_t>(tiles, sms))),
                                     dim3(Cfg<kCons>::kThreads), size_t(smem), SAGE_SM90_PDL != 0},
                                    stream, p, maps);
  if (le != cudaSuccess) return le;
#ifdef SAGE_SM90_TRACE
  print_trace(maps.trace, D, kCausal, p.seq_kv);
#endif
  return cudaGetLastError();
}

template <int D, int kCons>
cudaError_t launch_with(const mma::AttnParams& p, bool bf16_out, bool causal, cudaStream_t stream) {
  TmaMaps maps;
#ifdef SAGE_SM90_TRACE
  maps.trace = trace_buffer();
#endif
  const uint64_t bk = uint64_t(p.batch * p.heads_kv), nk = uint64_t(p.nk_pad);
  const uint64_t bq = uint64_t(p.batch * p.heads_q), nq = uint64_t(p.nq_pad);
  cudaError_t e = p.fused_q ? make_q_in_map(&maps.q_in, p, D, Cfg<kCons>::kBlockQ)
                            : make_map(&maps.q, p.q, D, nq, bq, D, nq * D, D, mma::kBlockQ);
  if (e == cudaSuccess) e = make_map(&maps.k, p.k, D, nk, bk, D, nk * D, D, kBlockK);
  if (e == cudaSuccess) e = make_map(&maps.v, p.v, nk, D, bk, nk, nk * D, kBlockK, D);
  if (e != cudaSuccess) return e;
  if (bf16_out)
    return causal ? launch_one<D, __nv_bfloat16, true, kCons>(p, maps, stream)
                  : launch_one<D, __nv_bfloat16, false, kCons>(p, maps, stream);
  return causal ? launch_one<D, __half, true, kCons>(p, maps, stream)
                : launch_one<D, __half, false, kCons>(p, maps, stream);
}

// Three consumer warpgroups for D = 64 with fused Q (their 192-row tiles have no pre-pass Q
// layout), except causal with fewer than 2048 query rows: there the 192-row tiles lost (H100,
// one call, kernel-only, causal 1k 173 vs 187 TOPS) while three won everywhere else (non-causal
// 4k 484 vs 424, 16k 550 vs 474; causal 4k 392 vs 380, 16k 517 vs 465).
// SAGE_SM90_THREE_WG=0 (a measurement build) keeps two everywhere.
#ifndef SAGE_SM90_THREE_WG
#define SAGE_SM90_THREE_WG 1
#endif
template <int D>
cudaError_t launch_attention(const mma::AttnParams& p, bool bf16_out, bool causal,
                             cudaStream_t stream) {
  if constexpr (D == 64 && SAGE_SM90_THREE_WG != 0) {
    if (p.fused_q && !(causal && p.seq_q < 2048))
      return launch_with<D, 3>(p, bf16_out, causal, stream);
  }
  return launch_with<D, 2>(p, bf16_out, causal, stream);
}

}  // namespace sage::sm90
