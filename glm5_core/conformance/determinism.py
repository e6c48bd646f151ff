"""The ``determinism`` conformance family: what makes a backend's top-k RL-stable.

* repeatability: the same call twice gives the same bits;
* batch invariance: a query row gives the same bits alone, in any batch, and in any chunking of the
  queries (with the matching ``start_pos``);
* prefill/decode consistency: the top-k of a query computed with all queries at once (prefill) equals,
  bitwise, the top-k computed for that query alone against a cache of the keys so far (decode), also
  when the cache is a larger preallocated buffer whose tail holds garbage, including for keys whose scores
  differ only by rounding (near ties);
* the same three for the k-pool indexer's top-k (``dsa.kpool_topk``, GLM-5.3: pooled keys, the tail group);
* backward repeatability: the gradients of the trained ops with kernels of their own (sparse MLA prefill,
  the routed experts) are the same bits run to run (no atomics in their backward).

Each check returns a :class:`glm5_core.testing.Comparison` and runs on the tensors' device of the backend.
"""
from __future__ import annotations

from typing import Callable

import torch

from glm5_core import testing
from glm5_core.conformance.check import Check
from glm5_core.ops import dsa, moe

DETERMINISM_SHAPE = testing.IndexerShape(B=3, T=11, S=29, H=4, D=16, K=6)
KPOOL, KPOOL_TOPK = 3, 6  # the k-pool checks: pools of 3 keys (29 slots: 9 pools and a partial one), 2 pools kept


def _mismatch(what: str) -> testing.Comparison:
    return testing.Comparison(False, float("inf"), 0.0, what)


def _ok(what: str) -> testing.Comparison:
    return testing.Comparison(True, 0.0, 0.0, what)


