// Fused streaming DSA indexer top-k for CPU.
//
// Legend: B batch, T queries, S key slots, H indexer heads, D head dim, K top-k width.
//   q [B, T, H, D], k [B, S, D], w [B, T, H] (fp32 or fp64), start [B] int64 -> idx [B, T, K] int32.
//
// I[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s]) is never materialised beyond one key block:
// the keys of each batch row are packed once (zero-padded panels of NR keys, [D][NR] each), a register
// tile of MR heads x NR keys runs the dot products, the ReLU-weighted head sum is folded in as the tile
// leaves the registers, and each query keeps a running top-k of its visible keys. The selection compares
// one integer per candidate (rank_key: the score's bits made orderable, then the index), and a key block's
// scores are screened against the running threshold a vector at a time before any of them is pushed.
//
// Determinism by construction: every score is computed by the same instruction sequence whatever T, B,
// the query grouping, the key segmentation or the thread count -- one vector lane per key, dot products
// accumulated over d = 0..D-1 with explicit FMA, heads folded in the order h = 0..H-1 (mul, then add).
// The top-k is a total order (score descending, then key index ascending), so merging partial top-ks
// of key segments selects the same keys however the keys were split. Hence prefill (all queries) and
// decode (one query against the cache) pick bit-identical indices for the same query row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_simd.h"

