// The sparse stage's indexer-KL target at the selected keys, for CPU. No gradient: the target is detached.
//
// Legend: B batch, T queries, H heads, Dn nope width, R rope width, S key slots, K selected keys per query (-1 =
// none), G = ceil(H / 8) groups of 8 heads.
//   q_nope [B, T, H, Dn], q_pe [B, T, H, R] (fp32 or fp64), k_nope [B, S, H, Dn] (any strides with a unit last one:
//   it may be a view of kv_b_proj's output), k_pe [B, S, R] (shared by the heads), lse: the normaliser (below),
//   topk_idx [B, T, K], start [B] int64 (query t of row b sits at position start[b] + t and sees the keys
//   s <= start[b] + t).
//
//   p[b,t,j] = (1/H) sum_h exp(scale * (q_nope[h] . k_nope[i_j, h] + q_pe[h] . k_pe[i_j]) - lse[h])
//   (0 where i_j = -1 or where key i_j is past the query).
//
// Two normalisers, chosen by lse:
//   lse [B, T, H] ("causal"): each head's DENSE causal log-sum-exp of scale * score over every visible key,
//     computed by the caller. Each head's softmax sums to 1 over the visible keys, so the head sum sums to H: p is
//     the head-summed, L1-normalised main attention (indexer_loss.attention_target) gathered at the selected keys.
//   lse empty, shape [0] ("selected"): the kernel computes each head's log-sum-exp over the row's valid selected
//     keys itself (max, then the sum of exp(score - max)): p is each head's softmax over the selected keys, summed
//     over heads / H (NVIDIA Megatron-LM's DSA indexer loss with sparse_loss=True). A row with no valid key is 0.
// Cost O(T K H (Dn + R)) multiply-adds and T K H exponentials; memory O(S H Dn) (the keys' copy below), plus
// ("selected") K scores of every head per thread.
// Layout: k_nope is first copied into head-minor vectors [B*S, Dn, G, 8] (heads past H zero), so a score of 8 heads
// is Dn + R lane-wise multiply-adds with no horizontal sum (fp32 with H <= 4 heads: target_packed, two keys per
// vector, the same bits). Determinism: one thread computes each query row, in a
// fixed order (keys in slot order, heads summed in head order): bitwise repeatable, whatever the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_simd.h"

