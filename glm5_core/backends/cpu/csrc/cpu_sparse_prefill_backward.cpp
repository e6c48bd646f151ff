// Backward of sparse MLA prefill for CPU: gradients of the absorbed-form attention over the selected latent rows.
//
// Legend as in cpu_sparse_decode.cpp: B batch, T queries, H heads, C latent width, R rope width, S key slots,
// K selected keys per query (-1 = none).
// Forward (sparse_decode): s[h,j] = scale * (q_lat[h] . c_kv[i_j] + q_pe[h] . k_pe[i_j]), p = softmax_j(s),
// o_lat[h] = sum_j p[h,j] c_kv[i_j]. Given dO = d o_lat [B, T, H, C]:
//   dP[h,j] = dO[h] . c_kv[i_j],  D[h] = sum_j p dP,  G[h,j] = scale * p (dP - D)  (the gradient of s before scaling)
//   d q_lat[h] = sum_j G c_kv[i_j],  d q_pe[h] = sum_j G k_pe[i_j]
//   d c_kv[s] = sum over (t, j) with i_j = s of sum_h (p[h,j] dO[h] + G[h,j] q_lat[h]),  d k_pe[s] = ... G q_pe[h]
// Two passes, each touching only the selected rows (time and memory O(T K), never O(T S)):
//   1. per query row (parallel): recompute p from the selected rows, then dP, G, d q_lat, d q_pe; keep p and G
//      [B, T, H, K] (zeros at -1 slots);
//   2. per key slot (parallel): its (t, j) entries, listed by a stable counting sort in ascending (t, j) order,
//      summed in that order.
// Every sum has a fixed order that depends neither on the thread count nor on which thread ran what: the
// gradients are bitwise repeatable.
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

