// The C API entry points: initialisation, version, errors, and sage_attention() dispatching the
// validated call to the CPU reference or the CUDA backend. Host code; any architecture.
#include <algorithm>
#include <limits>
#include <new>
#include <string>

#include "api/backend.h"
#include "common/error.h"
#include "sage/sage.h"

namespace {

using sage::api::Resolved;

// One dense problem on the reference: out contiguous [B, Hq, Nq, D], lse [B, Hq, Nq] (or NULL).
void reference(const Resolved& r, const sage::ref::Problem& p, const sage::ref::TensorView& q,
               const sage::ref::TensorView& k, const sage::ref::TensorView& v, double* out,
               double* lse, int threads) {
  namespace ref = sage::ref;
  if (r.exact) {
    ref::attention_exact(p, q, k, v, out, lse, threads);
    return;
  }
  std::vector<float> outf(size_t(p.out_elems())), lsef(lse ? size_t(p.lse_elems()) : 0);
  ref::attention_quant(p, r.quant, q, k, v, outf.data(), lse ? lsef.data() : nullptr, threads);
  std::copy(outf.begin(), outf.end(), out);
  if (lse) std::copy(lsef.begin(), lsef.end(), lse);
}

// Writes one sequence's contiguous [Hq, n, D] result (lse [Hq, n]) in the caller's dtype:
// element (h, i, d) of o at o_base + h·o.head + i·o.token + d, of lse at lse_base + h·lse.head +
// i·lse.token.
void store_rows(const Resolved& r, const sage_attention_args& a, int64_t n, const double* out,
                const double* lse, int64_t o_base, int64_t lse_base) {
  const int64_t D = r.problem.head_dim;
  for (int64_t h = 0; h < r.problem.heads_q; ++h)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = h * n + i, base = o_base + h * r.o.head + i * r.o.token;
      for (int64_t d = 0; d < D; ++d)
        sage::ref::store_element(a.o, a.dtype, base + d, out[size_t(row * D + d)]);
      if (a.lse) a.lse[lse_base + h * r.lse.head + i * r.lse.token] = float(lse[size_t(row)]);
    }
}

// The CPU reference through the C API: compute into scratch, then write o (and lse) in the
// caller's dtype and strides, so a failure leaves the caller's buffers untouched.
void run_cpu(const Resolved& r, const sage_attention_args& a) {
  namespace ref = sage::ref;
  const ref::Problem& p = r.problem;
  const ref::TensorView q{a.q, a.dtype, r.q}, k{a.k, a.dtype, r.k}, v{a.v, a.dtype, r.v};
  const int64_t D = p.head_dim, N = p.seq_q, Hq = p.heads_q;
  std::vector<double> out(static_cast<size_t>(p.out_elems())),
      lse(a.lse ? size_t(p.lse_elems()) : 0);
  reference(r, p, q, k, v, out.data(), a.lse ? lse.data() : nullptr, a.num_threads);
  for (int64_t b = 0; b < p.batch; ++b)
    store_rows(r, a, N, out.data() + b * Hq * N * D, lse.data() + (a.lse ? b * Hq * N : 0),
               b * r.o.batch, b * r.lse.batch);
}

