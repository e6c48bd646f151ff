"""The replay tensors of a micro-batch: the samples' recorded traces, right-padded for the trainer's forward.

Legend: B samples, T padded length, M main MoE layers, K experts per token, F full-indexer layers, Ki index_topk.

A sample's trace covers positions ``0 .. L-2`` (every token but the last, whose output no loss reads). The
last position, the padding and samples the engine returned no trace for are -1 rows: the model selects there
as usual (``glm5_core.model.replay``). A trace whose shape does not match the sample and the model is refused
(``ValueError``); its values are checked by the model before use.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from glm5_core.rl.rollout.trajectory import Sample

TRACES = {"routing": "routed_experts", "index": "indexer_topk"}  # replay kind -> Sample attribute


def pad_traces(samples: Sequence[Sample], kind: str, layers: int, width: int, device=None
               ) -> tuple[torch.Tensor, int]:
    """int64 [B, T, layers, width] (-1 where nothing is replayed) and the number of samples without a trace."""
    attr = TRACES[kind]
    T = max(len(s.tokens) for s in samples)
    out = torch.full((len(samples), T, layers, width), -1, dtype=torch.int64)
    untraced = 0
    for i, s in enumerate(samples):
        trace = getattr(s, attr)
        if trace is None:
            untraced += 1
            continue
        expected = (len(s.tokens) - 1, layers, width)
        if not isinstance(trace, torch.Tensor) or tuple(trace.shape) != expected:
            got = tuple(trace.shape) if isinstance(trace, torch.Tensor) else type(trace).__name__
            raise ValueError(f"samples[{i}].{attr}: expected a tensor of shape {expected} "
                             f"(tokens - 1, layers, width), got {got}")
        out[i, :expected[0]] = trace.to(torch.int64)
    return out.to(device), untraced
