// Portable SIMD helpers for the CPU kernels (GCC/Clang vector extensions).
//
// The vector width follows the ISA the extension was compiled for (the loader keys its build cache by
// it): 64 bytes with AVX-512, 32 with AVX2, 16 otherwise. Fused multiply-add is explicit (`fmadd`) and
// the extension is compiled with -ffp-contract=off, so every expression rounds exactly as written:
// a kernel's bits depend only on its own loop structure, never on what the compiler chose to fuse.
#pragma once

#include <cmath>
#include <cstdint>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__FMA__)
#include <immintrin.h>
#endif

namespace glm5 {

#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
#elif defined(__AVX2__)
constexpr int kVecBytes = 32;
#else
constexpr int kVecBytes = 16;
#endif

typedef float VecF __attribute__((vector_size(kVecBytes)));
typedef double VecD __attribute__((vector_size(kVecBytes)));

template <typename T> struct Simd;
template <> struct Simd<float> { using V = VecF; static constexpr int width = kVecBytes / 4; };
template <> struct Simd<double> { using V = VecD; static constexpr int width = kVecBytes / 8; };

// a * b + c with one rounding where the ISA has FMA, two otherwise (fixed per build either way).
inline VecF fmadd(VecF a, VecF b, VecF c) {
#if defined(__AVX512F__)
  return (VecF)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__) && defined(__AVX2__)
  return (VecF)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

inline VecD fmadd(VecD a, VecD b, VecD c) {
#if defined(__AVX512F__)
  return (VecD)_mm512_fmadd_pd((__m512d)a, (__m512d)b, (__m512d)c);
#elif defined(__FMA__) && defined(__AVX2__)
  return (VecD)_mm256_fmadd_pd((__m256d)a, (__m256d)b, (__m256d)c);
#else
  return a * b + c;
#endif
}

template <typename V> inline V splat(decltype(V{}[0]) x) { return V{} + x; }

template <typename V> inline V load(const void* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof(V));
  return v;
}

template <typename V> inline void store(void* p, V v) { __builtin_memcpy(p, &v, sizeof(V)); }

template <typename V> inline V relu(V x) { return x > V{} ? x : V{}; }

// Sum of the lanes in a fixed pairwise order (independent of where the vector came from).
template <typename T> inline T hsum(typename Simd<T>::V v) {
  constexpr int W = Simd<T>::width;
  T lanes[W];
  __builtin_memcpy(lanes, &v, sizeof(v));
  for (int half = W / 2; half >= 1; half /= 2)
    for (int i = 0; i < half; ++i) lanes[i] = lanes[i] + lanes[i + half];
  return lanes[0];
}

// sum_i a[i] * b[i]: W lane accumulators over the full vectors, a fixed lane reduction, then the tail.
template <typename T> inline T dot(const T* a, const T* b, int64_t n) {
  using V = typename Simd<T>::V;
  constexpr int W = Simd<T>::width;
  V acc{};
  int64_t i = 0;
  for (; i + W <= n; i += W) acc = fmadd(load<V>(a + i), load<V>(b + i), acc);
  T sum = hsum<T>(acc);
  for (; i < n; ++i) sum = sum + a[i] * b[i];
  return sum;
}

// y[i] += alpha * x[i]
template <typename T> inline void axpy(T alpha, const T* x, T* y, int64_t n) {
  using V = typename Simd<T>::V;
  constexpr int W = Simd<T>::width;
  const V va = splat<V>(alpha);
  int64_t i = 0;
  for (; i + W <= n; i += W) store(y + i, fmadd(va, load<V>(x + i), load<V>(y + i)));
  for (; i < n; ++i) y[i] = y[i] + alpha * x[i];
}

// ---- 8-head vectors (cpu_sparse_expanded.cpp, cpu_selected_attention_target.cpp) ----
//
// A vector of kHeadLanes heads, whatever the build's width: kernels that vectorise over attention heads (head-minor
// copies [X, D, G, kHeadLanes], G = ceil(H / kHeadLanes) zero-padded head groups) make every per-head dot product a
// chain of lane-wise multiply-adds, with no horizontal sum per score. fma_lanes: one rounding where the ISA has an
// FMA of that width, two otherwise (fixed per build).
constexpr int64_t kHeadLanes = 8;
typedef float HeadVecF __attribute__((vector_size(kHeadLanes * sizeof(float))));
typedef double HeadVecD __attribute__((vector_size(kHeadLanes * sizeof(double))));
template <typename T> struct HeadVec;
template <> struct HeadVec<float> { using V = HeadVecF; };
template <> struct HeadVec<double> { using V = HeadVecD; };

inline HeadVecF fma_lanes(HeadVecF a, HeadVecF b, HeadVecF c) {
#if defined(__FMA__) && defined(__AVX2__)
  return (HeadVecF)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

inline HeadVecD fma_lanes(HeadVecD a, HeadVecD b, HeadVecD c) {
#if defined(__AVX512F__)
  return (HeadVecD)_mm512_fmadd_pd((__m512d)a, (__m512d)b, (__m512d)c);
#else
  return a * b + c;
#endif
}

// ---- Indexer kernels' helpers (cpu_indexer_topk.cpp, cpu_selected_index_scores.cpp) ----
//
// broadcast<V>(x): every lane holds x exactly, as one broadcast the compiler folds into an FMA's memory
// operand (splat adds +0 instead: one more instruction, and -0 becomes +0). Where the lanes enter an FMA chain
// that starts at +0 -- every use in the indexer kernels -- the two give the same bits: a zero operand's sign
// can only show in a sum of zeros, and such a chain never holds -0 (in round-to-nearest a sum is -0 only when
// both addends are).
template <typename V> inline V broadcast(decltype(V{}[0]) x) {
  using Mask = decltype(V{} == V{});
  return (Mask{} == Mask{}) ? x : x;  // an all-true select: the scalar goes to every lane, every bit kept
}

// Narrow vectors of 32 bytes (8 floats, 4 doubles) where the build has AVX2, else the build's own width: the
// indexer's 8 heads fill one, and two 32-byte FMAs per cycle run as fast as one 64-byte FMA on AMD Zen 4.
// fmadd rounds as the build's wide fmadd does (one rounding with FMA, two without), so a lane's bits do not
// depend on which of the two widths computed it.
#if defined(__AVX512F__) || defined(__AVX2__)
constexpr int kNarrowBytes = 32;
#else
constexpr int kNarrowBytes = kVecBytes;
#endif
typedef float NarrowF __attribute__((vector_size(kNarrowBytes)));
typedef double NarrowD __attribute__((vector_size(kNarrowBytes)));
template <typename T> struct Narrow;
template <> struct Narrow<float> { using V = NarrowF; static constexpr int width = kNarrowBytes / 4; };
template <> struct Narrow<double> { using V = NarrowD; static constexpr int width = kNarrowBytes / 8; };

#if defined(__AVX512F__)
inline NarrowF fmadd(NarrowF a, NarrowF b, NarrowF c) {
  return (NarrowF)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
inline NarrowD fmadd(NarrowD a, NarrowD b, NarrowD c) {
  return (NarrowD)_mm256_fmadd_pd((__m256d)a, (__m256d)b, (__m256d)c);
}
#endif  // elsewhere NarrowF is VecF and the fmadd above serves both

}  // namespace glm5
