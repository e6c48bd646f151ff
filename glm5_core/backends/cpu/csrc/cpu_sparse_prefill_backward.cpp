// Backward of sparse MLA prefill for CPU: gradients of the absorbed-form attention over the selected latent rows.
//
// Legend as in cpu_sparse_decode.cpp: B batch, T queries, H heads, C latent width, R rope width, S key slots,
// K selected keys per query (-1 = none).
// Forward (sparse_decode): s[h,j] = scale * (q_lat[h] . c_kv[i_j] + q_pe[h] . k_pe[i_j]), p = softmax_j(s),
// o_lat[h] = sum_j p[h,j] c_kv[i_j]. Given dO = d o_lat [B, T, H, C]:
//   dP[h,j] = dO[h] . c_kv[i_j],  D[h] = sum_j p dP,  G[h,j] = scale * p (dP - D)  (the gradient of s before scaling)
//   d q_lat[h] = sum_j G c_kv[i_j],  d q_pe[h] = sum_j G k_pe[i_j]
//   d c_kv[s] = sum over (t, j) with i_j = s of sum_h (p[h,j] dO[h] + G[h,j] q_lat[h]),  d k_pe[s] = ... G q_pe[h]
// Query rows go through in blocks whose per-entry key gradients fit kContribBytes (a block size that depends on
// the shapes only, never on the thread count):
//   1. per query row of the block (parallel): recompute p from the selected rows, then dP, G, d q_lat, d q_pe, and
//      each selected slot's contribution to its key's gradient, sum_h p dO[h] + G q_lat[h] (and sum_h G q_pe[h]),
//      from the row's own dO and queries (cache-hot);
//   2. the block's contributions are added to d c_kv / d k_pe (parallel over bands of keys, each band owned by
//      one thread), in ascending (t, j) order.
// Time and memory O(T K) (never O(T S)); each key's gradient is summed in (t, j) order whatever the thread
// count: the gradients are bitwise repeatable.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <omp.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_simd.h"

