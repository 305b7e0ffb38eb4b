// The CUDA backend when libsage is built without CUDA: every pointer is host memory and a CUDA
// request is a clear "unsupported". Host code.
#include "api/backend.h"
#include "common/error.h"

namespace sage::cuda {

PointerKind pointer_kind(const void*) { return PointerKind::kHost; }

std::string describe_devices(bool* has_gpu) {
  *has_gpu = false;
  return "no GPU: libsage was built without CUDA";
}

sage_status workspace_size(const api::Resolved&, const sage_attention_args&, size_t*) {
  return set_error(SAGE_ERROR_UNSUPPORTED, "backend = CUDA, but libsage was built without CUDA");
}

sage_status plan_info(const api::Resolved&, const sage_attention_args&, sage_plan_info*) {
  return set_error(SAGE_ERROR_UNSUPPORTED, "backend = CUDA, but libsage was built without CUDA");
}

sage_status attention_stages(const api::Resolved& r, const sage_attention_args& a, int) {
  return attention(r, a);
}

sage_status attention(const api::Resolved&, const sage_attention_args&) {
  return set_error(SAGE_ERROR_UNSUPPORTED, "backend = CUDA, but libsage was built without CUDA");
}

}  // namespace sage::cuda

namespace sage::cuda {

sage_status backward_workspace_size(const api::ResolvedBackward&, const sage_backward_args&,
                                    size_t*) {
  return set_error(SAGE_ERROR_UNSUPPORTED, "backend = CUDA, but libsage was built without CUDA");
}

sage_status backward(const api::ResolvedBackward&, const sage_backward_args&) {
  return set_error(SAGE_ERROR_UNSUPPORTED, "backend = CUDA, but libsage was built without CUDA");
}

}  // namespace sage::cuda
