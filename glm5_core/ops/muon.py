"""Muon's Newton-Schulz orthogonalisation, batched, and the per-head split used by Muon Split.

The op of this family (``OPS`` declares it): ``muon_orthogonalize`` (entry point ``orthogonalize``, reference
``orthogonalize_reference``).

Legend: G [..., m, n] a batch of matrices; inside the iteration X is wide (m <= n; tall inputs are
transposed) so the Gram matrix A = X X^T is the smaller m x m one.

One quintic step with coefficients (a, b, c):  A = X X^T;  B = b A + c A A;  X = a X + B X.
X starts as G / (||G||_F * norm_scale + 1e-7), per matrix. The result approximates the polar factor
U V^T of G = U S V^T (singular values pushed towards 1; Jordan's set stops in about [0.68, 1.13]).

Compute dtype (``compute_dtype``): ``torch.float32`` (the default) runs every step in fp32, or fp64 for fp64
input. ``torch.bfloat16`` iterates in bf16 whatever G's dtype, as ``torch.optim.Muon`` and Keller Jordan's
Muon do: the normalisation runs in fp32 (fp64 for fp64 G) and is rounded to bf16 once; then every product
is a bf16 GEMM with an fp32 accumulator and its epilogue fused, rounded to bf16 once:
A = bf16(X X^T),  B = bf16(b A + c A A),  X = bf16(a X + B X). (torch.optim.Muon divides by the norm in
bf16; here that division is exact before its one rounding.) ``"auto"`` picks bf16 only where bf16 GEMMs are
native on G's device (:func:`native_bf16_gemm`, asked at call time), else fp32.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Union

import torch

from glm5_core import registry
from glm5_core.ops import _checks
from glm5_core.opspec import OpSpec

Coeff = tuple[float, float, float]


@dataclasses.dataclass(frozen=True)
class NSCoefficients:
    """A Newton-Schulz schedule: per-step (a, b, c), the last one repeated past the end."""

    name: str
    steps: tuple[Coeff, ...]
    norm_scale: float = 1.0

    def schedule(self, num_steps: int) -> tuple[Coeff, ...]:
        return tuple(self.steps[min(i, len(self.steps) - 1)] for i in range(num_steps))


def _polar_express() -> NSCoefficients:
    # Amsel et al. 2025, degree 5; every step but the last divided by (1.01, 1.01^3, 1.01^5) for safety.
    raw = (
        (8.28721201814563, -23.595886519098837, 17.300387312530933),
        (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
        (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
        (3.3184196573706015, -2.488488024314874, 0.51004894012372),
        (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
        (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
        (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
        (1.875, -1.25, 0.375),
    )
    safe = tuple((a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in raw[:-1]) + (raw[-1],)
    return NSCoefficients("polar_express", safe, norm_scale=1.01)


COEFFICIENTS = {
    "jordan": NSCoefficients("jordan", ((3.4445, -4.7750, 2.0315),)),
    "polar_express": _polar_express(),
}
DEFAULT_STEPS = 5


_COEFF_LIMIT = torch.finfo(torch.float32).max  # coefficients must fit the fp32 (and bf16) iteration
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # names for configs; "auto" too


def native_bf16_gemm(device: torch.device) -> bool:
    """Whether bf16 GEMMs run natively on ``device`` (so faster than fp32), as its vendor's device facts say
    (``DeviceFacts.native_bf16_gemm``: CPUs with AVX512-BF16 or AMX, GPUs with native bf16). Asked at call time
    (cpuinfo / the device), never at import; False for device types no backend declares and for CPUs where
    oneDNN would emulate bf16 by conversions (slower than fp32)."""
    from glm5_core.device_kinds import facts_for

    facts = facts_for(device.type)
    return facts is not None and bool(facts.native_bf16_gemm(device))


def compute_dtype_name(compute_dtype, arg: str = "compute_dtype") -> str:
    """"float32", "bfloat16" or "auto" for those names or torch.float32 / torch.bfloat16; a ValueError naming
    ``arg`` for anything else."""
    if isinstance(compute_dtype, str) and compute_dtype in (*COMPUTE_DTYPES, "auto"):
        return compute_dtype
    for name, dtype in COMPUTE_DTYPES.items():
        if isinstance(compute_dtype, torch.dtype) and compute_dtype == dtype:
            return name
    raise ValueError(f"{arg}: expected torch.float32, torch.bfloat16 or one of "
                     f"{[*COMPUTE_DTYPES, 'auto']}, got {compute_dtype!r}")


def compute_dtype_for(compute_dtype, device: torch.device) -> torch.dtype:
    """The dtype Newton-Schulz iterates in on ``device``: ``compute_dtype`` as :func:`compute_dtype_name`
    takes it, ``"auto"`` meaning bf16 where :func:`native_bf16_gemm` says so, else fp32."""
    name = compute_dtype_name(compute_dtype)
    if name == "auto":
        return torch.bfloat16 if native_bf16_gemm(torch.device(device)) else torch.float32
    return COMPUTE_DTYPES[name]


def _checked(schedule: NSCoefficients, given) -> NSCoefficients:
    """Finite coefficients within fp32's range and a finite norm_scale > 0: anything else turns every
    update into NaN / inf (or, in a native kernel, an overflow error naming nothing)."""
    steps = schedule.steps
    if not isinstance(steps, (tuple, list)) or not steps or any(
            not isinstance(abc, (tuple, list)) or len(abc) != 3 for abc in steps):
        raise ValueError(f"coefficients: expected a non-empty sequence of (a, b, c) triples, got {given!r}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and abs(v) <= _COEFF_LIMIT
               for abc in steps for v in abc):
        raise ValueError(f"coefficients: expected finite numbers within the float32 range, got {given!r}")
    norm_scale = schedule.norm_scale
    if isinstance(norm_scale, bool) or not isinstance(norm_scale, (int, float)) or not (
            math.isfinite(norm_scale) and 0 < norm_scale <= _COEFF_LIMIT):
        raise ValueError(f"coefficients: expected a finite norm_scale > 0, got {norm_scale!r} in {given!r}")
    return schedule


def coefficients_for(coefficients: Union[str, NSCoefficients, Sequence[Coeff]]) -> NSCoefficients:
    """A schedule from a name (``"jordan"``, ``"polar_express"``), an NSCoefficients, or (a, b, c) triples."""
    if isinstance(coefficients, NSCoefficients):
        return _checked(coefficients, coefficients)
    if isinstance(coefficients, str):
        if coefficients not in COEFFICIENTS:
            raise ValueError(f"coefficients: expected one of {sorted(COEFFICIENTS)}, got {coefficients!r}")
        return COEFFICIENTS[coefficients]
    try:
        steps = tuple(tuple(float(v) for v in abc) for abc in coefficients)
    except (TypeError, ValueError):  # not iterable, or entries that are not numbers ("abc", a dict's keys)
        raise TypeError(f"coefficients: expected a name or a sequence of (a, b, c), got {coefficients!r}") from None
    return _checked(NSCoefficients("custom", steps), coefficients)


def _rounding_to(dtype: torch.dtype):
    """x -> x rounded to ``dtype`` and back (kept wide); the identity for fp32 (today's fp32 bits)."""
    if dtype == torch.float32:
        return lambda x: x
    return lambda x: x.to(dtype).to(x.dtype)


def orthogonalize_reference(G, *, steps: int, coefficients: NSCoefficients,
                            compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Batched Newton-Schulz in fp32 (fp64 for fp64 input), or iterated in bf16 (``compute_dtype``, see the
    module docstring: each product computed wide from bf16 values and rounded once). Returns G's shape and
    dtype."""
    rounded = _rounding_to(compute_dtype)
    X = G.to(_checks.compute_dtype(G.dtype))
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.transpose(-2, -1)  # [..., n, m]: make it wide
    norm = torch.linalg.matrix_norm(X, ord="fro", keepdim=True)  # [..., 1, 1]
    X = rounded(X / (norm * coefficients.norm_scale + 1e-7))
    for a, b, c in coefficients.schedule(steps):
        A = rounded(X @ X.transpose(-2, -1))  # [..., m, m]
        B = rounded(b * A + c * (A @ A))
        X = rounded(a * X + B @ X)
    if tall:
        X = X.transpose(-2, -1)
    return X.to(G.dtype)


OPS = (OpSpec("muon_orthogonalize", orthogonalize_reference, family="muon"),)


def orthogonalize(G: torch.Tensor, *, steps: int = DEFAULT_STEPS,
                  coefficients: Union[str, NSCoefficients, Sequence[Coeff]] = "polar_express",
                  compute_dtype: Union[str, torch.dtype] = torch.float32,
                  backend: registry.BackendArg = None) -> torch.Tensor:
    """Approximate polar factor of each matrix of ``G [..., m, n]`` by ``steps`` Newton-Schulz steps, iterated
    in ``compute_dtype`` (torch.float32, torch.bfloat16, their names or ``"auto"``; module docstring).

    Kernels receive ``compute_dtype=torch.bfloat16`` only for bf16 calls: fp32 calls pass what they passed
    before the option existed (G, steps, coefficients), so kernels written then keep working."""
    if not isinstance(G, torch.Tensor):
        raise TypeError(f"G: expected a torch.Tensor [..., m, n], got {type(G).__name__}")
    if G.dim() < 2:
        raise ValueError(f"G: expected rank >= 2 [..., m, n], got shape {tuple(G.shape)}")
    _checks.tensor("G", G, dims=(None,) * G.dim(), legend="[..., m, n]")
    if G.shape[-1] == 0 or G.shape[-2] == 0:
        raise ValueError(f"G: expected non-empty matrices [..., m, n], got shape {tuple(G.shape)}")
    _checks.positive_int("steps", steps)
    schedule = coefficients_for(coefficients)
    dtype = compute_dtype_for(compute_dtype, G.device)
    extra = {} if dtype == torch.float32 else {"compute_dtype": dtype}
    return registry.call("muon_orthogonalize", G, steps=steps, coefficients=schedule, backend=backend, **extra)


def split_heads(weight: torch.Tensor, num_heads: int, dim: int = 0) -> torch.Tensor:
    """Cut a projection into per-head blocks along ``dim`` and stack them first.

    dim=0: [H*d, n] -> [H, d, n] (q_b_proj, kv_b_proj rows);  dim=1: [m, H*d] -> [H, m, d] (o_proj columns).
    """
    _checks.tensor("weight", weight, dims=(None, None), legend="[rows, cols]")
    _checks.positive_int("num_heads", num_heads)
    if dim not in (0, 1):
        raise ValueError(f"dim: expected 0 or 1, got {dim}")
    if weight.shape[dim] % num_heads:
        raise ValueError(f"weight: expected dim {dim} divisible by num_heads={num_heads}, "
                         f"got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    if dim == 0:
        return weight.reshape(num_heads, rows // num_heads, cols)  # [H, d, n]
    return weight.reshape(rows, num_heads, cols // num_heads).permute(1, 0, 2)  # [H, m, d]


def merge_heads(blocks: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`split_heads`."""
    _checks.tensor("blocks", blocks, dims=(None, None, None), legend="[H, rows, cols]")
    if dim not in (0, 1):
        raise ValueError(f"dim: expected 0 or 1, got {dim}")
    H, r, c = blocks.shape
    if dim == 0:
        return blocks.reshape(H * r, c)  # [H*d, n]
    return blocks.permute(1, 0, 2).reshape(r, H * c)  # [m, H*d]
