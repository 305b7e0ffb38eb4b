// Probe: what does the fp32 accumulator of the FP8 tensor-core MMA really keep? Runs
// mma.sync m16n8k32 e4m3 (sm_89+) with known operands, many steps chained as P·V accumulates,
// and fits candidate models of one MMA step (exact sum then truncate / round to m mantissa bits,
// or align every addend to the largest exponent and truncate) to the observed bits. The result
// sets the CPU emulation's accumulator model (sage_quant_config.accum_mantissa_bits). sm_89/sm_90a.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/formats.h"
#include "ptx/mma.cuh"
#include "probe_util.h"

namespace {

// One warp: for each step, d = A·B_step + c where c is the previous d (chain) or c_in[step].
// A is every element equal to a_bits (so each output is c + a·Σ_k B[k, col]).
__global__ void probe_kernel(uint8_t a_bits, const uint32_t* b, const float* c_in, float* d_out,
                             int steps, int chain) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const int lane = threadIdx.x;
  const uint32_t a4 = uint32_t(a_bits) * 0x01010101u;
  const uint32_t a[4] = {a4, a4, a4, a4};
  float c[4] = {c_in[lane * 4 + 0], c_in[lane * 4 + 1], c_in[lane * 4 + 2], c_in[lane * 4 + 3]};
  for (int s = 0; s < steps; ++s) {
    if (!chain && s > 0)
      for (int e = 0; e < 4; ++e) c[e] = c_in[(s * 32 + lane) * 4 + e];
    const uint32_t bb[2] = {b[(s * 32 + lane) * 2 + 0], b[(s * 32 + lane) * 2 + 1]};
    float d[4];
    sage::ptx::mma_m16n8k32_e4m3(d, a, bb, c);
    for (int e = 0; e < 4; ++e) {
      d_out[(s * 32 + lane) * 4 + e] = d[e];
      c[e] = d[e];
    }
  }
#endif
}

struct Experiment {
  std::string name;
  uint8_t a_bits;
  int steps;
  bool chain;
  std::vector<uint32_t> b;  // [steps][32][2]
  std::vector<float> c;     // [steps or 1][32][4]
  std::vector<float> d;     // [steps][32][4] observed
};

double e4m3(uint8_t bits) { return sage::decode_float(sage::kE4M3, bits); }

// The 32 products of output column `col` in step s: a · B[k, col], B column col held by lanes
// 4col..4col+3 (k order does not matter for a sum).
void products(const Experiment& x, int s, int col, double* p) {
  int n = 0;
  for (int lane = 4 * col; lane < 4 * col + 4; ++lane)
    for (int r = 0; r < 2; ++r) {
      const uint32_t w = x.b[size_t((s * 32 + lane) * 2 + r)];
      for (int j = 0; j < 4; ++j) p[n++] = e4m3(x.a_bits) * e4m3(uint8_t(w >> (8 * j)));
    }
}

double trunc_bits(double v, int m) {
  if (v == 0 || !std::isfinite(v)) return v;
  int e;
  const double f = std::frexp(v, &e);
  return std::ldexp(std::trunc(std::ldexp(f, m + 1)), e - m - 1);
}
double round_bits(double v, int m) {
  if (v == 0 || !std::isfinite(v)) return v;
  int e;
  const double f = std::frexp(v, &e);
  return std::ldexp(std::nearbyint(std::ldexp(f, m + 1)), e - m - 1);
}

enum Model { kSumTrunc, kSumRound, kAlignTrunc, kAlignFloor, kModels };
const char* kModelNames[kModels] = {"exact sum, truncate", "exact sum, round-nearest",
                                    "align to max exponent, truncate each addend",
                                    "align to max exponent, floor each addend"};

double model(Model mdl, int m, double c, const double* p) {
  if (mdl == kSumTrunc || mdl == kSumRound) {
    double s = c;
    for (int k = 0; k < 32; ++k) s += p[k];
    return float(mdl == kSumTrunc ? trunc_bits(s, m) : round_bits(s, m));
  }
  int emax = -100000;
  auto consider = [&](double v) {
    if (v != 0) {
      int e;
      std::frexp(v, &e);
      emax = std::max(emax, e - 1);
    }
  };
  consider(c);
  for (int k = 0; k < 32; ++k) consider(p[k]);
  if (emax == -100000) return c;
  const double q = std::ldexp(1.0, emax - m);
  auto cut = [&](double v) { return (mdl == kAlignTrunc ? std::trunc(v / q) : std::floor(v / q)) * q; };
  double s = cut(c);
  for (int k = 0; k < 32; ++k) s += cut(p[k]);
  return float(trunc_bits(s, m));
}

