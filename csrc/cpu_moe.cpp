// MoE routing selection, dispatch and combine for CPU.
//
// Legend: N tokens, E routed experts, G expert groups, K experts per token, D hidden size,
// M = N * K routed rows (flat assignment m = n * K + j).
//
//   moe_select(select [N, E], K, G, topk_group) -> ids int64 [N, K]: group-limited top-k of the selection
//       scores (a group scores as the sum of its top-2; best groups then best experts, ties to the lower id).
//   moe_route(logits [N, E], bias [E], ...) -> (weights [N, K], ids int32 [N, K]): the whole routing contract.
//   moe_dispatch(x [N, D], ids [N, K], E) -> (x_sorted [M, D], sort_idx int64 [M], counts int64 [E]):
//       a stable counting sort by expert id, then a parallel row gather.
//   moe_combine(y_sorted [M, D], sort_idx [M], weights [N, K]) -> out [N, D]: per token, the weighted sum of
//       its K rows in slot order (mul then add, as the reference), no atomics.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace glm5 {
namespace {

// The `count` best of values[0..n) (descending, ties to the lower position) among eligible ones.
template <typename T>
void best_of(const T* values, int64_t n, const uint8_t* eligible, int64_t count, int64_t* chosen) {
  int64_t have = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (eligible != nullptr && !eligible[i]) continue;
    // Insertion into the sorted list; an equal value never displaces an earlier (lower) index.
    int64_t pos = have;
    while (pos > 0 && values[i] > values[chosen[pos - 1]]) --pos;
    if (pos >= count) continue;
    const int64_t last = std::min(have, count - 1);
    for (int64_t p = last; p > pos; --p) chosen[p] = chosen[p - 1];
    chosen[pos] = i;
    have = std::min(have + 1, count);
  }
}

template <typename T>
void select_kernel(const T* select_NE, int64_t N, int64_t E, int64_t K, int64_t G, int64_t topk_group, int64_t* ids) {
  const int64_t per_group = E / G;
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    std::vector<T> group_score(G);
    std::vector<int64_t> kept(topk_group), top2(2);
    std::vector<uint8_t> eligible(E);
    for (int64_t n = begin; n < end; ++n) {
      const T* row = select_NE + n * E;
      const uint8_t* mask = nullptr;
      if (G > 1) {
        for (int64_t g = 0; g < G; ++g) {
          const int64_t take = std::min<int64_t>(2, per_group);
          best_of(row + g * per_group, per_group, nullptr, take, top2.data());
          T score = row[g * per_group + top2[0]];
          if (take == 2) score = score + row[g * per_group + top2[1]];
          group_score[g] = score;
        }
        best_of(group_score.data(), G, nullptr, topk_group, kept.data());
        std::fill(eligible.begin(), eligible.end(), uint8_t(0));
        for (int64_t g : kept) std::fill(eligible.begin() + g * per_group, eligible.begin() + (g + 1) * per_group, 1);
        mask = eligible.data();
      }
      best_of(row, E, mask, K, ids + n * K);
    }
  });
}

