// mHC's Sinkhorn normalisation for CPU (the no-grad forward of ``mhc_sinkhorn``).
//
// Legend: R rows, N streams.
//
//   mhc_sinkhorn_normalize(p [R, N, N], iters, eps) -> comb [R, N, N] (p's dtype: fp32 or fp64): from the
//       softmax p of the logits (taken by the caller with torch's own softmax, whose vectorised exp this file
//       does not reproduce), what ``glm5_core.ops.mhc.sinkhorn_reference`` computes after its softmax:
//           C = p + eps;  C = C / (colsum(C) + eps);  repeat iters - 1 times: rows, then columns
//       with every sum taken over the column / row in index order in p's dtype, eps added to it, and every
//       element divided by it (IEEE division, no reciprocal). torch's CPU sum adds 4 or fewer values in index
//       order, so for N <= 4 this is the reference bit for bit; the Python kernel calls it for those N only
//       (glm5_core/backends/cpu/mhc.py), the test checks it (tests/backends/cpu/test_mhc.py).
//
// Rows are independent (no sum crosses a row): parallel over rows, the same bits for any thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace glm5 {
namespace {

template <typename scalar_t>
void sinkhorn_rows(const scalar_t* p, scalar_t* c, int64_t begin, int64_t end, int64_t N, int64_t iters,
                   scalar_t e) {
  const int64_t NN = N * N;
  for (int64_t r = begin; r < end; ++r) {
    const scalar_t* pr = p + r * NN;
    scalar_t* cr = c + r * NN;
    for (int64_t k = 0; k < NN; ++k) cr[k] = pr[k] + e;
    for (int64_t step = 0; step < 2 * iters - 1; ++step) {
      if (step % 2 == 0) {  // columns: the sum over dim -2
        for (int64_t j = 0; j < N; ++j) {
          scalar_t s = cr[j];
          for (int64_t i = 1; i < N; ++i) s = s + cr[i * N + j];
          s = s + e;
          for (int64_t i = 0; i < N; ++i) cr[i * N + j] = cr[i * N + j] / s;
        }
      } else {  // rows: the sum over dim -1
        for (int64_t i = 0; i < N; ++i) {
          scalar_t* row = cr + i * N;
          scalar_t s = row[0];
          for (int64_t j = 1; j < N; ++j) s = s + row[j];
          s = s + e;
          for (int64_t j = 0; j < N; ++j) row[j] = row[j] / s;
        }
      }
    }
  }
}

at::Tensor mhc_sinkhorn_normalize(const at::Tensor& p, int64_t iters, double eps) {
  TORCH_CHECK(p.dim() == 3 && p.size(1) == p.size(2), "mhc_sinkhorn_normalize: p must be [R, N, N], got ",
              p.sizes());
  TORCH_CHECK(p.scalar_type() == at::kFloat || p.scalar_type() == at::kDouble,
              "mhc_sinkhorn_normalize: p must be fp32 or fp64 (the compute dtype), got ", p.scalar_type());
  TORCH_CHECK(iters >= 1, "mhc_sinkhorn_normalize: iters must be >= 1, got ", iters);
  TORCH_CHECK(p.device().is_cpu(), "mhc_sinkhorn_normalize: p must be a CPU tensor");
  const at::Tensor pc = p.contiguous();
  at::Tensor out = at::empty_like(pc);
  const int64_t R = pc.size(0), N = pc.size(1);
  if (R == 0 || N == 0) return out;
  // ~ (2 iters) N^2 additions and divisions a row: rows in chunks of ~32k such operations
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, 2 * iters * N * N));
  AT_DISPATCH_FLOATING_TYPES(pc.scalar_type(), "mhc_sinkhorn_normalize", [&] {
    const scalar_t* src = pc.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    const scalar_t e = static_cast<scalar_t>(eps);  // the value torch's `tensor + eps` adds (round to nearest)
    at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
      sinkhorn_rows<scalar_t>(src, dst, begin, end, N, iters, e);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(glm5_cpu, m) {
  m.def("mhc_sinkhorn_normalize(Tensor p, int iters, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(glm5_cpu, CPU, m) {
  m.impl("mhc_sinkhorn_normalize", &mhc_sinkhorn_normalize);
}

}  // namespace glm5
