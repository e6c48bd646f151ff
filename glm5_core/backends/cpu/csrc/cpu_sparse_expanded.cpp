// Sparse MLA prefill in the EXPANDED form for CPU (training and inference prefill), forward and backward.
//
// Legend: B batch, T queries, H heads, Dn nope width, R rope width, Dv value width, S key slots, K selected keys
// per query (-1 = none), n the selected keys of one query.
//   q_nope [B, T, H, Dn], q_pe [B, T, H, R] (fp32 / fp64), k_nope [B, S, H, Dn], k_pe [B, S, R] (shared by the
//   heads), v [B, S, H, Dv] (fp32, fp64, bf16 or fp16, read in place: only the selected rows are touched; any
//   strides with a unit last one, so k_nope and v may be the two halves of kv_b_proj's output), topk_idx [B, T, K].
// Forward:  s[h,j] = scale * (q_nope[h] . k_nope[i_j, h] + q_pe[h] . k_pe[i_j]),  p = softmax_j(s),
//           out[h] = sum_j p[h,j] v[i_j, h],  lse[h] = log sum_j exp s[h,j]  (-inf and zeros for no key).
// Backward (dO = d out):  p recomputed from lse,  dP[h,j] = dO[h] . v[i_j, h],  D[h] = sum_j p dP = dO[h] . out[h],
//           G = scale * p (dP - D);  d q_nope[h] = sum_j G k_nope[i_j, h],  d q_pe[h] = sum_j G k_pe[i_j],
//           d k_nope[s, h] = sum_{(t,j): i_j = s} G[h,j] q_nope[h],  d v[s, h] = sum p[h,j] dO[h],
//           d k_pe[s] = sum sum_h G[h,j] q_pe[h].
// Per score Dn + R products and per output Dv, against C + R and C in the absorbed form (cpu_sparse_decode.cpp).
//
// Layout: the kernels first copy q, k_nope, v (and dO) into head-minor buffers [rows, D, G, 8] (G = ceil(H / 8)
// groups of 8 heads, zero padded, converted to the accumulation type): a score of 8 heads is then Dn + R lane-wise
// multiply-adds, with no horizontal sum (what a per-head dot product of 32 or 48 values would spend its time on).
// fp32 with H <= 4 heads takes the packed kernels (forward_packed, backward_packed): quad rows [rows, D, 4], two keys
// or two elements per 8-lane vector, the same chains in the same order, so the same bits as the 8-lane kernels.
// Determinism: the forward and pass 1 of the backward work on one query row at a time (rows are independent).
// Before pass 1 the block's (t, j) entries are grouped by key (a counting sort, ascending (t, j) within each key);
// pass 1 stores each entry's p and G at its place in that order, so pass 2 reads them sequentially, and gives each
// key to one thread, which adds its entries in that order: every key gradient is summed in (t, j) order whatever
// the thread count, so the gradients are bitwise repeatable. Rows go through in blocks whose p / G ([rows, K, H])
// fit kBlockBytes (a size set by the shapes only): time and memory O(T K), never O(T S).
// Speed: the dot products of kKeyBlock keys run as independent chains over one pass of the query, and the weighted
// sums (dk, dv, the output) keep kChunk accumulators in registers over the keys / entries; each chain adds its
// terms in the same order as a plain loop, so the results do not depend on these block sizes. Pass 1 takes D from
// the forward's output (dO . out), so it is one pass over a query's keys: scores, dP, G and the dq terms of a block
// of keys while their rows are in L1 (three passes before, two of them re-reading the rows from L2 / L3). The fp32
// exp is one 8-lane polynomial evaluation (exp_lanes).
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

// p and G of a block of query rows, in key order. Small enough that the block's p / G and its query rows stay in
// cache while pass 2 gathers them (4 MiB measured 1.3-1.5x faster than 64 MiB at 1x4096, top-k 256).
constexpr int64_t kBlockBytes = int64_t(4) << 20;

template <typename V> inline V max_lanes(V a, V b) { return a > b ? a : b; }

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

struct Sizes {
  int64_t B, T, H, Dn, R, Dv, S, K;
  int64_t groups() const { return (H + kHeadLanes - 1) / kHeadLanes; }
};

// dst [B * X, D, G] head vectors (acc_t, heads past H zero) from src [B, X, H, D], in parallel over rows.
template <typename acc_t, typename src_t>
std::vector<typename HeadVec<acc_t>::V> head_minor(const Rows<src_t>& src, int64_t B, int64_t X, int64_t H,
                                                   int64_t D, int64_t G) {
  using V = typename HeadVec<acc_t>::V;
  std::vector<V> dst(B * X * D * G);
  at::parallel_for(0, B * X, 16, [&](int64_t begin, int64_t end) {
    for (int64_t bx = begin; bx < end; ++bx) {
      acc_t* row = reinterpret_cast<acc_t*>(dst.data() + bx * D * G);  // [D, G * kHeadLanes]
      for (int64_t i = 0; i < D * G * kHeadLanes; ++i) row[i] = acc_t(0);
      for (int64_t h = 0; h < H; ++h) {
        const src_t* x = src.at(bx / X, bx % X, h);
        for (int64_t d = 0; d < D; ++d) row[d * G * kHeadLanes + h] = static_cast<acc_t>(x[d]);
      }
    }
  });
  return dst;
}

// out [B, X, H, D] (standard layout) from head vectors [B * X, D, G], in parallel over rows.
template <typename acc_t>
void from_head_minor(const typename HeadVec<acc_t>::V* src, int64_t rows, int64_t H, int64_t D, int64_t G,
                     acc_t* out) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const acc_t* row = reinterpret_cast<const acc_t*>(src + r * D * G);
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) out[(r * H + h) * D + d] = row[d * G * kHeadLanes + h];
    }
  });
}

// The head-minor inputs both passes read.
template <typename acc_t> struct HeadMinorInputs {
  using V = typename HeadVec<acc_t>::V;
  std::vector<V> q_nope, q_pe, k_nope, v;  // [B*T, Dn, G], [B*T, R, G], [B*S, Dn, G], [B*S, Dv, G]
};

template <typename cache_t, typename acc_t>
HeadMinorInputs<acc_t> head_minor_inputs(const Rows<acc_t>& q_nope, const Rows<acc_t>& q_pe,
                                         const Rows<cache_t>& k_nope, const Rows<cache_t>& v, const Sizes& z) {
  const int64_t G = z.groups();
  return {head_minor<acc_t>(q_nope, z.B, z.T, z.H, z.Dn, G), head_minor<acc_t>(q_pe, z.B, z.T, z.H, z.R, G),
          head_minor<acc_t>(k_nope, z.B, z.S, z.H, z.Dn, G), head_minor<acc_t>(v, z.B, z.S, z.H, z.Dv, G)};
}

