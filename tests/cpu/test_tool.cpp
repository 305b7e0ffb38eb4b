// The `sage` tool end to end: .npy inputs (float16 and float32, HND and NHD) written here, read
// by `sage accuracy --json`; the same data in either form must give the same table. And how it
// fails: usage on --help, one line on stderr and a non-zero exit for a wrong command, option or
// input file, and plain words where there is no GPU.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "common/test_util.h"

#ifndef SAGE_TOOL_PATH
#error "SAGE_TOOL_PATH must name the sage executable"
#endif

namespace {

// Writes a version-1 .npy file of `shape` with descr '<f2' or '<f4' (or `descr`).
void write_npy(const std::string& path, const std::vector<int64_t>& shape, bool fp16,
               const void* data, size_t bytes, const char* descr = nullptr) {
  std::string dims;
  for (size_t i = 0; i < shape.size(); ++i) dims += std::to_string(shape[i]) + ", ";
  if (shape.size() > 1) dims.resize(dims.size() - 2);
  std::string header = std::string("{'descr': '") + (descr ? descr : fp16 ? "<f2" : "<f4") +
                       "', 'fortran_order': False, 'shape': (" + dims + "), }";
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::ofstream f(path, std::ios::binary);
  f.write("\x93NUMPY\x01\x00", 8);
  const uint16_t len = uint16_t(header.size());
  f.write(reinterpret_cast<const char*>(&len), 2);
  f.write(header.data(), std::streamsize(header.size()));
  f.write(static_cast<const char*>(data), std::streamsize(bytes));
}

std::string run(const std::string& cmd, int* status) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  *status = pclose(p);
  return out;
}

// The tool's stdout and stderr apart, and its exit status (not the shell's wait status).
struct ToolRun {
  std::string out, err;
  int exit = -1;
};
ToolRun sage_tool(const std::string& args) {
  static int calls = 0;
  const std::string err_file = ::testing::TempDir() + "sage_tool_stderr_" +
                               std::to_string(getpid()) + "_" + std::to_string(calls++);
  ToolRun r;
  int status = -1;
  r.out = run(std::string(SAGE_TOOL_PATH) + " " + args + " 2>" + err_file, &status);
  r.exit = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream f(err_file);
  std::stringstream ss;
  ss << f.rdbuf();
  r.err = ss.str();
  std::remove(err_file.c_str());
  return r;
}

// One line on stderr naming `word`, nothing on stdout, a non-zero exit: the tool's error form.
void expect_one_line_error(const ToolRun& r, const std::string& word) {
  EXPECT_NE(r.exit, 0) << r.err;
  EXPECT_NE(r.exit, -1) << "the tool did not exit normally (a crash?): " << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_NE(r.err.find(word), std::string::npos) << "stderr does not name '" << word << "': "
                                                   << r.err;
  EXPECT_EQ(r.out, "");
}

TEST(Tool, AccuracyReadsNpyInEveryFormAndLayout) {
  const uint64_t seed = sage::test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t H = 2, N = 96, D = 64;
  const auto q = sage::test::random_tensor(rng, 1, H, N, D, 2.0f);
  const auto k = sage::test::random_tensor(rng, 1, H, N, D, 6.0f);
  const auto v = sage::test::random_tensor(rng, 1, H, N, D, 3.0f);
  const std::string dir = ::testing::TempDir();
  std::string tables[2];
  for (int form = 0; form < 2; ++form) {  // 0: fp16 HND [H,N,D]; 1: fp32 NHD [1,N,H,D]
    std::string args;
    for (const auto* t : {&q, &k, &v}) {
      const std::string name = dir + "sage_tool_" + std::to_string(form) + "_" +
                               (t == &q ? "q" : t == &k ? "k" : "v") + ".npy";
      if (form == 0) {
        write_npy(name, {H, N, D}, true, t->data.data(), t->data.size() * 2);
      } else {
        std::vector<float> nhd(size_t(N * H * D));
        for (int64_t h = 0; h < H; ++h)
          for (int64_t n = 0; n < N; ++n)
            for (int64_t d = 0; d < D; ++d)
              nhd[size_t((n * H + h) * D + d)] =
                  sage::decode_float(sage::kFp16, t->data[size_t((h * N + n) * D + d)]);
        write_npy(name, {1, N, H, D}, false, nhd.data(), nhd.size() * 4);
      }
      args += std::string(" --") + (t == &q ? "q" : t == &k ? "k" : "v") + " " + name;
    }
    if (form == 1) args += " --layout NHD";
    int status = -1;
    tables[form] = run(std::string(SAGE_TOOL_PATH) + " accuracy --json --threads 2" + args, &status);
    ASSERT_EQ(status, 0) << tables[form];
    EXPECT_NE(tables[form].find("\"seq_q\": 96"), std::string::npos) << tables[form];
    EXPECT_NE(tables[form].find("\"Q+K\""), std::string::npos);
    // The SageAttention3 paper's FP4 table, on the user's tensors too.
    EXPECT_NE(tables[form].find("\"NVFP4, P~ two-level (SageAttn3)\""),
              std::string::npos);
    EXPECT_NE(tables[form].find("\"MXFP4 (E8M0 scale / 32), P~ direct\""), std::string::npos);
  }
  // Identical numbers (the "seconds" fields differ): compare with those fields cut out.
  auto strip = [](std::string s) {
    for (size_t p; (p = s.find("\"seconds\": ")) != std::string::npos;) {
      const size_t e = s.find_first_of(",}", p);
      s.erase(p, e - p);
    }
    return s;
  };
  EXPECT_EQ(strip(tables[0]), strip(tables[1]));
}