namespace glm5 {
namespace {

constexpr int64_t kKeyBlock = 4;  // selected keys scored together (independent accumulator chains)

// exp of 8 floats at once (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial, times 2^n), within
// ~2 ulp of std::exp over [-87.3, 88.3]; below -87.3 it gives 0 (std::exp: a denormal under 1.2e-38). The exponentials
// were the kernel's cost (one library call per head and key): this keeps them in vector registers.
inline HeadVecF exp_heads(HeadVecF x) {
  typedef int32_t Ints __attribute__((vector_size(kHeadLanes * sizeof(int32_t))));
  const HeadVecF lo = HeadVecF{} - 87.3f, hi = HeadVecF{} + 88.3f;
  const HeadVecF xc = x < lo ? lo : (x > hi ? hi : x);
  const HeadVecF t = xc * 1.44269504088896341f + 0.5f;
  Ints n = __builtin_convertvector(t, Ints);  // truncation; then floor:
  HeadVecF nf = __builtin_convertvector(n, HeadVecF);
  const Ints above = nf > t;  // -1 where truncation rounded up (negative t)
  n = n + above;
  nf = nf + __builtin_convertvector(above, HeadVecF);
  const HeadVecF r = (xc - nf * 0.693359375f) - nf * -2.12194440e-4f;
  HeadVecF p = HeadVecF{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const HeadVecF y = (p * (r * r) + r) + 1.0f;
  const Ints bits = (n + 127) << 23;
  HeadVecF scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  const HeadVecF e = y * scale;
  return x < lo ? HeadVecF{} : e;
}

inline HeadVecD exp_heads(HeadVecD x) {  // fp64: the library's exp, lane by lane
  double lanes[kHeadLanes];
  __builtin_memcpy(lanes, &x, sizeof(x));
  for (int64_t l = 0; l < kHeadLanes; ++l) lanes[l] = std::exp(lanes[l]);
  __builtin_memcpy(&x, lanes, sizeof(x));
  return x;
}

struct Sizes {
  int64_t B, T, H, Dn, R, S, K;
  int64_t groups() const { return (H + kHeadLanes - 1) / kHeadLanes; }
};

// A [B, X, H, D] (or [B, X, D], h ignored) tensor with a unit last stride, read through its strides.
template <typename T> struct Rows {
  const T* base;
  int64_t sb, sx, sh;
  const T* at(int64_t b, int64_t x, int64_t h) const { return base + b * sb + x * sx + h * sh; }
};

template <typename T> Rows<T> rows_of(const at::Tensor& t) {
  return {t.data_ptr<T>(), t.stride(0), t.stride(1), t.dim() == 4 ? t.stride(2) : 0};
}

// dst [D, G] head vectors of row (b, x) of src [B, X, H, D] (heads past H zero).
template <typename T>
void head_minor_row(const Rows<T>& src, int64_t b, int64_t x, int64_t H, int64_t D, int64_t G,
                    typename HeadVec<T>::V* dst) {
  T* flat = reinterpret_cast<T*>(dst);  // [D, G * kHeadLanes]
  for (int64_t i = 0; i < D * G * kHeadLanes; ++i) flat[i] = T(0);
  for (int64_t h = 0; h < H; ++h) {
    const T* row = src.at(b, x, h);
    for (int64_t d = 0; d < D; ++d) flat[d * G * kHeadLanes + h] = row[d];
  }
}

// scores (unscaled) of the row's queries (qn [Dn, G], qr [R, G]) against kKeyBlock keys (kn[i] [Dn, G], kr[i] [R]),
// group g of heads, into acc[i]. kKeyBlock independent multiply-add chains (one per key, each in the
// same order as a lone key's), so the FMA latency is hidden and every score rounds as if computed alone.
template <typename T, typename V>
inline void score_keys(const V* qn, const V* qr, const V* const* kn, const T* const* kr, int64_t Dn, int64_t R,
                       int64_t G, int64_t g, V* acc) {
  for (int64_t i = 0; i < kKeyBlock; ++i) acc[i] = V{};
  for (int64_t d = 0; d < Dn; ++d) {
    const V q = qn[d * G + g];
    for (int64_t i = 0; i < kKeyBlock; ++i) acc[i] = fma_lanes(q, kn[i][d * G + g], acc[i]);
  }
  for (int64_t r = 0; r < R; ++r) {
    const V q = qr[r * G + g];
    for (int64_t i = 0; i < kKeyBlock; ++i) acc[i] = fma_lanes(q, V{} + kr[i][r], acc[i]);
  }
}

template <typename T>
void target_kernel(const Rows<T>& q_nope, const Rows<T>& q_pe, const Rows<T>& k_nope, const Rows<T>& k_pe,
                   const T* lse, const int64_t* idx, const int64_t* start, T scale, const Sizes& z, T* out) {
  using V = typename HeadVec<T>::V;
  const int64_t G = z.groups();
  std::vector<V> keys(z.B * z.S * z.Dn * G);  // [B*S, Dn, G]
  at::parallel_for(0, z.B * z.S, 16, [&](int64_t begin, int64_t end) {
    for (int64_t bs = begin; bs < end; ++bs)
      head_minor_row(k_nope, bs / z.S, bs % z.S, z.H, z.Dn, G, keys.data() + bs * z.Dn * G);
  });
  const V vscale = V{} + scale;
  const T inv_heads = T(1) / static_cast<T>(z.H);
  const bool selected = lse == nullptr;  // normalise each head over the row's selected keys
  at::parallel_for(0, z.B * z.T, 1, [&](int64_t begin, int64_t end) {
    std::vector<V> qn(z.Dn * G), qr(z.R * G), row_lse(G), inv_total(G);  // the row's queries and lse, head vectors
    std::vector<V> scores;  // "selected": [n, G] the kept keys' scaled scores, then exp(score - the head's max)
    if (selected) scores.resize((z.K + kKeyBlock) * G);
    std::vector<int64_t> slot, key;  // the row's kept slots j and their keys s
    slot.reserve(z.K), key.reserve(z.K);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / z.T, t = row % z.T, last_visible = start[b] + t;
      head_minor_row(q_nope, b, t, z.H, z.Dn, G, qn.data());
      head_minor_row(q_pe, b, t, z.H, z.R, G, qr.data());
      T* o = out + row * z.K;  // [K]
      slot.clear(), key.clear();
      for (int64_t j = 0; j < z.K; ++j) {
        const int64_t s = idx[row * z.K + j];
        o[j] = T(0);  // no key, or a key the query does not see: probability 0
        if (s >= 0 && s <= last_visible) slot.push_back(j), key.push_back(s);
      }
      const int64_t n = static_cast<int64_t>(key.size());
      if (selected && n == 0) continue;  // no valid key: the row stays 0
      const V* kn[kKeyBlock];
      const T* kr[kKeyBlock];
      auto point_at = [&](int64_t i0, int64_t m) {  // a short block repeats its last key (results unused)
        for (int64_t i = 0; i < kKeyBlock; ++i) {
          const int64_t s = key[i0 + std::min(i, m - 1)];
          kn[i] = keys.data() + (b * z.S + s) * z.Dn * G;
          kr[i] = k_pe.at(b, s, 0);
        }
      };
      if (selected) {
        // pass 1: every kept key's scores, and each head's max over them
        for (int64_t i0 = 0; i0 < n; i0 += kKeyBlock) {
          point_at(i0, std::min(kKeyBlock, n - i0));
          for (int64_t g = 0; g < G; ++g) {
            V acc[kKeyBlock];
            score_keys<T, V>(qn.data(), qr.data(), kn, kr, z.Dn, z.R, G, g, acc);
            for (int64_t i = 0; i < kKeyBlock; ++i) scores[(i0 + i) * G + g] = acc[i] * vscale;
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          V top = scores[g], total = V{};
          for (int64_t i = 1; i < n; ++i) top = scores[i * G + g] > top ? scores[i * G + g] : top;
          for (int64_t i = 0; i < n; ++i) {  // key order; the max key's term is exactly 1, so total >= 1
            scores[i * G + g] = exp_heads(scores[i * G + g] - top);
            total = total + scores[i * G + g];
          }
          inv_total[g] = T(1) / total;
        }
        // pass 2: each head's probabilities, summed over the heads in head order
        for (int64_t i = 0; i < n; ++i) {
          T total = T(0);
          for (int64_t g = 0; g < G; ++g) {
            const V prob = scores[i * G + g] * inv_total[g];
            T lanes[kHeadLanes];
            __builtin_memcpy(lanes, &prob, sizeof(V));
            const int64_t heads = std::min(kHeadLanes, z.H - g * kHeadLanes);
            for (int64_t l = 0; l < heads; ++l) total = total + lanes[l];
          }
          o[slot[i]] = total * inv_heads;
        }
        continue;
      }
      T* lse_flat = reinterpret_cast<T*>(row_lse.data());  // [G * kHeadLanes]; lanes past H unused
      for (int64_t h = 0; h < G * kHeadLanes; ++h) lse_flat[h] = h < z.H ? lse[row * z.H + h] : T(0);
      for (int64_t i0 = 0; i0 < n; i0 += kKeyBlock) {
        const int64_t m = std::min(kKeyBlock, n - i0);
        point_at(i0, m);
        T total[kKeyBlock] = {};
        for (int64_t g = 0; g < G; ++g) {
          V acc[kKeyBlock];
          score_keys<T, V>(qn.data(), qr.data(), kn, kr, z.Dn, z.R, G, g, acc);
          const int64_t heads = std::min(kHeadLanes, z.H - g * kHeadLanes);
          for (int64_t i = 0; i < m; ++i) {
            const V prob = exp_heads(acc[i] * vscale - row_lse[g]);
            T lanes[kHeadLanes];
            __builtin_memcpy(lanes, &prob, sizeof(V));
            for (int64_t l = 0; l < heads; ++l) total[i] = total[i] + lanes[l];  // head order
          }
        }
        for (int64_t i = 0; i < m; ++i) o[slot[i0 + i]] = total[i] * inv_heads;
      }
    }
  });
}

// ---- Packed path: H <= 4 heads, fp32 ----
//
// With H <= kQuad = kHeadLanes / 2 heads, an 8-lane vector scores TWO KEYS: lanes (key 2p | key 2p + 1) x head, the
// query quad twice, the keys as quad rows [B*S, D, 4] (heads past H zero; k_pe's value in all 4 lanes). Per lane the
// chain over d (then r) is the one target_kernel runs for that key and head, the exp is lane-wise, and the max, the
// totals and the head sums take the lanes one key at a time in key order: every output bit is target_kernel's.
constexpr int64_t kQuad = kHeadLanes / 2;
typedef float QuadF __attribute__((vector_size(kQuad * sizeof(float))));

inline HeadVecF pair_of(const float* a, const float* b) {  // [quad at a | quad at b]
  return __builtin_shufflevector(load<QuadF>(a), load<QuadF>(b), 0, 1, 2, 3, 4, 5, 6, 7);
}
inline HeadVecF twice(QuadF x) { return __builtin_shufflevector(x, x, 0, 1, 2, 3, 0, 1, 2, 3); }

// dst [B * X, D, kQuad] quad rows of src [B, X, H, D] (or [B, X, D]: each value in every lane), in parallel.
std::vector<float> quad_rows(const Rows<float>& src, int64_t B, int64_t X, int64_t H, int64_t D, bool shared) {
  std::vector<float> dst(B * X * D * kQuad);  // zeros
  at::parallel_for(0, B * X, 16, [&](int64_t begin, int64_t end) {
    for (int64_t bx = begin; bx < end; ++bx) {
      float* row = dst.data() + bx * D * kQuad;
      for (int64_t h = 0; h < (shared ? kQuad : H); ++h) {
        const float* x = src.at(bx / X, bx % X, shared ? 0 : h);
        for (int64_t d = 0; d < D; ++d) row[d * kQuad + h] = x[d];
      }
    }
  });
  return dst;
}

// pairs [ceil(n / 2), 8]: the unscaled scores of the row's query quads (qn [Dn, 4], qr [R, 4]) against the keys
// key[0, n) (quad rows kn [B*S, Dn, 4], kr [B*S, R, 4] from `base`), kKeyBlock pairs at a time (independent chains),
// then single pairs; the last pair of an odd n repeats its key (its high quad unused).
void pair_scores(float* pairs, const int64_t* key, int64_t n, int64_t base, const float* qn, const float* qr,
                 const std::vector<float>& kn, const std::vector<float>& kr, int64_t Dn, int64_t R) {
  auto block_of = [&](auto block, int64_t p0) {
    constexpr int M = decltype(block)::value;
    const float *na[M], *nb[M], *ra[M], *rb[M];
    HeadVecF acc[M];
    for (int m = 0; m < M; ++m) {
      const int64_t a = base + key[2 * (p0 + m)], b = base + key[std::min(2 * (p0 + m) + 1, n - 1)];
      na[m] = kn.data() + a * Dn * kQuad, nb[m] = kn.data() + b * Dn * kQuad;
      ra[m] = kr.data() + a * R * kQuad, rb[m] = kr.data() + b * R * kQuad, acc[m] = HeadVecF{};
    }
    for (int64_t d = 0; d < Dn; ++d) {
      const HeadVecF q = twice(load<QuadF>(qn + d * kQuad));
      for (int m = 0; m < M; ++m) acc[m] = fma_lanes(q, pair_of(na[m] + d * kQuad, nb[m] + d * kQuad), acc[m]);
    }
    for (int64_t r = 0; r < R; ++r) {
      const HeadVecF q = twice(load<QuadF>(qr + r * kQuad));
      for (int m = 0; m < M; ++m) acc[m] = fma_lanes(q, pair_of(ra[m] + r * kQuad, rb[m] + r * kQuad), acc[m]);
    }
    for (int m = 0; m < M; ++m) store(pairs + (p0 + m) * kHeadLanes, acc[m]);
  };
  const int64_t count = (n + 1) / 2;
  int64_t p = 0;
  for (; p + kKeyBlock <= count; p += kKeyBlock) block_of(std::integral_constant<int, kKeyBlock>{}, p);
  for (; p < count; ++p) block_of(std::integral_constant<int, 1>{}, p);
}

void target_packed(const Rows<float>& q_nope, const Rows<float>& q_pe, const Rows<float>& k_nope,
                   const Rows<float>& k_pe, const float* lse, const int64_t* idx, const int64_t* start, float scale,
                   const Sizes& z, float* out) {
  using V = HeadVecF;
  const std::vector<float> kn = quad_rows(k_nope, z.B, z.S, z.H, z.Dn, false);  // [B*S, Dn, 4]
  const std::vector<float> kr = quad_rows(k_pe, z.B, z.S, z.H, z.R, true);  // [B*S, R, 4]
  const V vscale = V{} + scale;
  const float inv_heads = 1.0f / static_cast<float>(z.H);
  const bool selected = lse == nullptr;
  at::parallel_for(0, z.B * z.T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qn(z.Dn * kQuad), qr(z.R * kQuad), scores((z.K + 1) * kQuad);  // scores [n (+1), 4]
    std::vector<int64_t> slot, key;
    slot.reserve(z.K), key.reserve(z.K);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / z.T, t = row % z.T, last_visible = start[b] + t;
      std::fill(qn.begin(), qn.end(), 0.0f), std::fill(qr.begin(), qr.end(), 0.0f);
      for (int64_t h = 0; h < z.H; ++h) {
        for (int64_t d = 0; d < z.Dn; ++d) qn[d * kQuad + h] = q_nope.at(b, t, h)[d];
        for (int64_t r = 0; r < z.R; ++r) qr[r * kQuad + h] = q_pe.at(b, t, h)[r];
      }
      float* o = out + row * z.K;  // [K]
      slot.clear(), key.clear();
      for (int64_t j = 0; j < z.K; ++j) {
        const int64_t s = idx[row * z.K + j];
        o[j] = 0.0f;
        if (s >= 0 && s <= last_visible) slot.push_back(j), key.push_back(s);
      }
      const int64_t n = static_cast<int64_t>(key.size()), pairs = (n + 1) / 2;
      if (n == 0) continue;  // every probability 0 (both normalisers)
      float* sc = scores.data();
      pair_scores(sc, key.data(), n, b * z.S, qn.data(), qr.data(), kn, kr, z.Dn, z.R);
      QuadF norm;  // "causal": lse; "selected": each head's max over the kept keys
      if (selected) {
        for (int64_t p = 0; p < pairs; ++p) store(sc + p * kHeadLanes, load<V>(sc + p * kHeadLanes) * vscale);
        norm = load<QuadF>(sc);
        for (int64_t i = 1; i < n; ++i) {
          const QuadF x = load<QuadF>(sc + i * kQuad);
          norm = x > norm ? x : norm;
        }
      } else {
        norm = QuadF{};
        for (int64_t h = 0; h < z.H; ++h) norm[h] = lse[row * z.H + h];
      }
      for (int64_t p = 0; p < pairs; ++p) {
        const V x = load<V>(sc + p * kHeadLanes);
        store(sc + p * kHeadLanes, exp_heads((selected ? x : x * vscale) - twice(norm)));
      }
      QuadF inv_total = QuadF{} + 1.0f;
      if (selected) {
        QuadF total = QuadF{};
        for (int64_t i = 0; i < n; ++i) total = total + load<QuadF>(sc + i * kQuad);  // key order
        inv_total = 1.0f / total;
      }
      for (int64_t i = 0; i < n; ++i) {
        const QuadF prob = selected ? load<QuadF>(sc + i * kQuad) * inv_total : load<QuadF>(sc + i * kQuad);
        float total = 0.0f;
        for (int64_t h = 0; h < z.H; ++h) total = total + prob[h];  // head order
        o[slot[i]] = total * inv_heads;
      }
    }
  });
}

at::Tensor unit_last_stride(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

at::Tensor selected_attention_target(const at::Tensor& q_nope_in, const at::Tensor& q_pe_in,
                                     const at::Tensor& k_nope_in, const at::Tensor& k_pe_in, const at::Tensor& lse_in,
                                     const at::Tensor& topk_idx, const at::Tensor& start_in, double scale) {
  const char* op = "selected_attention_target";
  const bool selected = lse_in.dim() == 1 && lse_in.size(0) == 0;  // empty lse: normalise over the selected keys
  TORCH_CHECK(q_nope_in.dim() == 4 && q_pe_in.dim() == 4 && k_nope_in.dim() == 4 && k_pe_in.dim() == 3 &&
                  (lse_in.dim() == 3 || selected) && topk_idx.dim() == 3 && start_in.dim() == 1,
              op, ": bad ranks (lse: [B, T, H], or [0] for the selected keys' normaliser)");
  const auto dtype = q_nope_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, op, ": expected fp32 or fp64 inputs");
  TORCH_CHECK(q_pe_in.scalar_type() == dtype && k_nope_in.scalar_type() == dtype && k_pe_in.scalar_type() == dtype &&
                  lse_in.scalar_type() == dtype,
              op, ": q_nope, q_pe, k_nope, k_pe and lse must share one dtype");
  const Sizes z{q_nope_in.size(0), q_nope_in.size(1), q_nope_in.size(2), q_nope_in.size(3), q_pe_in.size(3),
                k_nope_in.size(1), topk_idx.size(2)};
  TORCH_CHECK(q_pe_in.size(0) == z.B && q_pe_in.size(1) == z.T && q_pe_in.size(2) == z.H && k_nope_in.size(0) == z.B &&
                  k_nope_in.size(2) == z.H && k_nope_in.size(3) == z.Dn && k_pe_in.size(0) == z.B &&
                  k_pe_in.size(1) == z.S && k_pe_in.size(2) == z.R &&
                  (selected || (lse_in.size(0) == z.B && lse_in.size(1) == z.T && lse_in.size(2) == z.H)) &&
                  topk_idx.size(0) == z.B && topk_idx.size(1) == z.T &&
                  start_in.size(0) == z.B,
              op, ": shapes disagree");
  TORCH_CHECK(z.H >= 1, op, ": expected at least one head");
  // The kernel reads the selected keys in place: an index past them must not reach it, even when the public op's
  // value checks are off. Negative entries mean "no key".
  auto idx = topk_idx.to(at::kLong).contiguous();
  const int64_t* flat = idx.data_ptr<int64_t>();
  for (int64_t i = 0, n = idx.numel(); i < n; ++i)
    TORCH_CHECK_INDEX(flat[i] < z.S, op, ": topk_idx entry ", flat[i], " is past the keys (S=", z.S, " slots)");
  auto start = start_in.to(at::kLong).contiguous();
  auto lse = lse_in.contiguous();
  auto qn = unit_last_stride(q_nope_in), qr = unit_last_stride(q_pe_in), kn = unit_last_stride(k_nope_in);
  auto kr = unit_last_stride(k_pe_in);
  auto out = at::empty({z.B, z.T, z.K}, qn.options());
  if (dtype == at::kFloat && z.H <= kQuad) {
    target_packed(rows_of<float>(qn), rows_of<float>(qr), rows_of<float>(kn), rows_of<float>(kr),
                  selected ? nullptr : lse.data_ptr<float>(), idx.data_ptr<int64_t>(), start.data_ptr<int64_t>(),
                  static_cast<float>(scale), z, out.data_ptr<float>());
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES(dtype, "selected_attention_target", [&] {
    target_kernel<scalar_t>(rows_of<scalar_t>(qn), rows_of<scalar_t>(qr), rows_of<scalar_t>(kn),
                            rows_of<scalar_t>(kr), selected ? nullptr : lse.data_ptr<scalar_t>(),
                            idx.data_ptr<int64_t>(), start.data_ptr<int64_t>(), static_cast<scalar_t>(scale), z,
                            out.data_ptr<scalar_t>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(glm5_cpu, m) {
  m.def("selected_attention_target(Tensor q_nope, Tensor q_pe, Tensor k_nope, Tensor k_pe, Tensor lse, "
        "Tensor topk_idx, Tensor start, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(glm5_cpu, CPU, m) { m.impl("selected_attention_target", &selected_attention_target); }

}  // namespace glm5
