// The lightning-indexer scores at the selected keys only, and their backward, for CPU (the sparse stage's KL).
//
// Legend: B batch, T queries, H indexer heads, D index_head_dim, S key slots, K selected keys per query (-1 = none).
//   I_sel[b,t,j] = sum_h w[b,t,h] * ReLU(q[b,t,h,:] . k[b, i_j, :])      (-inf where i_j = -1)
// Backward, given g = d I_sel [B, T, K] (ignored at the -1 slots, whose score is the constant -inf):
//   a[h,j] = q[h] . k[i_j],  dd[h,j] = g[j] w[h] (a[h,j] > 0)
//   d w[h] = sum_j g[j] ReLU(a[h,j]),  d q[h] = sum_j dd[h,j] k[i_j],  d k[s] = sum over (t, j) with i_j = s of
//   sum_h dd[h,j] q[h]
// The forward keeps nothing; the backward recomputes the H x K dot products of each query row. Query rows go
// through in blocks whose per-entry key gradients fit kContribBytes (a block size set by the shapes only):
//   1. per query row (parallel): a, d w, d q and each kept slot's contribution sum_h dd[h,j] q[h] (row-local);
//   2. the contributions are added to d k, parallel over bands of keys (each band owned by one thread), in
//      ascending (t, j) order.
// Time and memory O(T K H D), never O(T S); every sum runs in a fixed order whatever the thread count, so the
// gradients are bitwise repeatable. Inputs are fp32 or fp64 (the caller converts bf16 / fp16 to fp32).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <omp.h>

#include <algorithm>
#include <limits>
#include <tuple>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_simd.h"

namespace glm5 {
namespace {

constexpr int64_t kContribBytes = int64_t(16) << 20;  // key-gradient contributions held at once (a row block)
constexpr int64_t kKeyBand = 16;  // keys per band of pass 2; bands are dealt to threads round-robin

struct Sizes {
  int64_t B, T, H, D, S, K;
};

template <typename acc_t, typename index_t>
void forward_kernel(const acc_t* q, const acc_t* keys, const acc_t* w, const index_t* idx, const Sizes& n,
                    acc_t* out) {
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  at::parallel_for(0, n.B * n.T, 8, [&](int64_t row0, int64_t row1) {
    for (int64_t row = row0; row < row1; ++row) {
      const int64_t b = row / n.T;
      const acc_t* q_row = q + row * n.H * n.D;  // [H, D]
      const acc_t* w_row = w + row * n.H;  // [H]
      for (int64_t j = 0; j < n.K; ++j) {
        const int64_t s = static_cast<int64_t>(idx[row * n.K + j]);
        if (s < 0) {
          out[row * n.K + j] = neg_inf;
          continue;
        }
        const acc_t* key = keys + (b * n.S + s) * n.D;
        acc_t total = 0;
        for (int64_t h = 0; h < n.H; ++h) {
          const acc_t a = dot(q_row + h * n.D, key, n.D);
          if (a > acc_t(0)) total = total + w_row[h] * a;
        }
        out[row * n.K + j] = total;
      }
    }
  });
}

template <typename acc_t, typename index_t>
void backward_kernel(const acc_t* grad, const acc_t* q, const acc_t* keys, const acc_t* w, const index_t* idx,
                     const Sizes& n, acc_t* dq, acc_t* dkeys, acc_t* dw) {
  const int64_t rows = n.B * n.T, H = n.H, D = n.D, K = n.K;
  const int threads = std::max(1, at::get_num_threads());
  const int64_t row_bytes = K * D * static_cast<int64_t>(sizeof(acc_t));
  const int64_t block = std::max<int64_t>(1, kContribBytes / std::max<int64_t>(1, row_bytes));
  std::vector<acc_t> contrib(std::min(rows, block) * K * D);  // [rows of the block, K, D]
  std::vector<acc_t> dd_all(threads * H);  // per-thread dd[h] of one slot
  std::fill(dkeys, dkeys + n.B * n.S * D, acc_t(0));
  RegionErrors errors;

  for (int64_t row0 = 0; row0 < rows; row0 += block) {
    const int64_t row1 = std::min(rows, row0 + block);
#pragma omp parallel num_threads(threads)
    {
      acc_t* dd = dd_all.data() + omp_get_thread_num() * H;
#pragma omp for schedule(dynamic, 4)
      for (int64_t row = row0; row < row1; ++row) {
        errors.run([&] {
          const int64_t b = row / n.T;
          const acc_t* q_row = q + row * H * D;  // [H, D]
          const acc_t* w_row = w + row * H;
          acc_t* dq_row = dq + row * H * D;
          acc_t* dw_row = dw + row * H;
          std::fill(dq_row, dq_row + H * D, acc_t(0));
          std::fill(dw_row, dw_row + H, acc_t(0));
          for (int64_t j = 0; j < K; ++j) {
            const int64_t s = static_cast<int64_t>(idx[row * K + j]);
            if (s < 0) continue;
            const acc_t g = grad[row * K + j];
            const acc_t* key = keys + (b * n.S + s) * D;
            for (int64_t h = 0; h < H; ++h) {
              const acc_t a = dot(q_row + h * D, key, D);
              const bool on = a > acc_t(0);
              dw_row[h] = dw_row[h] + (on ? g * a : acc_t(0));
              dd[h] = on ? g * w_row[h] : acc_t(0);
              if (on) axpy(dd[h], key, dq_row + h * D, D);
            }
            acc_t* dst = contrib.data() + ((row - row0) * K + j) * D;
            std::fill(dst, dst + D, acc_t(0));
            for (int64_t h = 0; h < H; ++h)
              if (dd[h] != acc_t(0)) axpy(dd[h], q_row + h * D, dst, D);
          }
        });
      }
    }
    errors.rethrow_if_failed("selected_index_scores_backward");

    // Pass 2: every thread walks the block's entries in (t, j) order and adds those of the key bands it owns.
#pragma omp parallel num_threads(threads)
    {
      const int64_t tid = omp_get_thread_num(), nthreads = omp_get_num_threads();
      for (int64_t row = row0; row < row1; ++row) {
        const int64_t b = row / n.T;
        for (int64_t j = 0; j < K; ++j) {
          const int64_t s = static_cast<int64_t>(idx[row * K + j]);
          if (s < 0 || (s / kKeyBand) % nthreads != tid) continue;
          const acc_t* src = contrib.data() + ((row - row0) * K + j) * D;
          acc_t* dk = dkeys + (b * n.S + s) * D;
          for (int64_t d = 0; d < D; ++d) dk[d] = dk[d] + src[d];
        }
      }
    }
  }
}

Sizes check_inputs(const char* op, const at::Tensor& q, const at::Tensor& keys, const at::Tensor& w,
                   const at::Tensor& topk_idx) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 3 && w.dim() == 3 && topk_idx.dim() == 3, op,
              ": expected q [B, T, H, D], keys [B, S, D], w [B, T, H], topk_idx [B, T, K]");
  const Sizes n{q.size(0), q.size(1), q.size(2), q.size(3), keys.size(1), topk_idx.size(2)};
  TORCH_CHECK(keys.size(0) == n.B && keys.size(2) == n.D && w.size(0) == n.B && w.size(1) == n.T &&
                  w.size(2) == n.H && topk_idx.size(0) == n.B && topk_idx.size(1) == n.T,
              op, ": shapes disagree");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && q.scalar_type() == w.scalar_type(), op,
              ": q, keys and w must share one dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble, op, ": expected fp32 or fp64");
  TORCH_CHECK(topk_idx.scalar_type() == at::kInt || topk_idx.scalar_type() == at::kLong, op,
              ": topk_idx must be int32 or int64");
  return n;
}

