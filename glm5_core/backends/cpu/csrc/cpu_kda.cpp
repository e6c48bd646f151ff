// KDA (Kimi Delta Attention) decode-path kernels for CPU: the recurrent gated delta rule and the short causal conv.
//
// Legend (glm5_core/ops/kda.py): B batch, T tokens, H heads, K key / V value head dims, D conv channels, W conv width.
//
// kda_recurrent: q, k [B, T, H, K] and v [B, T, H, V] (fp32, fp64, bf16 or fp16; the last dim contiguous, the
// others any stride: the model passes slices of one projection), g [B, T, H, K] and beta [B, T, H] in the compute
// dtype (fp32; fp64 for fp64 inputs), initial_state [B, H, K, V] in the compute dtype or undefined (zeros)
// -> (o [B, T, H, V] in q's dtype, final state [B, H, K, V] in the compute dtype). Per (batch row, head), token t:
//   S = diag(exp(g_t)) S;  u = beta_t (v_t - S^T k_t);  S = S + k_t u^T;  o_t = S^T q_t
// (q and k L2-normalised first when asked, q scaled). A column u_v depends only on column v of the state, so the
// state is walked in column blocks of up to kBlockVecs vectors: for a block, one sweep down the K rows reads the
// decayed state and accumulates S^T k, then a second sweep over the same block (still in L1) writes the new rows
// and accumulates S^T q. The decayed state is recomputed in the second sweep (the same product, the same bits)
// rather than stored: the state is read from memory once and written once per token, with no temporary.
// Work items are (batch row, head) pairs and nothing is reduced across them: every sum runs over K in row order
// inside one item, so the result is bitwise the same for any thread count.
//
// kda_causal_conv: x [B, T, D] (any float dtype, the last dim contiguous), weight [D, W], bias [D] or undefined,
// conv_state [B, W - 1, D] or undefined (zeros), all three in the compute dtype -> (out [B, T, D] in x's dtype,
// new state [B, W - 1, D] in the compute dtype: the last W - 1 inputs). out_t = act(bias + sum_w weight[:, w]
// x_{t - W + 1 + w}) with the taps summed in order as the reference does (a product, then an addition: no fused
// multiply-add, so the pre-activation sum is bitwise the reference's); SiLU is x / (1 + exp(-x)) with exp a
// polynomial accurate to ~1 ulp (below). One decode step (kda_causal_conv_update) is the same op at T = 1.
// Work items are blocks of channels of one batch row; every output element is computed by one item alone.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "cpu_simd.h"

