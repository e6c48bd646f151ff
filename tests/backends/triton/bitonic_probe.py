"""A one-program kernel around ``bitonic.merge_top`` for its unit test (imported inside the test, after
the interpreter is switched on)."""
import triton
import triton.language as tl

from glm5_core.backends.triton.bitonic import merge_top


@triton.jit
def merge_kernel(best_ptr, staged_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, merge_top(tl.load(best_ptr + offs), tl.load(staged_ptr + offs), N))
