// The cvt wrappers of src/ptx/cvt.cuh run on the GPU and compared bit for bit with the host codec
// (sage::encode_float and encode_e8m0 in formats.h): every fp16 value, every midpoint of
// E4M3/E5M2/E2M1/fp16/bf16 with its float neighbours, specials and random floats, plus the order
// of packed pairs and FP8 decoding. Needs sm_89+; the E2M1 and E8M0 tests also need a build and a
// device of the sm_100a/sm_120a families and skip themselves otherwise.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "common/test_util.h"

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "common/formats.h"
#include "gpu_test_util.h"
#include "ptx/cvt.cuh"

namespace {

// ---------------------------------------------------------------------------------------------
// Kernels. Element i is converted as the low half of a pair whose high half is element n-1-i,
// so every input is seen in both halves and a swapped pair order shows up as a mismatch.

// What the running device code was compiled with: [0] FP8 cvt, [1] E2M1 cvt.
__global__ void cvt_features_kernel(int* flags) {
#if defined(SAGE_PTX_HAS_CVT_FP8)
  flags[0] = 1;
#else
  flags[0] = 0;
#endif
#if defined(SAGE_PTX_HAS_CVT_E2M1)
  flags[1] = 1;
#else
  flags[1] = 0;
#endif
}

struct CvtOutputs {
  uint16_t* e4m3x2;
  uint16_t* e5m2x2;
  uint16_t* f16;
  uint16_t* bf16;
  uint32_t* f16x2;
  uint32_t* bf16x2;
};

__global__ void cvt_all_kernel(const float* x, int64_t n, CvtOutputs out) {
#if defined(SAGE_PTX_HAS_CVT_FP8)
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float lo = x[i];
    const float hi = x[n - 1 - i];
    out.e4m3x2[i] = sage::ptx::cvt_e4m3x2(lo, hi);
    out.e5m2x2[i] = sage::ptx::cvt_e5m2x2(lo, hi);
    out.f16[i] = sage::ptx::cvt_f16(lo);
    out.bf16[i] = sage::ptx::cvt_bf16(lo);
    out.f16x2[i] = sage::ptx::cvt_f16x2(lo, hi);
    out.bf16x2[i] = sage::ptx::cvt_bf16x2(lo, hi);
  }
#endif
}

__global__ void cvt_e2m1_kernel(const float* x, int64_t n, uint16_t* out) {
#if defined(SAGE_PTX_HAS_CVT_E2M1)
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = sage::ptx::cvt_e2m1x2(x[i], x[n - 1 - i]);
  }
#endif
}

// E8M0 of each pair, rounded toward zero in out[i] and up in out[n + i].
__global__ void cvt_ue8m0_kernel(const float* x, int64_t n, uint16_t* out) {
#if defined(SAGE_PTX_HAS_CVT_E2M1)
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = sage::ptx::cvt_ue8m0x2_rz(x[i], x[n - 1 - i]);
    out[n + i] = sage::ptx::cvt_ue8m0x2_rp(x[i], x[n - 1 - i]);
  }
#endif
}

// Every 16-bit pair of FP8 codes decoded to f16x2: out[p] from E4M3, out[65536 + p] from E5M2.
__global__ void fp8_decode_kernel(uint32_t* out) {
#if defined(SAGE_PTX_HAS_CVT_FP8)
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p < 65536) {
    out[p] = sage::ptx::cvt_f16x2_from_e4m3x2(uint16_t(p));
    out[65536 + p] = sage::ptx::cvt_f16x2_from_e5m2x2(uint16_t(p));
  }
#endif
}

// ---------------------------------------------------------------------------------------------
// Host helpers.

using sage::test::bits_float;
using sage::test::float_bits;
using sage::test::hex;

// Device memory freed on scope exit.
template <class T>
struct DeviceArray {
  T* ptr = nullptr;
  DeviceArray() = default;
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() {
    if (ptr != nullptr) cudaFree(ptr);
  }
};

struct Stream {
  cudaStream_t s = nullptr;
  Stream() = default;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() {
    if (s != nullptr) cudaStreamDestroy(s);
  }
};