namespace glm5 {
namespace {

constexpr int kBlockVecs = 4;           // state columns per block: 4 vectors (64 fp32 with AVX-512)
constexpr int64_t kItemWork = 1 << 14;  // state elements (or conv outputs x taps) per parallel item, at least
constexpr int64_t kMaxHeadDim = 1 << 16;

// ------------------------------------------------------------------------------------------ recurrent
template <typename acc_t, int NV>
inline void state_block(const acc_t* src, acc_t* dst, int64_t V, int64_t K, const acc_t* decay, const acc_t* k,
                        const acc_t* q, const acc_t* v, acc_t beta, acc_t* o, bool zero_src) {
  // Columns [0, NV * width) of this block: src / dst point at the block's first column of row 0.
  using Vec = typename Simd<acc_t>::V;
  constexpr int Wd = Simd<acc_t>::width;
  Vec acc[NV], u[NV];
  for (int j = 0; j < NV; ++j) acc[j] = Vec{};
  if (!zero_src) {
    for (int64_t i = 0; i < K; ++i) {  // S^T k over the decayed rows, in row order
      const Vec d = splat<Vec>(decay[i]), ki = splat<Vec>(k[i]);
      const acc_t* row = src + i * V;
      for (int j = 0; j < NV; ++j) acc[j] = fmadd(ki, load<Vec>(row + j * Wd) * d, acc[j]);
    }
  }
  const Vec b = splat<Vec>(beta);
  for (int j = 0; j < NV; ++j) {
    u[j] = b * (load<Vec>(v + j * Wd) - acc[j]);
    acc[j] = Vec{};
  }
  for (int64_t i = 0; i < K; ++i) {  // the new rows, and S^T q over them
    const Vec d = splat<Vec>(decay[i]), ki = splat<Vec>(k[i]), qi = splat<Vec>(q[i]);
    const acc_t* row = src + i * V;
    acc_t* out = dst + i * V;
    for (int j = 0; j < NV; ++j) {
      const Vec decayed = zero_src ? Vec{} : load<Vec>(row + j * Wd) * d;
      const Vec fresh = fmadd(ki, u[j], decayed);
      store(out + j * Wd, fresh);
      acc[j] = fmadd(qi, fresh, acc[j]);
    }
  }
  for (int j = 0; j < NV; ++j) store(o + j * Wd, acc[j]);
}

template <typename acc_t>
inline acc_t fma_scalar(acc_t a, acc_t b, acc_t c) {
#if defined(__FMA__) || defined(__AVX512F__)
  return std::fma(a, b, c);  // as the vector fmadd rounds (one rounding where the ISA has FMA)
#else
  return a * b + c;
#endif
}

template <typename acc_t>
inline void state_column(const acc_t* src, acc_t* dst, int64_t V, int64_t K, const acc_t* decay, const acc_t* k,
                         const acc_t* q, acc_t v, acc_t beta, acc_t* o, bool zero_src) {
  acc_t acc = 0;
  if (!zero_src)
    for (int64_t i = 0; i < K; ++i) acc = fma_scalar(k[i], src[i * V] * decay[i], acc);
  const acc_t u = beta * (v - acc);
  acc = 0;
  for (int64_t i = 0; i < K; ++i) {
    const acc_t fresh = fma_scalar(k[i], u, zero_src ? acc_t(0) : src[i * V] * decay[i]);
    dst[i * V] = fresh;
    acc = fma_scalar(q[i], fresh, acc);
  }
  *o = acc;
}

// x / sqrt(sum x^2 + eps), summed in index order (the l2norm of glm5_core/ops/kda.py).
template <typename in_t, typename acc_t>
inline void load_vector(const in_t* src, int64_t n, bool normalise, acc_t scale, acc_t* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<acc_t>(src[i]);
  if (normalise) {
    acc_t ss = 0;
    for (int64_t i = 0; i < n; ++i) ss = ss + dst[i] * dst[i];
    const acc_t norm = std::sqrt(ss + acc_t(1e-6));
    for (int64_t i = 0; i < n; ++i) dst[i] = dst[i] / norm;
  }
  if (scale != acc_t(1))
    for (int64_t i = 0; i < n; ++i) dst[i] = dst[i] * scale;
}

template <typename in_t, typename acc_t>
void recurrent_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                      const at::Tensor& beta, const acc_t* init, acc_t scale, bool l2norm, at::Tensor& o,
                      acc_t* state) {
  const int64_t B = k.size(0), T = k.size(1), H = k.size(2), K = k.size(3), V = v.size(3);
  const in_t *qp = q.data_ptr<in_t>(), *kp = k.data_ptr<in_t>(), *vp = v.data_ptr<in_t>();
  const acc_t *gp = g.data_ptr<acc_t>(), *bp = beta.data_ptr<acc_t>();
  in_t* op = o.data_ptr<in_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const int64_t gs0 = g.stride(0), gs1 = g.stride(1), gs2 = g.stride(2);
  const int64_t bs0 = beta.stride(0), bs1 = beta.stride(1), bs2 = beta.stride(2);
  constexpr int Wd = Simd<acc_t>::width;
  const int64_t grain = std::max<int64_t>(1, kItemWork / std::max<int64_t>(1, K * V * std::max<int64_t>(1, T)));
  at::parallel_for(0, B * H, grain, [&](int64_t begin, int64_t end) {
    // per-chunk scratch: q, k, decay [K]; v, o [V] in acc_t (no allocation inside a (b, h) item)
    std::vector<acc_t> scratch(3 * K + 2 * V);
    acc_t *qv = scratch.data(), *kv = qv + K, *dv = kv + K, *vv = dv + K, *ov = vv + V;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / H, h = item % H;
      acc_t* S = state + item * K * V;
      for (int64_t t = 0; t < T; ++t) {
        const bool first = t == 0;
        const acc_t* src = first ? init + (init ? item * K * V : 0) : S;
        const bool zero_src = first && init == nullptr;
        load_vector<in_t, acc_t>(qp + b * qs0 + t * qs1 + h * qs2, K, l2norm, scale, qv);
        load_vector<in_t, acc_t>(kp + b * ks0 + t * ks1 + h * ks2, K, l2norm, acc_t(1), kv);
        const in_t* vrow = vp + b * vs0 + t * vs1 + h * vs2;
        for (int64_t c = 0; c < V; ++c) vv[c] = static_cast<acc_t>(vrow[c]);
        const acc_t* grow = gp + b * gs0 + t * gs1 + h * gs2;
        for (int64_t i = 0; i < K; ++i) dv[i] = std::exp(grow[i]);
        const acc_t bt = bp[b * bs0 + t * bs1 + h * bs2];
        int64_t c = 0;
        for (; c + kBlockVecs * Wd <= V; c += kBlockVecs * Wd)
          state_block<acc_t, kBlockVecs>(src + c, S + c, V, K, dv, kv, qv, vv + c, bt, ov + c, zero_src);
        for (; c + Wd <= V; c += Wd)
          state_block<acc_t, 1>(src + c, S + c, V, K, dv, kv, qv, vv + c, bt, ov + c, zero_src);
        for (; c < V; ++c) state_column<acc_t>(src + c, S + c, V, K, dv, kv, qv, vv[c], bt, ov + c, zero_src);
        in_t* orow = op + ((b * T + t) * H + h) * V;
        for (int64_t j = 0; j < V; ++j) orow[j] = static_cast<in_t>(ov[j]);
      }
      if (T == 0) {  // no token: the state passes through
        for (int64_t e = 0; e < K * V; ++e) S[e] = init ? init[item * K * V + e] : acc_t(0);
      }
    }
  });
}

