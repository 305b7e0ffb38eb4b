// The `sage` tool end to end: .npy inputs (float16 and float32, HND and NHD) written here, read
// by `sage accuracy --json`; the same data in either form must give the same table.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/test_util.h"

#ifndef SAGE_TOOL_PATH
#error "SAGE_TOOL_PATH must name the sage executable"
#endif

namespace {

// Writes a version-1 .npy file of `shape` with descr '<f2' or '<f4'.
void write_npy(const std::string& path, const std::vector<int64_t>& shape, bool fp16,
               const void* data, size_t bytes) {
  std::string dims;
  for (size_t i = 0; i < shape.size(); ++i) dims += std::to_string(shape[i]) + ", ";
  if (shape.size() > 1) dims.resize(dims.size() - 2);
  std::string header = std::string("{'descr': '") + (fp16 ? "<f2" : "<f4") +
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
  const std::string badnum = run(std::string(SAGE_TOOL_PATH) + " accuracy --seq abc 2>&1", &status);
  EXPECT_NE(status, 0);
  EXPECT_NE(badnum.find("not a number"), std::string::npos) << badnum;
  const std::string info = run(std::string(SAGE_TOOL_PATH) + " info", &status);
  EXPECT_EQ(status, 0);
  EXPECT_NE(info.find("CUDA architectures built"), std::string::npos) << info;
}

}  // namespace
