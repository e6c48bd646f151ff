"""Batched Newton-Schulz orthogonalisation in Triton, with symmetric Gram products.

Legend: G [..., m, n] -> a batch [Bt, m, n] made wide (m <= n); BM / BN / BK tiles.

Per quintic step (a, b, c), on fp32 X [Bt, m, n]:
  A = X X^T          -- ``_symmetric_kernel`` without addend: only tiles (i, j) with j >= i are
                        computed, each written to (i, j) and, transposed, to (j, i);
  B = b A + c A A    -- the same kernel on A (A A = A A^T since A is symmetric), with addend b A;
  X = a X + B X      -- ``_gemm_kernel`` (a plain batched GEMM with the a X epilogue).
So each symmetric product is computed once per step, over half of its tiles.

bf16 compute (``compute_dtype=torch.bfloat16``): X, A and B are bf16 buffers; each product is a bf16
``tl.dot`` with an fp32 accumulator (tensor cores), its epilogue in fp32, rounded to bf16 once (ties to
even), as the reference states. Under Triton's interpreter, whose bf16 dot is unusable and whose
fp32 -> bf16 store truncates, the bf16 tiles are widened to fp32 (products of bf16 values are exact in
fp32) and the rounding is done by ``_round_to_bf16`` (the GPU's cast, bit for bit), as ``sparse_mla`` does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm5_core import platform
from glm5_core.backends.triton import _util
from glm5_core.backends.triton.launch import KernelConfigs, LaunchConfig, bind
from glm5_core.backends.triton.shared_memory import ModelDims, Tile
from glm5_core.backends.triton.sparse_mla import _round_to_bf16
from glm5_core.kernel import Kernel


@triton.jit
def _dot(x, y, acc, BF16: tl.constexpr, EMULATE: tl.constexpr):
    """acc + x @ y, fp32 accumulation: fp32 tiles exactly (ieee); bf16 tiles on the tensor cores, or widened
    to fp32 under the interpreter (EMULATE)."""
    if BF16:  # (one return: the compiler does not prune code after a return under a constexpr branch)
        if EMULATE:
            out = tl.dot(x.to(tl.float32), y.to(tl.float32), acc, input_precision="ieee")
        else:
            out = tl.dot(x, y, acc)
    else:
        out = tl.dot(x, y, acc, input_precision="ieee")
    return out


@triton.jit
def _symmetric_kernel(y_ptr, z_ptr, out_ptr, R, KDIM, alpha, beta, HAS_Z: tl.constexpr,
                      BM: tl.constexpr, BK: tl.constexpr, BF16: tl.constexpr, EMULATE: tl.constexpr):
    """out = beta * Y Y^T (+ alpha * Z) for Y [Bt, R, KDIM], Z / out [Bt, R, R] (Z symmetric)."""
    bt = tl.program_id(0).to(tl.int64)
    ti = tl.program_id(1)
    tj = tl.program_id(2)
    if tj >= ti:  # upper triangle of tiles only; the mirror is written below
        offs_i = ti * BM + tl.arange(0, BM)
        offs_j = tj * BM + tl.arange(0, BM)
        offs_k = tl.arange(0, BK)
        y_base = y_ptr + bt * R * KDIM
        acc = tl.zeros([BM, BM], tl.float32)
        for k0 in range(0, KDIM, BK):
            kk = k0 + offs_k
            yi = tl.load(y_base + offs_i[:, None] * KDIM + kk[None, :],
                         mask=(offs_i[:, None] < R) & (kk[None, :] < KDIM), other=0.0)
            yj = tl.load(y_base + offs_j[:, None] * KDIM + kk[None, :],
                         mask=(offs_j[:, None] < R) & (kk[None, :] < KDIM), other=0.0)
            acc = _dot(yi, tl.trans(yj), acc, BF16, EMULATE)
        acc = acc * beta
        mask = (offs_i[:, None] < R) & (offs_j[None, :] < R)
        tile = bt * R * R + offs_i[:, None] * R + offs_j[None, :]
        if HAS_Z:
            acc += alpha * tl.load(z_ptr + tile, mask=mask, other=0.0).to(tl.float32)
        if BF16:
            acc = _round_to_bf16(acc)
        # entries (i, j) with i <= j, each also written at (j, i): exactly symmetric, the diagonal tiles too (a dot
        # need not give its (p, q) and (q, p) entries the same rounding; numpy's, under the interpreter, does not)
        upper = mask & (offs_i[:, None] <= offs_j[None, :])
        mirror = bt * R * R + offs_j[None, :] * R + offs_i[:, None]
        tl.store(out_ptr + tile, acc, mask=upper)
        tl.store(out_ptr + mirror, acc, mask=upper)


@triton.jit
def _gemm_kernel(b_ptr, x_ptr, out_ptr, R, N, a_coef, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 BF16: tl.constexpr, EMULATE: tl.constexpr):
    """out = a X + B X for B [Bt, R, R], X / out [Bt, R, N]."""
    bt = tl.program_id(0).to(tl.int64)
    offs_i = tl.program_id(1) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(2) * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    b_base = b_ptr + bt * R * R
    x_base = x_ptr + bt * R * N
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, R, BK):
        kk = k0 + offs_k
        b = tl.load(b_base + offs_i[:, None] * R + kk[None, :], mask=(offs_i[:, None] < R) & (kk[None, :] < R),
                    other=0.0)
        x = tl.load(x_base + kk[:, None] * N + offs_n[None, :], mask=(kk[:, None] < R) & (offs_n[None, :] < N),
                    other=0.0)
        acc = _dot(b, x, acc, BF16, EMULATE)
    mask = (offs_i[:, None] < R) & (offs_n[None, :] < N)
    tile = offs_i[:, None] * N + offs_n[None, :]
    acc += a_coef * tl.load(x_base + tile, mask=mask, other=0.0).to(tl.float32)
    if BF16:
        acc = _round_to_bf16(acc)
    tl.store(out_ptr + bt * R * N + tile, acc, mask=mask)


def _modes(t: torch.Tensor) -> dict:
    """The kernels' dtype switches for buffers like ``t`` (fp32 or bf16)."""
    bf16 = t.dtype == torch.bfloat16
    return {"BF16": bf16, "EMULATE": bf16 and platform.triton_interpreter_enabled()}