def _inputs(device: str, ties=None, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """q, k, w (and, for the k-pool checks, the keys' compress-gate projections and the pool's ape)."""
    x = testing.make_indexer_inputs(DETERMINISM_SHAPE, dtype=dtype, device=device, seed=11, ties=ties)
    s = DETERMINISM_SHAPE
    gate = testing.randn((s.B, s.S, s.D), seed=12, dtype=dtype, device=device)
    if ties == "duplicate_keys":  # the keys repeat with period 3 = KPOOL: equal gates too, so every pool ties
        gate = gate[:, :3].repeat(1, -(-s.S // 3), 1)[:, :s.S]
    return {**x, "gate": gate, "ape": testing.randn((KPOOL, s.D), seed=13, dtype=dtype, device=device)}


def _topk(x: dict[str, torch.Tensor], kpool: bool, q, k, w, *, start_pos, backend: str, gate=None) -> torch.Tensor:
    """The top-k under test: the indexer's (``dsa.indexer_topk``) or the k-pool indexer's (``dsa.kpool_topk``, its
    compress-gate projections ``gate`` sliced as the keys ``k``)."""
    if not kpool:
        return dsa.indexer_topk(q, k, w, DETERMINISM_SHAPE.K, start_pos=start_pos, backend=backend)
    gate = x["gate"][:, :k.shape[1]] if gate is None else gate
    return dsa.kpool_topk(q, k, w, gate, x["ape"], topk=KPOOL_TOPK, kpool=KPOOL, select_tail=True,
                          start_pos=start_pos, backend=backend)


def topk_repeatability(backend: str, device: str, runs: int = 3, kpool: bool = False) -> testing.Comparison:
    x = _inputs(device)
    S, T = DETERMINISM_SHAPE.S, DETERMINISM_SHAPE.T
    first = _topk(x, kpool, x["q"], x["k"], x["w"], start_pos=S - T, backend=backend)
    for i in range(1, runs):
        again = _topk(x, kpool, x["q"], x["k"], x["w"], start_pos=S - T, backend=backend)
        if not torch.equal(first, again):
            return _mismatch(f"run {i} differs from run 0")
    return _ok(f"{runs} runs bitwise identical")


def topk_batch_invariance(backend: str, device: str, ties=None, kpool: bool = False) -> testing.Comparison:
    x = _inputs(device, ties)
    s = DETERMINISM_SHAPE
    base = s.S - s.T
    full = _topk(x, kpool, x["q"], x["k"], x["w"], start_pos=base, backend=backend)  # [B, T, K]
    for b in range(s.B):  # each batch row alone
        alone = _topk(x, kpool, x["q"][b:b + 1], x["k"][b:b + 1], x["w"][b:b + 1], start_pos=base,
                      backend=backend, gate=x["gate"][b:b + 1])
        if not torch.equal(alone[0], full[b]):
            return _mismatch(f"batch row {b} alone differs from the batched call")
    for chunk in (7,) if kpool else (1, 4, 7):  # the queries in chunks, keys unchanged (k-pool: fewer calls)
        for t0 in range(0, s.T, chunk):
            part = _topk(x, kpool, x["q"][:, t0:t0 + chunk], x["k"], x["w"][:, t0:t0 + chunk],
                         start_pos=base + t0, backend=backend)
            if not torch.equal(part, full[:, t0:t0 + chunk]):
                return _mismatch(f"query chunk [{t0}, {t0 + chunk}) of size {chunk} differs from the full call")
    ragged = torch.tensor([base, base - 3, 0], dtype=torch.int64, device=device)
    together = _topk(x, kpool, x["q"], x["k"], x["w"], start_pos=ragged, backend=backend)
    for b in range(s.B):
        alone = _topk(x, kpool, x["q"][b:b + 1], x["k"][b:b + 1], x["w"][b:b + 1], start_pos=int(ragged[b]),
                      backend=backend, gate=x["gate"][b:b + 1])
        if not torch.equal(alone[0], together[b]):
            return _mismatch(f"ragged batch: row {b} differs from the same row with an int start_pos")
    return _ok(f"rows, query chunks ({'7' if kpool else '1, 4, 7'}) and ragged batches bitwise identical to the "
               f"batched call")


def _near_tied_inputs(device: str) -> dict[str, torch.Tensor]:
    """Key t = key t-1 + a nudge orthogonal to every head of query t (t >= 1): the two index scores are equal
    in exact arithmetic, so query t's order between them is decided by rounding alone. Random inputs almost
    never have such pairs; a kernel whose rounding depends on the cache length flips them."""
    x = _inputs("cpu")
    s = DETERMINISM_SHAPE
    q, k = x["q"].double(), x["k"].double()  # [B, T, H, D], [B, S, D]  (the gates stay as drawn)
    g = testing.generator(3)
    for b in range(s.B):
        for t in range(1, s.T):
            heads_DH = q[b, t].T  # [D, H]
            nudge = torch.randn(s.D, generator=g, dtype=torch.float64) * 1e-3
            in_span = heads_DH @ torch.linalg.lstsq(heads_DH, nudge).solution  # [D]
            k[b, t] = k[b, t - 1] + nudge - in_span
    x["k"] = k.to(x["q"].dtype)
    return {name: value.to(device) for name, value in x.items()}


def topk_prefill_decode(backend: str, device: str, ties=None, kpool: bool = False) -> testing.Comparison:
    x = _near_tied_inputs(device) if ties == "near_ties" else _inputs(device, ties)
    s = DETERMINISM_SHAPE
    T = s.T
    keys = x["k"][:, :T]  # prefill: T tokens, each query sees the keys up to itself
    prefill = _topk(x, kpool, x["q"], keys, x["w"], start_pos=0, backend=backend)  # [B, T, K]
    garbage = testing.randn((s.B, s.S - T, s.D), seed=99, dtype=keys.dtype, device=device, scale=50.0)
    big_cache = torch.cat([keys, garbage], dim=1)  # [B, S, D]: slots past the query are never visible
    big_gate = torch.cat([x["gate"][:, :T], garbage.flip(1)], dim=1)  # [B, S, D], its garbage too
    # k-pool: before the first pool, at pool boundaries (KPOOL = 3) and between them, fewer calls
    for t in (0, 1, 2, 3, 5, 7, 8, 10) if kpool else range(T):
        q_t, w_t = x["q"][:, t:t + 1], x["w"][:, t:t + 1]
        exact = _topk(x, kpool, q_t, keys[:, :t + 1], w_t, start_pos=t, backend=backend)
        if not torch.equal(exact[:, 0], prefill[:, t]):
            return _mismatch(f"decode of token {t} against a {t + 1}-slot cache differs from prefill")
        padded = _topk(x, kpool, q_t, big_cache, w_t, start_pos=t, backend=backend, gate=big_gate)
        if not torch.equal(padded[:, 0], prefill[:, t]):
            return _mismatch(f"decode of token {t} against a preallocated {s.S}-slot cache differs from prefill")
    return _ok(f"{'8 of the' if kpool else 'all'} {T} decode steps bitwise equal to prefill (exact and preallocated "
               f"caches)")


def route_batch_invariance(backend: str, device: str) -> testing.Comparison:
    shape = testing.MoEShape(N=23, E=16, K=4, G=4, TG=2, D=8, F=4)
    x = testing.make_route_inputs(shape, device=device, seed=5)
    kw = dict(top_k=shape.K, n_group=shape.G, topk_group=shape.TG, routed_scaling_factor=2.5, backend=backend)
    w_full, ids_full = moe.route(x["logits"], x["bias"], **kw)
    for chunk in (1, 5):
        for n0 in range(0, shape.N, chunk):
            w, ids = moe.route(x["logits"][n0:n0 + chunk], x["bias"], **kw)
            if not (torch.equal(ids, ids_full[n0:n0 + chunk]) and torch.equal(w, w_full[n0:n0 + chunk])):
                return _mismatch(f"token chunk [{n0}, {n0 + chunk}) routes differently from the full batch")
    return _ok("per-token routing bitwise identical in chunks of 1 and 5")


def _sparse_grads(op: Callable, make_inputs: Callable, shape: testing.MLAShape, k: int, backend: str, device: str,
                  dtype: torch.dtype) -> list[torch.Tensor]:
    """The input gradients of one sparse-attention call (``op`` over ``make_inputs(shape, k)``), sorted by name."""
    x = make_inputs(shape, k, dtype=dtype, device=device, seed=13)
    idx = x.pop("topk_idx")
    leaves = {n: v.clone().requires_grad_() for n, v in x.items()}
    out = op(**leaves, topk_idx=idx, scale=(shape.Dn + shape.Dr) ** -0.5, backend=backend)
    out.backward(testing.randn(out.shape, seed=14, dtype=dtype, device=device))
    return [leaves[n].grad for n in sorted(leaves)]


def _sparse_prefill_grads(backend: str, device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    shape = testing.MLAShape(B=1, T=4, S=9, H=3, Dn=8, Dr=4, Dv=6, C=20)
    return _sparse_grads(dsa.sparse_prefill, testing.make_sparse_inputs, shape, 3, backend, device, dtype)


def _sparse_expanded_grads(backend: str, device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    shape = testing.MLAShape(B=2, T=5, S=9, H=3, Dn=8, Dr=4, Dv=6, C=20)
    return _sparse_grads(dsa.sparse_prefill_expanded, testing.make_sparse_expanded_inputs, shape, 4, backend, device,
                         dtype)


def _fused_experts_grads(backend: str, device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    shape = testing.MoEShape(N=7, E=5, K=2, G=1, TG=1, D=12, F=10)
    x = testing.make_expert_inputs(shape, dtype=dtype, device=device, seed=15)
    logits = testing.make_route_inputs(shape, device=device, seed=16)["logits"]
    weights, ids = moe.route_reference(logits, None, top_k=shape.K)
    leaves = {**{k: v.clone().requires_grad_() for k, v in x.items()}, "weights": weights.to(dtype).requires_grad_()}
    out = moe.fused_experts(leaves["x"], leaves["weights"], ids, leaves["w_gate"], leaves["w_up"], leaves["w_down"],
                            backend=backend)
    out.backward(testing.randn(out.shape, seed=17, dtype=dtype, device=device))
    return [leaves[k].grad for k in sorted(leaves)]


def backward_repeatability(grads: Callable[[str, str, torch.dtype], list[torch.Tensor]], dtype: torch.dtype,
                           backend: str, device: str, runs: int = 2) -> testing.Comparison:
    first = grads(backend, device, dtype)
    for i in range(1, runs):
        if not all(torch.equal(a, b) for a, b in zip(first, grads(backend, device, dtype))):
            return _mismatch(f"backward run {i} differs from run 0")
    return _ok(f"{runs} backward runs bitwise identical ({len(first)} gradients, {dtype})")


CHECKS: dict[str, Callable[[str, str], testing.Comparison]] = {
    "topk_repeatability": topk_repeatability,
    "topk_batch_invariance": topk_batch_invariance,
    "topk_batch_invariance_ties": lambda be, dev: topk_batch_invariance(be, dev, ties="duplicate_keys"),
    "topk_prefill_decode": topk_prefill_decode,
    "topk_prefill_decode_zero_relu": lambda be, dev: topk_prefill_decode(be, dev, ties="zero_relu"),
    "topk_prefill_decode_near_ties": lambda be, dev: topk_prefill_decode(be, dev, ties="near_ties"),
    # the k-pool top-k (its repeatability is in its prefill / decode checks, which compare many runs bitwise)
    "kpool_topk_batch_invariance_ties": lambda be, dev: topk_batch_invariance(be, dev, ties="duplicate_keys",
                                                                              kpool=True),
    "kpool_topk_prefill_decode": lambda be, dev: topk_prefill_decode(be, dev, kpool=True),
    "kpool_topk_prefill_decode_zero_relu": lambda be, dev: topk_prefill_decode(be, dev, ties="zero_relu", kpool=True),
    "route_batch_invariance": route_batch_invariance,
    "sparse_prefill_backward_repeatability": lambda be, dev: backward_repeatability(
        _sparse_prefill_grads, torch.bfloat16, be, dev),
    "sparse_expanded_backward_repeatability": lambda be, dev: backward_repeatability(
        _sparse_expanded_grads, torch.bfloat16, be, dev),
    "fused_experts_backward_repeatability": lambda be, dev: backward_repeatability(
        _fused_experts_grads, torch.float32, be, dev),
}

# Ops each check exercises (used to report fallbacks).
CHECK_OPS: dict[str, list[str]] = {name: ["dsa_indexer_topk"] for name in CHECKS}
CHECK_OPS.update({name: ["dsa_kpool_topk"] for name in CHECKS if name.startswith("kpool_")})
CHECK_OPS["route_batch_invariance"] = ["moe_route"]
CHECK_OPS["sparse_prefill_backward_repeatability"] = ["dsa_sparse_prefill"]
CHECK_OPS["sparse_expanded_backward_repeatability"] = ["dsa_sparse_prefill_expanded"]
CHECK_OPS["fused_experts_backward_repeatability"] = ["moe_fused_experts"]


def checks() -> list[Check]:
    """The checks above as conformance checks (properties: run on the reference too)."""
    return [Check("determinism", name, tuple(CHECK_OPS[name]), fn, against_reference=False)
            for name, fn in CHECKS.items()]
