"""k-pool top-k inputs shared by the backend tests (odd sizes, a partial tail group, a ragged batch)."""
from __future__ import annotations

import torch

from glm5_core import registry
from glm5_core.ops import dsa

B, S, H, D, KPOOL, TOPK = 2, 19, 3, 16, 4, 8


def inputs(dtype=torch.float32, device="cpu", seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = dict(q=torch.randn(B, S, H, D, generator=g), k=torch.randn(B, S, D, generator=g),
             w=torch.rand(B, S, H, generator=g), gate=torch.randn(B, S, D, generator=g),
             ape=torch.randn(KPOOL, D, generator=g))
    return {k: v.to(dtype).to(device) for k, v in x.items()}


def check_backend(backend: str, dtype=torch.float32, device="cpu") -> None:
    """The kernel runs (no reference fallback), gives the reference's indices, and prefill = decode bitwise."""
    x = inputs(dtype, device)
    kw = dict(topk=TOPK, kpool=KPOOL, select_tail=True)
    with registry.record_reference_runs() as log:
        got = dsa.kpool_topk(**x, **kw, backend=backend)
    assert not log, log
    want = registry.reference("dsa_kpool_topk")(**x, **kw, scale=D ** -0.5)
    assert got.dtype == torch.int32 and torch.equal(got.cpu(), want.cpu())
    for t in (2, S - 1):
        one = dsa.kpool_topk(x["q"][:, t:t + 1], x["k"][:, :t + 1], x["w"][:, t:t + 1], x["gate"][:, :t + 1],
                             x["ape"], start_pos=t, **kw, backend=backend)
        assert torch.equal(one[:, 0], got[:, t]), t
    rows = lambda v: torch.stack([v[0, 8:11], v[1, 13:16]])  # noqa: E731  row 0 at positions 8.., row 1 at 13..
    ragged = dsa.kpool_topk(rows(x["q"]), x["k"], rows(x["w"]), x["gate"], x["ape"],
                            start_pos=torch.tensor([8, 13], dtype=torch.int32, device=device), **kw, backend=backend)
    assert torch.equal(ragged[0], got[0, 8:11]) and torch.equal(ragged[1], got[1, 13:16])
