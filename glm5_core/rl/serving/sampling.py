"""Temperature / top-p sampling with the log-probability of each sampled token.

Legend: B rows being decoded, V vocabulary.

The recorded log-prob is that of the distribution the trainer's importance ratio refers to: the
temperature-scaled softmax over the full vocabulary (``log_softmax(logits / temperature)``). Top-p only
restricts which tokens may be drawn; like SGLang's ``return_logprob`` it does not renormalise the recorded
value, so the trainer can recompute it from logits alone.
"""
from __future__ import annotations

from typing import Optional

import torch

from glm5_core.rl.config import (  # noqa: F401 (importable here too)
    GREEDY_BELOW,
    check_top_p,
    check_training_temperature,
)

FIRST_TOPK = 256  # top_p_filter's first partial sort width (a peaked nucleus fits; a wider one grows it 4x)


def token_logprobs(logits_BV: torch.Tensor, tokens_B: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature)[tokens] in fp32: [B, V], [B] -> [B]. Works on any leading dims."""
    scaled = logits_BV.float() / max(float(temperature), GREEDY_BELOW)
    logp = torch.log_softmax(scaled, dim=-1)
    return logp.gather(-1, tokens_B.long().unsqueeze(-1)).squeeze(-1)


def top_p_filter(logits_BV: torch.Tensor, top_p_B: torch.Tensor) -> torch.Tensor:
    """Set to -inf every token outside the smallest set whose probability mass reaches top_p (per row).

    The most likely token always survives; ties in probability keep the lower token id first. A row with
    top_p >= 1 keeps every token: its fp32 running sum can reach 1.0 before the tail of a large vocabulary
    (rounding), which would otherwise drop thousands of tokens of nonzero probability.

    The kept set is that of a full stable descending sort of the probabilities (``sorted_top_p_filter``,
    the spec), found from a partial one: ``torch.topk`` of a growing ``k`` until every row's nucleus ends
    inside its top k. The top k values are the sorted order's first k whatever the order among equal values
    (equal values in any order give the same running sums), so the cut position is the full sort's; the
    tokens at the cut that tie with the last kept value are then taken lowest id first, as the stable sort
    would. Rows with top_p >= 1 are not sorted at all."""
    nucleus = top_p_B < 1.0  # [B]
    if not bool(nucleus.any()):
        return logits_BV
    rows = nucleus.nonzero().squeeze(-1)  # [R] rows with a nucleus
    probs = torch.softmax(logits_BV[rows], dim=-1)  # [R, V]
    top_p_R1 = top_p_B[rows].unsqueeze(-1)  # [R, 1]
    V = probs.shape[-1]
    k = min(V, FIRST_TOPK)
    while True:
        values = torch.topk(probs, k, dim=-1, sorted=True).values  # [R, k], descending
        mass_before = torch.cumsum(values, dim=-1) - values  # [R, k] mass of strictly better positions
        if k == V or bool((mass_before[:, -1] >= top_p_R1[:, 0]).all()):  # every cut falls inside the top k
            break
        k = min(V, 4 * k)
    n_keep = (mass_before < top_p_R1).sum(-1, keepdim=True)  # [R, 1] >= 1: position 0 has mass_before 0
    last_kept = values.gather(-1, n_keep - 1)  # [R, 1] probability of the last kept position
    keep = probs > last_kept  # [R, V] every token strictly more likely than the cut
    ties = probs == last_kept  # [R, V] tokens tied with the cut: the lowest ids fill the remaining places
    keep |= ties & (torch.cumsum(ties.to(torch.int64), dim=-1) <= n_keep - keep.sum(-1, keepdim=True))
    drop = torch.zeros(logits_BV.shape, dtype=torch.bool, device=logits_BV.device)  # [B, V]
    drop[rows] = ~keep
    return logits_BV.masked_fill(drop, float("-inf"))



def sorted_top_p_filter(logits_BV: torch.Tensor, top_p_B: torch.Tensor) -> torch.Tensor:
    """``top_p_filter`` by a full stable sort of every row: the definition the fast path is tested against."""
    probs = torch.softmax(logits_BV, dim=-1)
    order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(order.values, dim=-1) - order.values  # [B, V] mass of strictly better tokens
    top_p_B1 = top_p_B.unsqueeze(-1)  # [B, 1]
    drop_sorted = (mass_before >= top_p_B1) & (top_p_B1 < 1.0)  # [B, V]
    drop = torch.zeros_like(drop_sorted).scatter(-1, order.indices, drop_sorted)
    return logits_BV.masked_fill(drop, float("-inf"))


def sample(logits_BV: torch.Tensor, temperature_B: torch.Tensor, top_p_B: torch.Tensor,
           generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row. Returns (tokens int64 [B], logprobs fp32 [B]).

    Rows with temperature below ``GREEDY_BELOW`` (0 included) decode greedily (lowest id among equal maxima)
    and record the temperature-1 log-prob of the chosen token: that value is no sampling probability, so greedy
    rows are for evaluation only (training rollouts reject them, see ``check_training_temperature``).

    A batch of greedy rows only is an argmax: no filter, no softmax of the draw, no ``multinomial`` (and no
    generator state consumed). Otherwise every row is drawn, greedy ones too, so a seeded generator gives the
    same tokens whatever the batch's mix; rows with top_p >= 1 skip the nucleus filter (it keeps every token)."""
    logits = logits_BV.float()
    greedy = temperature_B < GREEDY_BELOW
    temp = torch.where(greedy, torch.ones_like(temperature_B), temperature_B).float()  # [B]
    scaled = logits / temp.unsqueeze(-1)  # [B, V]
    logp_full = torch.log_softmax(scaled, dim=-1)
    argmax = torch.argmax(logits, dim=-1)  # first maximum = lowest id
    if bool(greedy.all()):
        tokens = argmax
    else:
        probs = torch.softmax(top_p_filter(scaled, top_p_B.float()), dim=-1)
        drawn = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # [B]
        tokens = torch.where(greedy, argmax, drawn)
    return tokens, logp_full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
