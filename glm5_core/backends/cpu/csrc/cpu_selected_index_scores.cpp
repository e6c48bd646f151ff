// The lightning-indexer scores at the selected keys only, and their backward, for CPU (the sparse stage's KL).
//
// Legend: B batch, T queries, H indexer heads, D index_head_dim, S key slots, K selected keys per query (-1 = none).
//   I_sel[b,t,j] = sum_h w[b,t,h] * ReLU(q[b,t,h,:] . k[b, i_j, :])      (-inf where i_j = -1)
// Backward, given g = d I_sel [B, T, K] (ignored at the -1 slots, whose score is the constant -inf):
//   a[h,j] = q[h] . k[i_j],  dd[h,j] = g[j] w[h] (a[h,j] > 0)
//   d w[h] = sum_j g[j] ReLU(a[h,j]),  d q[h] = sum_j dd[h,j] k[i_j],  d k[s] = sum over (t, j) with i_j = s of
//   sum_h dd[h,j] q[h]
// The forward keeps nothing; the backward recomputes the H x K dot products of each query row (RowLayout: the
// row's queries transposed, all heads of a key in one pass over its D values). Query rows go
// through in blocks whose per-slot key contributions u [K, D] fit kSlotGradBytes (a block size set by the shapes
// only):
//   1. per query row (parallel): a, d w and each kept slot's dd[:, j]; then d q [H, D] and the kept slots'
//      u_j = sum_h dd[h,j] q[h] (in h order), both register-tiled products (broadcast_gemm), every element one
//      multiply-add chain in the order the per-element loops used;
//   2. u_j is added to d k[i_j], parallel over bands of keys (each band owned by one thread), in ascending
//      (t, j) order.
// Time and memory O(T K H D), never O(T S); every sum runs in a fixed order whatever the thread count, so the
// gradients are bitwise repeatable. Inputs are fp32 or fp64 (the caller converts bf16 / fp16 to fp32).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <omp.h>

#include <algorithm>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_simd.h"

namespace glm5 {
namespace {

constexpr int64_t kSlotGradBytes = int64_t(2) << 20;  // u of the slots held at once (a row block, cache-sized)
constexpr int64_t kKeyBand = 16;  // keys per band of pass 2; bands are dealt to threads round-robin
constexpr int64_t kPrefetchAhead = 8;  // pass 2 prefetches the key gradient row of the slot this far ahead

struct Sizes {
  int64_t B, T, H, D, S, K;
};

// The query row transposed and padded to whole vectors of heads: q_t [D, Hp] (lanes past H zero), so the H dot
// products of one key are D broadcast-multiply-adds into Hp / W vectors: no horizontal sum per head.
template <typename acc_t> struct RowLayout {
  using V = typename Simd<acc_t>::V;
  static constexpr int W = Simd<acc_t>::width;
  int64_t H, D, nv, Hp;  // nv vectors of W heads, Hp = nv * W
  RowLayout(int64_t heads, int64_t dim) : H(heads), D(dim), nv((heads + W - 1) / W), Hp(nv * W) {}

  void transpose(const acc_t* q_row, const acc_t* w_row, acc_t* q_t, acc_t* w_pad) const {
    std::fill(q_t, q_t + D * Hp, acc_t(0));
    std::fill(w_pad, w_pad + Hp, acc_t(0));
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t d = 0; d < D; ++d) q_t[d * Hp + h] = q_row[h * D + d];
      w_pad[h] = w_row[h];
    }
  }

