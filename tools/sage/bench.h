// `sage bench` options and results (bench.cu with CUDA, bench_stub.cpp without).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ref/reference.h"

namespace sage::tool {

struct BenchOptions {
  std::vector<std::string> variants{"sage-8b"};
  std::vector<int64_t> dims{64, 128};
  std::vector<int64_t> seqs{1024, 2048, 4096, 8192, 16384, 32768};
  std::vector<int> causal{0, 1};
  int64_t batch = 4, heads = 32;
  float q_bias = 0, k_bias = 0, v_bias = 0;  // channel-bias input set: 4, 8, 8
  double seconds = 0.5;                      // timed time per figure (bounded to 3..50 runs)
  int accuracy_rows = 64;                    // sampled query rows per checked head
  int threads = 0;
  sage_kernel kernel = SAGE_KERNEL_AUTO;     // args.kernel: the plan's choice, or a forced family
  uint32_t options = 0;                      // args.options: SAGE_OPTION_* flags
};

// The row name of a variant run with opt's kernel and options, e.g. "sage-8b", "sage-8b-mma",
// "sage-8b-sm90-prepass-q".
std::string bench_impl_name(const std::string& variant, const BenchOptions& opt);

struct BenchRow {
  std::string impl;
  int64_t head_dim = 0, seq_len = 0, batch = 0, heads = 0;
  bool causal = false;
  double e2e_tops = 0, kernel_tops = 0, ms = 0;
  ref::Metrics acc;
};

// Runs the grid, printing a line per figure; false (with a message on stderr) on failure.
bool run_bench(const BenchOptions& opt, std::vector<BenchRow>* rows);
// GPU name, driver and CUDA runtime versions ("" without CUDA).
void device_strings(std::string* gpu, std::string* driver, std::string* cuda);

}  // namespace sage::tool
