"""Policy loss with direct double-sided importance sampling and token masking.

Legend: B samples, T tokens (targets, already shifted so that position t scores token t).

r_t = exp(log pi_theta(a_t) - log pi_rollout(a_t)) with log pi_rollout recorded by the engine at sampling
time (no old-policy recompute). f(r) = r inside the band (1 - eps_l, 1 + eps_h), 0 outside: out-of-band
tokens get no gradient. L = -sum_t f(r_t) A_t log pi_theta(a_t) / (number of loss-mask tokens), with f(r_t)
a constant (stop-gradient), so the gradient is r_t A_t grad log pi_theta - the importance-weighted policy
gradient - for in-band tokens.

``train.loss`` names a built-in (:func:`losses`) or a plug-in with the signature of
:func:`double_sided_is_loss` returning a :class:`LossStats`.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch


@dataclasses.dataclass
class LossStats:
    loss: torch.Tensor
    masked_fraction: float  # of loss-mask tokens, share zeroed by the IS band
    mean_abs_logprob_diff: float  # |log pi_theta - log pi_rollout| over loss-mask tokens
    mean_ratio: float
    num_tokens: int


def double_sided_is_loss(logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, advantages_BT: torch.Tensor,
                         loss_mask_BT: torch.Tensor, *, eps_low: float, eps_high: float) -> LossStats:
    if not 0.0 < eps_low <= 1.0:
        raise ValueError(f"eps_low: expected a float in (0, 1], got {eps_low!r}")
    if not eps_high > 0.0:
        raise ValueError(f"eps_high: expected a float > 0, got {eps_high!r}")
    shape = logp_BT.shape
    for name, t in (("rollout_logp", rollout_logp_BT), ("advantages", advantages_BT), ("loss_mask", loss_mask_BT)):
        if t.shape != shape:
            raise ValueError(f"{name}: expected shape {tuple(shape)} like logp, got {tuple(t.shape)}")
    mask = loss_mask_BT.to(logp_BT.dtype)
    log_ratio = (logp_BT.detach() - rollout_logp_BT).clamp(max=20.0)
    ratio = torch.exp(log_ratio)
    in_band = ((ratio > 1.0 - eps_low) & (ratio < 1.0 + eps_high)).to(logp_BT.dtype)
    weight = (ratio * in_band * mask).detach()  # f(r_t) on loss tokens, a constant
    n_tokens = int(mask.sum().item())
    denom = max(n_tokens, 1)
    loss = -(weight * advantages_BT * logp_BT).sum() / denom
    masked = float(((1.0 - in_band) * mask).sum().item()) / denom
    diff = float(((logp_BT.detach() - rollout_logp_BT).abs() * mask).sum().item()) / denom
    mean_ratio = float((ratio * mask).sum().item()) / denom
    return LossStats(loss, masked, diff, mean_ratio, n_tokens)


LossFn = Callable[..., LossStats]


def losses() -> dict[str, LossFn]:
    return {"double_sided_is": double_sided_is_loss}


def resolve_loss(value, key: str = "train.loss") -> LossFn:
    """The loss ``value`` names, checked on a one-token batch (a plug-in that does not take the built-in's
    arguments or returns no :class:`LossStats` with a scalar ``loss`` is refused here, at start)."""
    from glm5_core.rl.plugins import resolve_callable

    fn = resolve_callable(value, losses(), key)
    probe = torch.zeros(1, 1, requires_grad=True)
    try:
        out = fn(probe, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), eps_low=0.2, eps_high=0.28)
    except Exception as exc:
        raise ValueError(f"{key}: {value!r} failed on a one-token batch ({type(exc).__name__}: {exc})") from None
    if not isinstance(out, LossStats) or not isinstance(out.loss, torch.Tensor) or out.loss.dim() != 0:
        raise ValueError(f"{key}: {value!r} must return a LossStats with a scalar tensor loss, got "
                         f"{type(out).__name__}")
    return fn
