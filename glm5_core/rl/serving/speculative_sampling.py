"""Speculative sampling: accept a prefix of draft tokens so that emitted tokens follow the target distribution.

Legend: B rows, d draft tokens per row, V vocabulary.

The rule of Leviathan et al. (2023, "Fast Inference from Transformers via Speculative Decoding") and Chen et al.
(2023, "Accelerating LLM Decoding with Speculative Sampling"), as vLLM's ``RejectionSampler`` applies it: draft
token ``y_j ~ q_j`` is accepted with probability ``min(1, p_j(y_j) / q_j(y_j))``; at the first rejection the
emitted token is drawn from the residual ``max(0, p_j - q_j)`` (normalised); when all d drafts are accepted a
bonus token is drawn from ``p_d``. Every emitted token then follows the target distribution ``p`` exactly.

``p`` and ``q`` are the distributions :func:`glm5_core.rl.serving.sampling.sample` draws from: the softmax of
``logits / temperature`` restricted to the top-p nucleus. Greedy rows (temperature below ``GREEDY_BELOW``) use
one-hot distributions at the argmax, which makes the same rule accept a draft iff it is the target's argmax and
emit the target's argmax otherwise: exactly plain greedy decoding.

Randomness: every draw (drafts, acceptance tests, the last token) takes one given uniform number and inverts the
cumulative distribution (:func:`draw`), so a step's random numbers can be drawn up front, per row, from the
row's own generator (a request's ``sampling_seed``) and every row is then sampled in one batched call.
"""
from __future__ import annotations

from typing import Optional

import torch

from glm5_core.rl.serving.sampling import GREEDY_BELOW, top_p_filter


def sampling_probs(logits: torch.Tensor, temperature_B: torch.Tensor, top_p_B: Optional[torch.Tensor],
                   any_greedy: Optional[bool] = None) -> torch.Tensor:
    """The distribution ``sample`` draws from: [B, ..., V] logits, [B] temperature / top_p -> fp32 [B, ..., V].
    ``top_p_B`` None: every row keeps the whole vocabulary (top_p 1, no filter to run). ``any_greedy`` False
    (the caller knows no row is greedy): the one-hot branch is skipped; None: it is found from the temperatures."""
    shape = logits.shape
    B, V = shape[0], shape[-1]
    rows = logits.float().reshape(B, -1, V)  # [B, N, V]
    N = rows.shape[1]
    greedy_B = temperature_B < GREEDY_BELOW
    if any_greedy is None:
        any_greedy = bool(greedy_B.any())
    temp_B = torch.where(greedy_B, torch.ones_like(temperature_B), temperature_B).float() if any_greedy \
        else temperature_B.float()
    scaled = (rows / temp_B.view(B, 1, 1)).reshape(B * N, V)  # [B*N, V]
    if top_p_B is not None:
        scaled = top_p_filter(scaled, top_p_B.float().repeat_interleave(N))  # top_p per row [B*N]
    probs = torch.softmax(scaled, dim=-1).reshape(B, N, V)
    if not any_greedy:
        return probs.reshape(shape)
    one_hot = torch.zeros_like(probs).scatter_(-1, rows.argmax(-1, keepdim=True), 1.0)  # first maximum
    return torch.where(greedy_B.view(B, 1, 1), one_hot, probs).reshape(shape)


def draw(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row by inverting the cumulative distribution: weights [B, V] (>= 0, any positive total; need
    not be normalised), uniform [B] in [0, 1) -> int64 [B]. Token t is drawn with probability weights[t] / total;
    a token of weight 0 never is (even when rounding puts ``uniform * total`` on the total itself)."""
    cdf = weights.cumsum(-1)  # [B, V]
    target = (uniform.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)  # [B, 1]
    token = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [B] first index whose cdf exceeds target
    last_positive = (weights > 0).cumsum(-1).argmax(-1)  # [B] the last token of positive weight
    return torch.minimum(token, last_positive)


def full_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature_B: torch.Tensor) -> torch.Tensor:
    """What the engine records per token (as ``sample`` does): ``log_softmax(logits / T)`` over the full vocabulary,
    temperature 1 for greedy rows. [B, N, V], [B, N] -> fp32 [B, N]."""
    greedy_B = temperature_B < GREEDY_BELOW
    temp_B = torch.where(greedy_B, torch.ones_like(temperature_B), temperature_B).float()
    logp = torch.log_softmax(logits.float() / temp_B.view(-1, 1, 1), dim=-1)
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def accept_drafts(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                  generator: Optional[torch.Generator] = None, uniforms: Optional[torch.Tensor] = None,
                  limit: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the rejection rule to every row at once.

    target_probs [B, d+1, V] (``p_j`` for the token after draft j-1; position d is the bonus), draft_tokens
    [B, d] (``y_j ~ q_j``), draft_probs [B, d, V]. ``uniforms`` [B, d+1] in [0, 1): the row's d acceptance tests,
    then the draw of its last token (default: drawn from ``generator``). ``limit`` int64 [B] in [1, d] (default d):
    row b tests only its first ``limit[b]`` drafts, as if it had drafted that many (its bonus is drawn from
    ``p_limit``). Returns (tokens int64 [B, d+1]: the accepted drafts, then the corrected or bonus token at index
    ``accepted``, then padding; accepted int64 [B] in [0, limit])."""
    B, d1, V = target_probs.shape
    d = d1 - 1
    if tuple(draft_tokens.shape) != (B, d) or tuple(draft_probs.shape) != (B, d, V):
        raise ValueError(f"draft_tokens / draft_probs: expected [{B}, {d}] / [{B}, {d}, {V}], got "
                         f"{tuple(draft_tokens.shape)} / {tuple(draft_probs.shape)}")
    if uniforms is None:
        uniforms = torch.rand(B, d + 1, generator=generator, device=target_probs.device)
    elif tuple(uniforms.shape) != (B, d + 1):
        raise ValueError(f"uniforms: expected [{B}, {d + 1}], got {tuple(uniforms.shape)}")
    y = draft_tokens.long()
    p_y = target_probs[:, :d].gather(-1, y.unsqueeze(-1)).squeeze(-1)  # [B, d]
    q_y = draft_probs.gather(-1, y.unsqueeze(-1)).squeeze(-1)  # [B, d], > 0: y was drawn from q
    accept = uniforms[:, :d].to(q_y.dtype) * q_y < p_y  # u < p / q without dividing
    if limit is not None:  # drafts past a row's limit are never tested
        accept &= torch.arange(d, device=accept.device) < limit.view(B, 1)
    accepted = torch.cumprod(accept.long(), dim=1).sum(dim=1)  # [B] leading accepted drafts
    idx = accepted.view(B, 1, 1).expand(B, 1, V)
    p_k = target_probs.gather(1, idx).squeeze(1)  # [B, V]
    tested = accepted < (limit if limit is not None else d)  # [B] stopped at a rejected draft (else: the bonus)
    q_k = draft_probs.gather(1, idx.clamp_max(d - 1)).squeeze(1) * tested.view(B, 1).to(draft_probs.dtype)
    residual = (p_k - q_k).clamp_min(0.0)  # [B, V]; q = 0 at the bonus
    # p == q up to rounding leaves no residual mass; then any rejection was a rounding artefact: draw from p
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p_k, residual)
    next_token = draw(residual, uniforms[:, d])  # [B]
    tokens = torch.cat((y, y.new_zeros(B, 1)), dim=1).scatter_(1, accepted.unsqueeze(1), next_token.unsqueeze(1))
    return tokens, accepted  # tokens [B, d+1]
