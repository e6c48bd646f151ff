"""The replay tensors of a micro-batch: the samples' recorded traces, right-padded for the trainer's forward.

Legend: B samples, T padded length, M main MoE layers, K experts per token, F full-indexer layers, Ki index_topk.

A sample's trace covers positions ``0 .. L-2`` (every token but the last, whose output no loss reads), as the
engine sent it: int32 [L-1, num_hidden_layers * width], SGLang's per-layer wire array
(``glm5_core.rl.serving.replay_trace``), from which the model's layout picks the main MoE / full-indexer layers. The
last position, the padding and samples the engine returned no trace for are -1 rows: the model selects there
as usual (``glm5_core.model.replay``). A trace whose shape does not match the sample and the model is refused
(``ValueError``); its values are checked by the model before use.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from glm5_core.rl.rollout.trajectory import Sample
from glm5_core.rl.serving.replay_trace import TraceLayout, select

TRACES = {"routing": "routed_experts", "index": "indexer_topk"}  # replay kind -> Sample attribute


def pad_traces(samples: Sequence[Sample], kind: str, layout: TraceLayout, width: int, device=None
               ) -> tuple[torch.Tensor, int]:
    """int64 [B, T, layers, width] (-1 where nothing is replayed; layers: the model's main MoE layers for
    ``routing``, its full-indexer layers for ``index``) and the number of samples without a trace."""
    attr = TRACES[kind]
    wire_layers, rows = layout.wire(kind)
    T = max(len(s.tokens) for s in samples)
    out = torch.full((len(samples), T, len(rows), width), -1, dtype=torch.int64)
    untraced = 0
    for i, s in enumerate(samples):
        trace = getattr(s, attr)
        if trace is None:
            untraced += 1
            continue
        positions = len(s.tokens) - 1
        if not isinstance(trace, torch.Tensor) or trace.dim() != 2 or trace.shape[0] != positions:
            got = tuple(trace.shape) if isinstance(trace, torch.Tensor) else type(trace).__name__
            raise ValueError(f"samples[{i}].{attr}: expected a tensor of {positions} positions (tokens - 1) x "
                             f"layers * width, got {got}")
        out[i, :positions] = select(trace, f"samples[{i}].{attr}", wire_layers=wire_layers, layers=rows,
                                    width=width).to(torch.int64)
    return out.to(device), untraced
