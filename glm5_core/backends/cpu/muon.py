"""cpu backend kernel for Muon's Newton-Schulz orthogonalisation.

The iteration runs in C++ with the coefficient scaling fused into the GEMM calls (three GEMMs per step,
buffers allocated once), instead of the reference's six tensor ops per step. Normalisation and the
tall-matrix transposition are the reference's. Legend as in ``glm5_core.ops.muon``: G [..., m, n].

bf16 compute: the buffers are bf16 and so are the GEMMs; ATen's CPU bf16 mm / bmm / addmm / baddbmm (oneDNN)
accumulate in fp32 and apply the alpha / beta epilogue before the one rounding to bf16, which is the
reference's rounding rule (each product rounded once), up to the fp32 accumulation order.

Batching policy: a batch of matrices runs as one batched GEMM per product, except when the matrices are
large enough that a per-matrix loop of plain GEMMs is faster on CPU (batched GEMM splits threads across
the batch instead of inside each product). ``LOOP_MIN_ELEMENTS`` is that crossover, measured by
``benchmarks/bench_muon.py::test_batching_policy`` (results in ``benchmarks/results/``): here the
batched call was as fast or faster for every shape measured, up to 32 x 128 x 4096 (1.23x), so the loop is
kept only for very large matrices (untested territory, where one GEMM already fills the cores).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from glm5_core.kernel import Kernel
from glm5_core.ops import _checks
from glm5_core.ops.muon import NSCoefficients

LOOP_MIN_ELEMENTS = 1 << 23  # m * n at or above which a batch is looped matrix by matrix


def use_loop(batch: int, m: int, n: int) -> bool:
    """The batching policy: loop over the batch for large matrices, one batched call for small ones."""
    return batch > 1 and m * n >= LOOP_MIN_ELEMENTS


def orthogonalize(G, *, steps: int, coefficients: NSCoefficients,
                  compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Newton-Schulz in fp32 (fp64 for fp64 input) or in bf16 (``compute_dtype``). Returns G's shape and dtype."""
    X = G.to(_checks.compute_dtype(G.dtype))
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.transpose(-2, -1)  # [..., n, m]: make it wide
    lead, (m, n) = X.shape[:-2], X.shape[-2:]
    X = X.reshape(-1, m, n)  # [P, m, n]
    norm = torch.linalg.matrix_norm(X, ord="fro", keepdim=True)  # [P, 1, 1]
    X = X / (norm * coefficients.norm_scale + 1e-7)
    if compute_dtype == torch.bfloat16:
        X = X.to(torch.bfloat16)  # normalised wide, rounded once
    schedule = torch.tensor(coefficients.schedule(steps), dtype=torch.float64)  # [steps, 3]
    X = torch.ops.glm5_cpu.ns_orthogonalize(X, schedule, use_loop(X.shape[0], m, n))
    X = X.reshape(*lead, m, n)
    if tall:
        X = X.transpose(-2, -1)
    return X.to(G.dtype)


def _supports(G, *, steps: int, coefficients: NSCoefficients, compute_dtype: torch.dtype = torch.float32):
    if G.device.type != "cpu":
        return False, f"native CPU kernels need CPU tensors, got {G.device}"
    return True, ""


# No backward (optimizer-side only): a call needing gradients runs the reference.
KERNELS: Mapping[str, Kernel] = {"muon_orthogonalize": Kernel(orthogonalize, supports=_supports)}
