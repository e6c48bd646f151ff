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
//   moe_experts(x_sorted [M, D], counts [E], w_gate [E, F, D], w_up [E, F, D], w_down [E, D, F]) -> y [M, D]:
//       SwiGLU of each expert over its contiguous rows; experts run in parallel, one thread each, every
//       GEMM single-threaded (see experts_kernel).
//   moe_fused_experts(x [N, D], weights [N, K], ids [N, K], w_gate, w_up, w_down) -> out [N, D]: dispatch,
//       experts and combine in one op, each expert gathering its own rows (no [M, D] input copy).
//   moe_fused_experts_train(same) -> (out, gate [M, F], up [M, F], sort_idx [M], counts [E]): the same output
//       plus what the backward needs.
//   moe_fused_experts_backward(grad_out [N, D], x, weights, sort_idx, counts, gate, up, w_gate, w_up, w_down)
//       -> (dx [N, D], dweights [N, K], dw_gate [E, F, D], dw_up [E, F, D], dw_down [E, D, F]).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include "cpu_alloc.h"
#include "cpu_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
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

// Stable counting sort of the flat assignments m = n * K + j by expert id: (sort_idx int64 [M], counts int64 [E]).
std::tuple<at::Tensor, at::Tensor> sort_by_expert(const at::Tensor& expert_ids, int64_t num_experts, const char* op) {
  const int64_t M = expert_ids.numel();
  auto flat = expert_ids.to(at::kLong).contiguous();
  const int64_t* e_M = flat.data_ptr<int64_t>();
  auto counts = at::zeros({num_experts}, flat.options());
  int64_t* count_E = counts.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(e_M[m] >= 0 && e_M[m] < num_experts, op, ": expert id out of range");
    ++count_E[e_M[m]];
  }
  std::vector<int64_t> next(num_experts, 0);  // exclusive prefix sum: first row of each expert
  for (int64_t e = 1; e < num_experts; ++e) next[e] = next[e - 1] + count_E[e - 1];
  auto sort_idx = at::empty({M}, flat.options());
  int64_t* order = sort_idx.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) order[next[e_M[m]]++] = m;  // stable: token order, then slot order
  return {sort_idx, counts};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_dispatch(const at::Tensor& x, const at::Tensor& expert_ids,
                                                            int64_t num_experts) {
  TORCH_CHECK(x.dim() == 2 && expert_ids.dim() == 2 && x.size(0) == expert_ids.size(0), "moe_dispatch: bad shapes");
  const int64_t K = expert_ids.size(1), M = expert_ids.numel(), D = x.size(1);
  auto [sort_idx, counts] = sort_by_expert(expert_ids, num_experts, "moe_dispatch");
  const int64_t* order = sort_idx.data_ptr<int64_t>();
  auto xc = x.contiguous();
  auto x_sorted = empty_large({M, D}, x.options());
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
    TORCH_CHECK(order_M[r] >= 0 && order_M[r] < M && row_of[order_M[r]] < 0,
                "moe_combine: sort_idx is not a permutation");
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


// Why one thread per expert: the per-expert GEMMs are small ([rows ~ M/E, D] x [D, F] with F ~ D/4), and a
// multi-threaded BLAS call splits each of them across threads with a barrier per call, which the calls
// are too small to amortise (~80 GFLOP/s on 2 cores vs ~180 for a square GEMM). Running whole experts
// concurrently, each GEMM on one thread (BLAS and ATen run serially inside an OpenMP parallel region),
// keeps every core in a long GEMM. Experts are taken largest first (dynamic schedule) so the tail is a
// small expert. A row's result depends only on its expert's rows and the BLAS call that computes them,
// never on which thread ran the expert (with a single non-empty expert the region has one thread and
// BLAS may thread that GEMM itself).
// rows_of(first, n) -> the n input rows of the expert whose sorted rows start at ``first``, [n, D], in the
// compute dtype; called from inside the parallel region (it must not start a parallel region itself).
using RowSource = std::function<at::Tensor(int64_t first, int64_t n)>;
// task(e, first, n): the work of expert e over its n sorted rows starting at ``first``.
using ExpertTask = std::function<void(int64_t e, int64_t first, int64_t n)>;

std::vector<int64_t> first_rows(const std::vector<int64_t>& count_E) {
  std::vector<int64_t> first_row(count_E.size(), 0);  // exclusive prefix sum of the counts
  for (size_t e = 1; e < count_E.size(); ++e) first_row[e] = first_row[e - 1] + count_E[e - 1];
  return first_row;
}

// Runs task on every non-empty expert, one thread each, largest first (see the note above).
void for_each_expert(const std::vector<int64_t>& count_E, const ExpertTask& task) {
  const int64_t E = static_cast<int64_t>(count_E.size());
  const std::vector<int64_t> first_row = first_rows(count_E);
  std::vector<int64_t> order;  // non-empty experts, most rows first
  for (int64_t e = 0; e < E; ++e) if (count_E[e] > 0) order.push_back(e);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return count_E[a] > count_E[b]; });
  const int64_t tasks = static_cast<int64_t>(order.size());
  // Worker threads do not inherit ATen's thread-local state (inference mode, grad mode, dispatch keys):
  // each task installs the caller's. Exceptions stay inside the region (cpu_parallel.h).
  const at::ThreadLocalState caller_state;
  RegionErrors errors;
