// The seam between the validated C API and the backends: the resolved arguments, and the CUDA
// backend's entry points (implemented in cuda_backend.cu, or by a stub when built without CUDA).
// Host code; any architecture.
#pragma once

#include <string>

#include "ref/reference.h"
#include "sage/sage.h"

namespace sage::api {

// Head dims. Any call takes 1..kMaxHeadDim, the largest head dim a GPU kernel is planned for
// (32, 64, 80, 96, 128, 256): the CPU reference, the oracle, covers every kernel to come (and
// the odd sizes tests use), but nothing larger than any GPU kernel will take. The GPU runs the
// head dims it has a kernel for and refuses the others (UNSUPPORTED), naming these lists.
constexpr int64_t kMaxHeadDim = 256;
// The forward kernels are compiled for the native head dims 64, 128 and 256; a head dim that is a
// multiple of 8 from 8 to 256 runs at the smallest of them that holds it, the channels past it
// zero (the pre-pass writes them so; plan.h says why that computes the call exactly). 0: no forward
// kernel. Multiples of 8 (SD 1.x's 40, 80, 160; DiT's and PixArt's 72): every read the kernels
// make of a caller's row is a piece of 4 or 8 elements starting at a multiple of its size (the
// pre-pass's loads and staging, a D = 256 V slice of 16 read as two pieces of 8, the mma kernel's
// ΔS), so a piece is wholly inside the real channels or wholly past them, and fused Q's TMA map
// has head_dim as its inner extent (zeros past it); head_dim·2 bytes, a multiple of 16, keeps a
// contiguous tensor's rows 16-byte aligned (vector loads, the TMA map's strides); the epilogues
// store channel pairs below head_dim. Nothing fails below 32: 8..24 run the D = 64 kernel.
constexpr int64_t gpu_kernel_head_dim(int64_t d) {
  return d < 8 || d > 256 || d % 8 != 0 ? 0 : (d <= 64 ? 64 : d <= 128 ? 128 : 256);
}
constexpr bool gpu_has_head_dim(int64_t d) { return gpu_kernel_head_dim(d) != 0; }
constexpr char kGpuHeadDims[] = "multiples of 8 from 8 to 256";
// The sm90 (wgmma) kernel's native head dims: 64, 128 and 256 (and the dims padded to them).
constexpr bool sm90_has_kernel_head_dim(int64_t dk) {
  return dk == 64 || dk == 128 || dk == 256;
}
// The backward kernels take their native head dims only (no zero padding there yet).
constexpr bool gpu_backward_has_head_dim(int64_t d) { return d == 64 || d == 128; }
constexpr char kGpuBackwardHeadDims[] = "64, 128";

// sage_attention_args after validation: defaults filled in, strides resolved, preset expanded.
struct Resolved {
  ref::Problem problem;
  sage_quant_config quant{};
  bool exact = false;  // SAGE_VARIANT_EXACT: no quantization at all
  sage_backend backend = SAGE_BACKEND_CPU;
  sage_strides q{}, k{}, v{}, o{}, lse{};
  // Packed variable-length batch (sage_attention_args.cu_seqlens_*): problem.batch sequences,
  // problem.seq_q / seq_kv their longest lengths; NULL for a dense call.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  int64_t total_q = 0, total_k = 0;
  bool packed() const { return cu_seqlens_q != nullptr; }
};

// Checks everything about `args` and fills `out`; on failure records a message naming the
// argument and returns its status. Touches no tensor memory; on the CPU backend it reads a packed
// batch's cu_seqlens (host memory, and the extents the reference will index by).
sage_status validate(const sage_attention_args* args, Resolved* out);

// sage_backward_args after validation.
struct ResolvedBackward {
  ref::Problem problem;
  sage_backward_config config{};
  bool exact = false;  // SAGE_VARIANT_EXACT: float64, CPU only
  sage_backend backend = SAGE_BACKEND_CPU;
  sage_strides q{}, k{}, v{}, o{}, lse{}, d_o{}, dlse{}, dq{}, dk{}, dv{};
};
sage_status validate_backward(const sage_backward_args* args, ResolvedBackward* out);

}  // namespace sage::api

namespace sage::cuda {

enum class PointerKind { kHost, kDevice };

// Where a pointer lives (kHost when built without CUDA or when no driver answers).
PointerKind pointer_kind(const void* ptr);
// One line per visible GPU (name, compute capability, memory), or one line saying in plain words
// why there is none (no driver, an old driver, no device, a build without CUDA).
std::string describe_devices(bool* has_gpu);

sage_status workspace_size(const api::Resolved& r, const sage_attention_args& args, size_t* bytes);
sage_status plan_info(const api::Resolved& r, const sage_attention_args& args, sage_plan_info* info);
sage_status attention(const api::Resolved& r, const sage_attention_args& args);
sage_status backward_workspace_size(const api::ResolvedBackward& r,
                                    const sage_backward_args& args, size_t* bytes);
sage_status backward(const api::ResolvedBackward& r, const sage_backward_args& args);

// The two stages of a GPU call, separately (the benchmark's kernel-only figure): the pre-pass
// writes the workspace, the kernel reads it. attention() runs both.
constexpr int kStagePrepass = 1, kStageKernel = 2;
sage_status attention_stages(const api::Resolved& r, const sage_attention_args& args, int stages);

}  // namespace sage::cuda
