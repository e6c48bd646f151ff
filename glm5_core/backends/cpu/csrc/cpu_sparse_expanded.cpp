// Sparse MLA prefill in the EXPANDED form for CPU (training and inference prefill), forward and backward.
//
// Legend: B batch, T queries, H heads, Dn nope width, R rope width, Dv value width, S key slots, K selected keys
// per query (-1 = none), n the selected keys of one query.
//   q_nope [B, T, H, Dn], q_pe [B, T, H, R] (fp32 / fp64), k_nope [B, S, H, Dn], k_pe [B, S, R] (shared by the
//   heads), v [B, S, H, Dv] (fp32, fp64, bf16 or fp16, read in place: only the selected rows are touched; any
//   strides with a unit last one, so k_nope and v may be the two halves of kv_b_proj's output), topk_idx [B, T, K].
// Forward:  s[h,j] = scale * (q_nope[h] . k_nope[i_j, h] + q_pe[h] . k_pe[i_j]),  p = softmax_j(s),
//           out[h] = sum_j p[h,j] v[i_j, h],  lse[h] = log sum_j exp s[h,j]  (-inf and zeros for no key).
// Backward (dO = d out):  p recomputed from lse,  dP[h,j] = dO[h] . v[i_j, h],  D[h] = sum_j p dP,
//           G = scale * p (dP - D);  d q_nope[h] = sum_j G k_nope[i_j, h],  d q_pe[h] = sum_j G k_pe[i_j],
//           d k_nope[s, h] = sum_{(t,j): i_j = s} G[h,j] q_nope[h],  d v[s, h] = sum p[h,j] dO[h],
//           d k_pe[s] = sum sum_h G[h,j] q_pe[h].
// Per score Dn + R products and per output Dv, against C + R and C in the absorbed form (cpu_sparse_decode.cpp).
//
// Determinism: the forward and pass 1 of the backward work on one query row at a time (rows are independent).
// Pass 2 groups the block's (t, j) entries by key (a counting sort, ascending (t, j) within each key) and gives
// each key to one thread, which adds its entries in that order: every key gradient is summed in (t, j) order
// whatever the thread count, so the gradients are bitwise repeatable. Rows go through in blocks whose p / G
// ([rows, H, K]) fit kBlockBytes (a size set by the shapes only): time and memory O(T K), never O(T S).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <omp.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_simd.h"