// Collects mismatches; the test fails once with a count and the first few.
struct MismatchLog {
  explicit MismatchLog(std::string label) : what(std::move(label)) {}
  std::string what;
  size_t count = 0;
  size_t checked = 0;
  std::string first;
  void check(uint32_t got, uint32_t want, float x_lo, float x_hi, const char* op) {
    ++checked;
    if (got == want) return;
    if (++count <= 8) {
      first += std::string("\n  ") + op + "(lo=" + hex(float_bits(x_lo)) +
               ", hi=" + hex(float_bits(x_hi)) + "): gpu " + hex(got) + ", host " + hex(want);
    }
  }
  void check_code(uint32_t got, uint32_t want, uint32_t code, const char* op) {
    ++checked;
    if (got == want) return;
    if (++count <= 8) {
      first +=
          std::string("\n  ") + op + "(" + hex(code) + "): gpu " + hex(got) + ", host " + hex(want);
    }
  }
  void report() const {
    EXPECT_EQ(count, 0u) << what << ": " << count << " of " << checked << " results differ"
                         << first;
  }
};

// Positive finite values of a format, in code order (ascending for these formats).
std::vector<double> positive_values(const sage::FloatFormat& f) {
  const uint32_t max_code = (uint32_t(f.max_field()) << f.man_bits) | uint32_t(f.max_mantissa());
  std::vector<double> v;
  for (uint32_t c = 0; c <= max_code; ++c) v.push_back(double(sage::decode_float(f, c)));
  return v;
}

// Midpoints of adjacent values (and the one past the maximum), both signs, and the floats one
// ulp either side.
void append_midpoints(const sage::FloatFormat& f, std::vector<float>* out) {
  std::vector<double> v = positive_values(f);
  v.push_back(2.0 * v.back() - v[v.size() - 2]);  // the next step past the maximum
  for (size_t i = 0; i + 1 < v.size(); ++i) {
    const float m = float(0.5 * (v[i] + v[i + 1]));
    for (float y : {m, std::nextafter(m, 0.0f), std::nextafter(m, HUGE_VALF)}) {
      out->push_back(y);
      out->push_back(-y);
    }
  }
}

std::vector<float> every_fp16_input() {
  std::vector<float> x;
  for (uint32_t h = 0; h < 0x10000u; ++h) x.push_back(sage::decode_float(sage::kFp16, h));
  // decode_float gives one NaN per NaN code; add NaNs with payloads and both signs explicitly.
  for (uint32_t b : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu})
    x.push_back(bits_float(b));
  return x;
}

std::vector<float> midpoint_inputs() {
  std::vector<float> x;
  for (const sage::FloatFormat* f :
       {&sage::kE4M3, &sage::kE5M2, &sage::kE2M1, &sage::kFp16, &sage::kBf16}) {
    append_midpoints(*f, &x);
  }
  return x;
}

std::vector<float> special_inputs() {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> x = {inf,           -inf,     FLT_MAX,   -FLT_MAX,   1e30f,    -1e30f,
                          1e10f,         65520.0f, -65520.0f, 65519.996f, 57344.0f, 61440.0f,
                          448.0f,        464.0f,   465.0f,    480.0f,     6.0f,     7.0f,
                          8.0f,          0.0f,     -0.0f,     FLT_MIN,    -FLT_MIN, FLT_TRUE_MIN,
                          -FLT_TRUE_MIN, 0x1p-10f, 0x1p-17f,  0x1p-25f,   0x1p-134f};
  for (uint32_t b : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7FBFFFFFu, 0x7FFFFFFFu,
                     0xFFFFFFFFu, 0x7F7F8000u, 0x7F7F7FFFu, 0x00008000u}) {
    x.push_back(bits_float(b));
  }
  return x;
}