namespace glm5 {
namespace {

constexpr int64_t kKeyBlock = 256;    // keys packed (and scored) together
constexpr int64_t kQueryGroup = 8;    // queries sharing one packed key block
constexpr int kTileVecs = 2;          // NR = kTileVecs vectors of keys per register tile
constexpr int kMaxTileHeads = kVecBytes == 64 ? 8 : 4;  // MR (register budget: MR*NV + NV accumulators)

// A candidate as one unsigned integer that orders like the contract (score descending, then index ascending):
// a larger key ranks first. High part: the score's bits made orderable (-0 counted as +0, which it equals);
// low 32 bits: UINT32_MAX - index. fp64 scores need 96 bits: unsigned __int128.
template <typename T> struct RankKey;
template <> struct RankKey<float> {
  using type = uint64_t;
  static type make(float score, int32_t index) {
    uint32_t bits;
    const float canonical = score + 0.0f;  // -0 -> +0
    std::memcpy(&bits, &canonical, sizeof(bits));
    bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    return (static_cast<type>(bits) << 32) | (UINT32_MAX - static_cast<uint32_t>(index));
  }
};
template <> struct RankKey<double> {
  using type = unsigned __int128;
  static type make(double score, int32_t index) {
    uint64_t bits;
    const double canonical = score + 0.0;  // -0 -> +0
    std::memcpy(&bits, &canonical, sizeof(bits));
    bits = (bits >> 63) ? ~bits : (bits | (uint64_t(1) << 63));
    return (static_cast<type>(bits) << 32) | (UINT32_MAX - static_cast<uint32_t>(index));
  }
};

template <typename Key> inline int32_t index_of(Key key) {
  return static_cast<int32_t>(UINT32_MAX - static_cast<uint32_t>(key));
}

// Running top-k of one query over keys that arrive in increasing index order.
template <typename T> class RunningTopK {
 public:
  using Key = typename RankKey<T>::type;
  RunningTopK(int64_t k, int64_t slack) : k_(k), capacity_(k + slack) { kept_.reserve(capacity_); }

  // Scores below this one cannot enter (a later key that only ties the k-th best loses to it: ties go to the
  // lower index); -inf lets every score through until k are kept (the screen also needs > itself, below).
  T threshold() const { return full_ ? threshold_ : -std::numeric_limits<T>::infinity(); }
  bool full() const { return full_; }

  void push(T score, int32_t index) {
    if (full_ && !(score > threshold_)) return;
    kept_.push_back(RankKey<T>::make(score, index));
    if (static_cast<int64_t>(kept_.size()) >= capacity_) shrink();
  }

  std::vector<Key>& finish() {
    shrink();
    return kept_;
  }

 private:
  void shrink() {
    if (static_cast<int64_t>(kept_.size()) < k_) return;
    std::nth_element(kept_.begin(), kept_.begin() + (k_ - 1), kept_.end(), std::greater<Key>());
    kept_.resize(k_);
    const Key kth = kept_[k_ - 1];  // the k-th best: every kept score is >= its score
    kth_score_from_key(kth);
    full_ = true;
  }

  void kth_score_from_key(Key kth) {
    // Undo RankKey's bit map for the score part.
    if constexpr (sizeof(T) == 4) {
      uint32_t bits = static_cast<uint32_t>(kth >> 32);
      bits = (bits & 0x80000000u) ? (bits & 0x7fffffffu) : ~bits;
      std::memcpy(&threshold_, &bits, sizeof(bits));
    } else {
      uint64_t bits = static_cast<uint64_t>(kth >> 32);
      bits = (bits >> 63) ? (bits & ~(uint64_t(1) << 63)) : ~bits;
      std::memcpy(&threshold_, &bits, sizeof(bits));
    }
  }

  int64_t k_, capacity_;
  std::vector<Key> kept_;
  T threshold_ = T(0);
  bool full_ = false;
};

// Bit l set where lane l of scores[0, W) is above the threshold (or NaN: nan_bits), W <= 64.
template <typename T> inline uint64_t lanes_above(const T* scores, T threshold, uint64_t& nan_bits) {
  using V = typename Simd<T>::V;
  constexpr int W = Simd<T>::width;
  const V v = load<V>(scores);
#if defined(__AVX512F__)
  if constexpr (sizeof(T) == 4) {
    nan_bits = _mm512_cmp_ps_mask((__m512)v, (__m512)v, _CMP_UNORD_Q);
    return _mm512_cmp_ps_mask((__m512)v, _mm512_set1_ps(threshold), _CMP_GT_OQ);
  } else {
    nan_bits = _mm512_cmp_pd_mask((__m512d)v, (__m512d)v, _CMP_UNORD_Q);
    return _mm512_cmp_pd_mask((__m512d)v, _mm512_set1_pd(threshold), _CMP_GT_OQ);
  }
#else
  const auto is_nan = v != v;
  const auto above = v > broadcast<V>(threshold);
  uint64_t bits = 0, nans = 0;
  for (int l = 0; l < W; ++l) {
    bits |= static_cast<uint64_t>(above[l] != 0) << l;
    nans |= static_cast<uint64_t>(is_nan[l] != 0) << l;
  }
  nan_bits = nans;
  return bits;
#endif
}

// Pushes the visible scores [0, n) of one block (key indices first + i) into top, screening a vector at a time:
// only lanes above the running threshold are pushed, in index order (push re-checks against the threshold it has
// then; until k are kept every lane goes in). Returns whether a score was NaN.
template <typename T> bool push_block(RunningTopK<T>& top, const T* scores, int64_t n, int64_t first) {
  constexpr int W = Simd<T>::width;
  bool nan = false;
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    uint64_t nan_bits = 0;
    uint64_t push = lanes_above<T>(scores + i, top.threshold(), nan_bits);
    nan |= nan_bits != 0;
    if (!top.full()) push = W == 64 ? ~uint64_t(0) : (uint64_t(1) << W) - 1;
    while (push) {
      const int l = __builtin_ctzll(push);
      push &= push - 1;
      top.push(scores[i + l], static_cast<int32_t>(first + i + l));
    }
  }
  for (; i < n; ++i) {
    nan |= scores[i] != scores[i];
    top.push(scores[i], static_cast<int32_t>(first + i));
  }
  return nan;
}

// Dot products of MR query heads with the NR keys of one packed panel, folded into the scores.
//   q_MD: MR head rows (stride D); panel_DN: [D][NR]; w_M: the heads' weights; score_N: NV vectors.
template <typename T, int MR>
inline void score_tile(const T* q_MD, int64_t D, const T* panel_DN, const T* w_M,
                       typename Simd<T>::V (&score_N)[kTileVecs]) {
  using V = typename Simd<T>::V;
  constexpr int W = Simd<T>::width;
  V acc[MR][kTileVecs];
  for (int h = 0; h < MR; ++h)
    for (int v = 0; v < kTileVecs; ++v) acc[h][v] = V{};
  for (int64_t d = 0; d < D; ++d) {
    V keys[kTileVecs];
    for (int v = 0; v < kTileVecs; ++v) keys[v] = load<V>(panel_DN + d * (kTileVecs * W) + v * W);
    for (int h = 0; h < MR; ++h) {
      const V qd = broadcast<V>(q_MD[h * D + d]);
      for (int v = 0; v < kTileVecs; ++v) acc[h][v] = fmadd(qd, keys[v], acc[h][v]);
    }
  }
  for (int h = 0; h < MR; ++h) {
    const V wh = broadcast<V>(w_M[h]);
    for (int v = 0; v < kTileVecs; ++v) score_N[v] = score_N[v] + wh * relu(acc[h][v]);
  }
}

template <typename T>
inline void score_heads(const T* q_HD, int64_t H, int64_t D, const T* panel_DN, const T* w_H,
                        typename Simd<T>::V (&score_N)[kTileVecs]) {
  int64_t h = 0;
  for (; h + kMaxTileHeads <= H; h += kMaxTileHeads)
    score_tile<T, kMaxTileHeads>(q_HD + h * D, D, panel_DN, w_H + h, score_N);
  switch (H - h) {  // remaining heads, still folded in head order
    case 0: break;
    case 1: score_tile<T, 1>(q_HD + h * D, D, panel_DN, w_H + h, score_N); break;
    case 2: score_tile<T, 2>(q_HD + h * D, D, panel_DN, w_H + h, score_N); break;
    case 3: score_tile<T, 3>(q_HD + h * D, D, panel_DN, w_H + h, score_N); break;
#if defined(__AVX512F__)
    case 4: score_tile<T, 4>(q_HD + h * D, D, panel_DN, w_H + h, score_N); break;
    case 5: score_tile<T, 5>(q_HD + h * D, D, panel_DN, w_H + h, score_N); break;
    case 6: score_tile<T, 6>(q_HD + h * D, D, panel_DN, w_H + h, score_N); break;
    case 7: score_tile<T, 7>(q_HD + h * D, D, panel_DN, w_H + h, score_N); break;
#endif
    default: TORCH_INTERNAL_ASSERT(false, "head remainder out of range");
  }
}

// keys [0, S) of k_SD -> panels [P][D][NR], zero-padded past S.
template <typename T> void pack_key_panel(const T* k_SD, int64_t S, int64_t D, int64_t p, T* panel) {
  constexpr int64_t NR = kTileVecs * Simd<T>::width;
  for (int64_t r = 0; r < NR; ++r) {
    const int64_t s = p * NR + r;
    if (s < S) {
      const T* key = k_SD + s * D;
      for (int64_t d = 0; d < D; ++d) panel[d * NR + r] = key[d];
    } else {
      for (int64_t d = 0; d < D; ++d) panel[d * NR + r] = T(0);
    }
  }
}

struct WorkItem {
  int64_t b, t0, t1;          // queries [t0, t1) of batch row b
  int64_t key_begin, key_end;  // keys [key_begin, key_end), block aligned at key_begin
};

template <typename T>
void indexer_topk_kernel(const T* q, const T* k, const T* w, const int64_t* start, int64_t B, int64_t T_,
                         int64_t S, int64_t H, int64_t D, int64_t K, int64_t pool, int32_t* out) {
  // The last key query t of row b sees: its position start + t; with ``pool`` > 1 (the k-pool indexer, keys
  // being pools of ``pool`` tokens) the last pool whose every token is at or before that position.
  auto last_visible = [&](int64_t b, int64_t t) { return (start[b] + t + 1) / pool - 1; };
  using V = typename Simd<T>::V;
  using Key = typename RankKey<T>::type;
  constexpr int64_t NR = kTileVecs * Simd<T>::width;
  static_assert(kKeyBlock % NR == 0, "key block must hold whole panels");
  const int threads = std::max(1, at::get_num_threads());

  // Work items: query groups x key segments (segments only where groups alone cannot feed the threads).
  const int64_t groups_per_row = (T_ + kQueryGroup - 1) / kQueryGroup;
  const int64_t groups = B * groups_per_row;
  const int64_t segments_wanted = std::max<int64_t>(1, (4 * threads + groups - 1) / groups);
  std::vector<WorkItem> items;
  std::vector<int64_t> first_item(groups + 1, 0);
  int64_t key_panels = 0;  // panels each batch row needs packed: up to the last key any of its queries sees
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < groups_per_row; ++g) {
      const int64_t t0 = g * kQueryGroup, t1 = std::min(T_, t0 + kQueryGroup);
      const int64_t key_end = std::min(S, last_visible(b, t1 - 1) + 1);  // what the group's last query sees
      key_panels = std::max(key_panels, (key_end + NR - 1) / NR);
      const int64_t blocks = (key_end + kKeyBlock - 1) / kKeyBlock;
      const int64_t segs = std::min(segments_wanted, blocks);
      first_item[b * groups_per_row + g] = static_cast<int64_t>(items.size());
      for (int64_t j = 0; j < segs; ++j) {
        const int64_t kb = (blocks * j / segs) * kKeyBlock;
        const int64_t ke = std::min(key_end, (blocks * (j + 1) / segs) * kKeyBlock);
        items.push_back({b, t0, t1, kb, ke});
      }
    }
  }
  first_item[groups] = static_cast<int64_t>(items.size());

  // The keys, packed once for every query group: [B][key_panels][D][NR].
  const int64_t panel_size = D * NR;
  std::vector<T> packed(B * key_panels * panel_size);
  at::parallel_for(0, B * key_panels, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      pack_key_panel(k + (i / key_panels) * S * D, S, D, i % key_panels, packed.data() + i * panel_size);
  });

  // partial[item][query in group]: that segment's top-k candidates.
  std::vector<std::vector<std::vector<Key>>> partial(items.size());
  // Per-thread scratch, allocated here: nothing that can fail is allocated when the region starts.
  const int64_t scores_size = kQueryGroup * kKeyBlock;
  std::vector<T> scores_all(threads * scores_size);
  RegionErrors errors;
  bool saw_nan = false;

