// The planner: validated arguments plus the device's properties in, one plan out — the kernel
// family, its tile configuration, the pre-pass steps and the workspace layout, the crossover hint
// for the SDPA drop-in, and the config whose CPU emulation computes what the call runs. The one
// place a GPU kernel is chosen; the launchers carry the plan out and decide nothing. Host C++
// (no CUDA), so the CPU tests check it with described devices.
#pragma once

#include "api/backend.h"
#include "attn/sm90/split.h"
#include "bwd/fn/params.h"
#include "bwd/params.h"
#include "fp4/layout.h"
#include "quant/layout.h"
#include "sage/sage.h"

namespace sage::api {

// The GPU a call runs on, as the planner needs it (cuda_backend.cu queries it once per device).
struct Device {
  int index = 0;
  int cc = 0;   // compute capability, major·10 + minor
  int sms = 0;  // multiprocessors
  int kv_cluster = 0;  // the largest cluster K/V's one-launch pre-pass runs with (0: none)
  int mem_bus_bits = 0;  // the memory bus width (bits): tells an H100 SXM from an H200 (0: unknown)
  int staged_kv_ctas = 0;  // CTAs of the staged K/V quantization (D = 64) an SM holds (0: none)
};

enum class Family { kMma, kSm90, kFp4 };

struct Plan {
  Family family = Family::kMma;
  // The workspace layout and the pre-pass's steps (total: the size); prepass.head_dim is the
  // kernel's native head dim (64, 128 or 256), prepass.channels the caller's (zero-padded up to
  // it).
  quant::PrepassPlan prepass;
  fp4::Layout fp4;             // kFp4: its own workspace layout (prepass.total is its size)
  int block_q = 0, block_k = 0;
  int consumers = 0;       // sm90: consumer warpgroups (tile rows = 64 · consumers)
  bool fused_q = false;    // sm90: Q quantized inside the kernel (no quant_q launch)
  sm90::SplitTail split;   // sm90: the last round's tiles shared among the CTAs (tiles 0: none)
  bool two_level = false;  // mma: P·V in a fresh accumulator per key block, added into fp32
  bool prefer_sdpa = false;
  bool prefer_sdpa_training = false;
  int64_t sdpa_below = 0;     // sdpa_below(dev): any call with a length under it prefers SDPA
  bool has_backward = false;  // the GPU backward takes this call's head dim
  int launches = 0;        // kernels launched per call
  sage_quant_config emulation{};
};

// Plans a CUDA call (r.backend == CUDA): SAGE_ERROR_UNSUPPORTED, with a message naming the
// argument, where no kernel takes the arguments on this device.
sage_status make_plan(const Resolved& r, const sage_attention_args& a, const Device& dev,
                      Plan* plan);

// What the crossover model reads of a call beyond its lengths: its batch, heads and the
// kernel's query tile (the sm90 plan's block_q).
struct CallShape {
  int64_t batch = 1;
  int64_t heads_q = 1;
  int64_t heads_kv = 1;
  int block_q = 128;
};

// The crossover model: true where a dense fp16 SDPA (cuDNN) is predicted faster than this
// library's call of this shape at this (kernel, native) head dim and mask on this GPU; fitted to
// measurements (src/api/crossover_model.inc, tools/crossover.py). Architectures without
// measurements (no row: Ada, Blackwell): true (see plan.cpp).
bool prefer_sdpa(const Device& dev, int64_t head_dim, sage_mask mask, int64_t seq_q,
                 int64_t seq_kv, bool training = false, CallShape shape = {});

// The least length from which prefer_sdpa can route a forward call on this GPU to the library:
// every call whose query or key length is under it prefers SDPA, whatever its batch, heads, head
// dim and mask (on an architecture without measurements: every length, INT64_MAX).
int64_t sdpa_below(const Device& dev);

// A CUDA backward call's plan: the main kernel's family (the stats pass, pre-pass, dQ store and
// verdict are the same for both), the workspace layout, and the launches.
struct BackwardPlan {
  Family family = Family::kMma;  // kSm90: the wgmma main kernel; kMma: the mma.sync one
  // The forward-normalized 16-bit backward (config.normalizer SAGE_BWD_NORM_FORWARD, no INT8
  // product; sm_90a): its workspace is fn_layout, and layout is unused.
  bool forward_normalized = false;
  bwd::Layout layout;            // the workspace (layout.total bytes)
  bwd::fn::Layout fn_layout;
  int launches = 0;              // kernels launched per call
  size_t workspace() const { return forward_normalized ? fn_layout.total : layout.total; }
};

// Plans a CUDA backward (r.backend == CUDA): SAGE_ERROR_UNSUPPORTED, naming the argument, where
// no GPU kernel computes it on this device. (The grid limit on batch·heads is the backend's.)
sage_status make_backward_plan(const ResolvedBackward& r, const sage_backward_args& a,
                               const Device& dev, BackwardPlan* plan);

// The public description of a plan (sage_plan_info).
void describe(const Plan& plan, sage_plan_info* info);

}  // namespace sage::api