// Per-thread scratch of one query row: kept slots / keys, and per-key head vectors [n, G].
template <typename acc_t> struct Scratch {
  using V = typename HeadVec<acc_t>::V;
  std::vector<int64_t> slot, key;  // kept slot j and its flat key b * S + s
  std::vector<V> score, grad;  // [K, G]: scores, then p; backward: dP, then G
  std::vector<V> acc;  // accumulators [max(Dn, Dv, R) + 2, G]
  void reserve(const Sizes& z) {
    const int64_t G = z.groups();
    slot.reserve(z.K), key.reserve(z.K), score.resize(z.K * G), grad.resize(z.K * G);
    acc.resize((std::max(std::max(z.Dn, z.Dv), z.R) + 2) * G);
  }
};

// One reserved Scratch per thread, allocated before a parallel region.
template <typename acc_t> std::vector<Scratch<acc_t>> thread_scratch(const Sizes& z, int threads) {
  std::vector<Scratch<acc_t>> scratch(threads);
  for (auto& w : scratch) w.reserve(z);
  return scratch;
}

// body(w, row) for rows [row0, row1) on scratch.size() threads, thread t with scratch[t], in dynamic chunks of 4
// rows; after the region the first error a row raised is rethrown under the op's name.
template <typename acc_t, typename Body>
void parallel_rows(std::vector<Scratch<acc_t>>& scratch, int64_t row0, int64_t row1, const char* op, Body&& body) {
  RegionErrors errors;
#pragma omp parallel num_threads(static_cast<int>(scratch.size()))
  {
    Scratch<acc_t>& w = scratch[omp_get_thread_num()];
#pragma omp for schedule(dynamic, 4)
    for (int64_t row = row0; row < row1; ++row) errors.run([&] { body(w, row); });
  }
  errors.rethrow_if_failed(op);
}

template <typename acc_t> void gather_row(Scratch<acc_t>& w, const int64_t* idx, int64_t row, const Sizes& z) {
  const int64_t b = row / z.T;
  w.slot.clear(), w.key.clear();
  for (int64_t j = 0; j < z.K; ++j) {
    const int64_t s = idx[row * z.K + j];
    if (s < 0) continue;
    w.slot.push_back(j), w.key.push_back(b * z.S + s);
  }
}

// Blocking. Every sum below is one chain per output element, in the order a plain loop would add its terms
// (d ascending then r for a score; keys / entries ascending for a weighted sum): the blocking only interleaves
// independent chains (kKeyBlock keys per pass over a query, kChunk accumulators kept in registers per pass over
// the keys), so it never changes a bit, whatever the sizes.
constexpr int kKeyBlock = 8;
constexpr int kChunk = 8;

// f(block size M as an integral_constant, first index) over [0, n) in blocks of kKeyBlock, then singles.
template <typename F> inline void in_key_blocks(int64_t n, F&& f) {
  int64_t i = 0;
  for (; i + kKeyBlock <= n; i += kKeyBlock) f(std::integral_constant<int, kKeyBlock>{}, i);
  for (; i < n; ++i) f(std::integral_constant<int, 1>{}, i);
}

// acc[m] (m < M) continues the chain acc[m] = a[d] * rows[m][d] + acc[m] over d < D (head vectors G apart).
template <int M, typename V>
inline void dot_chains(V* acc, const V* a, const V* const* rows, int64_t D, int64_t G) {
  for (int64_t d = 0; d < D; ++d) {
    const V x = a[d * G];
    for (int m = 0; m < M; ++m) acc[m] = fma_lanes(x, rows[m][d * G], acc[m]);
  }
}

// The same with rows of per-key scalars (k_pe, shared by the heads), broadcast to every head.
template <int M, typename V, typename acc_t>
inline void dot_chains_shared(V* acc, const V* a, const acc_t* const* rows, int64_t R, int64_t G) {
  for (int64_t r = 0; r < R; ++r) {
    const V x = a[r * G];
    for (int m = 0; m < M; ++m) acc[m] = fma_lanes(x, V{} + rows[m][r], acc[m]);
  }
}

template <typename V> inline V lanes_of(const V& x) { return x; }
template <typename V> inline V lanes_of(float x) { return V{} + x; }
template <typename V> inline V lanes_of(double x) { return V{} + x; }

// out[c * G] (c < C) += sum_i coef[i * cs] * rows_i[c * es], i ascending, rows_i = base + ids[i] * row_len.
template <int C, typename V, typename src_t>
inline void weighted_chunk(V* out, int64_t G, const V* coef, int64_t cs, const src_t* base, const int64_t* ids,
                           int64_t row_len, int64_t es, int64_t n) {
  V acc[C];
  for (int c = 0; c < C; ++c) acc[c] = out[c * G];
  for (int64_t i = 0; i < n; ++i) {
    const V k = coef[i * cs];
    const src_t* r = base + ids[i] * row_len;
    for (int c = 0; c < C; ++c) acc[c] = fma_lanes(k, lanes_of<V>(r[c * es]), acc[c]);
  }
  for (int c = 0; c < C; ++c) out[c * G] = acc[c];
}

// out[d * G] (d < D) += sum_i coef[i * cs] * rows_i[d * es]: chunks of kChunk elements (then 4, 2, 1).
template <typename V, typename src_t>
void weighted_sum(V* out, int64_t G, const V* coef, int64_t cs, const src_t* base, const int64_t* ids,
                  int64_t row_len, int64_t es, int64_t n, int64_t D) {
  int64_t d = 0;
  for (; d + kChunk <= D; d += kChunk)
    weighted_chunk<kChunk>(out + d * G, G, coef, cs, base + d * es, ids, row_len, es, n);
  if (d + 4 <= D) weighted_chunk<4>(out + d * G, G, coef, cs, base + d * es, ids, row_len, es, n), d += 4;
  if (d + 2 <= D) weighted_chunk<2>(out + d * G, G, coef, cs, base + d * es, ids, row_len, es, n), d += 2;
  if (d < D) weighted_chunk<1>(out + d * G, G, coef, cs, base + d * es, ids, row_len, es, n);
}

// The inputs both passes read: head-minor q, k_nope, v and k_pe in the accumulation type.
template <typename acc_t> struct KernelInputs {
  HeadMinorInputs<acc_t> hm;
  std::vector<acc_t> k_pe;  // [B*S, R]
};

template <typename cache_t, typename acc_t>
KernelInputs<acc_t> kernel_inputs(const Rows<acc_t>& q_nope, const Rows<acc_t>& q_pe, const Rows<cache_t>& k_nope,
                                  const Rows<cache_t>& k_pe, const Rows<cache_t>& v, const Sizes& z) {
  KernelInputs<acc_t> in{head_minor_inputs(q_nope, q_pe, k_nope, v, z), std::vector<acc_t>(z.B * z.S * z.R)};
  at::parallel_for(0, z.B * z.S, 64, [&](int64_t begin, int64_t end) {
    for (int64_t key = begin; key < end; ++key) {
      const cache_t* kr = k_pe.at(key / z.S, key % z.S, 0);
      for (int64_t r = 0; r < z.R; ++r) in.k_pe[key * z.R + r] = static_cast<acc_t>(kr[r]);
    }
  });
  return in;
}