#pragma omp parallel num_threads(threads) reduction(|| : saw_nan)
  {
    T* scores = scores_all.data() + omp_get_thread_num() * scores_size;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) {
      errors.run([&] {
        const WorkItem it = items[i];
        const int64_t nq = it.t1 - it.t0;
        // A segment holds at most (key_end - key_begin) keys: no query keeps more candidates than that,
        // whatever K is (K past the key count only pads the output with -1).
        const int64_t keep = std::max<int64_t>(1, std::min(K, it.key_end - it.key_begin));
        std::vector<RunningTopK<T>> tops;
        tops.reserve(nq);
        for (int64_t tl = 0; tl < nq; ++tl) tops.emplace_back(keep, kKeyBlock);
        const T* panels_b = packed.data() + it.b * key_panels * panel_size;
        for (int64_t s0 = it.key_begin; s0 < it.key_end; s0 += kKeyBlock) {
          const int64_t s1 = std::min(it.key_end, s0 + kKeyBlock);
          const int64_t panels = (s1 - s0 + NR - 1) / NR;
          const T* block = panels_b + (s0 / NR) * panel_size;
          for (int64_t p = 0; p < panels; ++p) {
            for (int64_t tl = 0; tl < nq; ++tl) {
              const int64_t t = it.t0 + tl;
              if (s0 + p * NR > last_visible(it.b, t)) continue;  // whole panel in this query's future
              V score_N[kTileVecs];
              for (int v = 0; v < kTileVecs; ++v) score_N[v] = V{};
              const int64_t row = it.b * T_ + t;
              score_heads<T>(q + row * H * D, H, D, block + p * panel_size, w + row * H, score_N);
              for (int v = 0; v < kTileVecs; ++v)
                store(scores + tl * kKeyBlock + p * NR + v * Simd<T>::width, score_N[v]);
            }
          }
          for (int64_t tl = 0; tl < nq; ++tl) {
            const int64_t visible_end = std::min(s1, last_visible(it.b, it.t0 + tl) + 1);
            if (visible_end > s0)
              saw_nan = push_block(tops[tl], scores + tl * kKeyBlock, visible_end - s0, s0) || saw_nan;
          }
        }
        partial[i].resize(nq);
        for (int64_t tl = 0; tl < nq; ++tl) partial[i][tl] = std::move(tops[tl].finish());
      });
    }
  }
  errors.rethrow_if_failed("indexer_topk");
  TORCH_CHECK_VALUE(!saw_nan, "q, k, w: indexer scores overflowed to NaN; rescale the inputs");

  // Merge the segments of each query and write the contract's layout (sorted, -1 padded).
  at::parallel_for(0, B * T_, 1, [&](int64_t begin, int64_t end) {
    std::vector<Key> merged;
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / T_, t = row % T_;
      const int64_t g = b * groups_per_row + t / kQueryGroup, tl = t % kQueryGroup;
      const int64_t segments = first_item[g + 1] - first_item[g];  // 0 only without keys (S = 0)
      std::vector<Key>* ranked = &merged;
      merged.clear();
      if (segments == 1) {
        ranked = &partial[first_item[g]][tl];
      } else if (segments > 1) {  // several segments: their union, cut to the k best
        for (int64_t i = first_item[g]; i < first_item[g + 1]; ++i)
          merged.insert(merged.end(), partial[i][tl].begin(), partial[i][tl].end());
        if (static_cast<int64_t>(merged.size()) > K) {
          std::nth_element(merged.begin(), merged.begin() + (K - 1), merged.end(), std::greater<Key>());
          merged.resize(K);
        }
        ranked = &merged;
      }
      std::sort(ranked->begin(), ranked->end(), std::greater<Key>());
      const int64_t n = std::min<int64_t>(K, static_cast<int64_t>(ranked->size()));
      int32_t* dst = out + row * K;
      for (int64_t j = 0; j < n; ++j) dst[j] = index_of((*ranked)[j]);
      for (int64_t j = n; j < K; ++j) dst[j] = -1;
    }
  });
}