  // a[g][:] = q . key_g for G keys at once (G independent chains hide the multiply-add latency); each key's
  // products are summed in d order whatever G is, so a key's value does not depend on its group. Narrow
  // vectors (8 fp32 heads: GLM-5's indexer fills one) with the key value broadcast from memory; lanes of heads
  // past H are 0 (their q is 0), written without being computed.
  template <int G> void dots(const acc_t* q_t, const acc_t* const* key, acc_t* a) const {  // a [G, Hp]
    using N = typename Narrow<acc_t>::V;
    constexpr int NW = Narrow<acc_t>::width;
    for (int64_t v = 0; v < Hp; v += NW) {
      if (v >= H) {
        for (int g = 0; g < G; ++g) store(a + g * Hp + v, N{});
        continue;
      }
      N acc[G];
      for (int g = 0; g < G; ++g) acc[g] = N{};
      for (int64_t d = 0; d < D; ++d) {
        const N qv = load<N>(q_t + d * Hp + v);
        for (int g = 0; g < G; ++g) acc[g] = fmadd(broadcast<N>(key[g][d]), qv, acc[g]);
      }
      for (int g = 0; g < G; ++g) store(a + g * Hp + v, acc[g]);
    }
  }
};

constexpr int kKeyGroup = 8;  // keys whose dot products are computed together

// Calls body(slot j, its key, its dot products a [Hp]) for the kept slots of one query row, in slot order.
template <typename acc_t, typename index_t, typename Body>
void for_each_kept_key(const RowLayout<acc_t>& L, const acc_t* q_t, const acc_t* keys_b, const index_t* idx_row,
                       int64_t K, std::vector<int64_t>& kept, acc_t* a_buf, Body&& body) {
  kept.clear();
  for (int64_t j = 0; j < K; ++j)
    if (idx_row[j] >= 0) kept.push_back(j);
  const int64_t n = static_cast<int64_t>(kept.size());
  const acc_t* key[kKeyGroup];
  int64_t i = 0;
  for (; i + kKeyGroup <= n; i += kKeyGroup) {
    for (int g = 0; g < kKeyGroup; ++g) key[g] = keys_b + static_cast<int64_t>(idx_row[kept[i + g]]) * L.D;
    L.template dots<kKeyGroup>(q_t, key, a_buf);
    for (int g = 0; g < kKeyGroup; ++g) body(kept[i + g], key[g], a_buf + g * L.Hp);
  }
  for (; i < n; ++i) {
    key[0] = keys_b + static_cast<int64_t>(idx_row[kept[i]]) * L.D;
    L.template dots<1>(q_t, key, a_buf);
    body(kept[i], key[0], a_buf);
  }
}

// hsum of a score vector whose upper W / 2 lanes are +0 and whose lanes are never -0 (each lane is one fmadd onto
// +0): hsum's first step (lane i + lane i + W / 2) then returns the lower lanes unchanged, so its remaining pairwise
// steps on the lower half, done with vector shuffles for AVX-512 fp32 (the 8-head indexer), give its exact bits.
template <typename V> inline auto hsum_low_half(V v) {
  using T = std::remove_reference_t<decltype(v[0])>;
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64 && sizeof(T) == 4) {
    const __m256 lo = _mm512_castps512_ps256((__m512)v);
    const __m128 a = _mm_add_ps(_mm256_castps256_ps128(lo), _mm256_extractf128_ps(lo, 1));  // lane i + lane i + 4
    const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));                                     // lane i + lane i + 2
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_shuffle_ps(b, b, 1)));                           // lane 0 + lane 1
  }
#endif
  return hsum<T>(v);
}