void check_rows(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.dim() == dims, "kda_recurrent: ", name, " must have ", dims, " dims, got ", t.dim());
}

std::tuple<at::Tensor, at::Tensor> kda_recurrent(const at::Tensor& q_in, const at::Tensor& k_in,
                                                 const at::Tensor& v_in, const at::Tensor& g_in,
                                                 const at::Tensor& beta_in, const c10::optional<at::Tensor>& initial,
                                                 double scale, bool use_qk_l2norm) {
  auto last_contig = [](const at::Tensor& t) { return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous(); };
  const at::Tensor q = last_contig(q_in), k = last_contig(k_in), v = last_contig(v_in), g = last_contig(g_in);
  const at::Tensor& beta = beta_in;
  check_rows(q, "q", 4);
  check_rows(k, "k", 4);
  check_rows(v, "v", 4);
  check_rows(g, "g", 4);
  check_rows(beta, "beta", 3);
  const int64_t B = k.size(0), T = k.size(1), H = k.size(2), K = k.size(3), V = v.size(3);
  TORCH_CHECK(q.sizes() == k.sizes() && g.sizes() == k.sizes(), "kda_recurrent: q, k, g must be [B, T, H, K]");
  TORCH_CHECK(v.size(0) == B && v.size(1) == T && v.size(2) == H, "kda_recurrent: v must be [B, T, H, V]");
  TORCH_CHECK(beta.size(0) == B && beta.size(1) == T && beta.size(2) == H, "kda_recurrent: beta must be [B, T, H]");
  TORCH_CHECK(K <= kMaxHeadDim && V <= kMaxHeadDim, "kda_recurrent: head dims too large");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && v.scalar_type() == k.scalar_type(),
              "kda_recurrent: q, k, v dtypes differ");
  const at::ScalarType ct = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(g.scalar_type() == ct && beta.scalar_type() == ct, "kda_recurrent: g and beta must be in the "
              "compute dtype ", ct);
  at::Tensor init;
  if (initial.has_value() && initial->defined()) {
    init = initial->contiguous();
    TORCH_CHECK(init.scalar_type() == ct && init.dim() == 4 && init.size(0) == B && init.size(1) == H &&
                    init.size(2) == K && init.size(3) == V,
                "kda_recurrent: initial_state must be [B, H, K, V] in ", ct);
  }
  at::Tensor o = at::empty({B, T, H, V}, q.options());
  at::Tensor state = at::empty({B, H, K, V}, q.options().dtype(ct));
  if (ct == at::kDouble) {
    recurrent_kernel<double, double>(q, k, v, g, beta, init.defined() ? init.data_ptr<double>() : nullptr, scale,
                                     use_qk_l2norm, o, state.data_ptr<double>());
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "kda_recurrent", [&] {
      recurrent_kernel<scalar_t, float>(q, k, v, g, beta, init.defined() ? init.data_ptr<float>() : nullptr,
                                        static_cast<float>(scale), use_qk_l2norm, o, state.data_ptr<float>());
    });
  }
  return {o, state};
}