at::Tensor moe_select(const at::Tensor& select, int64_t top_k, int64_t n_group, int64_t topk_group) {
  TORCH_CHECK(select.dim() == 2, "moe_select: select must be [N, E]");
  const int64_t N = select.size(0), E = select.size(1);
  TORCH_CHECK(n_group >= 1 && E % n_group == 0 && topk_group >= 1 && topk_group <= n_group, "moe_select: bad groups");
  TORCH_CHECK(top_k >= 1 && top_k <= (E / n_group) * topk_group, "moe_select: top_k exceeds the eligible experts");
  auto sel = select.contiguous();
  auto ids = at::empty({N, top_k}, select.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES(sel.scalar_type(), "moe_select", [&] {
    select_kernel<scalar_t>(sel.data_ptr<scalar_t>(), N, E, top_k, n_group, topk_group, ids.data_ptr<int64_t>());
  });
  return ids;
}

// Full routing of each token in scalar per-row code (batch invariant bitwise: no vectorised tail that
// depends on N): scores, biased selection, weights from the unbiased scores, renormalised in slot order.
template <typename T>
void route_kernel(const T* logits_NE, const T* bias_E, int64_t N, int64_t E, int64_t K, bool sigmoid, int64_t G,
                  int64_t topk_group, bool renormalize, T scale, T* weights_NK, int32_t* ids_NK) {
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    std::vector<T> scores(E), select(E);
    std::vector<int64_t> chosen(K);
    for (int64_t n = begin; n < end; ++n) {
      const T* row = logits_NE + n * E;
      if (sigmoid) {
        for (int64_t e = 0; e < E; ++e) scores[e] = T(1) / (T(1) + std::exp(-row[e]));
      } else {
        T m = row[0];
        for (int64_t e = 1; e < E; ++e) m = std::max(m, row[e]);
        T total = 0;
        for (int64_t e = 0; e < E; ++e) total = total + (scores[e] = std::exp(row[e] - m));
        for (int64_t e = 0; e < E; ++e) scores[e] = scores[e] / total;
      }
      for (int64_t e = 0; e < E; ++e) select[e] = bias_E ? scores[e] + bias_E[e] : scores[e];
      select_kernel<T>(select.data(), 1, E, K, G, topk_group, chosen.data());
      T total = 0;
      for (int64_t j = 0; j < K; ++j) total = total + scores[chosen[j]];
      const T denom = total + T(1e-20);
      for (int64_t j = 0; j < K; ++j) {
        T w = scores[chosen[j]];
        if (renormalize) w = w / denom;
        weights_NK[n * K + j] = w * scale;
        ids_NK[n * K + j] = static_cast<int32_t>(chosen[j]);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, const c10::optional<at::Tensor>& bias,
                                             int64_t top_k, bool sigmoid, int64_t n_group, int64_t topk_group,
                                             bool renormalize, double routed_scaling_factor) {
  TORCH_CHECK(logits.dim() == 2, "moe_route: logits must be [N, E]");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kDouble,
              "moe_route: expected fp32 or fp64 logits");
  const int64_t N = logits.size(0), E = logits.size(1);
  TORCH_CHECK(n_group >= 1 && E % n_group == 0 && topk_group >= 1 && topk_group <= n_group, "moe_route: bad groups");
  TORCH_CHECK(top_k >= 1 && top_k <= (E / n_group) * topk_group, "moe_route: top_k exceeds the eligible experts");
  auto lg = logits.contiguous();
  at::Tensor b;
  if (bias.has_value()) b = bias->to(lg.scalar_type()).contiguous();
  auto weights = at::empty({N, top_k}, lg.options());
  auto ids = at::empty({N, top_k}, lg.options().dtype(at::kInt));
  AT_DISPATCH_FLOATING_TYPES(lg.scalar_type(), "moe_route", [&] {
    route_kernel<scalar_t>(lg.data_ptr<scalar_t>(), b.defined() ? b.data_ptr<scalar_t>() : nullptr, N, E, top_k,
                           sigmoid, n_group, topk_group, renormalize, static_cast<scalar_t>(routed_scaling_factor),
                           weights.data_ptr<scalar_t>(), ids.data_ptr<int32_t>());
  });
  return {weights, ids};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_dispatch(const at::Tensor& x, const at::Tensor& expert_ids,
                                                            int64_t num_experts) {
  TORCH_CHECK(x.dim() == 2 && expert_ids.dim() == 2 && x.size(0) == expert_ids.size(0), "moe_dispatch: bad shapes");
  const int64_t K = expert_ids.size(1), M = expert_ids.numel(), D = x.size(1);
  auto flat = expert_ids.to(at::kLong).contiguous();
  const int64_t* e_M = flat.data_ptr<int64_t>();
  auto counts = at::zeros({num_experts}, x.options().dtype(at::kLong));
  int64_t* count_E = counts.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(e_M[m] >= 0 && e_M[m] < num_experts, "moe_dispatch: expert id out of range");
    ++count_E[e_M[m]];
  }
  std::vector<int64_t> next(num_experts, 0);  // exclusive prefix sum: first row of each expert
  for (int64_t e = 1; e < num_experts; ++e) next[e] = next[e - 1] + count_E[e - 1];
  auto sort_idx = at::empty({M}, x.options().dtype(at::kLong));
  int64_t* order = sort_idx.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) order[next[e_M[m]]++] = m;  // stable: token order, then slot order
  auto xc = x.contiguous();
  auto x_sorted = at::empty({M, D}, x.options());
  const int64_t row_bytes = D * xc.element_size();
  const char* src = static_cast<const char*>(xc.data_ptr());
  char* dst = static_cast<char*>(x_sorted.data_ptr());
  at::parallel_for(0, M, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) std::memcpy(dst + r * row_bytes, src + (order[r] / K) * row_bytes, row_bytes);
  });
  return {x_sorted, sort_idx, counts};
}

