// Newton-Schulz orthogonalisation (Muon) for CPU, driven from C++ with fused GEMM epilogues.
//
// Legend: X [P, m, n] a batch of P wide matrices (m <= n; the caller transposes tall ones), A [P, m, m].
// One quintic step with coefficients (a, b, c):  A = X X^T;  B = b A + c A A;  X = a X + B X.
// The reference spends six tensor ops per step on this; here it is three GEMM calls whose epilogue does
// the scaling and the addition (addmm / baddbmm with alpha and beta), into buffers allocated once.
// Single matrices go through addmm (MKL/oneDNN GEMM); batches go through baddbmm unless the caller asks
// for a per-matrix loop (`loop_batch`), which the Python side chooses by the measured batching policy.
// The buffers take X's dtype: fp32, fp64, or bf16 (the Python side's bf16 compute), where ATen's CPU GEMMs
// accumulate in fp32 and round once after the alpha / beta epilogue.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

namespace glm5 {
namespace {

// Runs the schedule on one 2-D matrix or one 3-D batch, in place in X (X and Y are the ping-pong buffers).
void newton_schulz_steps(at::Tensor X, at::Tensor Y, at::Tensor A, at::Tensor Bm, const std::vector<double>& coeffs) {
  const bool batched = X.dim() == 3;
  const int64_t steps = static_cast<int64_t>(coeffs.size()) / 3;
  for (int64_t i = 0; i < steps; ++i) {
    const double a = coeffs[3 * i], b = coeffs[3 * i + 1], c = coeffs[3 * i + 2];
    if (batched) {
      at::bmm_out(A, X, X.transpose(1, 2));              // A = X X^T
      at::baddbmm_out(Bm, A, A, A, /*beta=*/b, /*alpha=*/c);  // B = b A + c A A
      at::baddbmm_out(Y, X, Bm, X, /*beta=*/a, /*alpha=*/1);  // X' = a X + B X
    } else {
      at::mm_out(A, X, X.t());
      at::addmm_out(Bm, A, A, A, /*beta=*/b, /*alpha=*/c);
      at::addmm_out(Y, X, Bm, X, /*beta=*/a, /*alpha=*/1);
    }
    std::swap(X, Y);
  }
  if (steps % 2 == 1) Y.copy_(X);  // the result lives in the caller's first buffer
}

// X_wide [P, m, n] (fp32 / fp64 / bf16, already normalised by the caller), coeffs [steps, 3] fp64.
at::Tensor ns_orthogonalize(const at::Tensor& X_wide, const at::Tensor& coeffs, bool loop_batch) {
  TORCH_CHECK(X_wide.dim() == 3 && X_wide.size(1) <= X_wide.size(2), "ns_orthogonalize: expected wide [P, m, n]");
  TORCH_CHECK(coeffs.dim() == 2 && coeffs.size(1) == 3 && coeffs.scalar_type() == at::kDouble,
              "ns_orthogonalize: coeffs must be fp64 [steps, 3]");
  auto c = coeffs.contiguous();
  const std::vector<double> schedule(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
  const int64_t P = X_wide.size(0), m = X_wide.size(1), n = X_wide.size(2);
  at::Tensor X = X_wide.contiguous().clone();
  if (P == 1 || loop_batch) {
    at::Tensor Y = at::empty({m, n}, X.options()), A = at::empty({m, m}, X.options()), Bm = at::empty_like(A);
    for (int64_t p = 0; p < P; ++p) newton_schulz_steps(X[p], Y, A, Bm, schedule);
  } else {
    at::Tensor Y = at::empty_like(X), A = at::empty({P, m, m}, X.options()), Bm = at::empty_like(A);
    newton_schulz_steps(X, Y, A, Bm, schedule);
  }
  return X;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(glm5_cpu, m) {
  m.def("ns_orthogonalize(Tensor X_wide, Tensor coeffs, bool loop_batch) -> Tensor");
}

TORCH_LIBRARY_IMPL(glm5_cpu, CPU, m) { m.impl("ns_orthogonalize", &ns_orthogonalize); }

}  // namespace glm5