#pragma omp parallel for schedule(dynamic, 1) num_threads(std::max(1, std::min<int>(at::get_num_threads(), tasks)))
  for (int64_t t = 0; t < tasks; ++t) {
    errors.run([&] {
      at::ThreadLocalStateGuard state_guard(caller_state);
      const int64_t e = order[t];
      task(e, first_row[e], count_E[e]);
    });
  }
  errors.rethrow_if_failed("moe_experts");
}

// The clamped SwiGLU's activation (GLM-5.3's ``swiglu_limit`` L, as transformers' Glm5NextTextExperts):
// silu(min(gate, L)) * clamp(up, -L, L); without a limit silu(gate) * up. ``up`` is consumed (it may be a
// temporary), ``gate`` is left as it is (the training path keeps it for the backward).
at::Tensor swiglu(const at::Tensor& gate, at::Tensor up, const c10::optional<double>& limit) {
  if (!limit.has_value()) return at::silu(gate).mul_(up);
  const double L = *limit;
  return at::silu(at::clamp_max(gate, L)).mul_(at::clamp(up, -L, L));
}

// y_MD = SwiGLU of each expert over its rows. With gate_MF / up_MF defined (training), the gate and up
// projections [M, F] are kept there (before any clamp) for the backward; the arithmetic is the same either way.
void experts_kernel(const RowSource& rows_of, const std::vector<int64_t>& count_E, const at::Tensor& w_gate_EFD,
                    const at::Tensor& w_up_EFD, const at::Tensor& w_down_EDF, at::Tensor& y_MD,
                    const c10::optional<double>& limit, at::Tensor gate_MF = at::Tensor(),
                    at::Tensor up_MF = at::Tensor()) {
  const at::ScalarType ct = y_MD.scalar_type();
  const bool keep = gate_MF.defined();
  for_each_expert(count_E, [&](int64_t e, int64_t first, int64_t n) {
    at::Tensor x_rows = rows_of(first, n);  // [n, D]
    at::Tensor wg = w_gate_EFD[e].to(ct), wu = w_up_EFD[e].to(ct), wd = w_down_EDF[e].to(ct);  // no-op when ct
    at::Tensor hidden;  // [n, F]
    if (keep) {
      at::Tensor gate = gate_MF.narrow(0, first, n), up = up_MF.narrow(0, first, n);  // [n, F] each
      at::mm_out(gate, x_rows, wg.t());
      at::mm_out(up, x_rows, wu.t());
      hidden = limit.has_value() ? swiglu(gate, up, limit) : at::silu(gate).mul_(up);
    } else {
      hidden = swiglu(at::mm(x_rows, wg.t()), at::mm(x_rows, wu.t()), limit);
    }
    at::Tensor y_rows = y_MD.narrow(0, first, n);  // [n, D]
    at::mm_out(y_rows, hidden, wd.t());
  });
}

