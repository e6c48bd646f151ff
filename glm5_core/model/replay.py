"""Routing replay and DSA index replay: the trainer's forward uses the experts / keys the rollout engine chose.

Legend: B batch, T tokens, M main MoE layers, K num_experts_per_tok, F full-indexer main layers, Ki index_topk,
E n_routed_experts.

* ``routing_replay`` int [B, T, M, K]: per token and main MoE layer, the expert ids to use. The routing weights
  are recomputed from the forward's own router logits at those ids (``glm5_core.ops.moe.route_weights``), so
  the router still learns through the replayed experts' weights, as Megatron's R3 and slime's
  ``--use-rollout-routing-replay`` do (scores gathered at the replayed ids, renormalised, scaled).
* ``index_replay`` int [B, T, F, Ki]: per token and full-indexer layer, the selected key positions (the DSA
  top-k contract: valid positions first, -1 padding after); "shared" layers reuse their full layer's keys.
* A row (one token, one layer) of all -1 is not replayed: that token is routed / selects keys as usual (the
  last token of a sample and padding, whose outputs no loss reads).

Replayed ids come from the network (engine -> gateway -> trainer), so :func:`check_routing` /
:func:`check_index` verify dtype, shape and values before any of them indexes a tensor. The engine stores
ids compactly (:func:`expert_id_dtype`, :func:`key_id_dtype`): 1 byte per expert id up to 256 experts.
"""
from __future__ import annotations

from typing import Union

import torch

from glm5_core.ops._checks import query_positions, value_checks_enabled

StartPos = Union[int, torch.Tensor]
INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def expert_id_dtype(num_experts: int) -> torch.dtype:
    """The smallest dtype holding expert ids ``[0, num_experts)``: uint8 up to 256 experts, else int16 / int32."""
    if num_experts <= 256:
        return torch.uint8
    return torch.int16 if num_experts <= 2 ** 15 else torch.int32


def key_id_dtype(max_len: int) -> torch.dtype:
    """The smallest signed dtype holding key positions ``[0, max_len)`` and the -1 padding."""
    return torch.int16 if max_len <= 2 ** 15 else torch.int32


def _check_tensor(name: str, value, shape, legend: str) -> None:
    if not isinstance(value, torch.Tensor) or value.dtype not in INT_DTYPES:
        got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{name}: expected an integer tensor {legend}, got {got}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {legend} = {tuple(shape)}, got {tuple(value.shape)}")


def check_routing(routing: torch.Tensor, *, batch: int, tokens: int, moe_layers: int, top_k: int,
                  num_experts: int) -> None:
    """ValueError unless ``routing`` is int [B, T, M, K] whose rows are all -1 (not replayed) or K distinct
    expert ids in [0, E)."""
    _check_tensor("routing_replay", routing, (batch, tokens, moe_layers, top_k), "[B, T, M, K]")
    if not value_checks_enabled() or not routing.numel():
        return
    ids = routing.long()  # uint8 ids stay non-negative; every check below is in int64
    missing = ids < 0  # [B, T, M, K]
    ordered = ids.sort(dim=-1).values
    flags = torch.stack([
        ids.min() < -1, ids.max() >= num_experts,
        (missing.any(-1) & ~missing.all(-1)).any(),  # a row partly replayed
        ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any(),  # an expert twice in a row
    ]).tolist()
    if flags[0] or flags[1]:
        raise ValueError(f"routing_replay: expected expert ids in [0, {num_experts}) or -1 (not replayed), "
                         f"got range [{int(ids.min())}, {int(ids.max())}]")
    if flags[2]:
        raise ValueError("routing_replay: expected each (token, layer) row to be all expert ids or all -1, "
                         "got a row mixing both")
    if flags[3]:
        raise ValueError("routing_replay: expected distinct expert ids within a (token, layer) row, "
                         "got an expert repeated")


def check_index(index: torch.Tensor, *, batch: int, tokens: int, full_layers: int, topk: int,
                start_pos: StartPos) -> None:
    """ValueError unless ``index`` is int [B, T, F, Ki] whose rows are all -1 (not replayed) or distinct causal
    key positions (<= the query's absolute position) followed by -1 padding."""
    _check_tensor("index_replay", index, (batch, tokens, full_layers, topk), "[B, T, F, Ki]")
    if not value_checks_enabled() or not index.numel():
        return
    keys = index.long()  # [B, T, F, Ki]
    pos = query_positions(start_pos, batch, tokens, index.device).view(batch, tokens, 1, 1)  # [B, T, 1, 1]
    pad = keys < 0
    ordered = keys.sort(dim=-1).values
    flags = torch.stack([
        (keys < -1).any(), (keys > pos).any(),
        (pad[..., :-1] & ~pad[..., 1:]).any(),  # a key after padding
        ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any(),
    ]).tolist()
    if flags[0] or flags[1]:
        raise ValueError("index_replay: expected key positions in [0, the query's position] or -1, got "
                         f"range [{int(keys.min())}, {int(keys.max())}] (a key after its query breaks causality)")
    if flags[2]:
        raise ValueError("index_replay: expected the -1 padding after the selected keys, got a key after -1")
    if flags[3]:
        raise ValueError("index_replay: expected distinct keys within a (token, layer) row, got a key repeated")