std::vector<float> random_inputs() {
  std::mt19937 rng(2024);
  std::vector<float> x;
  for (int i = 0; i < (1 << 18); ++i) x.push_back(bits_float(uint32_t(rng())));
  // Exponents 100..145: the FP8/fp16 ranges, subnormals and overflow edges.
  std::uniform_int_distribution<uint32_t> exp_dist(100, 145);
  for (int i = 0; i < (1 << 18); ++i) {
    x.push_back(bits_float((uint32_t(rng()) & 0x807FFFFFu) | (exp_dist(rng) << 23)));
  }
  return x;
}

// Runs cvt_all_kernel on x and compares every result with encode_float.
void check_fp8_and_half(const std::vector<float>& x, const std::string& what) {
  const int64_t n = int64_t(x.size());
  Stream stream;
  SAGE_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream.s, cudaStreamNonBlocking));
  DeviceArray<float> d_x;
  DeviceArray<uint16_t> d_e4m3, d_e5m2, d_f16, d_bf16;
  DeviceArray<uint32_t> d_f16x2, d_bf16x2;
  SAGE_ASSERT_CUDA(cudaMalloc(&d_x.ptr, n * sizeof(float)));
  SAGE_ASSERT_CUDA(cudaMalloc(&d_e4m3.ptr, n * sizeof(uint16_t)));
  SAGE_ASSERT_CUDA(cudaMalloc(&d_e5m2.ptr, n * sizeof(uint16_t)));
  SAGE_ASSERT_CUDA(cudaMalloc(&d_f16.ptr, n * sizeof(uint16_t)));
  SAGE_ASSERT_CUDA(cudaMalloc(&d_bf16.ptr, n * sizeof(uint16_t)));
  SAGE_ASSERT_CUDA(cudaMalloc(&d_f16x2.ptr, n * sizeof(uint32_t)));
  SAGE_ASSERT_CUDA(cudaMalloc(&d_bf16x2.ptr, n * sizeof(uint32_t)));
  SAGE_ASSERT_CUDA(
      cudaMemcpyAsync(d_x.ptr, x.data(), n * sizeof(float), cudaMemcpyHostToDevice, stream.s));
  const CvtOutputs out{d_e4m3.ptr, d_e5m2.ptr, d_f16.ptr, d_bf16.ptr, d_f16x2.ptr, d_bf16x2.ptr};
  cvt_all_kernel<<<256, 256, 0, stream.s>>>(d_x.ptr, n, out);
  SAGE_ASSERT_CUDA(cudaGetLastError());

  std::vector<uint16_t> e4m3(n), e5m2(n), f16(n), bf16(n);
  std::vector<uint32_t> f16x2(n), bf16x2(n);
  SAGE_ASSERT_CUDA(cudaMemcpyAsync(e4m3.data(), d_e4m3.ptr, n * sizeof(uint16_t),
                                   cudaMemcpyDeviceToHost, stream.s));
  SAGE_ASSERT_CUDA(cudaMemcpyAsync(e5m2.data(), d_e5m2.ptr, n * sizeof(uint16_t),
                                   cudaMemcpyDeviceToHost, stream.s));
  SAGE_ASSERT_CUDA(cudaMemcpyAsync(f16.data(), d_f16.ptr, n * sizeof(uint16_t),
                                   cudaMemcpyDeviceToHost, stream.s));
  SAGE_ASSERT_CUDA(cudaMemcpyAsync(bf16.data(), d_bf16.ptr, n * sizeof(uint16_t),
                                   cudaMemcpyDeviceToHost, stream.s));
  SAGE_ASSERT_CUDA(cudaMemcpyAsync(f16x2.data(), d_f16x2.ptr, n * sizeof(uint32_t),
                                   cudaMemcpyDeviceToHost, stream.s));
  SAGE_ASSERT_CUDA(cudaMemcpyAsync(bf16x2.data(), d_bf16x2.ptr, n * sizeof(uint32_t),
                                   cudaMemcpyDeviceToHost, stream.s));
  SAGE_ASSERT_CUDA(cudaStreamSynchronize(stream.s));

  MismatchLog log{what};
  for (int64_t i = 0; i < n; ++i) {
    const float lo = x[i];
    const float hi = x[n - 1 - i];
    const uint32_t e4_lo = sage::encode_float(sage::kE4M3, lo, /*saturate=*/true);
    const uint32_t e4_hi = sage::encode_float(sage::kE4M3, hi, /*saturate=*/true);
    const uint32_t e5_lo = sage::encode_float(sage::kE5M2, lo, /*saturate=*/true);
    const uint32_t e5_hi = sage::encode_float(sage::kE5M2, hi, /*saturate=*/true);
    const uint32_t h_lo = sage::encode_float(sage::kFp16, lo, /*saturate=*/false);
    const uint32_t h_hi = sage::encode_float(sage::kFp16, hi, /*saturate=*/false);
    const uint32_t b_lo = sage::encode_float(sage::kBf16, lo, /*saturate=*/false);
    const uint32_t b_hi = sage::encode_float(sage::kBf16, hi, /*saturate=*/false);
    log.check(e4m3[i], (e4_hi << 8) | e4_lo, lo, hi, "cvt.rn.satfinite.e4m3x2.f32");
    log.check(e5m2[i], (e5_hi << 8) | e5_lo, lo, hi, "cvt.rn.satfinite.e5m2x2.f32");
    log.check(f16[i], h_lo, lo, lo, "cvt.rn.f16.f32");
    log.check(bf16[i], b_lo, lo, lo, "cvt.rn.bf16.f32");
    log.check(f16x2[i], (h_hi << 16) | h_lo, lo, hi, "cvt.rn.f16x2.f32");
    log.check(bf16x2[i], (b_hi << 16) | b_lo, lo, hi, "cvt.rn.bf16x2.f32");
  }
  log.report();
}