template <typename index_t> void check_rows(const char* op, const index_t* idx, int64_t count, int64_t S) {
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK_INDEX(idx[i] >= -1 && idx[i] < S, op, ": topk_idx entry ", static_cast<int64_t>(idx[i]),
                      " is outside [-1, ", S, ")");
}

at::Tensor selected_index_scores(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& w,
                                 const at::Tensor& topk_idx) {
  const Sizes n = check_inputs("selected_index_scores", q, keys, w, topk_idx);
  auto qc = q.contiguous(), kc = keys.contiguous(), wc = w.contiguous(), ic = topk_idx.contiguous();
  auto out = at::empty({n.B, n.T, n.K}, qc.options());
  AT_DISPATCH_FLOATING_TYPES(qc.scalar_type(), "selected_index_scores", [&] {
    using acc_t = scalar_t;
    AT_DISPATCH_INDEX_TYPES(ic.scalar_type(), "selected_index_scores", [&] {
      check_rows("selected_index_scores", ic.data_ptr<index_t>(), ic.numel(), n.S);
      forward_kernel<acc_t, index_t>(qc.data_ptr<acc_t>(), kc.data_ptr<acc_t>(), wc.data_ptr<acc_t>(),
                                     ic.data_ptr<index_t>(), n, out.data_ptr<acc_t>());
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> selected_index_scores_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& keys, const at::Tensor& w,
    const at::Tensor& topk_idx) {
  const Sizes n = check_inputs("selected_index_scores_backward", q, keys, w, topk_idx);
  TORCH_CHECK(grad.sizes() == topk_idx.sizes() && grad.scalar_type() == q.scalar_type(),
              "selected_index_scores_backward: grad must have topk_idx's shape and q's dtype");
  auto gc = grad.contiguous(), qc = q.contiguous(), kc = keys.contiguous(), wc = w.contiguous();
  auto ic = topk_idx.contiguous();
  auto dq = at::empty_like(qc), dkeys = at::empty_like(kc), dw = at::empty_like(wc);
  AT_DISPATCH_FLOATING_TYPES(qc.scalar_type(), "selected_index_scores_backward", [&] {
    using acc_t = scalar_t;
    AT_DISPATCH_INDEX_TYPES(ic.scalar_type(), "selected_index_scores_backward", [&] {
      check_rows("selected_index_scores_backward", ic.data_ptr<index_t>(), ic.numel(), n.S);
      backward_kernel<acc_t, index_t>(gc.data_ptr<acc_t>(), qc.data_ptr<acc_t>(), kc.data_ptr<acc_t>(),
                                      wc.data_ptr<acc_t>(), ic.data_ptr<index_t>(), n, dq.data_ptr<acc_t>(),
                                      dkeys.data_ptr<acc_t>(), dw.data_ptr<acc_t>());
    });
  });
  return {dq, dkeys, dw};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(glm5_cpu, m) {
  m.def("selected_index_scores(Tensor q, Tensor keys, Tensor w, Tensor topk_idx) -> Tensor");
  m.def("selected_index_scores_backward(Tensor grad, Tensor q, Tensor keys, Tensor w, Tensor topk_idx) "
        "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(glm5_cpu, CPU, m) {
  m.impl("selected_index_scores", &selected_index_scores);
  m.impl("selected_index_scores_backward", &selected_index_scores_backward);
}

}  // namespace glm5
