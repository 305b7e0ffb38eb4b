// `sage bench`: speed of the GPU kernels over the standard grid (docs/performance.md; B=4, H=32,
// D in {64,128}, N in {1k..32k}, causal or not), end to end (fp16 in -> fp16 out: pre-pass +
// kernel) and kernel-only (pre-quantized workspace), with accuracy against float64 on sampled
// rows next to every figure. CUDA events, median of the timed runs after warm-up. Host + device.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include "api/backend.h"
#include "bench.h"
#include "common/formats.h"
#include "ref/reference.h"

namespace sage::tool {
namespace {

// N(0,1) fp16 from a counter hash (Box-Muller), plus an optional per-(head, channel) bias.
__global__ void fill_normal(uint16_t* out, int64_t n, uint64_t seed, const float* bias,
                            int64_t heads, int64_t seq, int64_t dim) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint64_t x = (uint64_t(i) + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 31, x *= 0xBF58476D1CE4E5B9ull, x ^= x >> 27, x *= 0x94D049BB133111EBull, x ^= x >> 33;
    const float u1 = (float(uint32_t(x)) + 1.0f) * 2.3283064e-10f;
    const float u2 = float(uint32_t(x >> 32)) * 2.3283064e-10f;
    float v = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    if (bias) v += bias[((i / (seq * dim)) % heads) * dim + i % dim];
    out[i] = __half_as_ushort(__float2half_rn(v));
  }
}

#define BENCH_CUDA(call)                                                          \
  do {                                                                            \
    const cudaError_t e_ = (call);                                                \
    if (e_ != cudaSuccess) {                                                      \
      std::fprintf(stderr, "sage bench: %s: %s\n", #call, cudaGetErrorString(e_)); \
      return false;                                                               \
    }                                                                             \
  } while (0)

struct Tensors {
  int64_t B, H, N, D;
  uint16_t *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr;
  void* ws = nullptr;
  ~Tensors() {
    cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(o), cudaFree(ws);
  }
};

bool fill(uint16_t* p, int64_t B, int64_t H, int64_t N, int64_t D, uint64_t seed, float bias_std) {
  float* bias = nullptr;
  if (bias_std > 0) {
    std::vector<float> hb(size_t(H * D));
    uint64_t s = seed * 7919 + 1;
    for (float& x : hb) {  // small host Box-Muller for the bias table
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      const double u1 = (double((s >> 11) & ((1ull << 53) - 1)) + 1.0) / 9007199254740993.0;
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      const double u2 = double((s >> 11) & ((1ull << 53) - 1)) / 9007199254740992.0;
      x = bias_std * float(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
    }
    BENCH_CUDA(cudaMalloc(&bias, hb.size() * 4));
    BENCH_CUDA(cudaMemcpy(bias, hb.data(), hb.size() * 4, cudaMemcpyHostToDevice));
  }
  fill_normal<<<1024, 256>>>(p, B * H * N * D, seed, bias, H, N, D);
  BENCH_CUDA(cudaDeviceSynchronize());
  cudaFree(bias);
  return true;
}

// float64 attention of `rows` sampled query rows in each of 8 heads spread over the batch and
// heads, against the GPU output, as SPEC §5 metrics (errors correlate within a head through its
// V scales, so several heads are checked).
ref::Metrics sampled_accuracy(const Tensors& t, bool causal, int rows, int threads) {
  const int64_t N = t.N, D = t.D;
  std::vector<double> want, got;
  const int64_t heads = t.B * t.H, checked = std::min<int64_t>(8, heads);
  for (int64_t which = 0; which < checked; ++which) {
    const int64_t head = which * (heads - 1) / std::max<int64_t>(1, checked - 1);
    std::vector<uint16_t> q(size_t(N * D)), k(q.size()), v(q.size()), o(q.size());
    const size_t off = size_t(head * N * D);
    cudaMemcpy(q.data(), t.q + off, q.size() * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(k.data(), t.k + off, k.size() * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(v.data(), t.v + off, v.size() * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(o.data(), t.o + off, o.size() * 2, cudaMemcpyDeviceToHost);
    // One head, the sampled rows as the queries (bottom-right = top-left as Nq = Nk; the sampled
    // row keeps its own diagonal through the key count).
    const int64_t step = std::max<int64_t>(1, N / rows);
    std::vector<int64_t> picked;
    for (int64_t i = step / 2; i < N; i += step) picked.push_back(i);
    std::vector<double> out(picked.size() * size_t(D));
    ref::parallel_for(int64_t(picked.size()), threads, [&](int64_t r) {
      const int64_t i = picked[size_t(r)], nk = causal ? i + 1 : N;
      std::vector<uint16_t> qi(q.begin() + i * D, q.begin() + (i + 1) * D);
      const ref::Problem p{1, 1, 1, 1, nk, D, 1.0 / std::sqrt(double(D)), SAGE_MASK_NONE};
      const sage_strides s{N * D, N * D, D};
      ref::attention_exact(p, {qi.data(), SAGE_DTYPE_FP16, s}, {k.data(), SAGE_DTYPE_FP16, s},
                           {v.data(), SAGE_DTYPE_FP16, s}, &out[size_t(r * D)], nullptr, 1);
    });
    for (size_t r = 0; r < picked.size(); ++r)
      for (int64_t d = 0; d < D; ++d) {
        want.push_back(out[r * size_t(D) + size_t(d)]);
        got.push_back(decode_float(kFp16, o[size_t(picked[r] * D + d)]));
      }
  }
  return ref::compare(want.data(), got.data(), int64_t(want.size()));
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

bool run_bench(const BenchOptions& opt, std::vector<BenchRow>* rows) {
  for (const std::string& variant : opt.variants)
    for (int64_t D : opt.dims)
      for (int causal : opt.causal)
        for (int64_t N : opt.seqs) {
          Tensors t{opt.batch, opt.heads, N, D};
          const size_t elems = size_t(t.B * t.H * N * D);
          BENCH_CUDA(cudaMalloc(&t.q, elems * 2));
          BENCH_CUDA(cudaMalloc(&t.k, elems * 2));
          BENCH_CUDA(cudaMalloc(&t.v, elems * 2));
          BENCH_CUDA(cudaMalloc(&t.o, elems * 2));
          const uint64_t seed = uint64_t(std::time(nullptr)) ^ uint64_t(N * 131 + D);
          if (!fill(t.q, t.B, t.H, N, D, seed, opt.q_bias) ||
              !fill(t.k, t.B, t.H, N, D, seed + 1, opt.k_bias) ||
              !fill(t.v, t.B, t.H, N, D, seed + 2, opt.v_bias))
            return false;
          sage_attention_args a;
          sage_attention_args_init(&a);
          a.q = t.q, a.k = t.k, a.v = t.v, a.o = t.o;
          a.batch = t.B, a.heads_q = t.H, a.heads_kv = t.H, a.seq_q = N, a.seq_kv = N, a.head_dim = D;
          a.mask = causal ? SAGE_MASK_CAUSAL_TOP_LEFT : SAGE_MASK_NONE;
          a.variant = variant == "sage-4b"   ? SAGE_VARIANT_SAGE2_4B
                      : variant == "sage-fp4" ? SAGE_VARIANT_SAGE3_FP4  // pre-pass in the kernel stage
                                              : SAGE_VARIANT_SAGE2_8B;
          a.kernel = opt.kernel;
          a.options = opt.options;
          const std::string impl = bench_impl_name(variant, opt);
          // A forced kernel family may have no kernel for a shape or this GPU: that row is
          // skipped with the library's reason, the rest of the grid still runs.
          auto skip_or_fail = [&](sage_status st) {
            std::fprintf(st == SAGE_ERROR_UNSUPPORTED ? stdout : stderr, "%s%s D=%" PRId64
                         " N=%" PRId64 " %s: %s\n", st == SAGE_ERROR_UNSUPPORTED ? "" : "sage bench: ",
                         impl.c_str(), D, N, causal ? "causal" : "non-causal", sage_last_error());
            return st == SAGE_ERROR_UNSUPPORTED;
          };
          size_t ws = 0;
          if (const sage_status st = sage_attention_workspace_size(&a, &ws); st != SAGE_OK) {
            if (skip_or_fail(st)) continue;
            return false;
          }
          BENCH_CUDA(cudaMalloc(&t.ws, ws));
          a.workspace = t.ws, a.workspace_size = ws;
          api::Resolved r;
          if (const sage_status st = api::validate(&a, &r); st != SAGE_OK) {
            if (skip_or_fail(st)) continue;
            return false;
          }
          if (const sage_status st = cuda::attention_stages(r, a, cuda::kStagePrepass |
                                                                      cuda::kStageKernel);
              st != SAGE_OK) {
            if (skip_or_fail(st)) continue;
            return false;
          }
          cudaEvent_t e0, e1;
          cudaEventCreate(&e0), cudaEventCreate(&e1);
          auto time_stages = [&](int stages, int iters) {
            std::vector<double> ms;
            for (int i = 0; i < iters; ++i) {
              cudaEventRecord(e0);
              cuda::attention_stages(r, a, stages);
              cudaEventRecord(e1);
              cudaEventSynchronize(e1);
              float x = 0;
              cudaEventElapsedTime(&x, e0, e1);
              ms.push_back(x);
            }
            return median(ms);
          };
          const int all = cuda::kStagePrepass | cuda::kStageKernel;
          const double first = time_stages(all, 1);  // warm-up, and sizes the run count
          const int iters = std::clamp(int(opt.seconds * 1000.0 / std::max(first, 1e-3)), 3, 50);
          time_stages(all, 2);
          const double e2e_ms = time_stages(all, iters);
          const double kernel_ms = time_stages(cuda::kStageKernel, iters);
          cudaEventDestroy(e0), cudaEventDestroy(e1);
          BENCH_CUDA(cudaGetLastError());
          // Output of a full call for the accuracy check.
          cuda::attention_stages(r, a, all);
          BENCH_CUDA(cudaDeviceSynchronize());
          const double flops = 4.0 * double(t.B * t.H) * double(N) * double(N) * double(D) *
                               (causal ? 0.5 : 1.0);
          BenchRow row;
          row.impl = impl;
          row.head_dim = D, row.seq_len = N, row.batch = t.B, row.heads = t.H;
          row.causal = causal != 0;
          row.ms = e2e_ms;
          row.e2e_tops = flops / (e2e_ms * 1e-3) / 1e12;
          row.kernel_tops = flops / (kernel_ms * 1e-3) / 1e12;
          row.acc = sampled_accuracy(t, causal != 0, opt.accuracy_rows, opt.threads);
          std::printf("%-8s D=%-3" PRId64 " N=%-6" PRId64 " %-10s e2e %8.3f ms %7.1f TOPS | "
                      "kernel %7.1f TOPS | cos %.5f rel-L1 %.4f rmse %.4f max %.4f\n",
                      row.impl.c_str(), D, N, causal ? "causal" : "non-causal", e2e_ms,
                      row.e2e_tops, row.kernel_tops, row.acc.cos, row.acc.rel_l1, row.acc.rmse,
                      row.acc.max_abs);
          std::fflush(stdout);
          rows->push_back(row);
        }
  return true;
}

}  // namespace sage::tool

namespace sage::tool {

void device_strings(std::string* gpu, std::string* driver, std::string* cuda) {
  cudaDeviceProp prop{};
  int dev = 0, drv = 0, rt = 0;
  cudaGetDevice(&dev);
  *gpu = cudaGetDeviceProperties(&prop, dev) == cudaSuccess ? prop.name : "";
  cudaDriverGetVersion(&drv);
  cudaRuntimeGetVersion(&rt);
  *driver = std::to_string(drv / 1000) + "." + std::to_string(drv % 1000 / 10);
  *cuda = std::to_string(rt / 1000) + "." + std::to_string(rt % 1000 / 10);
}

}  // namespace sage::tool
