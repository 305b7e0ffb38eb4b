// A minimal parallel-for for the CPU reference: std::thread workers pulling indices from an
// atomic counter. Host code.
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>

#include "ref/reference.h"

namespace sage::ref {

void parallel_for(int64_t n, int threads, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (threads <= 0) threads = int(std::max(1u, std::thread::hardware_concurrency()));
  if (threads > n) threads = int(n);
  std::atomic<int64_t> next{0};
  std::exception_ptr first_error;
  std::mutex error_mutex;
  auto worker = [&] {
    for (int64_t i; (i = next.fetch_add(1)) < n;) {
      try {
        fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!first_error) first_error = std::current_exception();
        next.store(n);  // stop handing out work
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace sage::ref
