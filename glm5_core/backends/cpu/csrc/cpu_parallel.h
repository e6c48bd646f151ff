// Exceptions and OpenMP regions.
//
// An exception that leaves an `#pragma omp parallel` region calls std::terminate: SIGABRT, the whole
// process gone (a std::bad_alloc from a large reserve did exactly that). The kernels therefore allocate
// their per-thread scratch before the region, and run every loop body inside the region through
// RegionErrors::run, which keeps the first exception (the remaining iterations then skip their work);
// rethrow_if_failed raises it after the region, with out-of-memory turned into an error naming the op.
// at::parallel_for needs none of this: ATen already carries exceptions out of its own regions.
#pragma once

#include <c10/util/Exception.h>

#include <atomic>
#include <exception>
#include <mutex>
#include <new>

namespace glm5 {

class RegionErrors {
 public:
  template <typename Body> void run(Body&& body) noexcept {
    if (failed_.load(std::memory_order_relaxed)) return;
    try {
      body();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!first_) first_ = std::current_exception();
      failed_.store(true, std::memory_order_relaxed);
    }
  }

  // Call after the region (on the thread that opened it).
  void rethrow_if_failed(const char* op) const {
    if (!first_) return;
    try {
      std::rethrow_exception(first_);
    } catch (const std::bad_alloc&) {
      TORCH_CHECK(false, op, ": out of memory inside the parallel region (inputs too large for this machine)");
    }
  }

 private:
  std::atomic<bool> failed_{false};
  std::mutex mutex_;
  std::exception_ptr first_;
};

}  // namespace glm5
