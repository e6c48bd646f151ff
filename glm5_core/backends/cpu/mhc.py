"""cpu backend kernels for mHC (``glm5_core.ops.mhc``), built on torch's CPU ops (no extension needed: in the
table whether or not it builds).

``sinkhorn``: the forward runs without a graph and keeps only the logits; the backward recomputes the iterates
and walks them back by hand (for y = x / (sum_axis x + eps): dx = (dy - sum_axis(dy * y)) / (sum_axis x + eps);
the softmax's dl = p * (dp - sum_row(dp * p))). Autograd's reference keeps 2 * iters [R, N, N] iterates per site
from the forward to the backward (40 with GLM-5.3's 20 iterations, two sites a layer); this keeps one.
``mix``: one fused ``baddbmm`` (post * block + comb^T @ residual) forward, and a backward of three batched
products and a row dot, keeping only the inputs.
Both compute in fp32 (fp64 for fp64 inputs), as the references.

Without gradients ``sinkhorn`` takes torch's softmax and then, where the native extension is loaded and N <= 4,
the whole normalisation in one native call (``torch.ops.glm5_cpu.mhc_sinkhorn_normalize``, csrc/cpu_mhc.cpp:
eps, then 2 iters - 1 column / row steps, each sum in index order as torch's CPU sum adds 4 or fewer values);
otherwise, or for wider matrices (torch's sum then adds in another order), the same steps as torch ops in place
(``sinkhorn_in_place``). Both are ``mhc.sinkhorn_reference`` bit for bit (tests/backends/cpu/test_mhc.py); a
decode step runs 2 sites a layer on [B, N, N] matrices, where the 3 (2 iters - 1) + 2 torch calls of the
in-place form were most of the cost.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from glm5_core.kernel import Kernel
from glm5_core.ops import _checks


def _iterates(logits: torch.Tensor, iters: int, eps: float):
    """(softmax p, [the input of every normalisation step], the result), in the compute dtype."""
    p = torch.softmax(logits.to(_checks.compute_dtype(logits.dtype)), dim=-1)
    c = p + eps
    inputs = []
    for k in range(2 * iters - 1):  # step k: columns (sum over dim -2) when k is even, rows when odd
        inputs.append(c)
        c = c / (c.sum(dim=-2 if k % 2 == 0 else -1, keepdim=True) + eps)
    return p, inputs, c


class _Sinkhorn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, iters, eps):
        ctx.save_for_backward(logits)
        ctx.iters, ctx.eps = iters, eps
        return _iterates(logits, iters, eps)[2]

    @staticmethod
    def backward(ctx, grad):
        (logits,) = ctx.saved_tensors
        p, inputs, y = _iterates(logits, ctx.iters, ctx.eps)
        g = grad.to(y.dtype)
        for k in reversed(range(len(inputs))):
            x, dim = inputs[k], (-2 if k % 2 == 0 else -1)
            g = (g - (g * y).sum(dim=dim, keepdim=True)) / (x.sum(dim=dim, keepdim=True) + ctx.eps)
            y = x
        d_logits = p * (g - (g * p).sum(dim=-1, keepdim=True))
        return d_logits.to(logits.dtype), None, None


def sinkhorn_in_place(logits: torch.Tensor, *, iters: int, eps: float) -> torch.Tensor:
    """``mhc.sinkhorn_reference`` (and ``_iterates``) bit for bit, for logits [R, N, N] already in the
    compute dtype, without gradients: each step's sum goes into one of two preallocated buffers, eps (a 0-dim
    tensor of the compute dtype: the value the Python scalar becomes) is added and the matrix divided in place."""
    comb = torch.softmax(logits, dim=-1)
    comb.add_(eps)
    R, n = comb.shape[0], comb.shape[-1]
    eps_t = torch.tensor(eps, dtype=comb.dtype, device=comb.device)
    cols, rows = comb.new_empty(R, 1, n), comb.new_empty(R, n, 1)
    torch.sum(comb, -2, keepdim=True, out=cols)
    comb.div_(cols.add_(eps_t))
    for _ in range(iters - 1):
        torch.sum(comb, -1, keepdim=True, out=rows)
        comb.div_(rows.add_(eps_t))
        torch.sum(comb, -2, keepdim=True, out=cols)
        comb.div_(cols.add_(eps_t))
    return comb


NATIVE_MAX_N = 4  # the widest matrices whose sums torch's CPU sum takes in index order (what the native op does)


def _native_built() -> bool:
    from glm5_core.backends.cpu import extension

    return extension.load().built  # cached after the first call (the table's resolution already made it)


def sinkhorn(logits, *, iters: int, eps: float) -> torch.Tensor:
    if torch.is_grad_enabled() and logits.requires_grad:
        return _Sinkhorn.apply(logits, iters, eps)
    x = _checks.cast(logits, _checks.compute_dtype(logits.dtype))
    if logits.shape[-1] <= NATIVE_MAX_N and _native_built():
        return torch.ops.glm5_cpu.mhc_sinkhorn_normalize(torch.softmax(x, dim=-1), iters, eps)
    return sinkhorn_in_place(x, iters=iters, eps=eps)


def _mix_forward(residual, block_out, post, comb):
    ct = _checks.compute_dtype(residual.dtype)
    cast = _checks.cast
    outer = cast(post, ct).unsqueeze(-1) * cast(block_out, ct).unsqueeze(-2)  # [R, N, D]
    return cast(torch.baddbmm(outer, cast(comb, ct).transpose(-1, -2), cast(residual, ct)), residual.dtype)


class _Mix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, residual, block_out, post, comb):
        ctx.save_for_backward(residual, block_out, post, comb)
        return _mix_forward(residual, block_out, post, comb)

    @staticmethod
    def backward(ctx, grad):
        residual, block_out, post, comb = ctx.saved_tensors
        ct = _checks.compute_dtype(residual.dtype)
        g, res, blk, pst, cmb = (t.to(ct) for t in (grad, residual, block_out, post, comb))
        d_res = torch.bmm(cmb, g)  # [R, N, D]: sum_j comb[i, j] g[j]
        d_blk = torch.bmm(pst.unsqueeze(1), g).squeeze(1)  # [R, D]: sum_j post[j] g[j]
        d_post = torch.bmm(g, blk.unsqueeze(-1)).squeeze(-1)  # [R, N]: <g[j], block>
        d_comb = torch.bmm(res, g.transpose(-1, -2))  # [R, N, N]: <res[i], g[j]>
        return (d_res.to(residual.dtype), d_blk.to(block_out.dtype), d_post.to(post.dtype),
                d_comb.to(comb.dtype))


def mix(residual, block_out, post, comb) -> torch.Tensor:
    if torch.is_grad_enabled() and any(t.requires_grad for t in (residual, block_out, post, comb)):
        return _Mix.apply(residual, block_out, post, comb)
    return _mix_forward(residual, block_out, post, comb)


def _on_cpu(*tensors) -> tuple[bool, str]:
    for t in tensors:
        if t.device.type != "cpu":
            return False, f"cpu kernels need CPU tensors, got {t.device}"
    return True, ""


KERNELS: Mapping[str, Kernel] = {
    "mhc_sinkhorn": Kernel(sinkhorn, supports=lambda logits, **kw: _on_cpu(logits), differentiable=True),
    "mhc_mix": Kernel(mix, supports=lambda *t, **kw: _on_cpu(*t), differentiable=True),
}