// ------------------------------------------------------------------------------------------ causal conv
// exp(x) for x in [-87.3, 88] (clamped outside, so 2^n stays a normal number: n in [-126, 127]): x = n ln2 + r,
// |r| <= ln2 / 2 (Cody-Waite split of ln2), exp(r) by its degree-7 Taylor polynomial (Horner), 2^n by the exponent
// bits. Branch-free, so the channel loop vectorises; relative error a few fp32 ulp (fp64 uses std::exp).
inline float exp_poly(float x) {
  x = std::min(std::max(x, -87.3f), 88.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;  // ln2 high part (exact product)
  r = r - n * -2.12194440e-4f;     // ln2 low part
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  __builtin_memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}

template <typename acc_t> inline acc_t silu(acc_t x);
template <> inline float silu<float>(float x) { return x / (1.0f + exp_poly(-x)); }
template <> inline double silu<double>(double x) { return x / (1.0 + std::exp(-x)); }

template <typename in_t, typename acc_t, int W>
void conv_rows(const in_t* x, int64_t xs_t, const acc_t* state, const acc_t* weight, int64_t Wr, const acc_t* bias,
               bool act, in_t* out, int64_t T, int64_t D, int64_t d0, int64_t d1, acc_t* wt) {
  // wt: this block's taps transposed to [W][d1 - d0] (channels contiguous per tap)
  const int64_t n = d1 - d0;
  for (int64_t d = 0; d < n; ++d)
    for (int w = 0; w < W; ++w) wt[w * n + d] = weight[(d0 + d) * Wr + w];
  for (int64_t t = 0; t < T; ++t) {
    in_t* dst = out + t * D + d0;
    // input row of tap w is position t - W + 1 + w: from the state when negative
    acc_t acc_buf[256];
    for (int64_t c0 = 0; c0 < n; c0 += 256) {
      const int64_t m = std::min<int64_t>(256, n - c0);
      for (int w = 0; w < W; ++w) {
        const int64_t pos = t - W + 1 + w;
        const acc_t* wv = wt + w * n + c0;
        if (pos < 0) {
          const acc_t* s = state ? state + (pos + W - 1) * D + d0 + c0 : nullptr;
#pragma omp simd
          for (int64_t d = 0; d < m; ++d) {
            const acc_t prod = (s ? s[d] : acc_t(0)) * wv[d];
            acc_buf[d] = w == 0 ? prod : acc_buf[d] + prod;
          }
        } else {
          const in_t* xr = x + pos * xs_t + d0 + c0;
#pragma omp simd
          for (int64_t d = 0; d < m; ++d) {
            const acc_t prod = static_cast<acc_t>(xr[d]) * wv[d];
            acc_buf[d] = w == 0 ? prod : acc_buf[d] + prod;
          }
        }
      }
      if (bias) {
        const acc_t* bv = bias + d0 + c0;
#pragma omp simd
        for (int64_t d = 0; d < m; ++d) acc_buf[d] = acc_buf[d] + bv[d];
      }
      if (act) {
#pragma omp simd
        for (int64_t d = 0; d < m; ++d) dst[c0 + d] = static_cast<in_t>(silu<acc_t>(acc_buf[d]));
      } else {
        for (int64_t d = 0; d < m; ++d) dst[c0 + d] = static_cast<in_t>(acc_buf[d]);
      }
    }
  }
}

template <typename in_t, typename acc_t>
void conv_kernel(const at::Tensor& x, const acc_t* weight, int64_t W, const acc_t* bias, const acc_t* state,
                 bool act, at::Tensor& out, acc_t* new_state) {
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  const int64_t xs_b = x.stride(0), xs_t = x.stride(1);
  const in_t* xp = x.data_ptr<in_t>();
  in_t* op = out.data_ptr<in_t>();
  constexpr int64_t kChannelBlock = 512;
  const int64_t blocks = (D + kChannelBlock - 1) / kChannelBlock;
  const int64_t work = std::max<int64_t>(1, std::min<int64_t>(D, kChannelBlock) * std::max<int64_t>(1, T) * W);
  at::parallel_for(0, B * blocks, std::max<int64_t>(1, kItemWork / work), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> wt(W * kChannelBlock);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / blocks, d0 = (item % blocks) * kChannelBlock, d1 = std::min(D, d0 + kChannelBlock);
      const in_t* xb = xp + b * xs_b;
      const acc_t* sb = state ? state + b * (W - 1) * D : nullptr;
      in_t* ob = op + b * T * D;
      switch (W) {
#define GLM5_CONV_CASE(WW) \
  case WW: conv_rows<in_t, acc_t, WW>(xb, xs_t, sb, weight, W, bias, act, ob, T, D, d0, d1, wt.data()); break;
        GLM5_CONV_CASE(1)
        GLM5_CONV_CASE(2)
        GLM5_CONV_CASE(3)
        GLM5_CONV_CASE(4)
        GLM5_CONV_CASE(5)
        GLM5_CONV_CASE(6)
        GLM5_CONV_CASE(7)
        GLM5_CONV_CASE(8)
#undef GLM5_CONV_CASE
        default: TORCH_CHECK(false, "kda_causal_conv: conv width ", W, " > 8 is not supported natively");
      }
      // the new state: rows W - 1 back from the end of cat(state, x), channels [d0, d1)
      acc_t* ns = new_state + b * (W - 1) * D;
      for (int64_t r = 0; r < W - 1; ++r) {
        const int64_t pos = T - (W - 1) + r;  // position in x; negative: in the old state
        acc_t* dst = ns + r * D;
        if (pos >= 0) {
          const in_t* xr = xb + pos * xs_t;
          for (int64_t d = d0; d < d1; ++d) dst[d] = static_cast<acc_t>(xr[d]);
        } else if (sb) {
          const acc_t* sr = sb + (pos + W - 1) * D;
          for (int64_t d = d0; d < d1; ++d) dst[d] = sr[d];
        } else {
          for (int64_t d = d0; d < d1; ++d) dst[d] = acc_t(0);
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> kda_causal_conv(const at::Tensor& x_in, const at::Tensor& weight_in,
                                                   const c10::optional<at::Tensor>& bias_in,
                                                   const c10::optional<at::Tensor>& state_in, bool silu_act) {
  const at::Tensor x = x_in.size(-1) <= 1 || x_in.stride(-1) == 1 ? x_in : x_in.contiguous();
  TORCH_CHECK(x.dim() == 3, "kda_causal_conv: x must be [B, T, D]");
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  const at::ScalarType ct = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor weight = weight_in.contiguous();
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == D && weight.size(1) >= 1 && weight.scalar_type() == ct,
              "kda_causal_conv: weight must be [D, W] in ", ct);
  const int64_t W = weight.size(1);
  at::Tensor bias, state;
  if (bias_in.has_value() && bias_in->defined()) {
    bias = bias_in->contiguous();
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == D && bias.scalar_type() == ct,
                "kda_causal_conv: bias must be [D] in ", ct);
  }
  if (state_in.has_value() && state_in->defined()) {
    state = state_in->contiguous();
    TORCH_CHECK(state.dim() == 3 && state.size(0) == B && state.size(1) == W - 1 && state.size(2) == D &&
                    state.scalar_type() == ct,
                "kda_causal_conv: conv_state must be [B, W - 1, D] in ", ct);
  }
  at::Tensor out = at::empty({B, T, D}, x.options());
  at::Tensor new_state = at::empty({B, W - 1, D}, x.options().dtype(ct));
  if (ct == at::kDouble) {
    conv_kernel<double, double>(x, weight.data_ptr<double>(), W, bias.defined() ? bias.data_ptr<double>() : nullptr,
                                state.defined() ? state.data_ptr<double>() : nullptr, silu_act, out,
                                new_state.data_ptr<double>());
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "kda_causal_conv", [&] {
      conv_kernel<scalar_t, float>(x, weight.data_ptr<float>(), W, bias.defined() ? bias.data_ptr<float>() : nullptr,
                                   state.defined() ? state.data_ptr<float>() : nullptr, silu_act, out,
                                   new_state.data_ptr<float>());
    });
  }
  return {out, new_state};
}

// ------------------------------------------------------------------------------------------ causal conv backward
// The gradients of kda_causal_conv's (out, new state) with respect to (x, weight, bias, conv_state). Per channel:
// the pre-activation a_t is recomputed exactly as the forward computes it, da_t = dout_t silu'(a_t) with
// silu'(a) = s (1 + a (1 - s)), s = 1 / (1 + exp(-a)) (autograd's form), then over the padded input
// full = cat(conv_state, x) (W - 1 + T positions): d full_p = sum_w weight_w da_{p - w} (taps in order) plus, for
// the last W - 1 positions, the gradient of the new state; d weight_w = sum_{b, t} full_{t + w} da_t and
// d bias = sum_{b, t} da_t, summed over b then t. Work items are blocks of channels covering every batch row and
// token, so each sum has one fixed order whatever the thread count.
template <typename acc_t> inline acc_t exp_acc(acc_t x);
template <> inline float exp_acc<float>(float x) { return exp_poly(x); }
template <> inline double exp_acc<double>(double x) { return std::exp(x); }

template <typename in_t, typename acc_t>
void conv_backward_kernel(const at::Tensor& gout, const at::Tensor& x, const acc_t* weight, int64_t W,
                          const acc_t* bias, const acc_t* state, const acc_t* gstate, bool act, at::Tensor& dx,
                          acc_t* dweight, acc_t* dbias, acc_t* dstate) {
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  const in_t *xp = x.data_ptr<in_t>(), *gp = gout.data_ptr<in_t>();
  in_t* dxp = dx.data_ptr<in_t>();
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (D + kBlock - 1) / kBlock, P = T + W - 1;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    // per block of channels: the padded input and da as [position][kBlock] in acc_t, the taps [W][kBlock],
    // the weight / bias gradient accumulators [W][kBlock], [kBlock]
    std::vector<acc_t> full(P * kBlock), da(std::max<int64_t>(1, T) * kBlock), wt(W * kBlock), dw(W * kBlock),
        db(kBlock), sum(kBlock);
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t d0 = blk * kBlock, n = std::min(D, d0 + kBlock) - d0;
      for (int64_t w = 0; w < W; ++w)
        for (int64_t d = 0; d < n; ++d) wt[w * kBlock + d] = weight[(d0 + d) * W + w];
      std::fill(dw.begin(), dw.end(), acc_t(0));
      std::fill(db.begin(), db.end(), acc_t(0));
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t p = 0; p < P; ++p) {  // full = cat(conv_state, x), this block's channels
          acc_t* dst = full.data() + p * kBlock;
          if (p >= W - 1) {
            const in_t* xr = xp + (b * T + p - (W - 1)) * D + d0;
            for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<acc_t>(xr[d]);
          } else if (state) {
            const acc_t* sr = state + (b * (W - 1) + p) * D + d0;
            for (int64_t d = 0; d < n; ++d) dst[d] = sr[d];
          } else {
            for (int64_t d = 0; d < n; ++d) dst[d] = acc_t(0);
          }
        }
        for (int64_t t = 0; t < T; ++t) {  // da_t, and the weight / bias gradients in (b, t) order
          acc_t* __restrict__ dat = da.data() + t * kBlock;
          acc_t* __restrict__ a = sum.data();
          const acc_t* f0 = full.data() + t * kBlock;
#pragma omp simd
          for (int64_t d = 0; d < n; ++d) a[d] = f0[d] * wt[d];
          for (int64_t w = 1; w < W; ++w) {
            const acc_t* fw = full.data() + (t + w) * kBlock;
            const acc_t* ww = wt.data() + w * kBlock;
#pragma omp simd
            for (int64_t d = 0; d < n; ++d) a[d] = a[d] + fw[d] * ww[d];
          }
          if (bias) {
#pragma omp simd
            for (int64_t d = 0; d < n; ++d) a[d] = a[d] + bias[d0 + d];
          }
          const in_t* gr = gp + (b * T + t) * D + d0;
          if (act) {
#pragma omp simd
            for (int64_t d = 0; d < n; ++d) {
              const acc_t sg = acc_t(1) / (acc_t(1) + exp_acc<acc_t>(-a[d]));
              dat[d] = static_cast<acc_t>(gr[d]) * (sg * (acc_t(1) + a[d] * (acc_t(1) - sg)));
            }
          } else {
            for (int64_t d = 0; d < n; ++d) dat[d] = static_cast<acc_t>(gr[d]);
          }
          acc_t* __restrict__ dbv = db.data();
#pragma omp simd
          for (int64_t d = 0; d < n; ++d) dbv[d] = dbv[d] + dat[d];
          for (int64_t w = 0; w < W; ++w) {
            const acc_t* fw = full.data() + (t + w) * kBlock;
            acc_t* __restrict__ dww = dw.data() + w * kBlock;
#pragma omp simd
            for (int64_t d = 0; d < n; ++d) dww[d] = dww[d] + fw[d] * dat[d];
          }
        }
        for (int64_t p = 0; p < P; ++p) {  // d full_p: into dx, or the old state's gradient
          acc_t* __restrict__ g = sum.data();
          for (int64_t d = 0; d < n; ++d) g[d] = acc_t(0);
          for (int64_t w = 0; w < W; ++w) {
            const int64_t t = p - w;
            if (t < 0 || t >= T) continue;
            const acc_t* dat = da.data() + t * kBlock;
            const acc_t* ww = wt.data() + w * kBlock;
#pragma omp simd
            for (int64_t d = 0; d < n; ++d) g[d] = g[d] + ww[d] * dat[d];
          }
          if (p >= T && gstate) {
            const acc_t* gs = gstate + (b * (W - 1) + (p - T)) * D + d0;
            for (int64_t d = 0; d < n; ++d) g[d] = g[d] + gs[d];
          }
          if (p >= W - 1) {
            in_t* dr = dxp + (b * T + p - (W - 1)) * D + d0;
            for (int64_t d = 0; d < n; ++d) dr[d] = static_cast<in_t>(g[d]);
          } else if (dstate) {
            acc_t* dr = dstate + (b * (W - 1) + p) * D + d0;
            for (int64_t d = 0; d < n; ++d) dr[d] = g[d];
          }
        }
      }
      for (int64_t d = 0; d < n; ++d)
        for (int64_t w = 0; w < W; ++w) dweight[(d0 + d) * W + w] = dw[w * kBlock + d];
      if (dbias)
        for (int64_t d = 0; d < n; ++d) dbias[d0 + d] = db[d];
    }
  });
}