// Skips the test unless this build has FP8 cvt code for the running device.
#define SAGE_REQUIRE_FP8_CVT()                                                      \
  do {                                                                              \
    SAGE_REQUIRE_GPU();                                                             \
    int flags_[2] = {0, 0};                                                         \
    ASSERT_NO_FATAL_FAILURE(query_features(flags_));                                \
    if (flags_[0] == 0) GTEST_SKIP() << "no FP8 cvt code for this device (sm_89+)"; \
  } while (0)

void query_features(int* flags) {
  DeviceArray<int> d_flags;
  SAGE_ASSERT_CUDA(cudaMalloc(&d_flags.ptr, 2 * sizeof(int)));
  cvt_features_kernel<<<1, 1>>>(d_flags.ptr);
  SAGE_ASSERT_CUDA(cudaGetLastError());
  SAGE_ASSERT_CUDA(cudaMemcpy(flags, d_flags.ptr, 2 * sizeof(int), cudaMemcpyDeviceToHost));
}

// Why a cvt of the sm_100a/sm_120a families cannot run here (empty: it can): the device's
// compute capability, or a build without code for it (query_features' second flag).
std::string blackwell_cvt_missing(const char* what) {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
    return std::string("cannot query the device for ") + what;
  const std::string cc = std::to_string(major) + "." + std::to_string(minor);
  if (major < 10)
    return std::string(what) + " needs compute capability 10.0 or later (sm_100a/sm_120a " +
           "families); this device is " + cc;
  int flags[2] = {0, 0};
  query_features(flags);
  if (flags[1] == 0)
    return std::string("this build has no ") + what + " code for compute capability " + cc +
           " (add an arch-specific target such as 100a or 120a)";
  return std::string();
}

// ---------------------------------------------------------------------------------------------
// Tests.

TEST(CvtGpu, EveryFp16ValueMatchesHostCodec) {
  SAGE_REQUIRE_FP8_CVT();
  check_fp8_and_half(every_fp16_input(), "every fp16 value");
}

TEST(CvtGpu, MidpointsAndNeighboursMatchHostCodec) {
  SAGE_REQUIRE_FP8_CVT();
  check_fp8_and_half(midpoint_inputs(), "midpoints of E4M3/E5M2/E2M1/fp16/bf16 and neighbours");
}

TEST(CvtGpu, SpecialsMatchHostCodec) {
  SAGE_REQUIRE_FP8_CVT();
  check_fp8_and_half(special_inputs(), "specials");
}

