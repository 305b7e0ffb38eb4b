// Argument validation for sage_attention(): the one place where user input is checked. Every
// failure names the argument and its value. Host code; any architecture.
#include <algorithm>
#include <cinttypes>
#include <cmath>

#include "api/backend.h"
#include "common/error.h"

namespace sage::api {
namespace {

using i128 = __int128;

int64_t dtype_size(sage_dtype d) {
  return d == SAGE_DTYPE_FP32 ? 4 : 2;
}

struct Dim {
  int64_t size, stride;
};

// Largest element offset reached by a tensor with these dims (plus a contiguous inner dim of
// `inner` elements), or -1 when it does not fit in int64.
int64_t max_offset(const Dim* dims, int n, int64_t inner) {
  i128 off = inner - 1;
  for (int i = 0; i < n; ++i) off += i128(dims[i].size - 1) * dims[i].stride;
  return off > i128(INT64_MAX) ? -1 : int64_t(off);
}

// True when no two index tuples share an element: sorted by stride, each dimension must step
// past everything the inner ones reach.
bool distinct_elements(Dim* dims, int n, int64_t inner) {
  std::sort(dims, dims + n, [](const Dim& a, const Dim& b) { return a.stride < b.stride; });
  i128 reach = inner;  // elements spanned so far
  for (int i = 0; i < n; ++i) {
    if (dims[i].size <= 1) continue;
    if (i128(dims[i].stride) < reach) return false;
    reach = i128(dims[i].stride) * (dims[i].size - 1) + reach;
  }
  return true;
}

struct Range {
  const char* name;
  uintptr_t lo, hi;  // [lo, hi)
};

// `layout` gives the default (contiguous) strides; the LSE is always [B, H, N] (pass HND, inner 1).
sage_status check_tensor(const char* name, const void* ptr, sage_strides* strides,
                         sage_layout layout, int64_t heads, int64_t seq, int64_t batch,
                         int64_t inner, int64_t elem_size, bool written, Range* range) {
  SAGE_CHECK_ARG(ptr != nullptr, "%s is NULL", name);
  SAGE_CHECK_ARG(reinterpret_cast<uintptr_t>(ptr) % uintptr_t(elem_size) == 0,
                 "%s = %p is not aligned to its element size (%" PRId64 " bytes)", name, ptr,
                 elem_size);
  if (strides->batch == 0 && strides->head == 0 && strides->token == 0) {
    // Checked before the strides are computed, so that computing them cannot overflow.
    SAGE_CHECK_ARG(i128(batch) * heads * seq * inner <= i128(INT64_MAX / elem_size),
                   "%s: %" PRId64 " x %" PRId64 " x %" PRId64 " x %" PRId64
                   " elements overflow a 64-bit offset",
                   name, batch, heads, seq, inner);
    *strides = ref::contiguous_strides(layout, heads, seq, inner);
  }
  SAGE_CHECK_ARG(strides->batch >= 0 && strides->head >= 0 && strides->token >= 0,
                 "%s_strides = {batch %" PRId64 ", head %" PRId64 ", token %" PRId64
                 "}: strides must be >= 0",
                 name, strides->batch, strides->head, strides->token);
  Dim dims[3] = {{batch, strides->batch}, {heads, strides->head}, {seq, strides->token}};
  const int64_t last = max_offset(dims, 3, inner);
  SAGE_CHECK_ARG(last >= 0 && last < INT64_MAX / elem_size,
                 "%s: the strides {%" PRId64 ", %" PRId64 ", %" PRId64
                 "} with these sizes overflow a 64-bit offset",
                 name, strides->batch, strides->head, strides->token);
  if (written)
    SAGE_CHECK_ARG(distinct_elements(dims, 3, inner),
                   "%s_strides = {batch %" PRId64 ", head %" PRId64 ", token %" PRId64
                   "} make elements of %s overlap (an output needs distinct elements; the "
                   "token stride must be >= %" PRId64 ")",
                   name, strides->batch, strides->head, strides->token, name, inner);
  const uintptr_t lo = reinterpret_cast<uintptr_t>(ptr);
  *range = {name, lo, lo + uintptr_t((last + 1) * elem_size)};
  return SAGE_OK;
}

bool overlap(const Range& a, const Range& b) {
  return a.lo < b.hi && b.lo < a.hi;
}

// A kernel family names GPU kernels: refused where the resolved backend is the CPU reference.
template <typename Args>
sage_status check_kernel_backend(const Args& a, sage_backend resolved) {
  SAGE_CHECK_ARG(resolved == SAGE_BACKEND_CUDA || a.kernel == SAGE_KERNEL_AUTO,
                 "kernel = %" PRId64 " chooses a GPU kernel, but the backend is the CPU reference",
                 enum_value(a.kernel));
  return SAGE_OK;
}

// The checks the forward and backward arguments share: enums, sizes, scale, threads.
template <typename Args>
sage_status check_common(const Args& a) {
  const int64_t dtype = enum_value(a.dtype), layout = enum_value(a.layout),
                mask = enum_value(a.mask), variant = enum_value(a.variant),
                backend = enum_value(a.backend), kernel = enum_value(a.kernel);
  SAGE_CHECK_ARG(kernel >= SAGE_KERNEL_AUTO && kernel <= SAGE_KERNEL_SM90,
                 "kernel = %" PRId64 " is unknown", kernel);
  SAGE_CHECK_ARG(dtype >= SAGE_DTYPE_FP16 && dtype <= SAGE_DTYPE_FP32,
                 "dtype = %" PRId64 " is unknown", dtype);
  SAGE_CHECK_ARG(layout == SAGE_LAYOUT_HND || layout == SAGE_LAYOUT_NHD,
                 "layout = %" PRId64 " is unknown", layout);
  SAGE_CHECK_ARG(mask >= SAGE_MASK_NONE && mask <= SAGE_MASK_CAUSAL_TOP_LEFT,
                 "mask = %" PRId64 " is unknown", mask);
  SAGE_CHECK_ARG(variant >= SAGE_VARIANT_AUTO && variant <= SAGE_VARIANT_SAGE3_FP4,
                 "variant = %" PRId64 " is unknown", variant);
  SAGE_CHECK_ARG(backend >= SAGE_BACKEND_AUTO && backend <= SAGE_BACKEND_CUDA,
                 "backend = %" PRId64 " is unknown", backend);
  SAGE_CHECK_ARG(a.batch >= 1, "batch = %" PRId64 " must be >= 1", a.batch);
  SAGE_CHECK_ARG(a.heads_q >= 1, "heads_q = %" PRId64 " must be >= 1", a.heads_q);
  SAGE_CHECK_ARG(a.heads_kv >= 1, "heads_kv = %" PRId64 " must be >= 1", a.heads_kv);
  SAGE_CHECK_ARG(a.heads_q % a.heads_kv == 0,
                 "heads_q = %" PRId64 " is not a multiple of heads_kv = %" PRId64 " (GQA)",
                 a.heads_q, a.heads_kv);
  SAGE_CHECK_ARG(a.seq_q >= 1, "seq_q = %" PRId64 " must be >= 1", a.seq_q);
  SAGE_CHECK_ARG(a.seq_kv >= 1, "seq_kv = %" PRId64 " must be >= 1", a.seq_kv);
  SAGE_CHECK_ARG(a.head_dim >= 1 && a.head_dim <= kMaxHeadDim,
                 "head_dim = %" PRId64 " is outside 1..%" PRId64
                 " (GPU kernels: %s; the backward's: %s)",
                 a.head_dim, kMaxHeadDim, kGpuHeadDims, kGpuBackwardHeadDims);
  SAGE_CHECK_ARG(std::isfinite(a.scale), "scale = %g is not finite", double(a.scale));
  SAGE_CHECK_ARG(a.num_threads >= 0, "num_threads = %d must be >= 0", int(a.num_threads));
  return SAGE_OK;
}

template <typename Args>
ref::Problem problem_of(const Args& a) {
  return {a.batch,
          a.heads_q,
          a.heads_kv,
          a.seq_q,
          a.seq_kv,
          a.head_dim,
          a.scale != 0.0f ? double(a.scale) : 1.0 / std::sqrt(double(a.head_dim)),
          a.mask};
}

// The backend: where the pointers live decides AUTO; an explicit choice must match them.
// (One query a pointer: each is a driver call, part of every call's host time.)
sage_status resolve_backend(sage_backend requested, const void* const* ptrs,
                            const char* const* names, int n, sage_backend* out) {
  bool on_device[16] = {};
  for (int i = 0; i < n; ++i)
    on_device[i] = ptrs[i] && cuda::pointer_kind(ptrs[i]) == cuda::PointerKind::kDevice;
  const sage_backend want = requested == SAGE_BACKEND_AUTO
                                ? (on_device[0] ? SAGE_BACKEND_CUDA : SAGE_BACKEND_CPU)
                                : requested;
  for (int i = 0; i < n; ++i) {
    if (!ptrs[i]) continue;
    SAGE_CHECK_ARG(on_device[i] == (want == SAGE_BACKEND_CUDA),
                   "%s = %p is %s memory but the backend is %s (all pointers must be on the "
                   "backend's side)",
                   names[i], ptrs[i], on_device[i] ? "device" : "host",
                   want == SAGE_BACKEND_CUDA ? "CUDA" : "the CPU reference");
  }
  *out = want;
  return SAGE_OK;
}

// A packed batch's arguments that need no memory read: both cu_seqlens or neither, the
// token-major layout, the totals, no batch strides (the sequences are found by cu_seqlens).
sage_status check_packed(const sage_attention_args& a) {
  SAGE_CHECK_ARG(a.cu_seqlens_q && a.cu_seqlens_k,
                 "%s is NULL but %s = %p is set: a packed batch needs both cu_seqlens_q and "
                 "cu_seqlens_k",
                 a.cu_seqlens_q ? "cu_seqlens_k" : "cu_seqlens_q",
                 a.cu_seqlens_q ? "cu_seqlens_q" : "cu_seqlens_k",
                 a.cu_seqlens_q ? static_cast<const void*>(a.cu_seqlens_q)
                                : static_cast<const void*>(a.cu_seqlens_k));
  for (const int32_t* cu : {a.cu_seqlens_q, a.cu_seqlens_k})
    SAGE_CHECK_ARG(reinterpret_cast<uintptr_t>(cu) % alignof(int32_t) == 0,
                   "%s = %p is not aligned to int32", cu == a.cu_seqlens_q ? "cu_seqlens_q"
                                                                            : "cu_seqlens_k",
                   static_cast<const void*>(cu));
  SAGE_CHECK_ARG(a.layout == SAGE_LAYOUT_NHD,
                 "layout = HND, but a packed batch (cu_seqlens_q) is token-major: layout must be "
                 "NHD ([total_q, Hq, D])");
  SAGE_CHECK_ARG(a.total_q >= 1, "total_q = %" PRId64 " must be >= 1 (packed batch)", a.total_q);
  SAGE_CHECK_ARG(a.total_k >= 1, "total_k = %" PRId64 " must be >= 1 (packed batch)", a.total_k);
  SAGE_CHECK_ARG(a.batch < INT32_MAX, "batch = %" PRId64 " sequences: cu_seqlens are int32",
                 a.batch);
  const struct {
    const char* name;
    const sage_strides& s;
  } strides[] = {{"q_strides", a.q_strides}, {"k_strides", a.k_strides},
                 {"v_strides", a.v_strides}, {"o_strides", a.o_strides},
                 {"lse_strides", a.lse_strides}};
  for (const auto& t : strides)
    SAGE_CHECK_ARG(t.s.batch == 0,
                   "%s.batch = %" PRId64 ": a packed batch has no batch dimension (sequences are "
                   "located by cu_seqlens), it must be 0",
                   t.name, t.s.batch);
  return SAGE_OK;
}

// The contents of host cu_seqlens (the CPU backend): FlashAttention's conventions, and every
// sequence within the declared longest length (the reference sizes its scratch by it).
sage_status check_cu_seqlens(const char* name, const int32_t* cu, int64_t batch,
                             const char* total_name, int64_t total, const char* max_name,
                             int64_t max_len) {
  SAGE_CHECK_ARG(cu[0] == 0, "%s[0] = %d: cumulative lengths start at 0", name, int(cu[0]));
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = int64_t(cu[b + 1]) - cu[b];
    SAGE_CHECK_ARG(len >= 0,
                   "%s[%" PRId64 "] = %d < %s[%" PRId64
                   "] = %d: cumulative lengths must be non-decreasing",
                   name, b + 1, int(cu[b + 1]), name, b, int(cu[b]));
    SAGE_CHECK_ARG(len <= max_len,
                   "%s: sequence %" PRId64 " has %" PRId64 " tokens, more than %s = %" PRId64
                   " (the longest sequence)",
                   name, b, len, max_name, max_len);
  }
  SAGE_CHECK_ARG(cu[batch] == total,
                 "%s[%" PRId64 "] = %d, but %s = %" PRId64
                 ": the last entry must be the total token count",
                 name, batch, int(cu[batch]), total_name, total);
  return SAGE_OK;
}

}  // namespace