template <typename scalar_t>
void combine_kernel(const scalar_t* y_MD, const int64_t* row_of, const at::opmath_type<scalar_t>* w_NK, int64_t N,
                    int64_t K, int64_t D, scalar_t* out_ND) {
  using acc_t = at::opmath_type<scalar_t>;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> acc(D);
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t j = 0; j < K; ++j) {
        const scalar_t* y = y_MD + row_of[n * K + j] * D;
        const acc_t w = w_NK[n * K + j];
        if (j == 0) {
          for (int64_t d = 0; d < D; ++d) acc[d] = w * static_cast<acc_t>(y[d]);
        } else {
          for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] + w * static_cast<acc_t>(y[d]);
        }
      }
      for (int64_t d = 0; d < D; ++d) out_ND[n * D + d] = static_cast<scalar_t>(acc[d]);
    }
  });
}

at::Tensor moe_combine(const at::Tensor& y_sorted, const at::Tensor& sort_idx, const at::Tensor& weights) {
  TORCH_CHECK(y_sorted.dim() == 2 && sort_idx.dim() == 1 && weights.dim() == 2, "moe_combine: bad ranks");
  const int64_t N = weights.size(0), K = weights.size(1), M = sort_idx.size(0), D = y_sorted.size(1);
  TORCH_CHECK(M == N * K && y_sorted.size(0) == M, "moe_combine: sizes disagree");
  auto order = sort_idx.to(at::kLong).contiguous();
  const int64_t* order_M = order.data_ptr<int64_t>();
  std::vector<int64_t> row_of(M, -1);  // flat assignment -> sorted row
  for (int64_t r = 0; r < M; ++r) {
    TORCH_CHECK(order_M[r] >= 0 && order_M[r] < M && row_of[order_M[r]] < 0, "moe_combine: sort_idx is not a permutation");
    row_of[order_M[r]] = r;
  }
  auto y = y_sorted.contiguous();
  auto out = at::empty({N, D}, y.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "moe_combine", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    auto w = weights.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();
    combine_kernel<scalar_t>(y.data_ptr<scalar_t>(), row_of.data(), w.data_ptr<acc_t>(), N, K, D,
                             out.data_ptr<scalar_t>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(glm5_cpu, m) {
  m.def("moe_select(Tensor select, int top_k, int n_group, int topk_group) -> Tensor");
  m.def("moe_route(Tensor logits, Tensor? bias, int top_k, bool sigmoid, int n_group, int topk_group, "
        "bool renormalize, float routed_scaling_factor) -> (Tensor, Tensor)");
  m.def("moe_dispatch(Tensor x, Tensor expert_ids, int num_experts) -> (Tensor, Tensor, Tensor)");
  m.def("moe_combine(Tensor y_sorted, Tensor sort_idx, Tensor weights) -> Tensor");
}

TORCH_LIBRARY_IMPL(glm5_cpu, CPU, m) {
  m.impl("moe_select", &moe_select);
  m.impl("moe_route", &moe_route);
  m.impl("moe_dispatch", &moe_dispatch);
  m.impl("moe_combine", &moe_combine);
}

}  // namespace glm5