TEST(Tool, BadInputsAreClearErrors) {
  int status = 0;
  const std::string missing =
      run(std::string(SAGE_TOOL_PATH) + " accuracy --q /nonexistent.npy --k x --v y 2>&1", &status);
  EXPECT_NE(status, 0);
  EXPECT_NE(missing.find("/nonexistent.npy"), std::string::npos) << missing;
  const std::string unknown = run(std::string(SAGE_TOOL_PATH) + " accuracy --bogus 2>&1", &status);
  EXPECT_NE(status, 0);
  EXPECT_NE(unknown.find("--bogus"), std::string::npos) << unknown;
  // A value that is not wholly a number is named with its option ("64x" is not 64).
  const std::pair<const char*, const char*> bad[] = {
      {" accuracy --seq abc", "--seq abc: not a number"},
      {" accuracy --heads 2 --seq 64x", "--seq 64x: not a number"},
      {" accuracy --seed -3 --seq 64", "--seed -3: not a number"},
      {" bench --seqs 1024,2k", "--seqs 2k: not a number"}};
  for (const auto& [args, says] : bad) {
    const std::string badnum = run(std::string(SAGE_TOOL_PATH) + args + " 2>&1", &status);
    EXPECT_NE(status, 0) << args;
    EXPECT_NE(badnum.find(says), std::string::npos) << badnum;
  }
  const std::string info = run(std::string(SAGE_TOOL_PATH) + " info", &status);
  EXPECT_EQ(status, 0);
  EXPECT_NE(info.find("CUDA architectures built"), std::string::npos) << info;
}

TEST(Tool, HelpAndVersionPrintUsageOnStdoutAndExitZero) {
  const ToolRun version = sage_tool("--version");
  EXPECT_EQ(version.exit, 0) << version.err;
  EXPECT_EQ(version.out, std::string("sage ") + sage_version() + "\n");
  const ToolRun help = sage_tool("--help");
  EXPECT_EQ(help.exit, 0) << help.err;
  EXPECT_EQ(help.out.rfind("usage: sage <command>", 0), 0u) << help.out;
  EXPECT_EQ(help.err, "");
  for (const std::string cmd : {"accuracy", "bench", "info"}) {
    SCOPED_TRACE(cmd);
    EXPECT_NE(help.out.find("\n  " + cmd + " "), std::string::npos) << help.out;
    for (const char* flag : {"--help", "-h"}) {
      const ToolRun r = sage_tool(cmd + " " + flag);
      EXPECT_EQ(r.exit, 0) << r.err;
      EXPECT_EQ(r.out.rfind("usage: sage " + cmd, 0), 0u) << r.out;
      EXPECT_EQ(r.err, "");
    }
  }
  // Each command's own options.
  EXPECT_NE(sage_tool("accuracy --help").out.find("--layout"), std::string::npos);
  EXPECT_NE(sage_tool("bench --help").out.find("--seqs"), std::string::npos);
  EXPECT_EQ(sage_tool("info --help").out.find("--seqs"), std::string::npos);
}

TEST(Tool, UnknownCommandOrOptionIsOneLine) {
  expect_one_line_error(sage_tool("frobnicate"), "'frobnicate'");
  expect_one_line_error(sage_tool("--verbose"), "'--verbose'");
  expect_one_line_error(sage_tool("accuracy --bogus"), "'--bogus'");
  expect_one_line_error(sage_tool("accuracy --seq"), "'--seq' needs a value");
  // Another command's option is refused, not silently ignored (--dim is accuracy's; bench's is
  // --dims).
  expect_one_line_error(sage_tool("bench --dim 64"), "'--dim'");
  expect_one_line_error(sage_tool("accuracy --dims 64"), "'--dims'");
  expect_one_line_error(sage_tool("info --json"), "'--json'");
}