// w.score [n, G] = scale * (q_nope . k_nope + q_pe . k_pe) per head, for the kept keys of `row`.
template <typename acc_t>
void row_scores(Scratch<acc_t>& w, const KernelInputs<acc_t>& in, int64_t row, acc_t scale, const Sizes& z) {
  using V = typename HeadVec<acc_t>::V;
  const int64_t G = z.groups(), n = static_cast<int64_t>(w.key.size());
  const V* qn = in.hm.q_nope.data() + row * z.Dn * G;
  const V* qr = in.hm.q_pe.data() + row * z.R * G;
  const V vscale = V{} + scale;
  for (int64_t g = 0; g < G; ++g)
    in_key_blocks(n, [&](auto block, int64_t i0) {
      constexpr int M = decltype(block)::value;
      const V* kn[M];
      const acc_t* kr[M];
      V acc[M];
      for (int m = 0; m < M; ++m) {
        const int64_t key = w.key[i0 + m];
        kn[m] = in.hm.k_nope.data() + key * z.Dn * G + g, kr[m] = in.k_pe.data() + key * z.R, acc[m] = V{};
      }
      dot_chains<M>(acc, qn + g, kn, z.Dn, G);
      dot_chains_shared<M>(acc, qr + g, kr, z.R, G);
      for (int m = 0; m < M; ++m) w.score[(i0 + m) * G + g] = acc[m] * vscale;
    });
}

// exp of every lane. fp64: std::exp per lane. fp32: one vector evaluation (std::exp per lane cost ~30% of the
// forward at 1x4096): e^x = 2^n e^r with n = round(x log2 e), r = x - n ln 2 (ln 2 in two parts, so r is exact to
// a few ulp), e^r by a degree-6 polynomial (Cephes' expf coefficients, relative error ~1 ulp on |r| <= ln 2 / 2),
// 2^n put into the exponent bits. Fixed operations (fma_lanes), so the bits depend only on x. x below -87.3
// gives 0 (e^x is subnormal there), above 88.3 +inf (near overflow; the kernels only take e^x of x <= 0: a score
// minus the row's max or log-sum-exp); NaN stays NaN.
template <typename V, typename acc_t> inline V exp_lanes(V x) {
  acc_t lanes[kHeadLanes];
  __builtin_memcpy(lanes, &x, sizeof(V));
  for (int64_t l = 0; l < kHeadLanes; ++l) lanes[l] = std::exp(lanes[l]);
  __builtin_memcpy(&x, lanes, sizeof(V));
  return x;
}

template <> inline HeadVecF exp_lanes<HeadVecF, float>(HeadVecF x) {
  using V = HeadVecF;
  typedef int32_t VI __attribute__((vector_size(sizeof(V))));
  const V lo = V{} - 87.3f, hi = V{} + 88.3f;
  V xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const V magic = V{} + 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const V n = (xc * (V{} + 1.44269504088896341f) + magic) - magic;
  V r = fma_lanes(n, V{} - 0.693359375f, xc);  // ln 2 = 0.693359375 - 2.12194440e-4 (the first part exact)
  r = fma_lanes(n, V{} + 2.12194440e-4f, r);
  V poly = V{} + 1.9875691500e-4f;
  poly = fma_lanes(poly, r, V{} + 1.3981999507e-3f);
  poly = fma_lanes(poly, r, V{} + 8.3334519073e-3f);
  poly = fma_lanes(poly, r, V{} + 4.1665795894e-2f);
  poly = fma_lanes(poly, r, V{} + 1.6666665459e-1f);
  poly = fma_lanes(poly, r, V{} + 5.0000001201e-1f);
  poly = fma_lanes(poly, r * r, r + (V{} + 1.0f));  // 1 + r + r^2 (1/2 + r / 6 + ...)
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;  // 2^n, n in [-126, 127]
  V two_n;
  __builtin_memcpy(&two_n, &bits, sizeof(V));
  V e = poly * two_n;
  e = x < lo ? V{} : e;
  return x > hi ? V{} + std::numeric_limits<float>::infinity() : e;
}

template <typename cache_t, typename acc_t>
void forward_kernel(const Rows<acc_t>& q_nope, const Rows<acc_t>& q_pe, const Rows<cache_t>& k_nope,
                    const Rows<cache_t>& k_pe, const Rows<cache_t>& v, const int64_t* idx, acc_t scale,
                    const Sizes& z, acc_t* out, acc_t* lse) {
  using V = typename HeadVec<acc_t>::V;
  const int64_t G = z.groups();
  const KernelInputs<acc_t> in = kernel_inputs(q_nope, q_pe, k_nope, k_pe, v, z);
  const int threads = std::max(1, at::get_num_threads());
  std::vector<Scratch<acc_t>> scratch = thread_scratch<acc_t>(z, threads);  // allocated before the region
  parallel_rows(scratch, 0, z.B * z.T, "sparse_expanded_forward", [&](Scratch<acc_t>& w, int64_t row) {
    gather_row(w, idx, row, z);
    const int64_t n = static_cast<int64_t>(w.key.size());
    acc_t* o = out + row * z.H * z.Dv;  // [H, Dv]
    if (n == 0) {  // no selected key: zeros, as the reference
      for (int64_t i = 0; i < z.H * z.Dv; ++i) o[i] = acc_t(0);
      for (int64_t h = 0; h < z.H; ++h) lse[row * z.H + h] = -std::numeric_limits<acc_t>::infinity();
      return;
    }
    row_scores(w, in, row, scale, z);
    V* out_DG = w.acc.data();  // [Dv, G]
    V* max_G = out_DG + z.Dv * G;  // [G]
    V* total = max_G + G;  // [G]
    for (int64_t g = 0; g < G; ++g) {
      max_G[g] = V{} - std::numeric_limits<acc_t>::infinity(), total[g] = V{};
      for (int64_t i = 0; i < n; ++i) max_G[g] = max_lanes(max_G[g], w.score[i * G + g]);
    }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t g = 0; g < G; ++g) {
        const V p = exp_lanes<V, acc_t>(w.score[i * G + g] - max_G[g]);
        w.score[i * G + g] = p;  // p from here on
        total[g] = total[g] + p;
      }
    for (int64_t i = 0; i < z.Dv * G; ++i) out_DG[i] = V{};
    for (int64_t g = 0; g < G; ++g)
      weighted_sum(out_DG + g, G, w.score.data() + g, G, in.hm.v.data() + g, w.key.data(), z.Dv * G, G, n, z.Dv);
    const acc_t* flat = reinterpret_cast<const acc_t*>(out_DG);  // [Dv, G * kHeadLanes]
    const acc_t* tot = reinterpret_cast<const acc_t*>(total);
    const acc_t* mx = reinterpret_cast<const acc_t*>(max_G);
    for (int64_t h = 0; h < z.H; ++h) {
      const acc_t inv = acc_t(1) / tot[h];
      for (int64_t d = 0; d < z.Dv; ++d) o[h * z.Dv + d] = flat[d * G * kHeadLanes + h] * inv;
      lse[row * z.H + h] = mx[h] + std::log(tot[h]);
    }
  });
}

