// Tiled TMA tensor maps from the host (the driver's cuTensorMapEncodeTiled, fetched through the
// runtime, so libsage links no libcuda), kept per thread by their inputs: the forward's and the
// backward's launchers build theirs here.
#pragma once

#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstring>

namespace sage {

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
// element strides 1, the given swizzle; reads past the tensor fill zeros. Encoded maps are kept
// per thread (a few, by their inputs): a call's K and Vᵀ maps point into the workspace, which the
// caller's allocator usually hands back at the same address, so a repeated call skips the driver.
inline cudaError_t encode_tiled(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank,
                                const void* base, const cuuint64_t* dims, const cuuint64_t* strides,
                                const cuuint32_t* box, CUtensorMapSwizzle swizzle) {
  struct Key {
    const void* base;
    cuuint64_t dims[5], strides[4];
    cuuint32_t box[5], rank;
    int type, swizzle;
    bool operator==(const Key& o) const { return std::memcmp(this, &o, sizeof(Key)) == 0; }
  };
  Key key;
  std::memset(&key, 0, sizeof key);  // padding too: keys compare bytewise
  key.base = base, key.rank = rank, key.type = int(type), key.swizzle = int(swizzle);
  for (cuuint32_t i = 0; i < rank; ++i) key.dims[i] = dims[i], key.box[i] = box[i];
  for (cuuint32_t i = 0; i + 1 < rank; ++i) key.strides[i] = strides[i];
  constexpr int kKept = 8;
  thread_local struct {
    Key key[kKept];
    CUtensorMap map[kKept];
    int used = 0, next = 0;
  } kept;
  for (int i = 0; i < kept.used; ++i)
    if (kept.key[i] == key) {
      *map = kept.map[i];
      return cudaSuccess;
    }
  const auto fn = encode_fn();
  if (!fn) return cudaErrorNotSupported;
  const cuuint32_t elem[5] = {1, 1, 1, 1, 1};
  const CUresult r = fn(map, type, rank, const_cast<void*>(base), dims, strides, box, elem,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return cudaErrorInvalidValue;
  const int slot = kept.next;
  std::memcpy(&kept.key[slot], &key, sizeof key);  // with its zeroed padding
  kept.map[slot] = *map;
  kept.next = (slot + 1) % kKept;
  if (kept.used < kKept) ++kept.used;
  return cudaSuccess;
}

}  // namespace sage