// A packed batch: each sequence is a dense problem of batch 1 over its own token range, so its
// causal alignment, smoothing means and quantization groups never reach another sequence (one
// mechanism: the dense reference). Sequence b's result sits in the scratch at token cu_q[b] as
// [Hq, Nq_b, D]; o and lse are written once every sequence is computed.
void run_cpu_packed(const Resolved& r, const sage_attention_args& a) {
  namespace ref = sage::ref;
  const ref::Problem& p = r.problem;
  const int64_t Hq = p.heads_q, D = p.head_dim, es = a.dtype == SAGE_DTYPE_FP32 ? 4 : 2;
  const int32_t *cu_q = r.cu_seqlens_q, *cu_k = r.cu_seqlens_k;
  std::vector<double> out(size_t(r.total_q * Hq * D)), lse(a.lse ? size_t(r.total_q * Hq) : 0);
  auto view = [&](const void* data, const sage_strides& s, int64_t token) {
    return ref::TensorView{static_cast<const char*>(data) + token * s.token * es, a.dtype, s};
  };
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t q0 = cu_q[b], nq = cu_q[b + 1] - q0, k0 = cu_k[b], nk = cu_k[b + 1] - k0;
    double* lse_b = a.lse ? lse.data() + q0 * Hq : nullptr;
    if (nq == 0) continue;
    if (nk == 0) {
      // No key at all: every row is fully masked, as in the dense call (o = 0, lse = -inf).
      if (lse_b) std::fill(lse_b, lse_b + Hq * nq, -std::numeric_limits<double>::infinity());
      continue;
    }
    ref::Problem pb = p;
    pb.batch = 1, pb.seq_q = nq, pb.seq_kv = nk;
    reference(r, pb, view(a.q, r.q, q0), view(a.k, r.k, k0), view(a.v, r.v, k0),
              out.data() + q0 * Hq * D, lse_b, a.num_threads);
  }
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t q0 = cu_q[b];
    store_rows(r, a, cu_q[b + 1] - q0, out.data() + q0 * Hq * D,
               lse.data() + (a.lse ? q0 * Hq : 0), q0 * r.o.token, q0 * r.lse.token);
  }
}

// The backward on the CPU: the gradients (and the exact backward's O and LSE) go through
// contiguous scratch; dq, dk, dv are written only once everything is computed, and *untrusted
// (if given) always.
void run_cpu_backward(const sage::api::ResolvedBackward& r, const sage_backward_args& a) {
  namespace ref = sage::ref;
  const ref::Problem& p = r.problem;
  const ref::TensorView q{a.q, a.dtype, r.q}, k{a.k, a.dtype, r.k}, v{a.v, a.dtype, r.v},
      d_o{a.d_o, a.dtype, r.d_o};
  const int64_t D = p.head_dim, Nq = p.seq_q, Nk = p.seq_kv;
  const size_t q_elems = size_t(p.out_elems()), k_elems = size_t(p.batch * p.heads_kv * Nk * D);
  std::vector<double> dq(q_elems), dk(k_elems), dv(k_elems);
  bool untrusted = false;
  auto o_at = [&](int64_t bh, int64_t i, int64_t d) {
    return ref::load_element(a.o, a.dtype, (bh / p.heads_q) * r.o.batch +
                                               (bh % p.heads_q) * r.o.head + i * r.o.token + d);
  };
  auto lse_at = [&](int64_t bh, int64_t i) {
    return a.lse[(bh / p.heads_q) * r.lse.batch + (bh % p.heads_q) * r.lse.head + i * r.lse.token];
  };
  auto dlse_at = [&](int64_t bh, int64_t i) {
    return a.d_lse[(bh / p.heads_q) * r.dlse.batch + (bh % p.heads_q) * r.dlse.head +
                   i * r.dlse.token];
  };
  if (r.exact) {
    std::vector<double> of(q_elems), lf(size_t(p.lse_elems())), gf(a.d_lse ? lf.size() : 0);
    for (int64_t bh = 0; bh < p.batch * p.heads_q; ++bh)
      for (int64_t i = 0; i < Nq; ++i) {
        lf[size_t(bh * Nq + i)] = lse_at(bh, i);
        if (a.d_lse) gf[size_t(bh * Nq + i)] = dlse_at(bh, i);
        for (int64_t d = 0; d < D; ++d) of[size_t((bh * Nq + i) * D + d)] = o_at(bh, i, d);
      }
    ref::attention_backward_exact(p, q, k, v, of.data(), lf.data(), d_o, dq.data(), dk.data(),
                                  dv.data(), a.num_threads, a.d_lse ? gf.data() : nullptr);
  } else {
    // The preset reads neither O nor the LSE: it normalizes its own scores (ref/backward.cpp).
    std::vector<float> gf(a.d_lse ? size_t(p.lse_elems()) : 0);
    for (int64_t bh = 0; a.d_lse && bh < p.batch * p.heads_q; ++bh)
      for (int64_t i = 0; i < Nq; ++i) gf[size_t(bh * Nq + i)] = dlse_at(bh, i);
    std::vector<float> dqf(q_elems), dkf(k_elems), dvf(k_elems);
    // The forward's O and LSE where the config normalizes with them (SAGE_BWD_NORM_FORWARD).
    const bool fwd = r.config.normalizer == SAGE_BWD_NORM_FORWARD;
    std::vector<float> of(fwd ? q_elems : 0), lf(fwd ? size_t(p.lse_elems()) : 0);
    for (int64_t bh = 0; fwd && bh < p.batch * p.heads_q; ++bh)
      for (int64_t i = 0; i < Nq; ++i) {
        lf[size_t(bh * Nq + i)] = lse_at(bh, i);
        for (int64_t d = 0; d < D; ++d) of[size_t((bh * Nq + i) * D + d)] = float(o_at(bh, i, d));
      }
    ref::BackwardCheck check;
    ref::attention_backward_quant(p, r.config, q, k, v, d_o, dqf.data(), dkf.data(), dvf.data(),
                                  a.num_threads, a.d_lse ? gf.data() : nullptr, &check, 0,
                                  fwd ? of.data() : nullptr, fwd ? lf.data() : nullptr);
    untrusted = check.untrusted;
    dq.assign(dqf.begin(), dqf.end());
    dk.assign(dkf.begin(), dkf.end());
    dv.assign(dvf.begin(), dvf.end());
  }
  auto store = [&](void* dst, const sage_strides& st, int64_t heads, int64_t n,
                   const std::vector<double>& src) {
    for (int64_t bh = 0; bh < p.batch * heads; ++bh)
      for (int64_t i = 0; i < n; ++i) {
        const int64_t base = (bh / heads) * st.batch + (bh % heads) * st.head + i * st.token;
        for (int64_t d = 0; d < D; ++d)
          ref::store_element(dst, a.dtype, base + d, src[size_t((bh * n + i) * D + d)]);
      }
  };
  store(a.dq, r.dq, p.heads_q, Nq, dq);
  store(a.dk, r.dk, p.heads_kv, Nk, dk);
  store(a.dv, r.dv, p.heads_kv, Nk, dv);
  if (a.untrusted) *a.untrusted = untrusted ? 1 : 0;
}