at::Tensor indexer_topk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& w, const at::Tensor& start,
                        int64_t topk, int64_t pool) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 3 && w.dim() == 3 && start.dim() == 1, "indexer_topk: bad ranks");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == w.scalar_type(), "indexer_topk: dtypes differ");
  TORCH_CHECK(start.scalar_type() == at::kLong, "indexer_topk: start must be int64");
  TORCH_CHECK(topk >= 1, "indexer_topk: topk must be >= 1");
  TORCH_CHECK(pool >= 1, "indexer_topk: pool must be >= 1");
  const int64_t B = q.size(0), T_ = q.size(1), H = q.size(2), D = q.size(3), S = k.size(1);
  TORCH_CHECK(S < INT32_MAX, "indexer_topk: key count must fit int32");
  auto qc = q.contiguous(), kc = k.contiguous(), wc = w.contiguous(), sc = start.contiguous();
  auto out = at::empty({B, T_, topk}, q.options().dtype(at::kInt));
  if (B == 0 || T_ == 0) return out;  // no query rows (the work split below divides by their count)
  if (q.scalar_type() == at::kDouble) {
    indexer_topk_kernel<double>(qc.data_ptr<double>(), kc.data_ptr<double>(), wc.data_ptr<double>(),
                                sc.data_ptr<int64_t>(), B, T_, S, H, D, topk, pool, out.data_ptr<int32_t>());
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "indexer_topk: expected float32 or float64");
    indexer_topk_kernel<float>(qc.data_ptr<float>(), kc.data_ptr<float>(), wc.data_ptr<float>(),
                               sc.data_ptr<int64_t>(), B, T_, S, H, D, topk, pool, out.data_ptr<int32_t>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(glm5_cpu, m) {
  m.def("indexer_topk(Tensor q, Tensor k, Tensor w, Tensor start, int topk, int pool=1) -> Tensor");
}

TORCH_LIBRARY_IMPL(glm5_cpu, CPU, m) { m.impl("indexer_topk", &indexer_topk); }

}  // namespace glm5