sage_status validate(const sage_attention_args* args, Resolved* out) {
  SAGE_CHECK_ARG(args != nullptr, "args is NULL");
  SAGE_CHECK_ARG(args->struct_size == sizeof(sage_attention_args),
                 "args.struct_size = %zu, expected %zu (initialise with sage_attention_args_init)",
                 args->struct_size, sizeof(sage_attention_args));
  const sage_attention_args& a = *args;
  SAGE_RETURN_IF_ERROR(check_common(a));
  SAGE_CHECK_ARG((a.options & ~(SAGE_OPTION_PREPASS_Q | SAGE_OPTION_PREPASS_KV_SPLIT |
                                SAGE_OPTION_WHOLE_TILES | SAGE_OPTION_PREPASS_KV_BLOCKS)) == 0u,
                 "options = 0x%x has unknown flag bits", unsigned(a.options));

  Resolved r;
  r.problem = problem_of(a);
  r.q = a.q_strides;
  r.k = a.k_strides;
  r.v = a.v_strides;
  r.o = a.o_strides;
  r.lse = a.lse_strides;
  const int64_t es = dtype_size(a.dtype), D = a.head_dim;
  // A packed batch is one [total, H, D] tensor an argument (its LSE one [Hq, total_q]): checked
  // as a batch of one.
  const bool packed = a.cu_seqlens_q || a.cu_seqlens_k;
  if (packed) SAGE_RETURN_IF_ERROR(check_packed(a));
  const int64_t nb = packed ? 1 : a.batch, nq = packed ? a.total_q : a.seq_q,
                nk = packed ? a.total_k : a.seq_kv;
  Range q, k, v, o, lse{}, cu_q{}, cu_k{};
  SAGE_RETURN_IF_ERROR(
      check_tensor("q", a.q, &r.q, a.layout, a.heads_q, nq, nb, D, es, false, &q));
  SAGE_RETURN_IF_ERROR(
      check_tensor("k", a.k, &r.k, a.layout, a.heads_kv, nk, nb, D, es, false, &k));
  SAGE_RETURN_IF_ERROR(
      check_tensor("v", a.v, &r.v, a.layout, a.heads_kv, nk, nb, D, es, false, &v));
  SAGE_RETURN_IF_ERROR(
      check_tensor("o", a.o, &r.o, a.layout, a.heads_q, nq, nb, D, es, true, &o));
  for (const Range* in : {&q, &k, &v})
    SAGE_CHECK_ARG(!overlap(o, *in), "o overlaps %s: the output must not alias an input", in->name);
  if (packed) {
    const uintptr_t bytes = uintptr_t(a.batch + 1) * sizeof(int32_t);
    cu_q = {"cu_seqlens_q", reinterpret_cast<uintptr_t>(a.cu_seqlens_q),
            reinterpret_cast<uintptr_t>(a.cu_seqlens_q) + bytes};
    cu_k = {"cu_seqlens_k", reinterpret_cast<uintptr_t>(a.cu_seqlens_k),
            reinterpret_cast<uintptr_t>(a.cu_seqlens_k) + bytes};
    for (const Range* in : {&cu_q, &cu_k})
      SAGE_CHECK_ARG(!overlap(o, *in), "o overlaps %s: the output must not alias an input",
                     in->name);
  }
  if (a.lse) {
    SAGE_RETURN_IF_ERROR(check_tensor("lse", a.lse, &r.lse, SAGE_LAYOUT_HND, a.heads_q, nq, nb, 1,
                                      4, true, &lse));
    for (const Range* other : {&q, &k, &v, &o})
      SAGE_CHECK_ARG(!overlap(lse, *other), "lse overlaps %s", other->name);
    if (packed)
      for (const Range* other : {&cu_q, &cu_k})
        SAGE_CHECK_ARG(!overlap(lse, *other), "lse overlaps %s", other->name);
  }

  if (a.variant == SAGE_VARIANT_CUSTOM) {
    const std::string e = ref::quant_config_error(a.quant);
    if (!e.empty()) return set_error(SAGE_ERROR_INVALID_ARGUMENT, "%s", e.c_str());
    r.quant = a.quant;
  } else {
    r.quant = ref::quant_preset(a.variant);
  }
  r.exact = a.variant == SAGE_VARIANT_EXACT;

  const void* ptrs[] = {a.q, a.k, a.v, a.o, a.lse, a.cu_seqlens_q, a.cu_seqlens_k};
  const char* names[] = {"q", "k", "v", "o", "lse", "cu_seqlens_q", "cu_seqlens_k"};
  sage_backend want = SAGE_BACKEND_CPU;
  SAGE_RETURN_IF_ERROR(resolve_backend(a.backend, ptrs, names, 7, &want));
  SAGE_RETURN_IF_ERROR(check_kernel_backend(a, want));
  r.backend = want;
  if (packed) {
    // The CUDA backend must not read device memory here (no host synchronization); its planner
    // refuses packed batches for now. The CPU reference indexes by these, so they are checked.
    if (want == SAGE_BACKEND_CPU) {
      SAGE_RETURN_IF_ERROR(check_cu_seqlens("cu_seqlens_q", a.cu_seqlens_q, a.batch, "total_q",
                                            a.total_q, "seq_q", a.seq_q));
      SAGE_RETURN_IF_ERROR(check_cu_seqlens("cu_seqlens_k", a.cu_seqlens_k, a.batch, "total_k",
                                            a.total_k, "seq_kv", a.seq_kv));
    }
    r.cu_seqlens_q = a.cu_seqlens_q;
    r.cu_seqlens_k = a.cu_seqlens_k;
    r.total_q = a.total_q;
    r.total_k = a.total_k;
  }
  *out = r;
  return SAGE_OK;
}

}  // namespace sage::api