at::ScalarType compute_type(const at::Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

std::vector<int64_t> checked_counts(const at::Tensor& counts, int64_t M, const char* op) {
  auto c = counts.to(at::kLong).contiguous();
  std::vector<int64_t> count_E(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  int64_t total = 0;
  for (int64_t n : count_E) {
    TORCH_CHECK(n >= 0, op, ": negative count");
    total += n;
  }
  TORCH_CHECK(total == M, op, ": counts do not sum to the routed rows");
  return count_E;
}

void check_expert_weights(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up,
                          const at::Tensor& w_down, const char* op) {
  TORCH_CHECK(x.dim() == 2 && w_gate.dim() == 3 && w_up.dim() == 3 && w_down.dim() == 3, op, ": bad ranks");
  const int64_t D = x.size(1), E = w_gate.size(0), F = w_gate.size(1);
  TORCH_CHECK(w_gate.size(2) == D && w_up.sizes() == w_gate.sizes() && w_down.size(0) == E && w_down.size(1) == D &&
                  w_down.size(2) == F,
              op, ": shapes disagree");
  TORCH_CHECK(w_gate.scalar_type() == x.scalar_type() && w_up.scalar_type() == x.scalar_type() &&
                  w_down.scalar_type() == x.scalar_type(),
              op, ": dtypes disagree");
}

at::Tensor moe_experts(const at::Tensor& x_sorted, const at::Tensor& counts, const at::Tensor& w_gate,
                       const at::Tensor& w_up, const at::Tensor& w_down, c10::optional<double> swiglu_limit) {
  check_expert_weights(x_sorted, w_gate, w_up, w_down, "moe_experts");
  TORCH_CHECK(counts.dim() == 1 && counts.size(0) == w_gate.size(0), "moe_experts: counts must be [E]");
  const int64_t M = x_sorted.size(0), D = x_sorted.size(1);
  std::vector<int64_t> count_E = checked_counts(counts, M, "moe_experts");
  const at::ScalarType ct = compute_type(x_sorted);
  auto y = empty_large({M, D}, x_sorted.options().dtype(ct));
  auto x = x_sorted.contiguous();
  experts_kernel([&](int64_t first, int64_t n) { return x.narrow(0, first, n).to(ct); }, count_E,
                 w_gate.contiguous(), w_up.contiguous(), w_down.contiguous(), y, swiglu_limit);
  return y.scalar_type() == x_sorted.scalar_type() ? y : y.to(x_sorted.scalar_type());
}

// dispatch -> experts -> combine without the [M, D] copy of the routed inputs: each expert task gathers its
// tokens' rows itself (x is N x D, cache-resident next to the M x D copy). Same arithmetic as the three ops:
// expert outputs rounded to x's dtype, then combined per token in slot order. With ``keep`` (training) the
// gate and up projections are kept: (out [N, D], gate [M, F], up [M, F], sort_idx [M], counts [E]), gate and
// up in the compute dtype and expert-sorted row order; undefined tensors otherwise.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_forward(
    const at::Tensor& x, const at::Tensor& weights, const at::Tensor& expert_ids, const at::Tensor& w_gate,
    const at::Tensor& w_up, const at::Tensor& w_down, const c10::optional<double>& limit, bool keep, const char* op) {
  check_expert_weights(x, w_gate, w_up, w_down, op);
  TORCH_CHECK(expert_ids.dim() == 2 && expert_ids.size(0) == x.size(0) && weights.sizes() == expert_ids.sizes(),
              op, ": expert_ids and weights must be [N, K]");
  const int64_t K = expert_ids.size(1), M = expert_ids.numel(), D = x.size(1), F = w_gate.size(1);
  auto [sort_idx, counts] = sort_by_expert(expert_ids, w_gate.size(0), op);
  std::vector<int64_t> count_E = checked_counts(counts, M, op);
  auto token_of_row = at::div(sort_idx, K, "floor");  // [M] token of each sorted row
  const at::ScalarType ct = compute_type(x);
  auto y = empty_large({M, D}, x.options().dtype(ct));
  at::Tensor gate, up;
  if (keep) {
    gate = empty_large({M, F}, x.options().dtype(ct));
    up = empty_large({M, F}, x.options().dtype(ct));
  }
  auto xc = x.contiguous();
  auto gather_rows = [&](int64_t first, int64_t n) {
    return at::index_select(xc, 0, token_of_row.narrow(0, first, n)).to(ct);  // [n, D]
  };
  experts_kernel(gather_rows, count_E, w_gate.contiguous(), w_up.contiguous(), w_down.contiguous(), y, limit, gate,
                 up);
  if (y.scalar_type() != x.scalar_type()) y = y.to(x.scalar_type());
  return {moe_combine(y, sort_idx, weights), gate, up, sort_idx, counts};
}

at::Tensor moe_fused_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& expert_ids,
                             const at::Tensor& w_gate, const at::Tensor& w_up, const at::Tensor& w_down,
                             c10::optional<double> swiglu_limit) {
  return std::get<0>(
      fused_forward(x, weights, expert_ids, w_gate, w_up, w_down, swiglu_limit, false, "moe_fused_experts"));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_fused_experts_train(
    const at::Tensor& x, const at::Tensor& weights, const at::Tensor& expert_ids, const at::Tensor& w_gate,
    const at::Tensor& w_up, const at::Tensor& w_down, c10::optional<double> swiglu_limit) {
  return fused_forward(x, weights, expert_ids, w_gate, w_up, w_down, swiglu_limit, true, "moe_fused_experts_train");
}

// out = a b, written into ``out`` (a slice of a gradient stack) whatever its dtype.
void mm_into(at::Tensor out, const at::Tensor& a, const at::Tensor& b) {
  if (out.scalar_type() == a.scalar_type()) {
    at::mm_out(out, a, b);
  } else {
    out.copy_(at::mm(a, b));
  }
}

// Gradients of moe_fused_experts from what moe_fused_experts_train kept: (dx [N, D], dweights [N, K],
// dw_gate [E, F, D], dw_up [E, F, D], dw_down [E, D, F]). Per expert e over its sorted rows r (token t_r,
// routing weight w_r, saved projections g = x Wg^T and u = x Wu^T, s = sigmoid(g), h = silu(g) * u):
//   p = grad_out[t] Wd                      [n, F]  (before the routing weight)
//   dweights[r] = <p_r, h_r>                        (= <grad_out[t_r], y_r>)
//   dWd = grad_out[t]^T (w * h)             [D, F]
//   dh = w * p, du = dh * silu(g), dg = dh * u * s * (1 + g * (1 - s))
//   dWg = dg^T x[t], dWu = du^T x[t]        [F, D]
//   dx_rows = dg Wg + du Wu                 [n, D]
// With a ``swiglu_limit`` L, h = silu(gc) * uc of gc = min(g, L), uc = clamp(u, -L, L), and the clamps' gradients
// as torch's: dg = dh * uc * s(gc) * (1 + gc (1 - s(gc))) where g <= L (else 0), du = dh * silu(gc) where
// -L <= u <= L (else 0).
// then dx[n] = the sum of its K rows in slot order. Six GEMMs per expert, all on the expert's own rows: the
// cost never depends on the experts a token did not visit. Each expert's weight gradients are written once by
// the thread that owns the expert, an expert without rows gets zeros; no atomics, so bitwise repeatable.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_fused_experts_backward(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weights, const at::Tensor& sort_idx,
    const at::Tensor& counts, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& w_gate,
    const at::Tensor& w_up, const at::Tensor& w_down, c10::optional<double> swiglu_limit) {
  const char* op = "moe_fused_experts_backward";
  check_expert_weights(x, w_gate, w_up, w_down, op);
  const int64_t N = x.size(0), D = x.size(1), E = w_gate.size(0), F = w_gate.size(1);
  TORCH_CHECK(weights.dim() == 2 && weights.size(0) == N, op, ": weights must be [N, K]");
  const int64_t K = weights.size(1), M = N * K;
  TORCH_CHECK(grad_out.sizes() == x.sizes(), op, ": grad_out must be [N, D]");
  TORCH_CHECK(sort_idx.dim() == 1 && sort_idx.size(0) == M, op, ": sort_idx must be [N*K]");
  TORCH_CHECK(counts.dim() == 1 && counts.size(0) == E, op, ": counts must be [E]");
  const at::ScalarType ct = compute_type(x);
  TORCH_CHECK(gate.dim() == 2 && gate.size(0) == M && gate.size(1) == F && up.sizes() == gate.sizes() &&
                  gate.scalar_type() == ct && up.scalar_type() == ct,
              op, ": gate and up must be [N*K, F] in the compute dtype");
  std::vector<int64_t> count_E = checked_counts(counts, M, op);
  auto order = sort_idx.to(at::kLong).contiguous();
  auto token_of_row = at::div(order, K, "floor");                                // [M]
  auto w_sorted = weights.reshape({M}).index_select(0, order).to(ct);            // [M] routing weight of each row
  auto xc = x.contiguous(), gc = grad_out.contiguous(), g_MF = gate.contiguous(), u_MF = up.contiguous();
  auto wg_EFD = w_gate.contiguous(), wu_EFD = w_up.contiguous(), wd_EDF = w_down.contiguous();
  auto dw_gate = at::empty_like(wg_EFD), dw_up = at::empty_like(wu_EFD), dw_down = at::empty_like(wd_EDF);
  for (int64_t e = 0; e < E; ++e) {
    if (count_E[e] > 0) continue;
    dw_gate[e].zero_();
    dw_up[e].zero_();
    dw_down[e].zero_();
  }
  auto dx_rows = empty_large({M, D}, x.options().dtype(ct));       // [M, D] per sorted row
  auto dweights_sorted = at::empty({M}, x.options().dtype(ct));    // [M] per sorted row
  for_each_expert(count_E, [&](int64_t e, int64_t first, int64_t n) {
    at::Tensor tokens = token_of_row.narrow(0, first, n);
    at::Tensor x_rows = at::index_select(xc, 0, tokens).to(ct);    // [n, D]
    at::Tensor go_rows = at::index_select(gc, 0, tokens).to(ct);   // [n, D]
    at::Tensor w_rows = w_sorted.narrow(0, first, n).unsqueeze(1);  // [n, 1]
    at::Tensor g_raw = g_MF.narrow(0, first, n), u_raw = u_MF.narrow(0, first, n);  // [n, F]
    at::Tensor g = g_raw, u = u_raw;                                // the activation's inputs (clamped with a limit)
    if (swiglu_limit.has_value()) {
      g = at::clamp_max(g_raw, *swiglu_limit);
      u = at::clamp(u_raw, -*swiglu_limit, *swiglu_limit);
    }
    at::Tensor wg = wg_EFD[e].to(ct), wu = wu_EFD[e].to(ct), wd = wd_EDF[e].to(ct);
    at::Tensor silu_g = at::silu(g);
    at::Tensor hidden = silu_g * u;                                 // [n, F], as in the forward
    at::Tensor p = at::mm(go_rows, wd);                             // [n, F]
    at::Tensor dweights_e = dweights_sorted.narrow(0, first, n);    // [n]
    at::sum_out(dweights_e, p * hidden, at::IntArrayRef{1});
    mm_into(dw_down[e], go_rows.t(), hidden.mul_(w_rows));          // [D, F]
    at::Tensor dh = p.mul_(w_rows);                                 // [n, F]
    at::Tensor s = at::sigmoid(g);
    at::Tensor dg = dh * u * s * (1 + g * (1 - s));                 // [n, F]
    at::Tensor du = dh.mul_(silu_g);                                // [n, F]
    if (swiglu_limit.has_value()) {                                 // the clamps' gradients (torch's: ends pass)
      const double L = *swiglu_limit;
      dg.mul_(g_raw.le(L));
      du.mul_(u_raw.ge(-L).logical_and_(u_raw.le(L)));
    }
    mm_into(dw_gate[e], dg.t(), x_rows);                            // [F, D]
    mm_into(dw_up[e], du.t(), x_rows);                              // [F, D]
    at::Tensor dx_e = dx_rows.narrow(0, first, n);                  // [n, D]
    at::mm_out(dx_e, dg, wg);
    dx_e.addmm_(du, wu);
  });
  // dx: each token's K rows summed in slot order (combine with unit weights: 1 * v is exact).
  auto dx = moe_combine(dx_rows, order, at::ones({N, K}, x.options().dtype(ct)));
  auto dweights = at::empty({M}, x.options().dtype(ct));
  dweights.index_copy_(0, order, dweights_sorted);                  // sorted row -> flat assignment
  return {dx.to(x.scalar_type()), dweights.view({N, K}).to(weights.scalar_type()), dw_gate, dw_up, dw_down};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(glm5_cpu, m) {
  m.def("moe_select(Tensor select, int top_k, int n_group, int topk_group) -> Tensor");
  m.def("moe_route(Tensor logits, Tensor? bias, int top_k, bool sigmoid, int n_group, int topk_group, "
        "bool renormalize, float routed_scaling_factor) -> (Tensor, Tensor)");
  m.def("moe_dispatch(Tensor x, Tensor expert_ids, int num_experts) -> (Tensor, Tensor, Tensor)");
  m.def("moe_combine(Tensor y_sorted, Tensor sort_idx, Tensor weights) -> Tensor");
  m.def("moe_experts(Tensor x_sorted, Tensor counts, Tensor w_gate, Tensor w_up, Tensor w_down, "
        "float? swiglu_limit=None) -> Tensor");
  m.def("moe_fused_experts(Tensor x, Tensor weights, Tensor expert_ids, Tensor w_gate, Tensor w_up, "
        "Tensor w_down, float? swiglu_limit=None) -> Tensor");
  m.def("moe_fused_experts_train(Tensor x, Tensor weights, Tensor expert_ids, Tensor w_gate, Tensor w_up, "
        "Tensor w_down, float? swiglu_limit=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("moe_fused_experts_backward(Tensor grad_out, Tensor x, Tensor weights, Tensor sort_idx, Tensor counts, "
        "Tensor gate, Tensor up, Tensor w_gate, Tensor w_up, Tensor w_down, float? swiglu_limit=None) -> (Tensor, "
        "Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(glm5_cpu, CPU, m) {
  m.impl("moe_select", &moe_select);
  m.impl("moe_route", &moe_route);
  m.impl("moe_dispatch", &moe_dispatch);
  m.impl("moe_combine", &moe_combine);
  m.impl("moe_experts", &moe_experts);
  m.impl("moe_fused_experts", &moe_fused_experts);
  m.impl("moe_fused_experts_train", &moe_fused_experts_train);
  m.impl("moe_fused_experts_backward", &moe_fused_experts_backward);
}

}  // namespace glm5
