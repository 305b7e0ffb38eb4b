// sage.hpp — the C++ face of libsage: the C API (sage.h) with std types and exceptions. Header
// only, no CUDA headers. Every call goes through the C functions, so behaviour is the same.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

#include "sage/sage.h"

namespace sage {

// Thrown for every non-OK status; what() is sage_last_error()'s message.
class Exception : public std::runtime_error {
 public:
  Exception(sage_status status, const std::string& message)
      : std::runtime_error(message), status_(status) {}
  sage_status status() const noexcept { return status_; }

 private:
  sage_status status_;
};

inline void check(sage_status status) {
  if (status != SAGE_OK)
    throw Exception(status, std::string(sage_status_string(status)) + ": " + sage_last_error());
}

// sage_attention_args, initialised with the library defaults, with chainable setters.
struct AttentionArgs : sage_attention_args {
  AttentionArgs() { check(sage_attention_args_init(this)); }

  AttentionArgs& tensors(const void* q_, const void* k_, const void* v_, void* o_) {
    q = q_, k = k_, v = v_, o = o_;
    return *this;
  }
  AttentionArgs& shape(int64_t batch_, int64_t heads_q_, int64_t heads_kv_, int64_t seq_q_,
                       int64_t seq_kv_, int64_t head_dim_) {
    batch = batch_, heads_q = heads_q_, heads_kv = heads_kv_, seq_q = seq_q_, seq_kv = seq_kv_,
    head_dim = head_dim_;
    return *this;
  }
  AttentionArgs& with_layout(sage_layout l) { return layout = l, *this; }
  AttentionArgs& with_dtype(sage_dtype d) { return dtype = d, *this; }
  AttentionArgs& with_mask(sage_mask m) { return mask = m, *this; }
  AttentionArgs& with_scale(float s) { return scale = s, *this; }
  AttentionArgs& with_lse(float* l) { return lse = l, *this; }
  AttentionArgs& with_variant(sage_variant v) { return variant = v, *this; }
  AttentionArgs& with_quant(const sage_quant_config& c) {
    variant = SAGE_VARIANT_CUSTOM;
    quant = c;
    return *this;
  }
  AttentionArgs& with_backend(sage_backend b) { return backend = b, *this; }
  AttentionArgs& with_stream(void* s) { return stream = s, *this; }
  AttentionArgs& with_workspace(void* w, size_t bytes) {
    workspace = w, workspace_size = bytes;
    return *this;
  }
};

inline void attention(const AttentionArgs& args) { check(sage_attention(&args)); }

inline size_t workspace_size(const AttentionArgs& args) {
  size_t bytes = 0;
  check(sage_attention_workspace_size(&args, &bytes));
  return bytes;
}

inline sage_quant_config quant_preset(sage_variant variant) {
  sage_quant_config c;
  check(sage_quant_config_init(&c, variant));
  return c;
}

inline std::string version() { return sage_version(); }

}  // namespace sage