// On a machine without a usable GPU (this test's usual home: CI without a GPU driver), `sage
// info` says why in plain words and `sage bench` fails with that reason as its one line.
TEST(Tool, InfoAndBenchSayWhyThereIsNoGpu) {
  const ToolRun info = sage_tool("info");
  ASSERT_EQ(info.exit, 0) << info.err;
  if (info.out.find("\nGPU 0: ") != std::string::npos) GTEST_SKIP() << "a GPU is visible";
  const std::string last = info.out.substr(info.out.rfind('\n', info.out.size() - 2) + 1);
  EXPECT_EQ(last.rfind("no ", 0), 0u) << info.out;
  const bool cuda_built = info.out.find("CUDA architectures built: none") == std::string::npos;
  void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (driver) {
    dlclose(driver);
  } else if (cuda_built) {
    // Not the CUDA runtime's own words, which blame the driver's version.
    EXPECT_EQ(last.rfind("no NVIDIA GPU driver found: ", 0), 0u) << info.out;
  }
  const ToolRun bench = sage_tool("bench --dims 64 --seqs 1024 --causal 0");
  expect_one_line_error(bench, "sage bench: " + last.substr(0, last.size() - 1));
}

// Each input the accuracy comparison cannot use is one line naming the file, exit status 2.
TEST(Tool, AccuracyInputErrorsAreOneLineNamingTheFile) {
  const std::string dir = ::testing::TempDir() + "sage_tool_bad_" + std::to_string(getpid()) + "_";
  const int64_t N = 16, D = 64;
  std::vector<float> ok(size_t(N * D));
  for (size_t i = 0; i < ok.size(); ++i) ok[i] = std::sin(float(i));
  write_npy(dir + "ok.npy", {N, D}, false, ok.data(), ok.size() * 4);
  auto accuracy = [&](const std::string& q) {
    return sage_tool("accuracy --threads 2 --q " + q + " --k " + dir + "ok.npy --v " + dir +
                     "ok.npy");
  };
  ASSERT_EQ(accuracy(dir + "ok.npy").exit, 0);

  expect_one_line_error(accuracy(dir + "missing.npy"), dir + "missing.npy: cannot open");
  {
    std::ofstream f(dir + "garbage.npy");
    f << "not an array";
  }
  expect_one_line_error(accuracy(dir + "garbage.npy"), "garbage.npy: not a .npy file");
  write_npy(dir + "short.npy", {N, D}, false, ok.data(), ok.size() * 2);  // half the data
  expect_one_line_error(accuracy(dir + "short.npy"), "short.npy: truncated data");
  write_npy(dir + "huge.npy", {int64_t(1) << 30, int64_t(1) << 30}, false, ok.data(), 64);
  expect_one_line_error(accuracy(dir + "huge.npy"), "huge.npy: bad shape");
  std::vector<int32_t> ints(ok.size(), 1);
  write_npy(dir + "int32.npy", {N, D}, false, ints.data(), ints.size() * 4, "<i4");
  expect_one_line_error(accuracy(dir + "int32.npy"), "int32.npy: dtype '<i4' unsupported");
  write_npy(dir + "empty.npy", {0, D}, false, ok.data(), 0);
  expect_one_line_error(accuracy(dir + "empty.npy"), "empty.npy: N = 0");
  std::vector<float> big = ok;
  big[5] = -1.0e5f;
  write_npy(dir + "big.npy", {N, D}, false, big.data(), big.size() * 4);
  expect_one_line_error(accuracy(dir + "big.npy"),
                        "big.npy: values up to 1e+05 overflow fp16 (max 65504)");
  std::vector<float> nan = ok;
  nan[7] = std::nanf("");
  write_npy(dir + "nan.npy", {N, D}, false, nan.data(), nan.size() * 4);
  expect_one_line_error(accuracy(dir + "nan.npy"), "nan.npy: 1 of 1024 values are NaN");
  std::vector<float> wide(size_t(N * 300), 0.5f);
  write_npy(dir + "wide.npy", {N, 300}, false, wide.data(), wide.size() * 4);
  expect_one_line_error(
      sage_tool("accuracy --q " + dir + "wide.npy --k " + dir + "wide.npy --v " + dir + "wide.npy"),
      "wide.npy: D = 300 is above the largest head dim, 256");
}

}  // namespace
