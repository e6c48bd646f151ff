// Sparse MLA decode for CPU: absorbed-form attention over the latent rows selected by the DSA top-k.
//
// Legend: B batch, T queries, H heads, C latent width (kv_lora_rank), R rope width, S cache slots,
// K selected keys per query.
//   q_lat [B, T, H, C] and q_pe [B, T, H, R] (fp32 / fp64), c_kv [B, S, C] and k_pe [B, S, R] (fp32, fp64,
//   bf16 or fp16, read in place: only the selected rows are touched), topk_idx [B, T, K] (int32 / int64,
//   -1 = no key) -> o_lat [B, T, H, C] = softmax_k(scale * (q_lat . c_kv[i_k] + q_pe . k_pe[i_k])) @ c_kv[i_k].
//
// Each query's K selected keys are cut into fixed chunks of kKeyChunk; a chunk yields a partial softmax
// (running max, sum of exponentials, weighted row sum per head) and the chunks of a query are merged in
// chunk order. The chunking does not depend on the thread count, so the result is bitwise the same for
// any number of threads and any batch composition. Query rows go through in blocks whose partials fit
// kPartialBytes, so the working set stays bounded however many queries a prefill brings.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <omp.h>

#include <cmath>
#include <limits>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_simd.h"

namespace glm5 {
namespace {

constexpr int64_t kKeyChunk = 128;
constexpr int64_t kPartialBytes = int64_t(32) << 20;  // chunk partials held at once (a block of query rows)

template <typename acc_t> struct Partial {  // one chunk of one query
  std::vector<acc_t> max_H, sum_H, out_HC;
};

template <typename cache_t, typename acc_t>
void sparse_decode_kernel(const acc_t* q_lat, const acc_t* q_pe, const cache_t* c_kv, const cache_t* k_pe,
                          const int64_t* idx, acc_t scale, int64_t B, int64_t T_, int64_t H, int64_t C,
                          int64_t R, int64_t S, int64_t K, acc_t* out) {
  const int64_t chunks = (K + kKeyChunk - 1) / kKeyChunk;
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  const int threads = std::max(1, at::get_num_threads());
  const int64_t row_bytes = chunks * H * (C + 2) * static_cast<int64_t>(sizeof(acc_t));  // one row's partials
  const int64_t rows = B * T_, block = std::max<int64_t>(4 * threads, kPartialBytes / std::max<int64_t>(1, row_bytes));
  std::vector<Partial<acc_t>> partial(std::min(rows, block) * chunks);  // [rows of the block][chunk]

  // Per-thread scratch, allocated here: nothing that can fail is allocated when a region starts.
  const int64_t rows_size = kKeyChunk * (C + R), scores_size = H * kKeyChunk;
  std::vector<acc_t> rows_all(threads * rows_size);   // selected rows, converted to acc_t
  std::vector<acc_t> scores_all(threads * scores_size);
  std::vector<std::vector<int64_t>> valid_all(threads);
  for (auto& valid : valid_all) valid.reserve(kKeyChunk);
  RegionErrors errors;

  for (int64_t row0 = 0; row0 < rows; row0 += block) {
    const int64_t row1 = std::min(rows, row0 + block), items = (row1 - row0) * chunks;
#pragma omp parallel num_threads(threads)
    {
      acc_t* rows_KC = rows_all.data() + omp_get_thread_num() * rows_size;
      acc_t* scores_HK = scores_all.data() + omp_get_thread_num() * scores_size;
      std::vector<int64_t>& valid = valid_all[omp_get_thread_num()];
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < items; ++item) {
        errors.run([&] {
          const int64_t row = row0 + item / chunks, chunk = item % chunks, b = row / T_;
          const int64_t j0 = chunk * kKeyChunk, j1 = std::min(K, j0 + kKeyChunk);
          valid.clear();
          for (int64_t j = j0; j < j1; ++j) {
            const int64_t s = idx[row * K + j];
            if (s < 0) continue;
            acc_t* dst = rows_KC + static_cast<int64_t>(valid.size()) * (C + R);
            const cache_t* lat = c_kv + (b * S + s) * C;
            const cache_t* rope = k_pe + (b * S + s) * R;
            for (int64_t c = 0; c < C; ++c) dst[c] = static_cast<acc_t>(lat[c]);
            for (int64_t r = 0; r < R; ++r) dst[C + r] = static_cast<acc_t>(rope[r]);
            valid.push_back(s);
          }
          Partial<acc_t>& part = partial[item];
          part.max_H.assign(H, neg_inf);
          part.sum_H.assign(H, acc_t(0));
          part.out_HC.assign(H * C, acc_t(0));
          const int64_t n = static_cast<int64_t>(valid.size());
          if (n == 0) return;
          for (int64_t h = 0; h < H; ++h) {
            const acc_t* ql = q_lat + (row * H + h) * C;
            const acc_t* qr = q_pe + (row * H + h) * R;
            acc_t* sc = scores_HK + h * kKeyChunk;
            acc_t m = neg_inf;
            for (int64_t j = 0; j < n; ++j) {
              const acc_t* kv = rows_KC + j * (C + R);
              sc[j] = (dot(ql, kv, C) + dot(qr, kv + C, R)) * scale;
              m = std::max(m, sc[j]);
            }
            acc_t total = 0;
            acc_t* o = part.out_HC.data() + h * C;
            for (int64_t j = 0; j < n; ++j) {
              const acc_t p = std::exp(sc[j] - m);
              total = total + p;
              axpy(p, rows_KC + j * (C + R), o, C);
            }
            part.max_H[h] = m;
            part.sum_H[h] = total;
          }
        });
      }
    }
    errors.rethrow_if_failed("sparse_decode");

    // Merge each query's chunks in chunk order (fixed, whatever ran where).
    at::parallel_for(row0 * H, row1 * H, 1, [&](int64_t begin, int64_t end) {
      for (int64_t rh = begin; rh < end; ++rh) {
        const int64_t row = rh / H, h = rh % H, first = (row - row0) * chunks;
        acc_t m = neg_inf;
        for (int64_t c = 0; c < chunks; ++c) m = std::max(m, partial[first + c].max_H[h]);
        acc_t* dst = out + rh * C;
        for (int64_t c = 0; c < C; ++c) dst[c] = acc_t(0);
        if (m == neg_inf) continue;  // no selected key: zeros, as the reference
        acc_t total = 0;
        for (int64_t c = 0; c < chunks; ++c) {
          const Partial<acc_t>& part = partial[first + c];
          if (part.max_H[h] == neg_inf) continue;
          const acc_t rescale = std::exp(part.max_H[h] - m);
          total = total + part.sum_H[h] * rescale;
          axpy(rescale, part.out_HC.data() + h * C, dst, C);
        }
        const acc_t inv = acc_t(1) / total;
        for (int64_t c = 0; c < C; ++c) dst[c] = dst[c] * inv;
      }
    });
  }
}

at::Tensor sparse_decode(const at::Tensor& q_lat, const at::Tensor& q_pe, const at::Tensor& c_kv,
                         const at::Tensor& k_pe, const at::Tensor& topk_idx, double scale) {
  TORCH_CHECK(q_lat.dim() == 4 && q_pe.dim() == 4 && c_kv.dim() == 3 && k_pe.dim() == 3 && topk_idx.dim() == 3,
              "sparse_decode: bad ranks");
  TORCH_CHECK(q_lat.scalar_type() == q_pe.scalar_type() && c_kv.scalar_type() == k_pe.scalar_type(),
              "sparse_decode: dtypes differ");
  const int64_t B = q_lat.size(0), T_ = q_lat.size(1), H = q_lat.size(2), C = q_lat.size(3);
  const int64_t R = q_pe.size(3), S = c_kv.size(1), K = topk_idx.size(2);
  auto ql = q_lat.contiguous(), qr = q_pe.contiguous(), kv = c_kv.contiguous(), kr = k_pe.contiguous();
  auto idx = topk_idx.to(at::kLong).contiguous();
  // The kernel reads the selected rows in place: an index past the cache must not reach it, even when the
  // public op's value checks are off (GLM5_CHECK_VALUES=0). Negative entries mean "no key", as in the reference.
  const int64_t* idx_flat = idx.data_ptr<int64_t>();
  for (int64_t i = 0, n = idx.numel(); i < n; ++i)
    TORCH_CHECK_INDEX(idx_flat[i] < S, "sparse_decode: topk_idx entry ", idx_flat[i], " is past the cache (S=", S,
                      " slots)");
  auto out = at::empty_like(ql);
  if (ql.scalar_type() == at::kDouble) {
    TORCH_CHECK(kv.scalar_type() == at::kDouble, "sparse_decode: fp64 queries need an fp64 cache");
    sparse_decode_kernel<double, double>(ql.data_ptr<double>(), qr.data_ptr<double>(), kv.data_ptr<double>(),
                                         kr.data_ptr<double>(), idx.data_ptr<int64_t>(), scale, B, T_, H, C, R, S,
                                         K, out.data_ptr<double>());
    return out;
  }
  TORCH_CHECK(ql.scalar_type() == at::kFloat, "sparse_decode: expected fp32 or fp64 queries");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv.scalar_type(), "sparse_decode", [&] {
    sparse_decode_kernel<scalar_t, float>(ql.data_ptr<float>(), qr.data_ptr<float>(), kv.data_ptr<scalar_t>(),
                                          kr.data_ptr<scalar_t>(), idx.data_ptr<int64_t>(), static_cast<float>(scale),
                                          B, T_, H, C, R, S, K, out.data_ptr<float>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(glm5_cpu, m) {
  m.def("sparse_decode(Tensor q_lat, Tensor q_pe, Tensor c_kv, Tensor k_pe, Tensor topk_idx, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(glm5_cpu, CPU, m) { m.impl("sparse_decode", &sparse_decode); }

}  // namespace glm5