namespace sage::api {

sage_status validate_backward(const sage_backward_args* args, ResolvedBackward* out) {
  SAGE_CHECK_ARG(args != nullptr, "args is NULL");
  SAGE_CHECK_ARG(args->struct_size == sizeof(sage_backward_args),
                 "args.struct_size = %zu, expected %zu (initialise with sage_backward_args_init)",
                 args->struct_size, sizeof(sage_backward_args));
  const sage_backward_args& a = *args;
  SAGE_RETURN_IF_ERROR(check_common(a));
  SAGE_CHECK_ARG((a.options & ~SAGE_BWD_OPTION_DETERMINISTIC) == 0u,
                 "options = 0x%x has unknown flag bits (the backward knows "
                 "SAGE_BWD_OPTION_DETERMINISTIC = 0x%x)",
                 unsigned(a.options), unsigned(SAGE_BWD_OPTION_DETERMINISTIC));
  SAGE_CHECK_ARG(a.variant == SAGE_VARIANT_AUTO || a.variant == SAGE_VARIANT_EXACT ||
                     a.variant == SAGE_VARIANT_CUSTOM,
                 "variant = %" PRId64 " has no backward (AUTO, EXACT or CUSTOM)",
                 enum_value(a.variant));

  ResolvedBackward r;
  r.problem = problem_of(a);
  r.q = a.q_strides;
  r.k = a.k_strides;
  r.v = a.v_strides;
  r.o = a.o_strides;
  r.lse = a.lse_strides;
  r.d_o = a.do_strides;
  r.dlse = a.dlse_strides;
  r.dq = a.dq_strides;
  r.dk = a.dk_strides;
  r.dv = a.dv_strides;
  const int64_t es = dtype_size(a.dtype), D = a.head_dim;
  Range q, k, v, o{}, lse{}, d_o, dq, dk, dv, dlse{};
  SAGE_RETURN_IF_ERROR(
      check_tensor("q", a.q, &r.q, a.layout, a.heads_q, a.seq_q, a.batch, D, es, false, &q));
  SAGE_RETURN_IF_ERROR(
      check_tensor("k", a.k, &r.k, a.layout, a.heads_kv, a.seq_kv, a.batch, D, es, false, &k));
  SAGE_RETURN_IF_ERROR(
      check_tensor("v", a.v, &r.v, a.layout, a.heads_kv, a.seq_kv, a.batch, D, es, false, &v));
  // SageBwd normalizes its own scores: only the float64 backward reads the forward's O and LSE
  // (checked where given, required for EXACT).
  SAGE_CHECK_ARG(a.variant != SAGE_VARIANT_EXACT || (a.o != nullptr && a.lse != nullptr),
                 "variant = EXACT needs the forward's o and lse (one of them is NULL)");
  SAGE_CHECK_ARG(a.variant != SAGE_VARIANT_CUSTOM || a.config.normalizer != SAGE_BWD_NORM_FORWARD ||
                     (a.o != nullptr && a.lse != nullptr),
                 "config.normalizer = SAGE_BWD_NORM_FORWARD needs the forward's o and lse (one of "
                 "them is NULL)");
  if (a.o)
    SAGE_RETURN_IF_ERROR(
        check_tensor("o", a.o, &r.o, a.layout, a.heads_q, a.seq_q, a.batch, D, es, false, &o));
  if (a.lse)
    SAGE_RETURN_IF_ERROR(check_tensor("lse", a.lse, &r.lse, SAGE_LAYOUT_HND, a.heads_q, a.seq_q,
                                      a.batch, 1, 4, false, &lse));
  SAGE_RETURN_IF_ERROR(check_tensor("d_o", a.d_o, &r.d_o, a.layout, a.heads_q, a.seq_q, a.batch,
                                    D, es, false, &d_o));
  SAGE_RETURN_IF_ERROR(
      check_tensor("dq", a.dq, &r.dq, a.layout, a.heads_q, a.seq_q, a.batch, D, es, true, &dq));
  SAGE_RETURN_IF_ERROR(check_tensor("dk", a.dk, &r.dk, a.layout, a.heads_kv, a.seq_kv, a.batch,
                                    D, es, true, &dk));
  SAGE_RETURN_IF_ERROR(check_tensor("dv", a.dv, &r.dv, a.layout, a.heads_kv, a.seq_kv, a.batch,
                                    D, es, true, &dv));
  if (a.d_lse)
    SAGE_RETURN_IF_ERROR(check_tensor("d_lse", a.d_lse, &r.dlse, SAGE_LAYOUT_HND, a.heads_q,
                                      a.seq_q, a.batch, 1, 4, false, &dlse));
  const Range* outputs[] = {&dq, &dk, &dv};
  for (int i = 0; i < 3; ++i) {
    for (const Range* in : {&q, &k, &v, &o, &lse, &d_o, &dlse})
      SAGE_CHECK_ARG(!overlap(*outputs[i], *in),
                     "%s overlaps %s: an output must not alias an input", outputs[i]->name,
                     in->name);
    for (int j = 0; j < i; ++j)
      SAGE_CHECK_ARG(!overlap(*outputs[i], *outputs[j]), "%s overlaps %s", outputs[i]->name,
                     outputs[j]->name);
  }

  if (a.variant == SAGE_VARIANT_CUSTOM) {
    const std::string e = ref::backward_config_error(a.config);
    if (!e.empty()) return set_error(SAGE_ERROR_INVALID_ARGUMENT, "%s", e.c_str());
    r.config = a.config;
  } else {
    r.config = ref::backward_preset();
  }
  r.exact = a.variant == SAGE_VARIANT_EXACT;

  const void* ptrs[] = {a.q, a.k, a.v, a.o, a.lse, a.d_o, a.dq, a.dk, a.dv, a.d_lse, a.untrusted};
  const char* names[] = {"q", "k", "v", "o", "lse", "d_o", "dq", "dk", "dv", "d_lse", "untrusted"};
  SAGE_RETURN_IF_ERROR(resolve_backend(a.backend, ptrs, names, 11, &r.backend));
  if (r.exact && r.backend == SAGE_BACKEND_CUDA)
    return set_error(SAGE_ERROR_UNSUPPORTED,
                     "variant = EXACT (float64) runs on the CPU reference only; pass host "
                     "pointers");
  SAGE_RETURN_IF_ERROR(check_kernel_backend(a, r.backend));
  *out = r;
  return SAGE_OK;
}

}  // namespace sage::api