template <typename acc_t, typename index_t>
void forward_kernel(const acc_t* q, const acc_t* keys, const acc_t* w, const index_t* idx, const Sizes& n,
                    acc_t* out) {
  using V = typename Simd<acc_t>::V;
  constexpr int W = Simd<acc_t>::width;
  const RowLayout<acc_t> L(n.H, n.D);
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  const bool low_half = L.nv == 1 && n.H <= W / 2;  // the upper half of the head lanes is +0 (see hsum_low_half)
  at::parallel_for(0, n.B * n.T, 8, [&](int64_t row0, int64_t row1) {
    std::vector<acc_t> q_t(L.D * L.Hp), w_pad(L.Hp), a_buf(kKeyGroup * L.Hp);
    std::vector<int64_t> kept;
    kept.reserve(n.K);
    for (int64_t row = row0; row < row1; ++row) {
      const int64_t b = row / n.T;
      L.transpose(q + row * n.H * n.D, w + row * n.H, q_t.data(), w_pad.data());
      acc_t* out_row = out + row * n.K;
      std::fill(out_row, out_row + n.K, neg_inf);
      for_each_kept_key(L, q_t.data(), keys + b * n.S * n.D, idx + row * n.K, n.K, kept, a_buf.data(),
                        [&](int64_t j, const acc_t*, const acc_t* a) {
                          V total{};
                          for (int64_t v = 0; v < L.nv; ++v)
                            total = fmadd(relu(load<V>(a + v * W)), load<V>(w_pad.data() + v * W), total);
                          out_row[j] = low_half ? hsum_low_half(total) : hsum<acc_t>(total);
                        });
    }
  });
}