// What pass 1 of the backward reads for one query row: head vectors dO [Dv, G], lse [G], D = dO . out [G].
template <typename acc_t> struct RowGrad {
  using V = typename HeadVec<acc_t>::V;
  const V* dO;
  const V* lse;
  const V* D;
};

// Pass 1 of the backward for one query row, in ONE pass over its kept keys (ascending): per key and head
// s = scale (q_nope . k_nope + q_pe . k_pe), p = exp(s - lse), dP = dO . v, G = scale p (dP - D), p and G stored at
// the entry's place in key order (pg + position[j] * 2 G), and d q_nope += G k_nope, d q_pe += G k_pe while the key's
// rows are still in L1. D = sum_j p dP = dO . out (the forward's output), so no pass over the keys has to finish
// before G is known. Every sum is one chain in a fixed order (a score: d then r ascending; dq: keys ascending).
template <typename acc_t>
void backward_row(const Scratch<acc_t>& w, const KernelInputs<acc_t>& in, const RowGrad<acc_t>& rg, int64_t row,
                  acc_t scale, const Sizes& z, const int64_t* position, typename HeadVec<acc_t>::V* pg,
                  typename HeadVec<acc_t>::V* dqn, typename HeadVec<acc_t>::V* dqr) {
  using V = typename HeadVec<acc_t>::V;
  const int64_t G = z.groups(), n = static_cast<int64_t>(w.key.size());
  const V* qn = in.hm.q_nope.data() + row * z.Dn * G;
  const V* qr = in.hm.q_pe.data() + row * z.R * G;
  const V vscale = V{} + scale;
  for (int64_t g = 0; g < G; ++g)
    in_key_blocks(n, [&](auto block, int64_t i0) {
      constexpr int M = decltype(block)::value;
      const V* kn[M];
      const acc_t* kr[M];
      const V* vv[M];
      V s[M], dp[M];
      for (int m = 0; m < M; ++m) {
        const int64_t key = w.key[i0 + m];
        kn[m] = in.hm.k_nope.data() + key * z.Dn * G + g, kr[m] = in.k_pe.data() + key * z.R;
        vv[m] = in.hm.v.data() + key * z.Dv * G + g, s[m] = V{}, dp[m] = V{};
      }
      dot_chains<M>(s, qn + g, kn, z.Dn, G);
      dot_chains_shared<M>(s, qr + g, kr, z.R, G);
      dot_chains<M>(dp, rg.dO + g, vv, z.Dv, G);
      V gv[M];
      for (int m = 0; m < M; ++m) {
        const V p = exp_lanes<V, acc_t>(s[m] * vscale - rg.lse[g]);
        gv[m] = vscale * (p * (dp[m] - rg.D[g]));
        V* entry = pg + position[w.slot[i0 + m]] * 2 * G;  // [2, G]
        entry[g] = p, entry[G + g] = gv[m];
      }
      for (int64_t d = 0; d < z.Dn; ++d) {
        V acc = dqn[d * G + g];
        for (int m = 0; m < M; ++m) acc = fma_lanes(gv[m], kn[m][d * G], acc);
        dqn[d * G + g] = acc;
      }
      for (int64_t r = 0; r < z.R; ++r) {
        V acc = dqr[r * G + g];
        for (int m = 0; m < M; ++m) acc = fma_lanes(gv[m], V{} + kr[m][r], acc);
        dqr[r * G + g] = acc;
      }
    });
}

// The kept entries (row, j) of a block of query rows grouped by key: a counting sort, ascending (row, j) within
// each key. position[(row - row0) * K + j] is the entry's place in that order (-1 for a -1 slot), entry_row[e]
// its query row, and the entries of `key` are [start[key], start[key + 1]).
struct KeyOrder {
  std::vector<int64_t> start, position, entry_row, touched;

  KeyOrder(int64_t keys, int64_t block_rows, int64_t K)
      : start(keys + 1), position(block_rows * K), entry_row(block_rows * K) {
    touched.reserve(std::min(keys, block_rows * K));
  }

  void build(const int64_t* idx, int64_t row0, int64_t row1, const Sizes& z) {
    const int64_t keys = z.B * z.S;
    std::fill(start.begin(), start.end(), int64_t(0));
    for (int64_t row = row0; row < row1; ++row) {
      int64_t* count = start.data() + (row / z.T) * z.S + 1;  // of the row's batch
      for (int64_t j = 0; j < z.K; ++j) {
        const int64_t s = idx[row * z.K + j];
        if (s >= 0) ++count[s];
      }
    }
    touched.clear();
    for (int64_t key = 0; key < keys; ++key) {
      if (start[key + 1] > 0) touched.push_back(key);
      start[key + 1] += start[key];
    }
    std::vector<int64_t> next(start.begin(), start.end() - 1);  // the next free place of each key
    for (int64_t row = row0; row < row1; ++row) {
      int64_t* next_of_batch = next.data() + (row / z.T) * z.S;
      for (int64_t j = 0; j < z.K; ++j) {
        const int64_t s = idx[row * z.K + j], local = (row - row0) * z.K + j;
        if (s < 0) {
          position[local] = -1;
          continue;
        }
        const int64_t e = next_of_batch[s]++;
        position[local] = e, entry_row[e] = row;
      }
    }
  }
};

