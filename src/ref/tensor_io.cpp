// Strided tensor access for the CPU reference: dtype conversion on load and store, layouts,
// and the causal-mask geometry. Host code; any architecture.
#include <algorithm>
#include <cstring>

#include "common/formats.h"
#include "ref/reference.h"

namespace sage::ref {

int64_t Problem::visible_keys(int64_t i) const {
  int64_t last;  // last visible key index
  switch (mask) {
    case SAGE_MASK_CAUSAL_BOTTOM_RIGHT: last = i + seq_kv - seq_q; break;
    case SAGE_MASK_CAUSAL_TOP_LEFT: last = i; break;
    default: return seq_kv;
  }
  return std::clamp<int64_t>(last + 1, 0, seq_kv);
}

sage_strides contiguous_strides(sage_layout layout, int64_t heads, int64_t seq, int64_t dim) {
  if (layout == SAGE_LAYOUT_NHD) return {seq * heads * dim, dim, heads * dim};
  return {heads * seq * dim, seq * dim, dim};
}

float load_element(const void* data, sage_dtype dtype, int64_t offset) {
  switch (dtype) {
    case SAGE_DTYPE_FP16: return decode_float(kFp16, static_cast<const uint16_t*>(data)[offset]);
    case SAGE_DTYPE_BF16: {
      // bf16 is the top half of a float: widen exactly.
      const uint32_t bits = uint32_t(static_cast<const uint16_t*>(data)[offset]) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof(f));
      return f;
    }
    default: return static_cast<const float*>(data)[offset];
  }
}

void store_element(void* data, sage_dtype dtype, int64_t offset, double x) {
  switch (dtype) {
    case SAGE_DTYPE_FP16:
      static_cast<uint16_t*>(data)[offset] = uint16_t(encode_float(kFp16, x, false));
      break;
    case SAGE_DTYPE_BF16:
      // Rounded from the double directly: through float first could round twice.
      static_cast<uint16_t*>(data)[offset] = uint16_t(encode_float(kBf16, x, false));
      break;
    default: static_cast<float*>(data)[offset] = float(x); break;
  }
}

std::vector<float> load_matrix(const TensorView& t, int64_t b, int64_t h, int64_t rows,
                               int64_t dim) {
  std::vector<float> m(static_cast<size_t>(rows * dim));
  const int64_t base = b * t.strides.batch + h * t.strides.head;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < dim; ++d)
      m[size_t(r * dim + d)] = load_element(t.data, t.dtype, base + r * t.strides.token + d);
  return m;
}

}  // namespace sage::ref
