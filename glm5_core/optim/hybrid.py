"""Muon for hidden matrices + AdamW for the rest, stepped as one optimizer.

Every parameter group carries ``name`` (for logs), ``role`` ("main" or "indexer": which learning-rate
schedule drives it) and ``optimizer`` ("muon" or "adamw"). Both optimizers skip parameters whose
gradient is None, so freezing a part of the model (``requires_grad_(False)`` + ``zero_grad(set_to_none)``)
leaves its weights and optimizer state untouched.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from glm5_core.ops import muon as muon_ops
from glm5_core.optim.muon import SCALE_MODES, Muon
from glm5_core.optim.param_groups import Assignment, assign_parameters


def _field(default, **metadata):
    """A field with the validation metadata the YAML loader reads (``range``, ``open``, ``choices``)."""
    if isinstance(default, (list, dict, tuple)) or dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda: default, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass
class MuonConfig:
    momentum: float = _field(0.95, range=(0.0, 1.0), open=("hi",))
    nesterov: bool = True
    ns_steps: int = _field(5, range=(1, 100))
    coefficients: str = _field("polar_express", choices=tuple(muon_ops.COEFFICIENTS))
    # Newton-Schulz compute dtype: float32, bfloat16 (as torch.optim.Muon), or auto (bf16 where GEMMs are native)
    ns_dtype: str = _field("float32", choices=(*muon_ops.COMPUTE_DTYPES, "auto"))
    scale_mode: str = _field("match_rms_adamw", choices=SCALE_MODES)
    split_heads: bool = True  # Muon Split of q_b_proj / kv_b_proj / o_proj
    lr_ratio: float = _field(1.0, range=(0.0, None), open=("lo",))  # Muon lr = lr_ratio * the schedule's lr


@dataclasses.dataclass
class OptimizerConfig:
    weight_decay: float = _field(0.1, range=(0.0, None))
    betas: tuple[float, float] = _field((0.9, 0.95))
    eps: float = _field(1e-8, range=(0.0, None), open=("lo",))
    grad_clip: float = _field(1.0, range=(0.0, None))  # max global grad norm; 0 disables clipping
    muon: MuonConfig = dataclasses.field(default_factory=MuonConfig)

    def check(self) -> list[str]:
        """Problems the per-field ranges cannot express, one line each."""
        if not all(0.0 <= b < 1.0 for b in self.betas):
            return [f"optimizer.betas: expected two values in [0, 1), got {list(self.betas)}"]
        return []


class HybridOptimizer:
    """A Muon and an AdamW behind one ``step`` / ``zero_grad`` / ``state_dict`` / ``param_groups``."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer], assignments: list[Assignment]):
        self.optimizers = optimizers
        self.assignments = assignments

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, dict]:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state: dict[str, dict]) -> None:
        if set(state) != set(self.optimizers):
            raise ValueError(f"optimizer state: expected parts {sorted(self.optimizers)}, got {sorted(state)}")
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state[name])


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig, *, num_heads: int, lr: float,
                    backend: Optional[str] = None) -> HybridOptimizer:
    """Split ``model``'s parameters by :func:`assign_parameters` and build the two optimizers.

    ``num_heads`` is the attention head count (Muon Split cuts the projections into that many blocks);
    ``lr`` is the initial learning rate of every group (the driver's schedule overwrites it each step).
    """
    assignments = assign_parameters(model, split_heads=cfg.muon.split_heads)
    muon_groups: dict[Optional[int], list[torch.nn.Parameter]] = {}
    adamw_groups: dict[tuple[str, bool], list[torch.nn.Parameter]] = {}
    for a in assignments:
        if a.optimizer == "muon":
            muon_groups.setdefault(a.split_dim, []).append(a.param)
        elif a.optimizer == "adamw":
            adamw_groups.setdefault((a.role, a.weight_decay), []).append(a.param)
    m = cfg.muon
    split_names = {None: "muon", 0: "muon_split_rows", 1: "muon_split_cols"}
    muon_param_groups = [
        dict(params=params, name=split_names[split_dim], role="main", optimizer="muon", lr=lr * m.lr_ratio,
             split_heads=None if split_dim is None else num_heads, split_dim=0 if split_dim is None else split_dim)
        for split_dim, params in sorted(muon_groups.items(), key=lambda kv: -1 if kv[0] is None else kv[0])
    ]
    adamw_param_groups = [
        dict(params=params, name=f"adamw_{role}{'' if decay else '_no_decay'}", role=role, optimizer="adamw", lr=lr,
             weight_decay=cfg.weight_decay if decay else 0.0)
        for (role, decay), params in sorted(adamw_groups.items())
    ]
    optimizers: dict[str, torch.optim.Optimizer] = {}
    if muon_param_groups:
        optimizers["muon"] = Muon(muon_param_groups, lr=lr, momentum=m.momentum, nesterov=m.nesterov,
                                  weight_decay=cfg.weight_decay, ns_steps=m.ns_steps, coefficients=m.coefficients,
                                  ns_dtype=m.ns_dtype, scale_mode=m.scale_mode, backend=backend)
    if adamw_param_groups:
        # foreach=False: one code path on every device, so a resumed run repeats the same float operations.
        optimizers["adamw"] = torch.optim.AdamW(adamw_param_groups, lr=lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                                weight_decay=cfg.weight_decay, foreach=False)
    if not optimizers:
        raise ValueError("model: no trainable parameters (every parameter has requires_grad=False)")
    return HybridOptimizer(optimizers, assignments)