namespace glm5 {
namespace {

constexpr int64_t kContribBytes = int64_t(16) << 20;  // key-gradient contributions held at once (a row block)
constexpr int64_t kKeyBand = 16;  // keys per band of pass 2; bands are dealt to threads round-robin

template <typename cache_t, typename acc_t>
void sparse_prefill_backward_kernel(const acc_t* grad_o, const acc_t* q_lat, const acc_t* q_pe, const cache_t* c_kv,
                                    const cache_t* k_pe, const int64_t* idx, acc_t scale, int64_t B, int64_t T_,
                                    int64_t H, int64_t C, int64_t R, int64_t S, int64_t K, acc_t* dq_lat,
                                    acc_t* dq_pe, acc_t* dc_kv, acc_t* dk_pe) {
  const int64_t rows = B * T_, width = C + R;
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  const int threads = std::max(1, at::get_num_threads());
  const int64_t row_bytes = K * width * static_cast<int64_t>(sizeof(acc_t));
  const int64_t block = std::max<int64_t>(1, kContribBytes / std::max<int64_t>(1, row_bytes));
  std::vector<acc_t> contrib(std::min(rows, block) * K * width);  // [rows of the block, K, C + R]
  for (int64_t i = 0; i < B * S * C; ++i) dc_kv[i] = acc_t(0);
  for (int64_t i = 0; i < B * S * R; ++i) dk_pe[i] = acc_t(0);

  // Per-thread scratch, allocated before the regions (nothing that can fail is allocated inside them).
  std::vector<acc_t> kv_all(threads * K * width);  // the row's selected keys, converted to acc_t [K, C + R]
  std::vector<acc_t> pg_all(threads * 2 * H * K);  // p and G [H, K] of the row
  std::vector<std::vector<int64_t>> slot_all(threads);  // which of the K slots each kept key came from
  for (auto& slot : slot_all) slot.reserve(K);
  RegionErrors errors;

  for (int64_t row0 = 0; row0 < rows; row0 += block) {
    const int64_t row1 = std::min(rows, row0 + block);
#pragma omp parallel num_threads(threads)
    {
      const int tid = omp_get_thread_num();
      acc_t* kv_KC = kv_all.data() + tid * K * width;
      acc_t* p_HK = pg_all.data() + tid * 2 * H * K;
      acc_t* g_HK = p_HK + H * K;
      std::vector<int64_t>& slot = slot_all[tid];
#pragma omp for schedule(dynamic, 2)
      for (int64_t row = row0; row < row1; ++row) {
        errors.run([&] {
          const int64_t b = row / T_;
          slot.clear();
          for (int64_t j = 0; j < K; ++j) {
            const int64_t s = idx[row * K + j];
            if (s < 0) continue;
            acc_t* dst = kv_KC + static_cast<int64_t>(slot.size()) * width;
            const cache_t* lat = c_kv + (b * S + s) * C;
            const cache_t* rope = k_pe + (b * S + s) * R;
            for (int64_t c = 0; c < C; ++c) dst[c] = static_cast<acc_t>(lat[c]);
            for (int64_t r = 0; r < R; ++r) dst[C + r] = static_cast<acc_t>(rope[r]);
            slot.push_back(j);
          }
          const int64_t n = static_cast<int64_t>(slot.size());
          for (int64_t h = 0; h < H; ++h) {
            acc_t* dql = dq_lat + (row * H + h) * C;
            acc_t* dqr = dq_pe + (row * H + h) * R;
            for (int64_t c = 0; c < C; ++c) dql[c] = acc_t(0);
            for (int64_t r = 0; r < R; ++r) dqr[r] = acc_t(0);
            if (n == 0) continue;  // no selected key: the output was zeros, every gradient is zero
            const acc_t* ql = q_lat + (row * H + h) * C;
            const acc_t* qr = q_pe + (row * H + h) * R;
            const acc_t* dO = grad_o + (row * H + h) * C;
            acc_t* p = p_HK + h * K;  // indexed by kept key i < n
            acc_t* g = g_HK + h * K;
            acc_t m = neg_inf;
            for (int64_t i = 0; i < n; ++i) {
              const acc_t* kv = kv_KC + i * width;
              p[i] = (dot(ql, kv, C) + dot(qr, kv + C, R)) * scale;
              m = std::max(m, p[i]);
            }
            acc_t total = 0;
            for (int64_t i = 0; i < n; ++i) {
              p[i] = std::exp(p[i] - m);
              total = total + p[i];
            }
            const acc_t inv = acc_t(1) / total;
            acc_t d_sum = 0;  // D = sum_j p dP
            for (int64_t i = 0; i < n; ++i) {
              p[i] = p[i] * inv;
              g[i] = dot(dO, kv_KC + i * width, C);  // dP, for now
              d_sum = d_sum + p[i] * g[i];
            }
            for (int64_t i = 0; i < n; ++i) {
              g[i] = scale * (p[i] * (g[i] - d_sum));
              const acc_t* kv = kv_KC + i * width;
              axpy(g[i], kv, dql, C);
              axpy(g[i], kv + C, dqr, R);
            }
          }
          // This row's contribution to each kept key's gradient, slot by slot (-1 slots stay unused).
          acc_t* row_contrib = contrib.data() + (row - row0) * K * width;
          for (int64_t i = 0; i < n; ++i) {
            acc_t* dst = row_contrib + slot[i] * width;
            for (int64_t c = 0; c < width; ++c) dst[c] = acc_t(0);
            for (int64_t h = 0; h < H; ++h) {
              const acc_t p = p_HK[h * K + i], g = g_HK[h * K + i];
              axpy(p, grad_o + (row * H + h) * C, dst, C);
              axpy(g, q_lat + (row * H + h) * C, dst, C);
              axpy(g, q_pe + (row * H + h) * R, dst + C, R);
            }
          }
        });
      }
    }
    errors.rethrow_if_failed("sparse_prefill_backward");

    // Pass 2: every thread walks the block's entries in (t, j) order and adds those of the key bands it owns.
#pragma omp parallel num_threads(threads)
    {
      const int64_t tid = omp_get_thread_num(), nthreads = omp_get_num_threads();
      for (int64_t row = row0; row < row1; ++row) {
        const int64_t b = row / T_;
        for (int64_t j = 0; j < K; ++j) {
          const int64_t s = idx[row * K + j];
          if (s < 0 || (s / kKeyBand) % nthreads != tid) continue;
          const acc_t* src = contrib.data() + ((row - row0) * K + j) * width;
          acc_t* dkv = dc_kv + (b * S + s) * C;
          acc_t* dkr = dk_pe + (b * S + s) * R;
          for (int64_t c = 0; c < C; ++c) dkv[c] = dkv[c] + src[c];
          for (int64_t r = 0; r < R; ++r) dkr[r] = dkr[r] + src[C + r];
        }
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sparse_prefill_backward(
    const at::Tensor& grad_o_lat, const at::Tensor& q_lat, const at::Tensor& q_pe, const at::Tensor& c_kv,
    const at::Tensor& k_pe, const at::Tensor& topk_idx, double scale) {
  TORCH_CHECK(grad_o_lat.dim() == 4 && q_lat.dim() == 4 && q_pe.dim() == 4 && c_kv.dim() == 3 && k_pe.dim() == 3 &&
                  topk_idx.dim() == 3,
              "sparse_prefill_backward: bad ranks");
  TORCH_CHECK(grad_o_lat.sizes() == q_lat.sizes(), "sparse_prefill_backward: grad_o_lat must have q_lat's shape");
  TORCH_CHECK(q_lat.scalar_type() == q_pe.scalar_type() && grad_o_lat.scalar_type() == q_lat.scalar_type() &&
                  c_kv.scalar_type() == k_pe.scalar_type(),
              "sparse_prefill_backward: dtypes differ");
  const int64_t B = q_lat.size(0), T_ = q_lat.size(1), H = q_lat.size(2), C = q_lat.size(3);
  const int64_t R = q_pe.size(3), S = c_kv.size(1), K = topk_idx.size(2);
  TORCH_CHECK(q_pe.size(0) == B && q_pe.size(1) == T_ && q_pe.size(2) == H && c_kv.size(0) == B &&
                  c_kv.size(2) == C && k_pe.size(0) == B && k_pe.size(1) == S && k_pe.size(2) == R &&
                  topk_idx.size(0) == B && topk_idx.size(1) == T_,
              "sparse_prefill_backward: shapes disagree");
  auto dO = grad_o_lat.contiguous(), ql = q_lat.contiguous(), qr = q_pe.contiguous();
  auto kv = c_kv.contiguous(), kr = k_pe.contiguous();
  auto idx = topk_idx.to(at::kLong).contiguous();
  const int64_t* idx_flat = idx.data_ptr<int64_t>();
  for (int64_t i = 0, n = idx.numel(); i < n; ++i)
    TORCH_CHECK_INDEX(idx_flat[i] < S, "sparse_prefill_backward: topk_idx entry ", idx_flat[i],
                      " is past the keys (S=", S, " slots)");
  auto dq_lat = at::empty_like(ql), dq_pe = at::empty_like(qr);
  auto dc_kv = at::empty({B, S, C}, ql.options()), dk_pe = at::empty({B, S, R}, ql.options());
  if (ql.scalar_type() == at::kDouble) {
    TORCH_CHECK(kv.scalar_type() == at::kDouble, "sparse_prefill_backward: fp64 queries need fp64 keys");
    sparse_prefill_backward_kernel<double, double>(
        dO.data_ptr<double>(), ql.data_ptr<double>(), qr.data_ptr<double>(), kv.data_ptr<double>(),
        kr.data_ptr<double>(), idx_flat, scale, B, T_, H, C, R, S, K, dq_lat.data_ptr<double>(),
        dq_pe.data_ptr<double>(), dc_kv.data_ptr<double>(), dk_pe.data_ptr<double>());
    return {dq_lat, dq_pe, dc_kv, dk_pe};
  }
  TORCH_CHECK(ql.scalar_type() == at::kFloat, "sparse_prefill_backward: expected fp32 or fp64 queries");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv.scalar_type(), "sparse_prefill_backward", [&] {
    sparse_prefill_backward_kernel<scalar_t, float>(
        dO.data_ptr<float>(), ql.data_ptr<float>(), qr.data_ptr<float>(), kv.data_ptr<scalar_t>(),
        kr.data_ptr<scalar_t>(), idx_flat, static_cast<float>(scale), B, T_, H, C, R, S, K,
        dq_lat.data_ptr<float>(), dq_pe.data_ptr<float>(), dc_kv.data_ptr<float>(), dk_pe.data_ptr<float>());
  });
  return {dq_lat, dq_pe, dc_kv, dk_pe};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(glm5_cpu, m) {
  m.def("sparse_prefill_backward(Tensor grad_o_lat, Tensor q_lat, Tensor q_pe, Tensor c_kv, Tensor k_pe, "
        "Tensor topk_idx, float scale) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(glm5_cpu, CPU, m) { m.impl("sparse_prefill_backward", &sparse_prefill_backward); }

}  // namespace glm5