template <typename cache_t, typename acc_t>
void backward_kernel(const acc_t* grad_out, const Rows<acc_t>& q_nope, const Rows<acc_t>& q_pe,
                     const Rows<cache_t>& k_nope, const Rows<cache_t>& k_pe, const Rows<cache_t>& v,
                     const int64_t* idx, const acc_t* out, const acc_t* lse, acc_t scale, const Sizes& z,
                     acc_t* dq_nope,
                     acc_t* dq_pe, acc_t* dk_nope, acc_t* dk_pe, acc_t* dv) {
  using V = typename HeadVec<acc_t>::V;
  const int64_t rows = z.B * z.T, G = z.groups(), keys = z.B * z.S;
  const KernelInputs<acc_t> in = kernel_inputs(q_nope, q_pe, k_nope, k_pe, v, z);
  const std::vector<V> dO = head_minor<acc_t>(Rows<acc_t>{grad_out, z.T * z.H * z.Dv, z.H * z.Dv, z.Dv}, z.B, z.T,
                                              z.H, z.Dv, G);  // [B*T, Dv, G]
  const int threads = std::max(1, at::get_num_threads());
  const int64_t entry_bytes = 2 * G * int64_t(sizeof(V));  // p and G of one (row, j)
  const int64_t block = std::max<int64_t>(1, kBlockBytes / std::max<int64_t>(1, z.K * entry_bytes));
  const int64_t block_rows = std::min(rows, block);
  std::vector<V> pg(block_rows * z.K * 2 * G);  // [entries of the block in key order, 2 (p, G), G]
  std::vector<V> dq_n(rows * z.Dn * G), dq_r(rows * z.R * G);  // head-minor query gradients
  std::vector<V> dk_n(keys * z.Dn * G), dk_r(keys * z.R * G), dv_h(keys * z.Dv * G);  // head-minor key gradients
  KeyOrder order(keys, block_rows, z.K);
  std::vector<Scratch<acc_t>> scratch = thread_scratch<acc_t>(z, threads);

  for (int64_t row0 = 0; row0 < rows; row0 += block) {
    const int64_t row1 = std::min(rows, row0 + block);
    order.build(idx, row0, row1, z);
    // Pass 1 (parallel over rows): p and G of every kept entry (stored in key order), d q_nope and d q_pe.
    parallel_rows(scratch, row0, row1, "sparse_expanded_backward", [&](Scratch<acc_t>& w, int64_t row) {
      gather_row(w, idx, row, z);
      const int64_t n = static_cast<int64_t>(w.key.size());
      if (n == 0) return;  // the output was zeros: every gradient is zero (dq_n / dq_r stay zero)
      // lse and D = dO . out per head (a chain over d ascending); heads past H: 0 (their p and G come out
      // finite and unused)
      V* lse_G = w.acc.data();  // [G]
      V* d_G = lse_G + G;  // [G]
      acc_t* lse_lanes = reinterpret_cast<acc_t*>(lse_G);
      acc_t* d_lanes = reinterpret_cast<acc_t*>(d_G);
      for (int64_t l = 0; l < G * kHeadLanes; ++l) {
        lse_lanes[l] = l < z.H ? lse[row * z.H + l] : acc_t(0);
        acc_t sum = 0;
        for (int64_t d = 0; l < z.H && d < z.Dv; ++d) {
          const int64_t e = (row * z.H + l) * z.Dv + d;
          sum = sum + grad_out[e] * out[e];
        }
        d_lanes[l] = sum;
      }
      const RowGrad<acc_t> rg{dO.data() + row * z.Dv * G, lse_G, d_G};
      backward_row(w, in, rg, row, scale, z, order.position.data() + (row - row0) * z.K, pg.data(),
                   dq_n.data() + row * z.Dn * G, dq_r.data() + row * z.R * G);
    });

    // Pass 2 (parallel over keys, each key owned by one thread): add its entries in (t, j) order.
    const int64_t n_touched = static_cast<int64_t>(order.touched.size());
#pragma omp parallel for num_threads(threads) schedule(dynamic, 8)
    for (int64_t k = 0; k < n_touched; ++k) {
      const int64_t key = order.touched[k], e0 = order.start[key], n = order.start[key + 1] - e0;
      const int64_t* row_of = order.entry_row.data() + e0;
      const V* entry = pg.data() + e0 * 2 * G;  // [n, 2, G]
      V* dkn = dk_n.data() + key * z.Dn * G;
      V* dkr = dk_r.data() + key * z.R * G;
      V* dvv = dv_h.data() + key * z.Dv * G;
      for (int64_t g = 0; g < G; ++g) {
        const V* p = entry + g;
        const V* gv = entry + G + g;
        weighted_sum(dkn + g, G, gv, 2 * G, in.hm.q_nope.data() + g, row_of, z.Dn * G, G, n, z.Dn);
        weighted_sum(dvv + g, G, p, 2 * G, dO.data() + g, row_of, z.Dv * G, G, n, z.Dv);
        weighted_sum(dkr + g, G, gv, 2 * G, in.hm.q_pe.data() + g, row_of, z.R * G, G, n, z.R);
      }
    }
  }
  from_head_minor<acc_t>(dq_n.data(), rows, z.H, z.Dn, G, dq_nope);
  from_head_minor<acc_t>(dq_r.data(), rows, z.H, z.R, G, dq_pe);
  from_head_minor<acc_t>(dk_n.data(), keys, z.H, z.Dn, G, dk_nope);
  from_head_minor<acc_t>(dv_h.data(), keys, z.H, z.Dv, G, dv);
  // d k_pe[s, r] = sum over heads (ascending, a fixed order) of the head-minor rope gradient.
  at::parallel_for(0, keys, 64, [&](int64_t begin, int64_t end) {
    for (int64_t key = begin; key < end; ++key) {
      const acc_t* src = reinterpret_cast<const acc_t*>(dk_r.data() + key * z.R * G);  // [R, G * kHeadLanes]
      for (int64_t r = 0; r < z.R; ++r) {
        acc_t sum = 0;
        for (int64_t h = 0; h < z.H; ++h) sum = sum + src[r * G * kHeadLanes + h];
        dk_pe[key * z.R + r] = sum;
      }
    }
  });
}

// ---- Packed path: H <= 4 heads, fp32 ----
//
// With H <= kQuad = kHeadLanes / 2 heads an 8-lane vector holds two quads of 4 head lanes, so the copies are quad
// rows [X, D2, 4] (D2 = D rounded up to even; heads past H and d past D zero) and every vector does the work of two
// 8-lane head vectors of the general path. Each output element keeps its own chain, in its own order, so every bit
// is the general path's:
//   - dot products (scores, dP: sums over d) pack TWO KEYS: lanes (key 2p | key 2p + 1) x head, the query quad
//     twice; per lane the chain over d (then r) is the one the general path runs for that key and head;
//   - weighted sums (the output, dq, dk, dv: sums over keys / entries) pack TWO ELEMENTS d, d + 1 of a quad row:
//     per lane the chain over keys / entries ascending is the general path's;
//   - the max, the exp and the totals are per lane too: exp on packed pairs, max and totals one quad per key, in
//     key order.
constexpr int64_t kQuad = kHeadLanes / 2;
typedef float QuadF __attribute__((vector_size(kQuad * sizeof(float))));

inline int64_t even(int64_t D) { return (D + 1) / 2 * 2; }

inline HeadVecF pair_of(const float* a, const float* b) {  // [quad at a | quad at b]
  return __builtin_shufflevector(load<QuadF>(a), load<QuadF>(b), 0, 1, 2, 3, 4, 5, 6, 7);
}
inline HeadVecF twice(QuadF x) { return __builtin_shufflevector(x, x, 0, 1, 2, 3, 0, 1, 2, 3); }
inline QuadF low(HeadVecF x) { return __builtin_shufflevector(x, x, 0, 1, 2, 3); }
inline QuadF high(HeadVecF x) { return __builtin_shufflevector(x, x, 4, 5, 6, 7); }

