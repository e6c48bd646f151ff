"""A kernel around ``sparse_mla._round_to_bf16`` for its unit test (imported inside the test, after the
interpreter is switched on)."""
import triton
import triton.language as tl

from glm5_core.backends.triton.sparse_mla import _round_to_bf16


@triton.jit
def round_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, _round_to_bf16(tl.load(x_ptr + offs, mask=offs < N)), mask=offs < N)