template <typename cache_t, typename acc_t>
void sparse_prefill_backward_kernel(const acc_t* grad_o, const acc_t* q_lat, const acc_t* q_pe, const cache_t* c_kv,
                                    const cache_t* k_pe, const int64_t* idx, acc_t scale, int64_t B, int64_t T_,
                                    int64_t H, int64_t C, int64_t R, int64_t S, int64_t K, acc_t* dq_lat,
                                    acc_t* dq_pe, acc_t* dc_kv, acc_t* dk_pe) {
  const int64_t rows = B * T_;
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  const int threads = std::max(1, at::get_num_threads());
  std::vector<acc_t> p_all(rows * H * K), g_all(rows * H * K);  // p and G [B, T, H, K]

  // Per-thread scratch, allocated before the region (nothing that can fail is allocated inside it).
  const int64_t rows_size = K * (C + R);
  std::vector<acc_t> kv_all(threads * rows_size);  // the query's selected rows, converted to acc_t [K, C + R]
  std::vector<std::vector<int64_t>> slot_all(threads);  // which of the K slots each kept row came from
  for (auto& slot : slot_all) slot.reserve(K);
  RegionErrors errors;

#pragma omp parallel num_threads(threads)
  {
    acc_t* kv_KC = kv_all.data() + omp_get_thread_num() * rows_size;
    std::vector<int64_t>& slot = slot_all[omp_get_thread_num()];
#pragma omp for schedule(dynamic, 4)
    for (int64_t row = 0; row < rows; ++row) {
      errors.run([&] {
        const int64_t b = row / T_;
        slot.clear();
        for (int64_t j = 0; j < K; ++j) {
          const int64_t s = idx[row * K + j];
          if (s < 0) continue;
          acc_t* dst = kv_KC + static_cast<int64_t>(slot.size()) * (C + R);
          const cache_t* lat = c_kv + (b * S + s) * C;
          const cache_t* rope = k_pe + (b * S + s) * R;
          for (int64_t c = 0; c < C; ++c) dst[c] = static_cast<acc_t>(lat[c]);
          for (int64_t r = 0; r < R; ++r) dst[C + r] = static_cast<acc_t>(rope[r]);
          slot.push_back(j);
        }
        const int64_t n = static_cast<int64_t>(slot.size());
        acc_t* p_HK = p_all.data() + row * H * K;
        acc_t* g_HK = g_all.data() + row * H * K;
        for (int64_t i = 0; i < H * K; ++i) p_HK[i] = g_HK[i] = acc_t(0);
        for (int64_t h = 0; h < H; ++h) {
          acc_t* dql = dq_lat + (row * H + h) * C;
          acc_t* dqr = dq_pe + (row * H + h) * R;
          for (int64_t c = 0; c < C; ++c) dql[c] = acc_t(0);
          for (int64_t r = 0; r < R; ++r) dqr[r] = acc_t(0);
          if (n == 0) continue;  // no selected key: the output was zeros, every gradient is zero
          const acc_t* ql = q_lat + (row * H + h) * C;
          const acc_t* qr = q_pe + (row * H + h) * R;
          const acc_t* dO = grad_o + (row * H + h) * C;
          acc_t* p = p_HK + h * K;  // indexed by slot
          acc_t* g = g_HK + h * K;
          acc_t m = neg_inf;
          for (int64_t i = 0; i < n; ++i) {
            const acc_t* kv = kv_KC + i * (C + R);
            const acc_t sc = (dot(ql, kv, C) + dot(qr, kv + C, R)) * scale;
            p[slot[i]] = sc;
            m = std::max(m, sc);
          }
          acc_t total = 0;
          for (int64_t i = 0; i < n; ++i) {
            const acc_t e = std::exp(p[slot[i]] - m);
            p[slot[i]] = e;
            total = total + e;
          }
          const acc_t inv = acc_t(1) / total;
          acc_t d_sum = 0;  // D = sum_j p dP
          for (int64_t i = 0; i < n; ++i) {
            const int64_t j = slot[i];
            p[j] = p[j] * inv;
            g[j] = dot(dO, kv_KC + i * (C + R), C);  // dP, for now
            d_sum = d_sum + p[j] * g[j];
          }
          for (int64_t i = 0; i < n; ++i) {
            const int64_t j = slot[i];
            g[j] = scale * (p[j] * (g[j] - d_sum));
            const acc_t* kv = kv_KC + i * (C + R);
            axpy(g[j], kv, dql, C);
            axpy(g[j], kv + C, dqr, R);
          }
        }
      });
    }
  }
  errors.rethrow_if_failed("sparse_prefill_backward");

  // Pass 2: each key slot's (t, j) entries in ascending order (stable counting sort), then its sums.
  std::vector<int64_t> start(B * S + 1, 0), entry(rows * K);
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t b = row / T_;
    for (int64_t j = 0; j < K; ++j) {
      const int64_t s = idx[row * K + j];
      if (s >= 0) ++start[b * S + s + 1];
    }
  }
  for (int64_t i = 0; i < B * S; ++i) start[i + 1] += start[i];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t b = row / T_;
      for (int64_t j = 0; j < K; ++j) {
        const int64_t s = idx[row * K + j];
        if (s >= 0) entry[fill[b * S + s]++] = row * K + j;
      }
    }
  }
  // Early keys are visible to more queries: dynamic chunks keep the threads evenly loaded.
#pragma omp parallel for num_threads(threads) schedule(dynamic, 16)
  for (int64_t key = 0; key < B * S; ++key) {
    errors.run([&] {
      acc_t* dkv = dc_kv + key * C;
      acc_t* dkr = dk_pe + key * R;
      for (int64_t c = 0; c < C; ++c) dkv[c] = acc_t(0);
      for (int64_t r = 0; r < R; ++r) dkr[r] = acc_t(0);
      for (int64_t e = start[key]; e < start[key + 1]; ++e) {
        const int64_t row = entry[e] / K, j = entry[e] % K;
        for (int64_t h = 0; h < H; ++h) {
          const int64_t at = (row * H + h) * K + j;
          axpy(p_all[at], grad_o + (row * H + h) * C, dkv, C);
          axpy(g_all[at], q_lat + (row * H + h) * C, dkv, C);
          axpy(g_all[at], q_pe + (row * H + h) * R, dkr, R);
        }
      }
    });
  }
  errors.rethrow_if_failed("sparse_prefill_backward");
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
