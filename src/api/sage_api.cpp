// The C API entry points: initialisation, version, errors, and sage_attention() dispatching the
// validated call to the CPU reference or the CUDA backend. Host code; any architecture.
#include <new>
#include <string>

#include "api/backend.h"
#include "common/error.h"
#include "sage/sage.h"

namespace {

using sage::api::Resolved;

// The CPU reference through the C API: compute into scratch, then write o (and lse) in the
// caller's dtype and strides, so a failure leaves the caller's buffers untouched.
void run_cpu(const Resolved& r, const sage_attention_args& a) {
  namespace ref = sage::ref;
  const ref::Problem& p = r.problem;
  const ref::TensorView q{a.q, a.dtype, r.q}, k{a.k, a.dtype, r.k}, v{a.v, a.dtype, r.v};
  const int64_t D = p.head_dim, N = p.seq_q;
  std::vector<double> out(static_cast<size_t>(p.out_elems())),
      lse(a.lse ? size_t(p.lse_elems()) : 0);
  if (r.exact) {
    ref::attention_exact(p, q, k, v, out.data(), a.lse ? lse.data() : nullptr, a.num_threads);
  } else {
    std::vector<float> outf(out.size()), lsef(lse.size());
    ref::attention_quant(p, r.quant, q, k, v, outf.data(), a.lse ? lsef.data() : nullptr,
                         a.num_threads);
    out.assign(outf.begin(), outf.end());
    lse.assign(lsef.begin(), lsef.end());
  }
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads_q; ++h)
      for (int64_t i = 0; i < N; ++i) {
        const int64_t row = (b * p.heads_q + h) * N + i;
        const int64_t base = b * r.o.batch + h * r.o.head + i * r.o.token;
        for (int64_t d = 0; d < D; ++d)
          ref::store_element(a.o, a.dtype, base + d, out[size_t(row * D + d)]);
        if (a.lse)
          a.lse[b * r.lse.batch + h * r.lse.head + i * r.lse.token] = float(lse[size_t(row)]);
      }
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
  SAGE_CHECK_ARG(v >= SAGE_VARIANT_AUTO && v <= SAGE_VARIANT_CUSTOM, "variant = %lld is unknown",
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
  return SAGE_OK;
}

sage_status sage_attention(const sage_attention_args* args) {
  sage::clear_error();
  Resolved r;
  SAGE_RETURN_IF_ERROR(sage::api::validate(args, &r));
  if (r.backend == SAGE_BACKEND_CUDA) return sage::cuda::attention(r, *args);
  try {
    run_cpu(r, *args);
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

}  // extern "C"