uint8_t random_e4m3(std::mt19937_64& rng, bool positive, int min_exp_field) {
  for (;;) {
    uint8_t bits = uint8_t(rng());
    if ((bits & 0x7F) == 0x7F) continue;                  // NaN
    if (((bits >> 3) & 0xF) < min_exp_field) continue;    // keep magnitudes in a band
    if (positive) bits &= 0x7F;
    return bits;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const char* json_path = argc > 1 ? argv[1] : nullptr;
  int dev = 0;
  cudaDeviceProp prop{};
  CUDA_OK(cudaGetDeviceProperties(&prop, dev));
  std::printf("device: %s sm_%d%d\n", prop.name, prop.major, prop.minor);
  if (prop.major * 10 + prop.minor < 89) {
    std::printf("FP8 mma needs sm_89+: skipped\n");
    return 0;
  }
  std::mt19937_64 rng(20261122);
  std::vector<Experiment> xs;
  // P·V-like chains: positive products accumulating over 512 MMAs (16k keys) from 0.
  for (int band : {0, 6, 10}) {
    Experiment x{"chain, positive products, exp field >= " + std::to_string(band), 0x38, 512, true};
    for (int i = 0; i < 512 * 64; ++i) {
      uint32_t w = 0;
      for (int j = 0; j < 4; ++j) w |= uint32_t(random_e4m3(rng, true, band)) << (8 * j);
      x.b.push_back(w);
    }
    x.c.assign(32 * 4, 0.0f);
    xs.push_back(x);
  }
  // Mixed signs, chained.
  {
    Experiment x{"chain, mixed-sign products", 0x30, 512, true};
    for (int i = 0; i < 512 * 64; ++i) {
      uint32_t w = 0;
      for (int j = 0; j < 4; ++j) w |= uint32_t(random_e4m3(rng, false, 4)) << (8 * j);
      x.b.push_back(w);
    }
    x.c.assign(32 * 4, 0.0f);
    xs.push_back(x);
  }
  // Independent steps: random full-mantissa C over many magnitudes, random products.
  {
    Experiment x{"independent, random fp32 C, mixed products", 0x38, 512, false};
    std::uniform_real_distribution<double> u(1.0, 2.0);
    for (int i = 0; i < 512 * 64; ++i) {
      uint32_t w = 0;
      for (int j = 0; j < 4; ++j) w |= uint32_t(random_e4m3(rng, false, 0)) << (8 * j);
      x.b.push_back(w);
    }
    for (int i = 0; i < 512 * 128; ++i) {
      const int e = int(rng() % 30) - 10;
      x.c.push_back(float((rng() & 1 ? -1 : 1) * std::ldexp(u(rng), e)));
    }
    xs.push_back(x);
  }
  // C = 0·0 + D with a full 23-bit D: does a zero product pass D through?
  {
    Experiment x{"zero products, random fp32 C", 0x00, 64, false};
    std::uniform_real_distribution<double> u(1.0, 2.0);
    x.b.assign(64 * 64, 0u);
    for (int i = 0; i < 64 * 128; ++i) x.c.push_back(float(std::ldexp(u(rng), int(rng() % 20) - 5)));
    xs.push_back(x);
  }

  for (Experiment& x : xs) {
    uint32_t* db;
    float *dc, *dd;
    CUDA_OK(cudaMalloc(&db, x.b.size() * 4));
    CUDA_OK(cudaMalloc(&dc, x.c.size() * 4));
    CUDA_OK(cudaMalloc(&dd, size_t(x.steps) * 128 * 4));
    CUDA_OK(cudaMemcpy(db, x.b.data(), x.b.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dc, x.c.data(), x.c.size() * 4, cudaMemcpyHostToDevice));
    probe_kernel<<<1, 32>>>(x.a_bits, db, dc, dd, x.steps, x.chain ? 1 : 0);
    CUDA_OK(cudaGetLastError());
    x.d.resize(size_t(x.steps) * 128);
    CUDA_OK(cudaMemcpy(x.d.data(), dd, x.d.size() * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaFree(db));
    CUDA_OK(cudaFree(dc));
    CUDA_OK(cudaFree(dd));
  }

  FILE* js = json_path ? std::fopen(json_path, "w") : nullptr;
  if (js) std::fprintf(js, "{\"device\": \"%s\", \"experiments\": [\n", prop.name);
  int best_m_overall = -1;
  for (size_t xi = 0; xi < xs.size(); ++xi) {
    const Experiment& x = xs[xi];
    std::printf("\n%s (%d steps x 128 outputs)\n", x.name.c_str(), x.steps);
    if (js) std::fprintf(js, "%s {\"name\": \"%s\", \"models\": [", xi ? "," : "", x.name.c_str());
    long total = 0;
    std::vector<std::vector<long>> match(kModels, std::vector<long>(26, 0));
    double final_rel_err_sum = 0;
    for (int s = 0; s < x.steps; ++s)
      for (int lane = 0; lane < 32; ++lane)
        for (int e = 0; e < 4; ++e) {
          const int col = (lane % 4) * 2 + (e & 1);
          double p[32];
          products(x, s, col, p);
          const float c = x.chain ? (s == 0 ? x.c[size_t(lane * 4 + e)]
                                            : x.d[size_t(((s - 1) * 32 + lane) * 4 + e)])
                                  : x.c[size_t((s * 32 + lane) * 4 + e)];
          const float got = x.d[size_t((s * 32 + lane) * 4 + e)];
          ++total;
          for (int mdl = 0; mdl < kModels; ++mdl)
            for (int m = 10; m <= 25; ++m)
              match[size_t(mdl)][size_t(m)] += float(model(Model(mdl), m, c, p)) == got;
          if (s == x.steps - 1 && x.chain) {
            // Accumulated drift: the chained fp32-exact sum against what the hardware kept.
            double exact = 0;
            for (int t = 0; t < x.steps; ++t) {
              double pp[32];
              products(x, t, col, pp);
              for (double v : pp) exact += v;
            }
            final_rel_err_sum += std::fabs(double(got) - exact) / std::max(1e-30, std::fabs(exact));
          }
        }
    for (int mdl = 0; mdl < kModels; ++mdl) {
      int best = 10;
      for (int m = 10; m <= 25; ++m)
        if (match[size_t(mdl)][size_t(m)] > match[size_t(mdl)][size_t(best)]) best = m;
      std::printf("  %-46s best m=%2d: %6.2f%% exact (m=13: %6.2f%%, m=23: %6.2f%%)\n",
                  kModelNames[mdl], best, 100.0 * match[size_t(mdl)][size_t(best)] / total,
                  100.0 * match[size_t(mdl)][13] / total, 100.0 * match[size_t(mdl)][23] / total);
      if (js)
        std::fprintf(js, "%s{\"model\": \"%s\", \"best_mantissa_bits\": %d, \"match\": %.6f, "
                         "\"match_m13\": %.6f, \"match_m23\": %.6f}",
                     mdl ? ", " : "", kModelNames[mdl], best,
                     double(match[size_t(mdl)][size_t(best)]) / total,
                     double(match[size_t(mdl)][13]) / total, double(match[size_t(mdl)][23]) / total);
      if (mdl == kSumTrunc && xi == 0) best_m_overall = best;
    }
    if (x.chain)
      std::printf("  relative error of the chained sum after %d MMAs (%d keys): mean %.3g\n",
                  x.steps, x.steps * 32, final_rel_err_sum / 128.0);
    if (js) std::fprintf(js, "], \"chain_final_mean_rel_err\": %.6g}\n",
                         x.chain ? final_rel_err_sum / 128.0 : 0.0);
  }
  if (js) {
    std::fprintf(js, "]}\n");
    std::fclose(js);
  }
  std::printf("\nbest truncation model bits (first experiment): %d\n", best_m_overall);
  return 0;
}