// Runs a CPU reference call, turning its exceptions into statuses.
template <typename Fn>
sage_status guarded(Fn&& fn) {
  try {
    fn();
  } catch (const sage::Error& e) {
    return sage::set_error(e.status, "%s", e.message.c_str());
  } catch (const std::bad_alloc&) {
    return sage::set_error(SAGE_ERROR_OUT_OF_MEMORY,
                           "the CPU reference could not allocate its scratch memory");
  } catch (const std::exception& e) {
    return sage::set_error(SAGE_ERROR_INTERNAL, "CPU reference failed: %s", e.what());
  }
  return SAGE_OK;
}

}  // namespace

extern "C" {

const char* sage_version(void) {
  return "0.1.0";
}

void sage_version_numbers(int* major, int* minor, int* patch) {
  if (major) *major = SAGE_VERSION_MAJOR;
  if (minor) *minor = SAGE_VERSION_MINOR;
  if (patch) *patch = SAGE_VERSION_PATCH;
}

const char* sage_last_error(void) {
  return sage::last_error();
}

const char* sage_status_string(sage_status status) {
  switch (sage::enum_value(status)) {
    case SAGE_OK:
      return "ok";
    case SAGE_ERROR_INVALID_ARGUMENT:
      return "invalid argument";
    case SAGE_ERROR_UNSUPPORTED:
      return "unsupported";
    case SAGE_ERROR_CUDA:
      return "CUDA error";
    case SAGE_ERROR_OUT_OF_MEMORY:
      return "out of memory";
    case SAGE_ERROR_WORKSPACE_TOO_SMALL:
      return "workspace too small";
    case SAGE_ERROR_INTERNAL:
      return "internal error";
  }
  return "unknown status";
}

sage_status sage_quant_config_init(sage_quant_config* config, sage_variant variant) {
  sage::clear_error();
  SAGE_CHECK_ARG(config != nullptr, "config is NULL");
  const int64_t v = sage::enum_value(variant);
  SAGE_CHECK_ARG(v >= SAGE_VARIANT_AUTO && v <= SAGE_VARIANT_SAGE3_FP4, "variant = %lld is unknown",
                 static_cast<long long>(v));
  *config = sage::ref::quant_preset(variant);
  return SAGE_OK;
}

sage_status sage_attention_args_init(sage_attention_args* args) {
  sage::clear_error();
  SAGE_CHECK_ARG(args != nullptr, "args is NULL");
  *args = sage_attention_args{};
  args->struct_size = sizeof(sage_attention_args);
  args->layout = SAGE_LAYOUT_HND;
  args->dtype = SAGE_DTYPE_FP16;
  args->mask = SAGE_MASK_NONE;
  args->variant = SAGE_VARIANT_AUTO;
  args->backend = SAGE_BACKEND_AUTO;
  args->quant = sage::ref::quant_preset(SAGE_VARIANT_SAGE2_8B);
  return SAGE_OK;
}

sage_status sage_attention_workspace_size(const sage_attention_args* args, size_t* bytes) {
  sage::clear_error();
  SAGE_CHECK_ARG(bytes != nullptr, "bytes is NULL");
  Resolved r;
  SAGE_RETURN_IF_ERROR(sage::api::validate(args, &r));
  if (r.backend == SAGE_BACKEND_CUDA) return sage::cuda::workspace_size(r, *args, bytes);
  *bytes = 0;
  return SAGE_OK;
}

sage_status sage_attention_plan(const sage_attention_args* args, sage_plan_info* info) {
  sage::clear_error();
  SAGE_CHECK_ARG(info != nullptr, "info is NULL");
  SAGE_CHECK_ARG(info->struct_size == sizeof(sage_plan_info),
                 "info.struct_size = %zu, expected %zu", info->struct_size, sizeof(sage_plan_info));
  Resolved r;
  SAGE_RETURN_IF_ERROR(sage::api::validate(args, &r));
  if (r.backend == SAGE_BACKEND_CUDA) return sage::cuda::plan_info(r, *args, info);
  *info = sage_plan_info{};
  info->struct_size = sizeof(sage_plan_info);
  info->backend = SAGE_BACKEND_CPU;
  info->kernel = SAGE_KERNEL_AUTO;
  info->block_q = r.quant.block_q;
  info->block_k = r.quant.block_k;
  info->emulation = r.quant;
  info->kernel_head_dim = r.problem.head_dim;
  info->has_backward = 1;
  return SAGE_OK;
}

sage_status sage_attention(const sage_attention_args* args) {
  sage::clear_error();
  Resolved r;
  SAGE_RETURN_IF_ERROR(sage::api::validate(args, &r));
  if (r.backend == SAGE_BACKEND_CUDA) return sage::cuda::attention(r, *args);
  return guarded([&] { r.packed() ? run_cpu_packed(r, *args) : run_cpu(r, *args); });
}

sage_status sage_backward_args_init(sage_backward_args* args) {
  sage::clear_error();
  SAGE_CHECK_ARG(args != nullptr, "args is NULL");
  *args = sage_backward_args{};
  args->struct_size = sizeof(sage_backward_args);
  args->layout = SAGE_LAYOUT_HND;
  args->dtype = SAGE_DTYPE_FP16;
  args->mask = SAGE_MASK_NONE;
  args->variant = SAGE_VARIANT_AUTO;
  args->backend = SAGE_BACKEND_AUTO;
  args->config = sage::ref::backward_preset();
  return SAGE_OK;
}

sage_status sage_backward_workspace_size(const sage_backward_args* args, size_t* bytes) {
  sage::clear_error();
  SAGE_CHECK_ARG(bytes != nullptr, "bytes is NULL");
  sage::api::ResolvedBackward r;
  SAGE_RETURN_IF_ERROR(sage::api::validate_backward(args, &r));
  if (r.backend == SAGE_BACKEND_CUDA) return sage::cuda::backward_workspace_size(r, *args, bytes);
  *bytes = 0;
  return SAGE_OK;
}

sage_status sage_attention_backward(const sage_backward_args* args) {
  sage::clear_error();
  sage::api::ResolvedBackward r;
  SAGE_RETURN_IF_ERROR(sage::api::validate_backward(args, &r));
  if (r.backend == SAGE_BACKEND_CUDA) return sage::cuda::backward(r, *args);
  return guarded([&] { run_cpu_backward(r, *args); });
}

}  // extern "C"
