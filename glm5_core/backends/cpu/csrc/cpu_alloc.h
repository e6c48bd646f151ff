// Large output buffers backed by transparent huge pages where the kernel allows it.
//
// A tensor of tens of MiB comes from glibc as a fresh mmap on every call (above its 32 MiB mmap
// threshold the memory is returned to the OS on free), so the kernel that first writes it pays one
// page fault and a page zeroing per 4 KiB: for the 64 MiB MoE dispatch buffer that was most of the
// op's time. Advising the 2 MiB-aligned interior as MADV_HUGEPAGE before the first write turns those
// 16K faults into 32 (on systems whose THP mode is "madvise" or "always"). The advice is best effort:
// a failing madvise (THP disabled, memory not from mmap) changes nothing but speed. PyTorch's own
// allocator does the same when THP_MEM_ALLOC_ENABLE=1; this applies it only to our kernels' outputs.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace glm5 {

inline void advise_huge_pages(void* data, int64_t nbytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(1) << 21;  // 2 MiB
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + static_cast<uintptr_t>(nbytes)) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)nbytes;
#endif
}

// at::empty, with huge-page advice when the buffer spans at least a few huge pages.
inline at::Tensor empty_large(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor out = at::empty(sizes, options);
  const int64_t nbytes = static_cast<int64_t>(out.nbytes());
  if (nbytes >= (int64_t(4) << 21)) advise_huge_pages(out.data_ptr(), nbytes);
  return out;
}

}  // namespace glm5