// Both weighted sums of the backward are small products out [M, D] = A [M, C] x B [C, D] with each out element one
// multiply-add chain over c = 0..C-1 from +0: d q (M heads, C kept keys, B the keys) and the per-slot key
// contributions u_j = sum_h dd[h,j] q[h, :] (M slots, C heads, B the query's head rows). A register tile of MR rows x
// NV vectors of d runs the chains: the NV vectors of B's row c are loaded once for the MR rows, A's values are
// broadcast from memory. A[r][c] sits at a[r * a_row + c * a_col]; row c of B starts at b_rows[c].
template <typename acc_t, int MR, int NV>
inline void broadcast_gemm_tile(const acc_t* __restrict a, int64_t a_row, int64_t a_col,
                                const acc_t* const* __restrict b_rows, int64_t C, int64_t d0, acc_t* __restrict out,
                                int64_t out_row) {
  using V = typename Simd<acc_t>::V;
  constexpr int W = Simd<acc_t>::width;
  V acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = V{};
  for (int64_t c = 0; c < C; ++c) {
    V bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = load<V>(b_rows[c] + d0 + v * W);
    for (int r = 0; r < MR; ++r) {
      const V av = broadcast<V>(a[r * a_row + c * a_col]);
      for (int v = 0; v < NV; ++v) acc[r][v] = fmadd(av, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) store(out + r * out_row + d0 + v * W, acc[r][v]);
}

constexpr int kTileRows = kVecBytes == 64 ? 8 : 4;  // MR (registers: MR * 2 accumulators + 2 loads of B)

// The whole-vector part of out (d < D rounded down to W) for M rows: tiles of kTileRows x 2 vectors, then the
// remainders. Returns the first d left to the caller (the tail, handled as the scalar loops before it did).
template <typename acc_t, int MR>
inline void broadcast_gemm_rows(const acc_t* a, int64_t a_row, int64_t a_col, const acc_t* const* b_rows, int64_t C,
                                int64_t Dv, acc_t* out, int64_t out_row) {
  constexpr int W = Simd<acc_t>::width;
  int64_t d = 0;
  for (; d + 2 * W <= Dv; d += 2 * W) broadcast_gemm_tile<acc_t, MR, 2>(a, a_row, a_col, b_rows, C, d, out, out_row);
  if (d < Dv) broadcast_gemm_tile<acc_t, MR, 1>(a, a_row, a_col, b_rows, C, d, out, out_row);
}

template <typename acc_t>
int64_t broadcast_gemm(const acc_t* a, int64_t a_row, int64_t a_col, const acc_t* const* b_rows, int64_t M, int64_t C,
                       int64_t D, acc_t* out, int64_t out_row) {
  constexpr int W = Simd<acc_t>::width;
  const int64_t Dv = D / W * W;
  if (Dv == 0) return 0;
  int64_t r = 0;
  for (; r + kTileRows <= M; r += kTileRows)
    broadcast_gemm_rows<acc_t, kTileRows>(a + r * a_row, a_row, a_col, b_rows, C, Dv, out + r * out_row, out_row);
  for (; r < M; ++r) broadcast_gemm_rows<acc_t, 1>(a + r * a_row, a_row, a_col, b_rows, C, Dv, out + r * out_row,
                                                   out_row);
  return Dv;
}

// One multiply-add rounded as the vector fmadd rounds in this build (once with FMA, twice without): the d q tail.
template <typename acc_t> inline acc_t fmadd_like_vectors(acc_t a, acc_t b, acc_t c) {
#if defined(__AVX512F__) || (defined(__FMA__) && defined(__AVX2__))
  return __builtin_fma(a, b, c);
#else
  return a * b + c;
#endif
}
inline float fmadd_like_vectors(float a, float b, float c) {
#if defined(__AVX512F__) || (defined(__FMA__) && defined(__AVX2__))
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

// d q [H, D] = sum_i dd_i[h] key_i[:] over the n kept keys, in i order (dd [n, Hp]).
template <typename acc_t>
void keys_times_dd(const acc_t* const* key, const acc_t* dd, int64_t n, int64_t D, int64_t H, int64_t Hp,
                   acc_t* dq_row) {
  const int64_t done = broadcast_gemm(dd, 1, Hp, key, H, n, D, dq_row, D);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t d = done; d < D; ++d) {
      acc_t acc = 0;
      for (int64_t i = 0; i < n; ++i) acc = fmadd_like_vectors(dd[i * Hp + h], key[i][d], acc);
      dq_row[h * D + d] = acc;
    }
}

// u[i, :] = sum_h dd_i[h] q[h, :] for the n kept slots (the sum over h in h order; past the whole vectors of d,
// a multiply then an add, as the scalar loop always did), u [n, D].
template <typename acc_t>
void heads_times_queries(const acc_t* dd, const acc_t* const* q_heads, int64_t n, int64_t H, int64_t D, int64_t Hp,
                         acc_t* u) {
  const int64_t done = broadcast_gemm(dd, Hp, 1, q_heads, n, H, D, u, D);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = done; d < D; ++d) {
      acc_t acc = 0;
      for (int64_t h = 0; h < H; ++h) acc = acc + dd[i * Hp + h] * q_heads[h][d];
      u[i * D + d] = acc;
    }
}

template <typename acc_t, typename index_t>
void backward_kernel(const acc_t* grad, const acc_t* q, const acc_t* keys, const acc_t* w, const index_t* idx,
                     const Sizes& n, acc_t* dq, acc_t* dkeys, acc_t* dw) {
  using V = typename Simd<acc_t>::V;
  constexpr int W = Simd<acc_t>::width;
  const RowLayout<acc_t> L(n.H, n.D);
  const int64_t rows = n.B * n.T, H = n.H, D = n.D, K = n.K, Hp = L.Hp;
  const int threads = std::max(1, at::get_num_threads());
  const int64_t row_bytes = K * D * static_cast<int64_t>(sizeof(acc_t));
  const int64_t block = std::max<int64_t>(1, kSlotGradBytes / std::max<int64_t>(1, row_bytes));
  std::vector<acc_t> slot_u(std::min(rows, block) * K * D);  // u [rows of the block, kept slots of the row, D]
  // Per-thread scratch, allocated before the regions (nothing that can fail is allocated inside them):
  // q_t [D, Hp], w and d w [Hp], the kept keys' dd [K, Hp], a group's dot products [kKeyGroup, Hp].
  const int64_t scratch = D * Hp + 2 * Hp + K * Hp + kKeyGroup * Hp;
  std::vector<acc_t> scratch_all(threads * scratch);
  std::vector<std::vector<int64_t>> kept_all(threads);
  std::vector<std::vector<const acc_t*>> key_all(threads), q_heads_all(threads, std::vector<const acc_t*>(H));
  for (int t = 0; t < threads; ++t) {
    kept_all[t].reserve(K);
    key_all[t].reserve(K);
  }
  std::fill(dkeys, dkeys + n.B * n.S * D, acc_t(0));
  RegionErrors errors;

  for (int64_t row0 = 0; row0 < rows; row0 += block) {
    const int64_t row1 = std::min(rows, row0 + block);
#pragma omp parallel num_threads(threads)
    {
      const int tid = omp_get_thread_num();
      acc_t* q_t = scratch_all.data() + tid * scratch;
      acc_t* w_pad = q_t + D * Hp;
      acc_t* dw_pad = w_pad + Hp;
      acc_t* dd_kept = dw_pad + Hp;  // [kept keys, Hp]
      acc_t* a_buf = dd_kept + K * Hp;
      std::vector<const acc_t*>& key_ptr = key_all[tid];
      const acc_t** q_heads = q_heads_all[tid].data();  // the row's head vectors q[h, :]
#pragma omp for schedule(dynamic, 4)
      for (int64_t row = row0; row < row1; ++row) {
        errors.run([&] {
          const int64_t b = row / n.T;
          const acc_t* q_row = q + row * H * D;
          L.transpose(q_row, w + row * H, q_t, w_pad);
          std::fill(dw_pad, dw_pad + Hp, acc_t(0));
          key_ptr.clear();
          std::vector<int64_t>& kept = kept_all[tid];
          for_each_kept_key(L, q_t, keys + b * n.S * D, idx + row * K, K, kept, a_buf,
                            [&](int64_t j, const acc_t* key, const acc_t* a) {
                              const V g = broadcast<V>(grad[row * K + j]);
                              acc_t* dd = dd_kept + static_cast<int64_t>(key_ptr.size()) * Hp;
                              for (int64_t v = 0; v < Hp; v += W) {
                                const V av = load<V>(a + v);
                                const V on = av > V{} ? splat<V>(acc_t(1)) : V{};
                                store(dw_pad + v, fmadd(g, relu(av), load<V>(dw_pad + v)));
                                store(dd + v, g * load<V>(w_pad + v) * on);
                              }
                              key_ptr.push_back(key);
                            });
          const int64_t kept_n = static_cast<int64_t>(key_ptr.size());
          keys_times_dd(key_ptr.data(), dd_kept, kept_n, D, H, Hp, dq + row * H * D);
          for (int64_t h = 0; h < H; ++h) {
            dw[row * H + h] = dw_pad[h];
            q_heads[h] = q_row + h * D;
          }
          // the kept slots' u, packed in slot order: [kept keys, D]
          heads_times_queries(dd_kept, q_heads, kept_n, H, D, Hp, slot_u.data() + (row - row0) * K * D);
        });
      }
    }
    errors.rethrow_if_failed("selected_index_scores_backward");

    // Pass 2: every thread walks the block's entries in (t, j) order and, for the key bands it owns, adds
    // the slot's u = sum_h dd[h] q[h] to the key's gradient (the row's i-th kept slot holds u row i).
#pragma omp parallel num_threads(threads)
    {
      const int64_t tid = omp_get_thread_num(), nthreads = omp_get_num_threads();
      for (int64_t row = row0; row < row1; ++row) {
        const int64_t b = row / n.T;
        const acc_t* u = slot_u.data() + (row - row0) * K * D;
        const index_t* idx_row = idx + row * K;
        acc_t* dk_b = dkeys + b * n.S * D;
        for (int64_t j = 0; j < K; ++j) {
          const int64_t s = static_cast<int64_t>(idx_row[j]);
          if (s < 0) continue;
          if ((s / kKeyBand) % nthreads == tid) {
            if (j + kPrefetchAhead < K && idx_row[j + kPrefetchAhead] >= 0)
              __builtin_prefetch(dk_b + static_cast<int64_t>(idx_row[j + kPrefetchAhead]) * D, 1);
            acc_t* dk = dk_b + s * D;
            int64_t d = 0;
            for (; d + W <= D; d += W) store(dk + d, load<V>(dk + d) + load<V>(u + d));
            for (; d < D; ++d) dk[d] = dk[d] + u[d];
          }
          u += D;
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
