"""Muon: momentum, then Newton-Schulz orthogonalisation of each matrix update, batched by shape.

Legend: p [rows, cols] a parameter; U its momentum update; with Muon Split a projection is cut into H
per-head blocks (``split_heads``), blocks [H, d, n] (row split) or [H, m, d] (column split), and each
block is orthogonalised and scaled on its own.

One step for a parameter p with gradient g (decoupled weight decay, as AdamW):
    buf = lerp(buf, g, 1 - momentum)                     (an EMA of gradients)
    U   = lerp(g, buf, momentum) if nesterov else buf
    O   = orthogonalize(U) per matrix (per head block with Muon Split)
    p   = p * (1 - lr * weight_decay) - lr * scale(O's matrix shape) * O

Scale modes (the shape is the matrix that was orthogonalised, i.e. the head block under Muon Split):
    "match_rms_adamw" (Moonlight)      0.2 * sqrt(max(rows, cols))  -> update RMS ~0.2, AdamW's lr/decay work
    "original" (Keller Jordan / torch) sqrt(max(1, rows / cols))
Every parameter group may set ``split_heads`` (H) and ``split_dim`` (0: row blocks, 1: column blocks).
Matrices of one shape are stacked and orthogonalised in one batched call.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch

from glm5_core.ops import muon as muon_ops

SCALE_MODES = ("match_rms_adamw", "original")


def update_scale(rows: int, cols: int, mode: str = "match_rms_adamw") -> float:
    """Multiplier of an orthogonalised [rows, cols] update (see the module docstring)."""
    if mode == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if mode == "original":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"scale_mode: expected one of {', '.join(SCALE_MODES)}, got {mode!r}")


def as_matrix(t: torch.Tensor) -> torch.Tensor:
    """A parameter seen as a matrix: [rows, prod(rest)] (conv kernels and the like are flattened)."""
    return t if t.dim() == 2 else t.reshape(t.shape[0], -1)


def _check_hyper(name: str, value, lo: float, hi: float = math.inf, *, hi_open: bool = False) -> None:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = is_number and lo <= value and (value < hi if hi_open else value <= hi)
    if not ok:
        bracket = ")" if hi_open else "]"
        raise ValueError(f"{name}: expected a number in [{lo}, {hi}{bracket}, got {value!r}")


class Muon(torch.optim.Optimizer):
    """Muon for 2-D (or flattened) hidden weight matrices; see the module docstring.

    Group options: lr, momentum, nesterov, weight_decay, ns_steps, coefficients (name or (a, b, c) triples),
    scale_mode, split_heads (None or H), split_dim (0 or 1). ``backend`` selects the orthogonalisation kernel.
    """

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, ns_steps: int = muon_ops.DEFAULT_STEPS,
                 coefficients="polar_express", scale_mode: str = "match_rms_adamw",
                 split_heads: Optional[int] = None, split_dim: int = 0, backend: Optional[str] = None):
        _check_hyper("lr", lr, 0.0)
        _check_hyper("momentum", momentum, 0.0, 1.0, hi_open=True)
        _check_hyper("weight_decay", weight_decay, 0.0)
        update_scale(1, 1, scale_mode)  # validates the mode
        muon_ops.coefficients_for(coefficients)  # validates the schedule
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, ns_steps=ns_steps,
                        coefficients=coefficients, scale_mode=scale_mode, split_heads=split_heads,
                        split_dim=split_dim)
        super().__init__(params, defaults)
        self.backend = backend
        for group in self.param_groups:
            self._check_group(group)

    @staticmethod
    def _check_group(group: dict) -> None:
        for p in group["params"]:
            if p.dim() < 2:
                raise ValueError(f"params: Muon needs matrices (rank >= 2), got a parameter of shape {tuple(p.shape)}; "
                                 "give vectors to AdamW")
        heads = group["split_heads"]
        if heads is None:
            return
        if group["split_dim"] not in (0, 1):
            raise ValueError(f"split_dim: expected 0 (row blocks) or 1 (column blocks), got {group['split_dim']!r}")
        for p in group["params"]:
            size = as_matrix(p).shape[group["split_dim"]]
            if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or size % heads:
                raise ValueError(f"split_heads: expected a positive int dividing dim {group['split_dim']} of "
                                 f"shape {tuple(p.shape)}, got {heads!r}")

    def _momentum_update(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        grad = p.grad
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1.0 - group["momentum"])
        return grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf

    @staticmethod
    def _blocks(update: torch.Tensor, group: dict) -> torch.Tensor:
        """The matrices to orthogonalise, stacked: [n_blocks, m, n]."""
        matrix = as_matrix(update)
        if group["split_heads"] is None:
            return matrix.unsqueeze(0)  # [1, rows, cols]
        return muon_ops.split_heads(matrix, group["split_heads"], dim=group["split_dim"])  # [H, d, n] or [H, m, d]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            # Stack every block of one shape (and dtype/device) into one batched orthogonalisation.
            buckets: Dict[Tuple, List[Tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
            for p in params:
                if p.grad.is_sparse:
                    raise ValueError("params: Muon does not support sparse gradients")
                blocks = self._blocks(self._momentum_update(p, group), group)
                buckets[(tuple(blocks.shape[1:]), blocks.dtype, blocks.device)].append((p, blocks))
            for (shape, _, _), members in buckets.items():
                stacked = torch.cat([blocks for _, blocks in members], dim=0)  # [sum of blocks, m, n]
                ortho = muon_ops.orthogonalize(stacked, steps=group["ns_steps"], coefficients=group["coefficients"],
                                               backend=self.backend)
                scale = update_scale(shape[0], shape[1], group["scale_mode"])
                offset = 0
                for p, blocks in members:
                    n = blocks.shape[0]
                    mine = ortho[offset:offset + n]  # [n, m, n_cols]
                    offset += n
                    if group["split_heads"] is None:
                        matrix = mine[0]
                    else:
                        matrix = muon_ops.merge_heads(mine, dim=group["split_dim"])
                    p.mul_(1.0 - group["lr"] * group["weight_decay"])
                    p.add_(matrix.reshape(p.shape).to(p.dtype), alpha=-group["lr"] * scale)
        return loss


def muon_reference_step(p: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, *, lr: float, momentum: float,
                        nesterov: bool, weight_decay: float, ns_steps: int, coefficients, scale_mode: str,
                        split_heads: Optional[int] = None, split_dim: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """One Muon step on one parameter, written plainly (one head at a time, no batching): the spec the
    optimizer is tested against. Returns (new p, new momentum buffer)."""
    schedule = muon_ops.coefficients_for(coefficients)
    buf = buf + (grad - buf) * (1.0 - momentum)
    update = grad + (buf - grad) * momentum if nesterov else buf
    if split_heads is None:
        heads = [update]
    else:
        heads = list(torch.chunk(update, split_heads, dim=split_dim))
    parts = []
    for block in heads:
        ortho = muon_ops.orthogonalize_reference(block, steps=ns_steps, coefficients=schedule)
        parts.append(ortho * update_scale(block.shape[0], block.shape[1], scale_mode))
    step = parts[0] if split_heads is None else torch.cat(parts, dim=split_dim)
    return p * (1.0 - lr * weight_decay) - lr * step, buf

