// `sage bench` in a build without CUDA: nothing to time.
#include <cstdio>

#include "bench.h"

namespace sage::tool {

bool run_bench(const BenchOptions&, std::vector<BenchRow>*) {
  std::fprintf(stderr, "sage bench: libsage was built without CUDA; nothing to time\n");
  return false;
}

void device_strings(std::string* gpu, std::string* driver, std::string* cuda) {
  gpu->clear(), driver->clear(), cuda->clear();
}

}  // namespace sage::tool