// dst [B * X, D2, kQuad] quad rows (float) from src [B, X, H, D] (or [B, X, D], each value in every lane), in parallel.
template <typename src_t>
std::vector<float> quad_rows(const Rows<src_t>& src, int64_t B, int64_t X, int64_t H, int64_t D, bool shared) {
  const int64_t D2 = even(D);
  std::vector<float> dst(B * X * D2 * kQuad);  // zeros
  at::parallel_for(0, B * X, 16, [&](int64_t begin, int64_t end) {
    for (int64_t bx = begin; bx < end; ++bx) {
      float* row = dst.data() + bx * D2 * kQuad;
      for (int64_t h = 0; h < (shared ? kQuad : H); ++h) {
        const src_t* x = src.at(bx / X, bx % X, shared ? 0 : h);
        for (int64_t d = 0; d < D; ++d) row[d * kQuad + h] = static_cast<float>(x[d]);
      }
    }
  });
  return dst;
}

// out [rows, H, D] from quad rows [rows, D2, kQuad], in parallel.
void from_quad_rows(const std::vector<float>& src, int64_t rows, int64_t H, int64_t D, float* out) {
  const int64_t D2 = even(D);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) out[(r * H + h) * D + d] = src[(r * D2 + d) * kQuad + h];
  });
}

struct QuadInputs {
  std::vector<float> q_nope, q_pe, k_nope, k_pe, v;  // [B*T, Dn2, 4], [B*T, R2, 4], [B*S, Dn2 / R2 / Dv2, 4]
};

template <typename cache_t>
QuadInputs quad_inputs(const Rows<float>& q_nope, const Rows<float>& q_pe, const Rows<cache_t>& k_nope,
                       const Rows<cache_t>& k_pe, const Rows<cache_t>& v, const Sizes& z) {
  return {quad_rows(q_nope, z.B, z.T, z.H, z.Dn, false), quad_rows(q_pe, z.B, z.T, z.H, z.R, false),
          quad_rows(k_nope, z.B, z.S, z.H, z.Dn, false), quad_rows(k_pe, z.B, z.S, z.H, z.R, true),
          quad_rows(v, z.B, z.S, z.H, z.Dv, false)};
}

// acc[m] (m < M) continues the chain acc[m] = twice(a[d]) * [a_rows[m][d] | b_rows[m][d]] + acc[m] over d < D.
template <int M>
inline void pair_chains(HeadVecF* acc, const float* a, const float* const* a_rows, const float* const* b_rows,
                        int64_t D) {
  for (int64_t d = 0; d < D; ++d) {
    const HeadVecF x = twice(load<QuadF>(a + d * kQuad));
    for (int m = 0; m < M; ++m) acc[m] = fma_lanes(x, pair_of(a_rows[m] + d * kQuad, b_rows[m] + d * kQuad), acc[m]);
  }
}

// f(block size M as an integral_constant, first pair) over the ceil(n / 2) key pairs, kKeyBlock pairs a block.
template <typename F> inline void in_pair_blocks(int64_t n, F&& f) {
  const int64_t pairs = (n + 1) / 2;
  int64_t p = 0;
  for (; p + kKeyBlock <= pairs; p += kKeyBlock) f(std::integral_constant<int, kKeyBlock>{}, p);
  for (; p < pairs; ++p) f(std::integral_constant<int, 1>{}, p);
}

// out[e] (e < 2 kQuad C) += sum_i coef_i[e % kQuad] * rows_i[e], i < n ascending, rows_i = base + ids[i] * row_len,
// coef_i = coef + i * cs.
template <int C>
inline void weighted_pairs_chunk(float* out, const float* coef, int64_t cs, const float* base, const int64_t* ids,
                                 int64_t row_len, int64_t n) {
  HeadVecF acc[C];
  for (int c = 0; c < C; ++c) acc[c] = load<HeadVecF>(out + c * kHeadLanes);
  for (int64_t i = 0; i < n; ++i) {
    const HeadVecF k = twice(load<QuadF>(coef + i * cs));
    const float* r = base + ids[i] * row_len;
    for (int c = 0; c < C; ++c) acc[c] = fma_lanes(k, load<HeadVecF>(r + c * kHeadLanes), acc[c]);
  }
  for (int c = 0; c < C; ++c) store(out + c * kHeadLanes, acc[c]);
}

// The same over a quad row of D2 (even) elements: chunks of kChunk element pairs (then 4, 2, 1).
void weighted_pairs(float* out, const float* coef, int64_t cs, const float* base, const int64_t* ids,
                    int64_t row_len, int64_t n, int64_t D2) {
  const int64_t pairs = D2 / 2;
  int64_t p = 0;
  auto at = [&](int64_t q) { return q * kHeadLanes; };
  for (; p + kChunk <= pairs; p += kChunk) weighted_pairs_chunk<kChunk>(out + at(p), coef, cs, base + at(p), ids, row_len, n);
  if (p + 4 <= pairs) weighted_pairs_chunk<4>(out + at(p), coef, cs, base + at(p), ids, row_len, n), p += 4;
  if (p + 2 <= pairs) weighted_pairs_chunk<2>(out + at(p), coef, cs, base + at(p), ids, row_len, n), p += 2;
  if (p < pairs) weighted_pairs_chunk<1>(out + at(p), coef, cs, base + at(p), ids, row_len, n);
}

// pairs [ceil(n / 2), 8] of dot products of the row's query quads `a` [D, 4] (then `ar` [R, 4]) with the kept keys'
// quad rows (rows + key * row_len, then rows_r + key * row_len_r; R = 0 for none), unscaled. The last pair of an
// odd n repeats its key (the high quad is unused).
void pair_dots(float* pairs, const std::vector<int64_t>& key, const float* a, const float* rows, int64_t row_len,
               int64_t D, const float* ar, const float* rows_r, int64_t row_len_r, int64_t R) {
  const int64_t n = static_cast<int64_t>(key.size());
  in_pair_blocks(n, [&](auto block, int64_t p0) {
    constexpr int M = decltype(block)::value;
    const float *ka[M], *kb[M], *ra[M], *rb[M];
    HeadVecF acc[M];
    for (int m = 0; m < M; ++m) {
      const int64_t i = 2 * (p0 + m), a_key = key[i], b_key = key[std::min(i + 1, n - 1)];
      ka[m] = rows + a_key * row_len, kb[m] = rows + b_key * row_len, acc[m] = HeadVecF{};
      if (R > 0) ra[m] = rows_r + a_key * row_len_r, rb[m] = rows_r + b_key * row_len_r;
    }
    pair_chains<M>(acc, a, ka, kb, D);
    if (R > 0) pair_chains<M>(acc, ar, ra, rb, R);
    for (int m = 0; m < M; ++m) store(pairs + (p0 + m) * kHeadLanes, acc[m]);
  });
}

