// Deterministic row-wise top-k over materialised fp32 scores (CUDA).
//
// Contract (the DSA top-k of glm5_core.ops.dsa): per row, the k largest scores, sorted by score
// descending, ties broken by the LOWER column index; the result is a function of the row only, never
// of thread scheduling.
//
// One thread block per row:
//   1. radix select: four 8-bit digit passes (most significant first) over order-preserving uint32
//      keys find the k-th largest key T and how many of the k picks must equal T ("need_equal");
//      the shared histogram uses atomics, but integer counts do not depend on their order;
//   2. collect: every key > T, plus the need_equal LOWEST-index keys == T (an index-ordered block
//      scan over the row, one tile of blockDim.x columns at a time);
//   3. sort the <= k picks packed as (key << 32 | ~index) with a bitonic sort in shared memory:
//      the packing makes "descending" mean "score descending, then index ascending".
#pragma once

#include <cstdint>

namespace glm5 {

constexpr int kTopkThreads = 1024;
constexpr int kTopkMaxK = 2048;  // shared buffer of kTopkMaxK packed keys (16 KiB)

// Order-preserving map float -> uint32 (ascending). -0.0 is folded onto +0.0; NaN is excluded upstream.
__device__ __forceinline__ uint32_t order_key(float v) {
  uint32_t bits = __float_as_uint(v);
  if (v == 0.0f) bits = 0u;
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

__device__ __forceinline__ unsigned long long pack(uint32_t key, uint32_t index) {
  return (static_cast<unsigned long long>(key) << 32) | static_cast<unsigned long long>(0xFFFFFFFFu - index);
}

// Exclusive prefix count of `flag` over the block, in thread order; returns the block total via *total.
__device__ __forceinline__ int block_exclusive_count(bool flag, int* warp_totals, int* total) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const unsigned ballot = __ballot_sync(0xFFFFFFFFu, flag);
  const int in_warp = __popc(ballot & ((1u << lane) - 1u));
  if (lane == 0) warp_totals[warp] = __popc(ballot);
  __syncthreads();
  int before = 0, sum = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) {
    if (w < warp) before += warp_totals[w];
    sum += warp_totals[w];
  }
  __syncthreads();  // warp_totals is reused by the next call
  *total = sum;
  return before + in_warp;
}

__global__ void __launch_bounds__(kTopkThreads)
deterministic_topk_kernel(const float* __restrict__ scores, int64_t cols, int64_t row_stride, int k,
                          int32_t* __restrict__ out) {
  __shared__ unsigned int histogram[256];
  __shared__ unsigned long long picks[kTopkMaxK];
  __shared__ int warp_totals[kTopkThreads / 32];
  __shared__ uint32_t prefix_s;
  __shared__ int need_s;

  const float* row = scores + static_cast<int64_t>(blockIdx.x) * row_stride;
  if (threadIdx.x == 0) {
    prefix_s = 0u;
    need_s = k;
  }
  __syncthreads();

  // 1. radix select of the k-th largest key.
  uint32_t mask = 0u;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) histogram[i] = 0u;
    __syncthreads();
    const uint32_t prefix = prefix_s;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const uint32_t key = order_key(row[c]);
      if ((key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & 0xFFu], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int need = need_s;
      int digit = 255;
      for (; digit > 0; --digit) {
        const int here = static_cast<int>(histogram[digit]);
        if (here >= need) break;
        need -= here;
      }
      prefix_s = prefix | (static_cast<uint32_t>(digit) << shift);
      need_s = need;
    }
    mask |= 0xFFu << shift;
    __syncthreads();
  }
  const uint32_t threshold = prefix_s;
  const int need_equal = need_s;  // picks equal to the threshold
  const int num_greater = k - need_equal;

  // 2. collect, in column order: every key > threshold, then the lowest-index keys == threshold.
  int taken_greater = 0, taken_equal = 0;
  for (int64_t base = 0; base < cols; base += blockDim.x) {
    const int64_t c = base + threadIdx.x;
    const uint32_t key = c < cols ? order_key(row[c]) : 0u;
    const bool greater = c < cols && key > threshold;
    const bool equal = c < cols && key == threshold;
    int tile_greater = 0, tile_equal = 0;
    const int rank_greater = block_exclusive_count(greater, warp_totals, &tile_greater);
    const int rank_equal = block_exclusive_count(equal, warp_totals, &tile_equal);
    if (greater) picks[taken_greater + rank_greater] = pack(key, static_cast<uint32_t>(c));
    if (equal && taken_equal + rank_equal < need_equal)
      picks[num_greater + taken_equal + rank_equal] = pack(key, static_cast<uint32_t>(c));
    taken_greater += tile_greater;
    taken_equal += tile_equal;
  }
  // Pad to a power of two with 0 (below every packed key: real keys have a nonzero high word).
  int padded = 1;
  while (padded < k) padded <<= 1;
  for (int i = k + threadIdx.x; i < padded; i += blockDim.x) picks[i] = 0ull;
  __syncthreads();

  // 3. bitonic sort, descending.
  for (int size = 2; size <= padded; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < padded; i += blockDim.x) {
        const int partner = i ^ stride;
        if (partner > i) {
          const bool descending = (i & size) == 0;
          const unsigned long long a = picks[i], b = picks[partner];
          if ((a < b) == descending) {
            picks[i] = b;
            picks[partner] = a;
          }
        }
      }
      __syncthreads();
    }
  }
  for (int i = threadIdx.x; i < k; i += blockDim.x)
    out[static_cast<int64_t>(blockIdx.x) * k + i] = static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(picks[i]));
}

}  // namespace glm5
