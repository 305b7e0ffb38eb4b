// Helpers shared by the GPU GoogleTest suites: skip a test (reported as skipped by ctest) when the
// machine has no usable CUDA device, and fail a test on the first CUDA error with its message.
// Host code only; any architecture.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <string>

// True when a CUDA device can be used: one is present and a context can be made on device 0.
// Otherwise false, with the reason in *why. Asked once per process; the answer is kept.
inline bool sage_test_has_gpu(std::string* why) {
  static const std::string reason = [] {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      cudaGetLastError();  // reset the last-error state so later calls start clean
      return std::string("no usable GPU: cudaGetDeviceCount failed: ") + cudaGetErrorName(err) +
             " (" + cudaGetErrorString(err) + ")";
    }
    if (count == 0) return std::string("no usable GPU: cudaGetDeviceCount reports 0 devices");
    const cudaError_t ctx = cudaFree(nullptr);  // creates the primary context on device 0
    if (ctx != cudaSuccess) {
      cudaGetLastError();
      return std::string("no usable GPU: cannot create a context on device 0: ") +
             cudaGetErrorName(ctx) + " (" + cudaGetErrorString(ctx) + ")";
    }
    return std::string();
  }();
  if (why != nullptr) *why = reason;
  return reason.empty();
}

// First statement of a GPU test: skips it (GTEST_SKIP returns from the test body) without a GPU.
#define SAGE_REQUIRE_GPU()                            \
  do {                                                \
    std::string sage_require_gpu_why_;                \
    if (!sage_test_has_gpu(&sage_require_gpu_why_)) { \
      GTEST_SKIP() << sage_require_gpu_why_;          \
    }                                                 \
  } while (0)

// Fails the current test (and returns from it) when a CUDA runtime call does not succeed.
#define SAGE_ASSERT_CUDA(call)                                              \
  do {                                                                      \
    const cudaError_t sage_assert_cuda_err_ = (call);                       \
    ASSERT_EQ(sage_assert_cuda_err_, cudaSuccess)                           \
        << #call << ": " << cudaGetErrorName(sage_assert_cuda_err_) << " (" \
        << cudaGetErrorString(sage_assert_cuda_err_) << ")";                \
  } while (0)

// A device allocation freed at scope exit (ptr null when cudaMalloc failed; 0 bytes take 1).
struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) {
    if (cudaMalloc(&ptr, bytes ? bytes : 1) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};