template <typename cache_t>
void forward_packed(const Rows<float>& q_nope, const Rows<float>& q_pe, const Rows<cache_t>& k_nope,
                    const Rows<cache_t>& k_pe, const Rows<cache_t>& v, const int64_t* idx, float scale,
                    const Sizes& z, float* out, float* lse) {
  using V = HeadVecF;
  const int64_t Dn2 = even(z.Dn), R2 = even(z.R), Dv2 = even(z.Dv);
  const QuadInputs in = quad_inputs(q_nope, q_pe, k_nope, k_pe, v, z);
  const int threads = std::max(1, at::get_num_threads());
  std::vector<Scratch<float>> scratch = thread_scratch<float>(z, threads);
  parallel_rows(scratch, 0, z.B * z.T, "sparse_expanded_forward", [&](Scratch<float>& w, int64_t row) {
    gather_row(w, idx, row, z);
    const int64_t n = static_cast<int64_t>(w.key.size());
    float* o = out + row * z.H * z.Dv;  // [H, Dv]
    if (n == 0) {
      for (int64_t i = 0; i < z.H * z.Dv; ++i) o[i] = 0.0f;
      for (int64_t h = 0; h < z.H; ++h) lse[row * z.H + h] = -std::numeric_limits<float>::infinity();
      return;
    }
    float* s = reinterpret_cast<float*>(w.score.data());  // [ceil(n / 2), 8] = [n (+1), 4]: scores, then p
    pair_dots(s, w.key, in.q_nope.data() + row * Dn2 * kQuad, in.k_nope.data(), Dn2 * kQuad, z.Dn,
              in.q_pe.data() + row * R2 * kQuad, in.k_pe.data(), R2 * kQuad, z.R);
    const int64_t pairs = (n + 1) / 2;
    for (int64_t p = 0; p < pairs; ++p) store(s + p * kHeadLanes, load<V>(s + p * kHeadLanes) * scale);
    QuadF top = QuadF{} - std::numeric_limits<float>::infinity(), total = QuadF{};
    for (int64_t i = 0; i < n; ++i) top = max_lanes(top, load<QuadF>(s + i * kQuad));
    for (int64_t p = 0; p < pairs; ++p) {
      const V e = exp_lanes<V, float>(load<V>(s + p * kHeadLanes) - twice(top));
      store(s + p * kHeadLanes, e);
      total = total + low(e);
      if (2 * p + 1 < n) total = total + high(e);
    }
    float* acc = reinterpret_cast<float*>(w.acc.data());  // [Dv2, 4]
    for (int64_t i = 0; i < Dv2 * kQuad; ++i) acc[i] = 0.0f;
    weighted_pairs(acc, s, kQuad, in.v.data(), w.key.data(), Dv2 * kQuad, n, Dv2);
    for (int64_t h = 0; h < z.H; ++h) {
      const float inv = 1.0f / total[h];
      for (int64_t d = 0; d < z.Dv; ++d) o[h * z.Dv + d] = acc[d * kQuad + h] * inv;
      lse[row * z.H + h] = top[h] + std::log(total[h]);
    }
  });
}