namespace glm5 {
namespace {

constexpr int64_t kBlockBytes = int64_t(64) << 20;  // p and G of a block of query rows

// A [B, X, H, D] (or [B, X, D] with h = 0) tensor with a unit last stride, read through its strides.
template <typename T> struct Rows {
  const T* base;
  int64_t sb, sx, sh;
  const T* at(int64_t b, int64_t x, int64_t h) const { return base + b * sb + x * sx + h * sh; }
};

template <typename T> Rows<T> rows_of(const at::Tensor& t) {
  const bool per_head = t.dim() == 4;
  return {t.data_ptr<T>(), t.stride(0), t.stride(1), per_head ? t.stride(2) : 0};
}

// The n values at src as acc_t: src itself when no conversion is needed, else a converted copy in scratch.
template <typename acc_t, typename cache_t> const acc_t* as_acc(const cache_t* src, acc_t* scratch, int64_t n) {
  if constexpr (std::is_same<acc_t, cache_t>::value) {
    return src;
  } else {
    for (int64_t i = 0; i < n; ++i) scratch[i] = static_cast<acc_t>(src[i]);
    return scratch;
  }
}

struct Sizes {
  int64_t B, T, H, Dn, R, Dv, S, K;
};

// Per-thread scratch: the row's kept keys, pointers to their (converted) rows, and per-head scores.
template <typename acc_t> struct Scratch {
  std::vector<int64_t> slot, key;           // kept slot j and its key s
  std::vector<const acc_t*> kn, kr, vv;    // [n] rows of k_nope (one head), k_pe, v (one head)
  std::vector<acc_t> kn_buf, kr_buf, v_buf, score;  // conversions [K, Dn], [K, R], [K, Dv]; scores [K]
  void reserve(const Sizes& z) {
    slot.reserve(z.K), key.reserve(z.K), kn.resize(z.K), kr.resize(z.K), vv.resize(z.K), score.resize(z.K);
    kn_buf.resize(z.K * z.Dn), kr_buf.resize(z.K * z.R), v_buf.resize(z.K * z.Dv);
  }
};

// Collects the kept keys of query row `row` and points kr at their k_pe rows.
template <typename acc_t, typename cache_t>
void gather_row(Scratch<acc_t>& w, const int64_t* idx, int64_t row, const Rows<cache_t>& k_pe, const Sizes& z) {
  const int64_t b = row / z.T;
  w.slot.clear(), w.key.clear();
  for (int64_t j = 0; j < z.K; ++j) {
    const int64_t s = idx[row * z.K + j];
    if (s < 0) continue;
    w.kr[w.key.size()] = as_acc(k_pe.at(b, s, 0), w.kr_buf.data() + w.key.size() * z.R, z.R);
    w.slot.push_back(j), w.key.push_back(s);
  }
}

// Scores of head h of row `row` against the kept keys: fills w.kn / w.vv for the head, w.score; returns the max.
template <typename acc_t, typename cache_t>
acc_t head_scores(Scratch<acc_t>& w, const acc_t* qn, const acc_t* qr, const Rows<cache_t>& k_nope,
                  const Rows<cache_t>& v, int64_t b, int64_t h, acc_t scale, const Sizes& z) {
  acc_t m = -std::numeric_limits<acc_t>::infinity();
  for (size_t i = 0; i < w.key.size(); ++i) {
    const int64_t s = w.key[i];
    w.kn[i] = as_acc(k_nope.at(b, s, h), w.kn_buf.data() + i * z.Dn, z.Dn);
    w.vv[i] = as_acc(v.at(b, s, h), w.v_buf.data() + i * z.Dv, z.Dv);
    w.score[i] = (dot(qn, w.kn[i], z.Dn) + dot(qr, w.kr[i], z.R)) * scale;
    m = std::max(m, w.score[i]);
  }
  return m;
}

template <typename cache_t, typename acc_t>
void forward_kernel(const Rows<acc_t>& q_nope, const Rows<acc_t>& q_pe, const Rows<cache_t>& k_nope,
                    const Rows<cache_t>& k_pe, const Rows<cache_t>& v, const int64_t* idx, acc_t scale,
                    const Sizes& z, acc_t* out, acc_t* lse) {
  const int threads = std::max(1, at::get_num_threads());
  std::vector<Scratch<acc_t>> scratch(threads);  // allocated before the region
  for (auto& w : scratch) w.reserve(z);
  RegionErrors errors;
#pragma omp parallel num_threads(threads)
  {
    Scratch<acc_t>& w = scratch[omp_get_thread_num()];
#pragma omp for schedule(dynamic, 4)
    for (int64_t row = 0; row < z.B * z.T; ++row) {
      errors.run([&] {
        const int64_t b = row / z.T, t = row % z.T;
        gather_row(w, idx, row, k_pe, z);
        const int64_t n = static_cast<int64_t>(w.key.size());
        for (int64_t h = 0; h < z.H; ++h) {
          acc_t* o = out + (row * z.H + h) * z.Dv;
          for (int64_t d = 0; d < z.Dv; ++d) o[d] = acc_t(0);
          if (n == 0) {  // no selected key: zeros, as the reference
            lse[row * z.H + h] = -std::numeric_limits<acc_t>::infinity();
            continue;
          }
          const acc_t m = head_scores(w, q_nope.at(b, t, h), q_pe.at(b, t, h), k_nope, v, b, h, scale, z);
          acc_t total = 0;
          for (int64_t i = 0; i < n; ++i) {
            const acc_t p = std::exp(w.score[i] - m);
            total = total + p;
            axpy(p, w.vv[i], o, z.Dv);
          }
          const acc_t inv = acc_t(1) / total;
          for (int64_t d = 0; d < z.Dv; ++d) o[d] = o[d] * inv;
          lse[row * z.H + h] = m + std::log(total);
        }
      });
    }
  }
  errors.rethrow_if_failed("sparse_expanded_forward");
}

template <typename cache_t, typename acc_t>
void backward_kernel(const acc_t* grad_out, const Rows<acc_t>& q_nope, const Rows<acc_t>& q_pe,
                     const Rows<cache_t>& k_nope, const Rows<cache_t>& k_pe, const Rows<cache_t>& v,
                     const int64_t* idx, const acc_t* lse, acc_t scale, const Sizes& z, acc_t* dq_nope,
                     acc_t* dq_pe, acc_t* dk_nope, acc_t* dk_pe, acc_t* dv) {
  const int64_t rows = z.B * z.T, HK = z.H * z.K;
  const int threads = std::max(1, at::get_num_threads());
  const int64_t block = std::max<int64_t>(1, kBlockBytes / std::max<int64_t>(1, 2 * HK * int64_t(sizeof(acc_t))));
  const int64_t block_rows = std::min(rows, block);
  std::vector<acc_t> p_all(block_rows * HK), g_all(block_rows * HK);  // [rows of the block, H, K]
  std::vector<int64_t> start(z.B * z.S + 1), fill(z.B * z.S), entries(block_rows * z.K), touched;
  touched.reserve(std::min(z.B * z.S, block_rows * z.K));
  std::vector<Scratch<acc_t>> scratch(threads);
  for (auto& w : scratch) w.reserve(z);
  for (int64_t i = 0; i < z.B * z.S * z.H * z.Dn; ++i) dk_nope[i] = acc_t(0);
  for (int64_t i = 0; i < z.B * z.S * z.H * z.Dv; ++i) dv[i] = acc_t(0);
  for (int64_t i = 0; i < z.B * z.S * z.R; ++i) dk_pe[i] = acc_t(0);
  RegionErrors errors;

  for (int64_t row0 = 0; row0 < rows; row0 += block) {
    const int64_t row1 = std::min(rows, row0 + block);
    // Pass 1 (parallel over rows): p and G of every kept entry, d q_nope and d q_pe of the row.
#pragma omp parallel num_threads(threads)
    {
      Scratch<acc_t>& w = scratch[omp_get_thread_num()];
#pragma omp for schedule(dynamic, 4)
      for (int64_t row = row0; row < row1; ++row) {
        errors.run([&] {
          const int64_t b = row / z.T, t = row % z.T;
          gather_row(w, idx, row, k_pe, z);
          const int64_t n = static_cast<int64_t>(w.key.size());
          for (int64_t h = 0; h < z.H; ++h) {
            acc_t* dqn = dq_nope + (row * z.H + h) * z.Dn;
            acc_t* dqr = dq_pe + (row * z.H + h) * z.R;
            for (int64_t d = 0; d < z.Dn; ++d) dqn[d] = acc_t(0);
            for (int64_t d = 0; d < z.R; ++d) dqr[d] = acc_t(0);
            if (n == 0) continue;  // the output was zeros: every gradient is zero
            const acc_t* dO = grad_out + (row * z.H + h) * z.Dv;
            head_scores(w, q_nope.at(b, t, h), q_pe.at(b, t, h), k_nope, v, b, h, scale, z);
            acc_t* p = p_all.data() + (row - row0) * HK + h * z.K;  // indexed by slot j
            acc_t* g = g_all.data() + (row - row0) * HK + h * z.K;
            const acc_t row_lse = lse[row * z.H + h];
            acc_t d_sum = 0;  // D = sum_j p dP
            for (int64_t i = 0; i < n; ++i) {
              const int64_t j = w.slot[i];
              p[j] = std::exp(w.score[i] - row_lse);
              g[j] = dot(dO, w.vv[i], z.Dv);  // dP, for now
              d_sum = d_sum + p[j] * g[j];
            }
            for (int64_t i = 0; i < n; ++i) {
              const int64_t j = w.slot[i];
              g[j] = scale * (p[j] * (g[j] - d_sum));
              axpy(g[j], w.kn[i], dqn, z.Dn);
              axpy(g[j], w.kr[i], dqr, z.R);
            }
          }
        });
      }
    }
    errors.rethrow_if_failed("sparse_expanded_backward");

    // Group the block's kept entries (row * K + j) by key, ascending within each key (a counting sort).
    std::fill(start.begin(), start.end(), int64_t(0));
    for (int64_t row = row0; row < row1; ++row)
      for (int64_t j = 0; j < z.K; ++j) {
        const int64_t s = idx[row * z.K + j];
        if (s >= 0) ++start[(row / z.T) * z.S + s + 1];
      }
    touched.clear();
    for (int64_t key = 0; key < z.B * z.S; ++key) {
      if (start[key + 1] > 0) touched.push_back(key);
      start[key + 1] += start[key];
      fill[key] = start[key];
    }
    for (int64_t row = row0; row < row1; ++row)
      for (int64_t j = 0; j < z.K; ++j) {
        const int64_t s = idx[row * z.K + j];
        if (s >= 0) entries[fill[(row / z.T) * z.S + s]++] = (row - row0) * z.K + j;
      }

    // Pass 2 (parallel over keys, each key owned by one thread): add its entries in (t, j) order.
    const int64_t n_touched = static_cast<int64_t>(touched.size());
#pragma omp parallel for num_threads(threads) schedule(dynamic, 8)
    for (int64_t k = 0; k < n_touched; ++k) {
      const int64_t key = touched[k], b = key / z.S;
      acc_t* dkr = dk_pe + key * z.R;
      for (int64_t e = start[key]; e < start[key + 1]; ++e) {
        const int64_t local = entries[e] / z.K, j = entries[e] % z.K, row = row0 + local, t = row % z.T;
        for (int64_t h = 0; h < z.H; ++h) {
          const acc_t p = p_all[local * HK + h * z.K + j], g = g_all[local * HK + h * z.K + j];
          axpy(g, q_nope.at(b, t, h), dk_nope + (key * z.H + h) * z.Dn, z.Dn);
          axpy(p, grad_out + (row * z.H + h) * z.Dv, dv + (key * z.H + h) * z.Dv, z.Dv);
          axpy(g, q_pe.at(b, t, h), dkr, z.R);
        }
      }
    }
  }
}

at::Tensor unit_last_stride(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

Sizes check_inputs(const char* op, const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& k_nope,
                   const at::Tensor& k_pe, const at::Tensor& v, const at::Tensor& topk_idx) {
  TORCH_CHECK(q_nope.dim() == 4 && q_pe.dim() == 4 && k_nope.dim() == 4 && k_pe.dim() == 3 && v.dim() == 4 &&
                  topk_idx.dim() == 3,
              op, ": bad ranks");
  TORCH_CHECK(q_nope.scalar_type() == q_pe.scalar_type() && k_nope.scalar_type() == k_pe.scalar_type() &&
                  k_nope.scalar_type() == v.scalar_type(),
              op, ": dtypes differ");
  const Sizes z{q_nope.size(0), q_nope.size(1), q_nope.size(2), q_nope.size(3), q_pe.size(3), v.size(3),
                k_nope.size(1), topk_idx.size(2)};
  TORCH_CHECK(q_pe.size(0) == z.B && q_pe.size(1) == z.T && q_pe.size(2) == z.H && k_nope.size(0) == z.B &&
                  k_nope.size(2) == z.H && k_nope.size(3) == z.Dn && k_pe.size(0) == z.B && k_pe.size(1) == z.S &&
                  k_pe.size(2) == z.R && v.size(0) == z.B && v.size(1) == z.S && v.size(2) == z.H &&
                  topk_idx.size(0) == z.B && topk_idx.size(1) == z.T,
              op, ": shapes disagree");
  return z;
}

at::Tensor checked_indices(const char* op, const at::Tensor& topk_idx, int64_t S) {
  // The kernels read the selected rows in place: an index past the keys must not reach them, even when the
  // public op's value checks are off. Negative entries mean "no key", as in the reference.
  auto idx = topk_idx.to(at::kLong).contiguous();
  const int64_t* flat = idx.data_ptr<int64_t>();
  for (int64_t i = 0, n = idx.numel(); i < n; ++i)
    TORCH_CHECK_INDEX(flat[i] < S, op, ": topk_idx entry ", flat[i], " is past the keys (S=", S, " slots)");
  return idx;
}

std::tuple<at::Tensor, at::Tensor> sparse_expanded_forward(const at::Tensor& q_nope_in, const at::Tensor& q_pe_in,
                                                           const at::Tensor& k_nope_in, const at::Tensor& k_pe_in,
                                                           const at::Tensor& v_in, const at::Tensor& topk_idx,
                                                           double scale) {
  const char* op = "sparse_expanded_forward";
  const Sizes z = check_inputs(op, q_nope_in, q_pe_in, k_nope_in, k_pe_in, v_in, topk_idx);
  auto qn = unit_last_stride(q_nope_in), qr = unit_last_stride(q_pe_in), kn = unit_last_stride(k_nope_in);
  auto kr = unit_last_stride(k_pe_in), vv = unit_last_stride(v_in);
  auto idx = checked_indices(op, topk_idx, z.S);
  auto out = at::empty({z.B, z.T, z.H, z.Dv}, qn.options());
  auto lse = at::empty({z.B, z.T, z.H}, qn.options());
  if (qn.scalar_type() == at::kDouble) {
    TORCH_CHECK(kn.scalar_type() == at::kDouble, op, ": fp64 queries need fp64 keys");
    forward_kernel<double, double>(rows_of<double>(qn), rows_of<double>(qr), rows_of<double>(kn),
                                   rows_of<double>(kr), rows_of<double>(vv), idx.data_ptr<int64_t>(), scale, z,
                                   out.data_ptr<double>(), lse.data_ptr<double>());
    return {out, lse};
  }
  TORCH_CHECK(qn.scalar_type() == at::kFloat, op, ": expected fp32 or fp64 queries");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kn.scalar_type(), "sparse_expanded_forward", [&] {
    forward_kernel<scalar_t, float>(rows_of<float>(qn), rows_of<float>(qr), rows_of<scalar_t>(kn),
                                    rows_of<scalar_t>(kr), rows_of<scalar_t>(vv), idx.data_ptr<int64_t>(),
                                    static_cast<float>(scale), z, out.data_ptr<float>(), lse.data_ptr<float>());
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> sparse_expanded_backward(
    const at::Tensor& grad_out_in, const at::Tensor& q_nope_in, const at::Tensor& q_pe_in,
    const at::Tensor& k_nope_in, const at::Tensor& k_pe_in, const at::Tensor& v_in, const at::Tensor& topk_idx,
    const at::Tensor& lse_in, double scale) {
  const char* op = "sparse_expanded_backward";
  const Sizes z = check_inputs(op, q_nope_in, q_pe_in, k_nope_in, k_pe_in, v_in, topk_idx);
  TORCH_CHECK(grad_out_in.dim() == 4 && grad_out_in.size(0) == z.B && grad_out_in.size(1) == z.T &&
                  grad_out_in.size(2) == z.H && grad_out_in.size(3) == z.Dv,
              op, ": grad_out must be [B, T, H, Dv]");
  TORCH_CHECK(lse_in.dim() == 3 && lse_in.size(0) == z.B && lse_in.size(1) == z.T && lse_in.size(2) == z.H, op,
              ": lse must be [B, T, H]");
  TORCH_CHECK(grad_out_in.scalar_type() == q_nope_in.scalar_type() && lse_in.scalar_type() == q_nope_in.scalar_type(),
              op, ": grad_out / lse must have the queries' dtype");
  auto dO = grad_out_in.contiguous(), lse = lse_in.contiguous();
  auto qn = unit_last_stride(q_nope_in), qr = unit_last_stride(q_pe_in), kn = unit_last_stride(k_nope_in);
  auto kr = unit_last_stride(k_pe_in), vv = unit_last_stride(v_in);
  auto idx = checked_indices(op, topk_idx, z.S);
  auto opts = qn.options();
  auto dq_nope = at::empty({z.B, z.T, z.H, z.Dn}, opts), dq_pe = at::empty({z.B, z.T, z.H, z.R}, opts);
  auto dk_nope = at::empty({z.B, z.S, z.H, z.Dn}, opts), dk_pe = at::empty({z.B, z.S, z.R}, opts);
  auto dv = at::empty({z.B, z.S, z.H, z.Dv}, opts);
  if (qn.scalar_type() == at::kDouble) {
    TORCH_CHECK(kn.scalar_type() == at::kDouble, op, ": fp64 queries need fp64 keys");
    backward_kernel<double, double>(dO.data_ptr<double>(), rows_of<double>(qn), rows_of<double>(qr),
                                    rows_of<double>(kn), rows_of<double>(kr), rows_of<double>(vv),
                                    idx.data_ptr<int64_t>(), lse.data_ptr<double>(), scale, z,
                                    dq_nope.data_ptr<double>(), dq_pe.data_ptr<double>(), dk_nope.data_ptr<double>(),
                                    dk_pe.data_ptr<double>(), dv.data_ptr<double>());
    return {dq_nope, dq_pe, dk_nope, dk_pe, dv};
  }
  TORCH_CHECK(qn.scalar_type() == at::kFloat, op, ": expected fp32 or fp64 queries");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kn.scalar_type(), "sparse_expanded_backward", [&] {
    backward_kernel<scalar_t, float>(dO.data_ptr<float>(), rows_of<float>(qn), rows_of<float>(qr),
                                     rows_of<scalar_t>(kn), rows_of<scalar_t>(kr), rows_of<scalar_t>(vv),
                                     idx.data_ptr<int64_t>(), lse.data_ptr<float>(), static_cast<float>(scale), z,
                                     dq_nope.data_ptr<float>(), dq_pe.data_ptr<float>(), dk_nope.data_ptr<float>(),
                                     dk_pe.data_ptr<float>(), dv.data_ptr<float>());
  });
  return {dq_nope, dq_pe, dk_nope, dk_pe, dv};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(glm5_cpu, m) {
  m.def("sparse_expanded_forward(Tensor q_nope, Tensor q_pe, Tensor k_nope, Tensor k_pe, Tensor v, "
        "Tensor topk_idx, float scale) -> (Tensor, Tensor)");
  m.def("sparse_expanded_backward(Tensor grad_out, Tensor q_nope, Tensor q_pe, Tensor k_nope, Tensor k_pe, "
        "Tensor v, Tensor topk_idx, Tensor lse, float scale) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(glm5_cpu, CPU, m) {
  m.impl("sparse_expanded_forward", &sparse_expanded_forward);
  m.impl("sparse_expanded_backward", &sparse_expanded_backward);
}

}  // namespace glm5