TEST(CvtGpu, RandomFloatsMatchHostCodec) {
  SAGE_REQUIRE_FP8_CVT();
  check_fp8_and_half(random_inputs(), "random floats");
}

// The element passed as `lo` lands in the low bits, with known codes: 1.0 and 2.0 in each format.
__global__ void pair_order_kernel(uint32_t* out) {
#if defined(SAGE_PTX_HAS_CVT_FP8)
  out[0] = sage::ptx::cvt_e4m3x2(1.0f, 2.0f);
  out[1] = sage::ptx::cvt_e5m2x2(1.0f, 2.0f);
  out[2] = sage::ptx::cvt_f16x2(1.0f, 2.0f);
  out[3] = sage::ptx::cvt_bf16x2(1.0f, 2.0f);
  out[4] = sage::ptx::cvt_f16x2_from_e4m3x2(0x4038);  // hi 2.0, lo 1.0
  out[5] = sage::ptx::cvt_f16x2_from_e5m2x2(0x403C);
#endif
}

TEST(CvtGpu, PairOrderPutsLoInLowBits) {
  SAGE_REQUIRE_FP8_CVT();
  DeviceArray<uint32_t> d_out;
  SAGE_ASSERT_CUDA(cudaMalloc(&d_out.ptr, 6 * sizeof(uint32_t)));
  pair_order_kernel<<<1, 1>>>(d_out.ptr);
  SAGE_ASSERT_CUDA(cudaGetLastError());
  uint32_t out[6];
  SAGE_ASSERT_CUDA(cudaMemcpy(out, d_out.ptr, sizeof out, cudaMemcpyDeviceToHost));
  EXPECT_EQ(out[0], 0x4038u) << "e4m3x2: E4M3 1.0 = 0x38, 2.0 = 0x40";
  EXPECT_EQ(out[1], 0x403Cu) << "e5m2x2: E5M2 1.0 = 0x3C, 2.0 = 0x40";
  EXPECT_EQ(out[2], 0x40003C00u) << "f16x2";
  EXPECT_EQ(out[3], 0x40003F80u) << "bf16x2";
  EXPECT_EQ(out[4], 0x40003C00u) << "f16x2 from e4m3x2";
  EXPECT_EQ(out[5], 0x40003C00u) << "f16x2 from e5m2x2";
}

// Every E4M3 and E5M2 code pair decoded to f16x2 equals the host decode, re-encoded as fp16 (exact:
// both formats are subsets of fp16); NaN comes back as 0x7FFF.
TEST(CvtGpu, Fp8ToF16x2MatchesHostDecode) {
  SAGE_REQUIRE_FP8_CVT();
  DeviceArray<uint32_t> d_out;
  SAGE_ASSERT_CUDA(cudaMalloc(&d_out.ptr, 2 * 65536 * sizeof(uint32_t)));
  fp8_decode_kernel<<<256, 256>>>(d_out.ptr);
  SAGE_ASSERT_CUDA(cudaGetLastError());
  std::vector<uint32_t> out(2 * 65536);
  SAGE_ASSERT_CUDA(
      cudaMemcpy(out.data(), d_out.ptr, out.size() * sizeof(uint32_t), cudaMemcpyDeviceToHost));
  MismatchLog log{"FP8 -> f16x2 decode"};
  for (uint32_t p = 0; p < 65536; ++p) {
    for (int k = 0; k < 2; ++k) {
      const sage::FloatFormat& f = k == 0 ? sage::kE4M3 : sage::kE5M2;
      const uint32_t lo = sage::encode_float(sage::kFp16, sage::decode_float(f, p & 0xFFu), false);
      const uint32_t hi = sage::encode_float(sage::kFp16, sage::decode_float(f, p >> 8), false);
      log.check_code(out[k * 65536 + p], (hi << 16) | lo, p,
                     k == 0 ? "cvt.rn.f16x2.e4m3x2" : "cvt.rn.f16x2.e5m2x2");
    }
  }
  log.report();
}