template <typename cache_t>
void backward_packed(const float* grad_out, const Rows<float>& q_nope, const Rows<float>& q_pe,
                     const Rows<cache_t>& k_nope, const Rows<cache_t>& k_pe, const Rows<cache_t>& v,
                     const int64_t* idx, const float* out, const float* lse, float scale, const Sizes& z,
                     float* dq_nope, float* dq_pe, float* dk_nope, float* dk_pe, float* dv) {
  using V = HeadVecF;
  const int64_t rows = z.B * z.T, keys = z.B * z.S, Dn2 = even(z.Dn), R2 = even(z.R), Dv2 = even(z.Dv);
  const QuadInputs in = quad_inputs(q_nope, q_pe, k_nope, k_pe, v, z);
  const std::vector<float> dO =
      quad_rows(Rows<float>{grad_out, z.T * z.H * z.Dv, z.H * z.Dv, z.Dv}, z.B, z.T, z.H, z.Dv, false);
  const int threads = std::max(1, at::get_num_threads());
  const int64_t entry_bytes = 2 * kQuad * int64_t(sizeof(float));  // p and G of one (row, j)
  const int64_t block = std::max<int64_t>(1, kBlockBytes / std::max<int64_t>(1, z.K * entry_bytes));
  const int64_t block_rows = std::min(rows, block);
  std::vector<float> pg(block_rows * z.K * 2 * kQuad);  // [entries of the block in key order, 2 (p, G), 4]
  std::vector<float> dq_n(rows * Dn2 * kQuad), dq_r(rows * R2 * kQuad);
  std::vector<float> dk_n(keys * Dn2 * kQuad), dk_r(keys * R2 * kQuad), dv_q(keys * Dv2 * kQuad);
  KeyOrder order(keys, block_rows, z.K);
  std::vector<Scratch<float>> scratch = thread_scratch<float>(z, threads);  // score: scores [n (+1), 4]; grad: dP, then G [n (+1), 4]
  const V vscale = V{} + scale;

  for (int64_t row0 = 0; row0 < rows; row0 += block) {
    const int64_t row1 = std::min(rows, row0 + block);
    order.build(idx, row0, row1, z);
    parallel_rows(scratch, row0, row1, "sparse_expanded_backward", [&](Scratch<float>& w, int64_t row) {
      gather_row(w, idx, row, z);
      const int64_t n = static_cast<int64_t>(w.key.size());
      if (n == 0) return;
      QuadF lse4{}, d4{};  // lse and D = dO . out per head (a chain over d ascending); heads past H: 0
      for (int64_t h = 0; h < z.H; ++h) {
        lse4[h] = lse[row * z.H + h];
        float sum = 0;
        for (int64_t d = 0; d < z.Dv; ++d) {
          const int64_t e = (row * z.H + h) * z.Dv + d;
          sum = sum + grad_out[e] * out[e];
        }
        d4[h] = sum;
      }
      float* s = reinterpret_cast<float*>(w.score.data());
      float* g = reinterpret_cast<float*>(w.grad.data());
      pair_dots(s, w.key, in.q_nope.data() + row * Dn2 * kQuad, in.k_nope.data(), Dn2 * kQuad, z.Dn,
                in.q_pe.data() + row * R2 * kQuad, in.k_pe.data(), R2 * kQuad, z.R);
      pair_dots(g, w.key, dO.data() + row * Dv2 * kQuad, in.v.data(), Dv2 * kQuad, z.Dv, nullptr, nullptr, 0, 0);
      const int64_t* position = order.position.data() + (row - row0) * z.K;
      for (int64_t p = 0; p < (n + 1) / 2; ++p) {
        const V e = exp_lanes<V, float>(load<V>(s + p * kHeadLanes) * vscale - twice(lse4));
        const V gv = vscale * (e * (load<V>(g + p * kHeadLanes) - twice(d4)));
        store(g + p * kHeadLanes, gv);
        for (int64_t i = 2 * p; i < std::min(2 * p + 2, n); ++i) {
          float* entry = pg.data() + position[w.slot[i]] * 2 * kQuad;  // [2, 4]
          store(entry, i == 2 * p ? low(e) : high(e)), store(entry + kQuad, i == 2 * p ? low(gv) : high(gv));
        }
      }
      weighted_pairs(dq_n.data() + row * Dn2 * kQuad, g, kQuad, in.k_nope.data(), w.key.data(), Dn2 * kQuad, n,
                     Dn2);
      weighted_pairs(dq_r.data() + row * R2 * kQuad, g, kQuad, in.k_pe.data(), w.key.data(), R2 * kQuad, n, R2);
    });

    const int64_t n_touched = static_cast<int64_t>(order.touched.size());
#pragma omp parallel for num_threads(threads) schedule(dynamic, 8)
    for (int64_t k = 0; k < n_touched; ++k) {
      const int64_t key = order.touched[k], e0 = order.start[key], n = order.start[key + 1] - e0;
      const int64_t* row_of = order.entry_row.data() + e0;
      const float* entry = pg.data() + e0 * 2 * kQuad;  // [n, 2, 4]
      weighted_pairs(dk_n.data() + key * Dn2 * kQuad, entry + kQuad, 2 * kQuad, in.q_nope.data(), row_of,
                     Dn2 * kQuad, n, Dn2);
      weighted_pairs(dv_q.data() + key * Dv2 * kQuad, entry, 2 * kQuad, dO.data(), row_of, Dv2 * kQuad, n, Dv2);
      weighted_pairs(dk_r.data() + key * R2 * kQuad, entry + kQuad, 2 * kQuad, in.q_pe.data(), row_of, R2 * kQuad,
                     n, R2);
    }
  }
  from_quad_rows(dq_n, rows, z.H, z.Dn, dq_nope);
  from_quad_rows(dq_r, rows, z.H, z.R, dq_pe);
  from_quad_rows(dk_n, keys, z.H, z.Dn, dk_nope);
  from_quad_rows(dv_q, keys, z.H, z.Dv, dv);
  at::parallel_for(0, keys, 64, [&](int64_t begin, int64_t end) {  // d k_pe: the heads summed in ascending order
    for (int64_t key = begin; key < end; ++key)
      for (int64_t r = 0; r < z.R; ++r) {
        float sum = 0;
        for (int64_t h = 0; h < z.H; ++h) sum = sum + dk_r[(key * R2 + r) * kQuad + h];
        dk_pe[key * z.R + r] = sum;
      }
  });
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
    auto* kernel = z.H <= kQuad ? &forward_packed<scalar_t> : &forward_kernel<scalar_t, float>;
    kernel(rows_of<float>(qn), rows_of<float>(qr), rows_of<scalar_t>(kn), rows_of<scalar_t>(kr),
           rows_of<scalar_t>(vv), idx.data_ptr<int64_t>(), static_cast<float>(scale), z, out.data_ptr<float>(),
           lse.data_ptr<float>());
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> sparse_expanded_backward(
    const at::Tensor& grad_out_in, const at::Tensor& q_nope_in, const at::Tensor& q_pe_in,
    const at::Tensor& k_nope_in, const at::Tensor& k_pe_in, const at::Tensor& v_in, const at::Tensor& topk_idx,
    const at::Tensor& out_in, const at::Tensor& lse_in, double scale) {
  const char* op = "sparse_expanded_backward";
  const Sizes z = check_inputs(op, q_nope_in, q_pe_in, k_nope_in, k_pe_in, v_in, topk_idx);
  TORCH_CHECK(grad_out_in.dim() == 4 && grad_out_in.size(0) == z.B && grad_out_in.size(1) == z.T &&
                  grad_out_in.size(2) == z.H && grad_out_in.size(3) == z.Dv,
              op, ": grad_out must be [B, T, H, Dv]");
  TORCH_CHECK(out_in.dim() == 4 && out_in.size(0) == z.B && out_in.size(1) == z.T && out_in.size(2) == z.H &&
                  out_in.size(3) == z.Dv,
              op, ": out (the forward's output) must be [B, T, H, Dv]");
  TORCH_CHECK(lse_in.dim() == 3 && lse_in.size(0) == z.B && lse_in.size(1) == z.T && lse_in.size(2) == z.H, op,
              ": lse must be [B, T, H]");
  TORCH_CHECK(grad_out_in.scalar_type() == q_nope_in.scalar_type() && out_in.scalar_type() == q_nope_in.scalar_type() &&
                  lse_in.scalar_type() == q_nope_in.scalar_type(),
              op, ": grad_out / out / lse must have the queries' dtype");
  auto dO = grad_out_in.contiguous(), out = out_in.contiguous(), lse = lse_in.contiguous();
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
                                    idx.data_ptr<int64_t>(), out.data_ptr<double>(), lse.data_ptr<double>(), scale, z,
                                    dq_nope.data_ptr<double>(), dq_pe.data_ptr<double>(), dk_nope.data_ptr<double>(),
                                    dk_pe.data_ptr<double>(), dv.data_ptr<double>());
    return {dq_nope, dq_pe, dk_nope, dk_pe, dv};
  }
  TORCH_CHECK(qn.scalar_type() == at::kFloat, op, ": expected fp32 or fp64 queries");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kn.scalar_type(), "sparse_expanded_backward", [&] {
    auto* kernel = z.H <= kQuad ? &backward_packed<scalar_t> : &backward_kernel<scalar_t, float>;
    kernel(dO.data_ptr<float>(), rows_of<float>(qn), rows_of<float>(qr), rows_of<scalar_t>(kn),
           rows_of<scalar_t>(kr), rows_of<scalar_t>(vv), idx.data_ptr<int64_t>(), out.data_ptr<float>(),
           lse.data_ptr<float>(), static_cast<float>(scale), z, dq_nope.data_ptr<float>(), dq_pe.data_ptr<float>(),
           dk_nope.data_ptr<float>(), dk_pe.data_ptr<float>(), dv.data_ptr<float>());
  });
  return {dq_nope, dq_pe, dk_nope, dk_pe, dv};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(glm5_cpu, m) {
  m.def("sparse_expanded_forward(Tensor q_nope, Tensor q_pe, Tensor k_nope, Tensor k_pe, Tensor v, "
        "Tensor topk_idx, float scale) -> (Tensor, Tensor)");
  m.def("sparse_expanded_backward(Tensor grad_out, Tensor q_nope, Tensor q_pe, Tensor k_nope, Tensor k_pe, "
        "Tensor v, Tensor topk_idx, Tensor out, Tensor lse, float scale) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(glm5_cpu, CPU, m) {
  m.impl("sparse_expanded_forward", &sparse_expanded_forward);
  m.impl("sparse_expanded_backward", &sparse_expanded_backward);
}

}  // namespace glm5