// -> (d x [B, T, D] in x's dtype, d weight [D, W], d bias [D] (empty when bias is undefined), d conv_state
// [B, W - 1, D] (empty when conv_state is undefined)), the last three in the compute dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> kda_causal_conv_backward(
    const at::Tensor& grad_out_in, const c10::optional<at::Tensor>& grad_state_in, const at::Tensor& x_in,
    const at::Tensor& weight_in, const c10::optional<at::Tensor>& bias_in, const c10::optional<at::Tensor>& state_in,
    bool silu_act) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 3, "kda_causal_conv_backward: x must be [B, T, D]");
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  const at::Tensor gout = grad_out_in.to(x.scalar_type()).contiguous();
  TORCH_CHECK(gout.sizes() == x.sizes(), "kda_causal_conv_backward: grad_out must be [B, T, D]");
  const at::ScalarType ct = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor weight = weight_in.contiguous();
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == D && weight.size(1) >= 1 && weight.scalar_type() == ct,
              "kda_causal_conv_backward: weight must be [D, W] in ", ct);
  const int64_t W = weight.size(1);
  at::Tensor bias, state, gstate;
  if (bias_in.has_value() && bias_in->defined()) {
    bias = bias_in->contiguous();
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == D && bias.scalar_type() == ct,
                "kda_causal_conv_backward: bias must be [D] in ", ct);
  }
  auto check_state = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.dim() == 3 && t.size(0) == B && t.size(1) == W - 1 && t.size(2) == D && t.scalar_type() == ct,
                "kda_causal_conv_backward: ", name, " must be [B, W - 1, D] in ", ct);
  };
  if (state_in.has_value() && state_in->defined()) {
    state = state_in->contiguous();
    check_state(state, "conv_state");
  }
  if (grad_state_in.has_value() && grad_state_in->defined()) {
    gstate = grad_state_in->to(ct).contiguous();
    check_state(gstate, "grad_state");
  }
  at::Tensor dx = at::empty({B, T, D}, x.options());
  at::Tensor dweight = at::empty({D, W}, weight.options());
  at::Tensor dbias = bias.defined() ? at::empty({D}, weight.options()) : at::empty({0}, weight.options());
  at::Tensor dstate = state.defined() ? at::empty({B, W - 1, D}, weight.options()) : at::empty({0}, weight.options());
  if (ct == at::kDouble) {
    conv_backward_kernel<double, double>(
        gout, x, weight.data_ptr<double>(), W, bias.defined() ? bias.data_ptr<double>() : nullptr,
        state.defined() ? state.data_ptr<double>() : nullptr, gstate.defined() ? gstate.data_ptr<double>() : nullptr,
        silu_act, dx, dweight.data_ptr<double>(), bias.defined() ? dbias.data_ptr<double>() : nullptr,
        state.defined() ? dstate.data_ptr<double>() : nullptr);
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "kda_causal_conv_backward", [&] {
      conv_backward_kernel<scalar_t, float>(
          gout, x, weight.data_ptr<float>(), W, bias.defined() ? bias.data_ptr<float>() : nullptr,
          state.defined() ? state.data_ptr<float>() : nullptr, gstate.defined() ? gstate.data_ptr<float>() : nullptr,
          silu_act, dx, dweight.data_ptr<float>(), bias.defined() ? dbias.data_ptr<float>() : nullptr,
          state.defined() ? dstate.data_ptr<float>() : nullptr);
    });
  }
  return {dx, dweight, dbias, dstate};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(glm5_cpu, m) {
  m.def("kda_recurrent(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? initial_state, float scale, "
        "bool use_qk_l2norm) -> (Tensor, Tensor)");
  m.def("kda_causal_conv(Tensor x, Tensor weight, Tensor? bias, Tensor? conv_state, bool silu) -> (Tensor, Tensor)");
  m.def("kda_causal_conv_backward(Tensor grad_out, Tensor? grad_state, Tensor x, Tensor weight, Tensor? bias, "
        "Tensor? conv_state, bool silu) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(glm5_cpu, CPU, m) {
  m.impl("kda_recurrent", &kda_recurrent);
  m.impl("kda_causal_conv", &kda_causal_conv);
  m.impl("kda_causal_conv_backward", &kda_causal_conv_backward);
}

}  // namespace glm5