def _symmetric(y, z, alpha: float, beta: float, config: LaunchConfig):
    Bt, R, KDIM = y.shape
    BM, BK = config.block("m"), config.block("k")
    out = torch.empty((Bt, R, R), dtype=y.dtype, device=y.device)
    nt = triton.cdiv(R, BM)
    _symmetric_kernel[(Bt, nt, nt)](y, z if z is not None else out, out, R, KDIM, alpha, beta,
                                    HAS_Z=z is not None, BM=BM, BK=BK, **_modes(y), **config.launch_kwargs())
    return out


def _step(x, a: float, b: float, c: float, config: LaunchConfig):
    Bt, R, N = x.shape
    gram = _symmetric(x, None, 0.0, 1.0, config)  # A = X X^T
    poly = _symmetric(gram, gram, b, c, config)  # B = b A + c A A
    out = torch.empty_like(x)
    BM, BN, BK = config.block("m"), config.block("n"), config.block("k")
    _gemm_kernel[(Bt, triton.cdiv(R, BM), triton.cdiv(N, BN))](poly, x, out, R, N, a, BM=BM, BN=BN, BK=BK,
                                                               **_modes(x), **config.launch_kwargs())
    return out


def orthogonalize(G, *, steps: int, coefficients, config: LaunchConfig, compute_dtype=torch.float32):
    """``muon_orthogonalize``: G's shape and dtype; iterated in fp32 or bf16 (``compute_dtype``)."""
    X = G.float()
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.transpose(-2, -1)  # [..., n, m]: wide
    lead = X.shape[:-2]
    X = X.reshape(-1, *X.shape[-2:])  # [Bt, m, n]
    norm = torch.linalg.matrix_norm(X, ord="fro", keepdim=True)  # [Bt, 1, 1]
    X = (X / (norm * coefficients.norm_scale + 1e-7)).to(compute_dtype).contiguous()  # normalised in fp32
    for a, b, c in coefficients.schedule(steps):
        X = _step(X, float(a), float(b), float(c), config)
    X = X.reshape(*lead, *X.shape[-2:])
    if tall:
        X = X.transpose(-2, -1)
    return X.to(G.dtype)


def supports(G, **kwargs):
    why = _util.float_dtype_verdict("G", G)
    return (False, why) if why else (True, "")


# ---- the kernel-module protocol (``table.py``): launch family, shared-memory tiles, kernel-table entries ----
FAMILY = "newton_schulz"  # this module's launch configuration
# the launch unless the vendor overrides it
DEFAULT_LAUNCH = LaunchConfig(num_warps=4, num_stages=3, blocks={"m": 64, "n": 64, "k": 32})
ITEMSIZES = (4, 2)  # fp32 or bf16 compute


def tiles(blocks, dims: ModelDims, itemsize: int) -> dict[str, list[Tile]]:
    BM, BN, BK = blocks["m"], blocks["n"], blocks["k"]
    return {
        "symmetric": [Tile("y_i", (BM, BK), itemsize, True), Tile("y_j", (BM, BK), itemsize, True),
                      Tile("acc", (BM, BM), 4, scratch=True)],
        "gemm": [Tile("b", (BM, BK), itemsize, True), Tile("x", (BK, BN), itemsize, True),
                 Tile("acc", (BM, BN), 4, scratch=True)],
    }


def kernels(configs: KernelConfigs) -> dict[str, Kernel]:
    return {"muon_orthogonalize": bind(orthogonalize, configs.get(FAMILY, DEFAULT_LAUNCH), supports)}