TEST(CvtGpu, E2m1MatchesHostCodec) {
  SAGE_REQUIRE_GPU();
  std::string why;
  ASSERT_NO_FATAL_FAILURE(why = blackwell_cvt_missing("cvt.rn.satfinite.e2m1x2"));
  if (!why.empty()) GTEST_SKIP() << why;

  std::vector<float> x = every_fp16_input();
  for (const std::vector<float>& more : {midpoint_inputs(), special_inputs(), random_inputs()})
    x.insert(x.end(), more.begin(), more.end());
  const int64_t n = int64_t(x.size());
  DeviceArray<float> d_x;
  DeviceArray<uint16_t> d_out;
  SAGE_ASSERT_CUDA(cudaMalloc(&d_x.ptr, n * sizeof(float)));
  SAGE_ASSERT_CUDA(cudaMalloc(&d_out.ptr, n * sizeof(uint16_t)));
  SAGE_ASSERT_CUDA(cudaMemcpy(d_x.ptr, x.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  cvt_e2m1_kernel<<<256, 256>>>(d_x.ptr, n, d_out.ptr);
  SAGE_ASSERT_CUDA(cudaGetLastError());
  std::vector<uint16_t> out(n);
  SAGE_ASSERT_CUDA(cudaMemcpy(out.data(), d_out.ptr, n * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  MismatchLog log{"cvt.rn.satfinite.e2m1x2.f32"};
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t lo = sage::encode_float(sage::kE2M1, x[i], /*saturate=*/true);
    const uint32_t hi = sage::encode_float(sage::kE2M1, x[n - 1 - i], /*saturate=*/true);
    log.check(out[i], (hi << 4) | lo, x[i], x[n - 1 - i], "cvt.rn.satfinite.e2m1x2.f32");
  }
  log.report();
}

// cvt.{rz,rp}.satfinite.ue8m0x2.f32 against sage::encode_e8m0, the MXFP4 scale's codec (the
// reference's E8M0 semantics for zero, negatives, subnormals and saturation are read from the
// PTX ISA, not measured: this test is what measures them).
TEST(CvtGpu, Ue8m0MatchesHostCodec) {
  SAGE_REQUIRE_GPU();
  std::string why;
  ASSERT_NO_FATAL_FAILURE(why = blackwell_cvt_missing("cvt.ue8m0x2"));
  if (!why.empty()) GTEST_SKIP() << why;
  std::vector<float> x = every_fp16_input();
  for (const std::vector<float>& more : {midpoint_inputs(), special_inputs(), random_inputs()})
    x.insert(x.end(), more.begin(), more.end());
  for (uint32_t b = 1; b < 0x7F800000u; b += 65521) {  // every exponent, both signs
    float f;
    std::memcpy(&f, &b, sizeof f);
    x.push_back(f);
    x.push_back(-f);
  }
  const int64_t n = int64_t(x.size());
  DeviceArray<float> d_x;
  DeviceArray<uint16_t> d_out;
  SAGE_ASSERT_CUDA(cudaMalloc(&d_x.ptr, n * sizeof(float)));
  SAGE_ASSERT_CUDA(cudaMalloc(&d_out.ptr, 2 * n * sizeof(uint16_t)));
  SAGE_ASSERT_CUDA(cudaMemcpy(d_x.ptr, x.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  cvt_ue8m0_kernel<<<256, 256>>>(d_x.ptr, n, d_out.ptr);
  SAGE_ASSERT_CUDA(cudaGetLastError());
  std::vector<uint16_t> out(2 * n);
  SAGE_ASSERT_CUDA(
      cudaMemcpy(out.data(), d_out.ptr, 2 * n * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  for (int up = 0; up < 2; ++up) {
    const char* name = up ? "cvt.rp.satfinite.ue8m0x2.f32" : "cvt.rz.satfinite.ue8m0x2.f32";
    MismatchLog log{name};
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t lo = sage::encode_e8m0(x[i], up != 0);
      const uint32_t hi = sage::encode_e8m0(x[n - 1 - i], up != 0);
      log.check(out[up * n + i], (hi << 8) | lo, x[i], x[n - 1 - i], name);
    }
    log.report();
  }
}

}  // namespace
