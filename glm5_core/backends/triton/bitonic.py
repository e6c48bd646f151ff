"""Bitonic networks over power-of-two int64 vectors, written with min / max reductions.

A vector of 2^n values is viewed as a hypercube ``[2] * n``: bit ``j`` of a position (counted from the
least significant) is axis ``n - 1 - j``. A compare-exchange along bit ``j`` takes the max and the min of
each pair with one reduction each and puts the max at the lower position of pairs sorted descending.
(Using ``tl.max`` / ``tl.min`` instead of a partner lookup keeps Triton's CPU interpreter fast: both map
to single numpy calls there.)

``merge_top(best, staged)``: ``best`` sorted descending, ``staged`` in any order, both 2^n long;
returns the 2^n largest of their union sorted descending. Sort ``staged`` ascending, take the
elementwise max with ``best`` (the top half of the union, as a bitonic sequence), then merge it down.
"""
import triton
import triton.language as tl


@triton.jit
def _exchange(h, descending, n: tl.constexpr, j: tl.constexpr):
    """Compare-exchange the pairs that differ in bit j; ``descending`` (0/1, broadcastable) per pair."""
    hi = tl.max(h, axis=n - 1 - j, keep_dims=True)
    lo = tl.min(h, axis=n - 1 - j, keep_dims=True)
    bit_j = tl.reshape(tl.arange(0, 2), [1] * (n - 1 - j) + [2] + [1] * j)  # bit j of the position
    take_hi = (bit_j ^ descending) != 0
    return tl.where(take_hi, hi, lo)


@triton.jit
def _sort_ascending(h, n: tl.constexpr):
    for s in tl.static_range(1, n + 1):
        if s < n:  # bit s: blocks of 2^s alternate direction, so the next stage sees bitonic blocks
            direction = tl.reshape(tl.arange(0, 2), [1] * (n - 1 - s) + [2] + [1] * s)
        else:
            direction = tl.zeros([1] * n, tl.int32)
        for i in tl.static_range(s):
            h = _exchange(h, direction, n, s - 1 - i)
    return h


@triton.jit
def merge_top(best, staged, N: tl.constexpr):
    """Top N of best (sorted descending) and staged (any order), sorted descending. N = 2^n."""
    n: tl.constexpr = N.bit_length() - 1
    hb = tl.reshape(best, [2] * n)
    hs = _sort_ascending(tl.reshape(staged, [2] * n), n)
    h = tl.maximum(hb, hs)  # bitonic: the N largest of the union
    ones = tl.full([1] * n, 1, tl.int32)
    for i in tl.static_range(n):
        h = _exchange(h, ones, n, n - 1 - i)
    return tl.reshape(h, [N])
