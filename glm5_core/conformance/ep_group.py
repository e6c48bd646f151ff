"""The expert-parallel contract on real processes: ``glm5 conformance`` runs it as one check of the ``ep`` family,
``ep_group[2 processes]``, so a vendor proves its ``ep_dispatch`` / ``ep_combine`` (and its collective backend) with
the command it already runs.

Two processes join a group on the backend's collective (the device facts' ``dist_backend``: gloo on a host
device, the accelerator's own collective on one device per process). Every process builds the same concatenated
batch (fp32, identical generators), takes its own tokens and checks, against the single-device reference over the
whole batch (``moe.dispatch_reference`` / ``moe.combine_reference``):

* ``random``: the rows and counts its experts receive, bitwise (expert-major, within an expert by source rank,
  source token, slot), and combine's output for its tokens, bitwise;
* ``one_rank``: every token to rank 0's experts (rank 1's experts receive nothing);
* ``empty_rank``: rank 1 has no token at all;
* ``bad_argument``: rank 1 passes an expert id out of range: EVERY rank raises a ``ValueError`` (rank 1 its own,
  rank 0 one naming rank 1), and the group still works afterwards (no rank was left inside an exchange).

A backend whose device is not the host needs two such devices; with fewer the check is ``not_run`` (a
:class:`~glm5_core.conformance.check.NotRunnable`), never passed.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import re
import tempfile
import traceback
from typing import Optional

import torch

from glm5_core import testing
from glm5_core.conformance.check import Check, NotRunnable

WORLD = 2
T, D, K = 5, 8, 2  # tokens per rank, hidden size, top-k
E = 4 * WORLD  # routed experts (4 per rank)
TIMEOUT_S = 120


def _batch(routing: str, device: str):
    """The concatenated batch, identical in every process: x [WORLD*T, D], ids [WORLD*T, K] int32, weights."""
    g = torch.Generator().manual_seed(7)
    n = WORLD * T
    x = torch.randn(n, D, generator=g)
    weights = torch.rand(n, K, generator=g) + 0.1
    experts = E // WORLD if routing == "one_rank" else E  # one_rank: only rank 0's experts are chosen
    ids = torch.stack([torch.randperm(experts, generator=g)[:K] for _ in range(n)]).to(torch.int32)
    return x.to(device), ids.to(device), weights.to(device)


def _mine(rank: int, routing: str) -> slice:
    if routing == "empty_rank" and rank == 1:
        return slice(T, T)
    return slice(rank * T, (rank + 1) * T)


def _case(rank: int, routing: str, group, backend: str, device: str) -> str:
    """'' when this rank's rows, counts and combined output are bitwise the reference's, else what differs."""
    from glm5_core.ops import ep, moe

    x, ids, weights = _batch(routing, device)
    keep = torch.ones(WORLD * T, dtype=torch.bool)
    if routing == "empty_rank":
        keep[T:2 * T] = False  # rank 1's tokens do not exist
    mine = _mine(rank, routing)
    handle = ep.dispatch(x[mine], ids[mine], weights[mine], group=group, num_experts=E, backend=backend)
    rows, sort_idx, counts = moe.dispatch_reference(x[keep], ids[keep], num_experts=E)
    L = E // WORLD
    first = int(counts[:rank * L].sum())
    want_rows, want_counts = rows[first:first + int(counts[rank * L:(rank + 1) * L].sum())], \
        counts[rank * L:(rank + 1) * L]
    if not torch.equal(handle.counts.cpu(), want_counts.cpu()):
        return f"{routing}: counts {handle.counts.tolist()} != reference {want_counts.tolist()}"
    if handle.rows.dtype != want_rows.dtype or not torch.equal(handle.rows.cpu(), want_rows.cpu()):
        return f"{routing}: received rows differ from the reference's (expert-major, by rank, token, slot)"
    out = ep.combine(handle.rows * 1.5 + 0.25, handle, backend=backend)  # stands in for the experts' outputs
    want = moe.combine_reference(rows * 1.5 + 0.25, sort_idx, weights[keep])
    before = int(keep[:mine.start].sum())
    want = want[before:before + (mine.stop - mine.start)]
    if out.dtype != want.dtype or not torch.equal(out.cpu(), want.cpu()):
        return f"{routing}: combined output differs from moe.combine_reference's"
    return ""


def _bad_argument(rank: int, group, backend: str, device: str) -> str:
    from glm5_core.ops import ep

    x, ids, weights = _batch("random", device)
    mine = _mine(rank, "random")
    bad = ids[mine].clone()
    if rank == 1:
        bad[0, 0] = E  # out of range
    try:
        ep.dispatch(x[mine], bad, weights[mine], group=group, num_experts=E, backend=backend)
    except ValueError as exc:
        expected = r"expert_ids: expected entries in \[0, " if rank == 1 else r"rank\(s\) \[1\]"
        if not re.search(expected, str(exc)):
            return f"bad_argument: rank {rank} raised {str(exc)[:120]!r}, expected /{expected}/"
    else:
        return f"bad_argument: rank {rank} raised nothing for rank 1's out-of-range expert id"
    handle = ep.dispatch(x[mine], ids[mine], weights[mine], group=group, num_experts=E, backend=backend)
    ep.combine(handle.rows, handle, backend=backend)  # the group still works
    return ""


def _worker(rank: int, backend: str, device_type: str, dist_backend: str, host: bool, init_file: str,
            result_dir: str, simulated_backend: Optional[str] = None) -> None:
    """One rank. ``simulated_backend``: the backend whose simulated stack the parent ran under (a simulated stack is
    installed per process, so a spawned rank installs it again; None: none)."""
    from glm5_core.backends import simulated

    problems = []
    try:
        with simulated.simulate(simulated_backend) if simulated_backend else contextlib.nullcontext():
            _rank_cases(rank, backend, device_type, dist_backend, host, init_file, problems)
    except Exception as exc:  # reported by the parent as this rank's failure
        problems.append(f"rank {rank} crashed: {exc!r} {traceback.format_exc(limit=3)}")
    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(p for p in problems if p))


def _rank_cases(rank: int, backend: str, device_type: str, dist_backend: str, host: bool, init_file: str,
                problems: list) -> None:
    """The rank's cases, each appending its problem ("" when it held) to ``problems``."""
    import torch.distributed as dist

    device = device_type if host else f"{device_type}:{rank}"
    if not host:
        getattr(torch, device_type).set_device(rank)
    dist.init_process_group(dist_backend, init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        group = dist.group.WORLD
        for routing in ("random", "one_rank", "empty_rank"):
            problems.append(_case(rank, routing, group, backend, device))
        problems.append(_bad_argument(rank, group, backend, device))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(backend: str, device: str) -> testing.Comparison:
    import torch.multiprocessing as mp

    from glm5_core import device_kinds

    device_type = torch.device(device).type
    facts = device_kinds.device_types().get(device_type)
    if facts is None:
        raise NotRunnable(f"no device facts for device type {device_type!r}")
    host = facts.is_host
    if not host:
        seen = facts.count()
        if seen < WORLD:
            raise NotRunnable(f"needs {WORLD} {device_type} devices (one per process), {seen} visible")
    from glm5_core.backends import simulated

    with tempfile.TemporaryDirectory(prefix="glm5-ep-group-") as tmp:
        context = mp.get_context("spawn")
        procs = [context.Process(target=_worker, args=(r, backend, device_type, facts.dist_backend, host,
                                                       os.path.join(tmp, "init"), tmp,
                                                       simulated.SIMULATED_BACKEND.get()), daemon=True)
                 for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(TIMEOUT_S + 30)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        problems = [f"rank {r} did not finish within {TIMEOUT_S + 30} s (left inside a collective?)" for r in hung]
        for r in range(WORLD):
            path = os.path.join(tmp, f"rank{r}.txt")
            if r not in hung:
                text = open(path, encoding="utf-8").read() if os.path.exists(path) else f"rank {r} wrote nothing"
                problems += [f"rank {r}: {line}" for line in text.splitlines() if line]
    if problems:
        return testing.Comparison(False, float("inf"), 0.0, "; ".join(problems)[:2000])
    return testing.Comparison(True, 0.0, 0.0, f"{WORLD} processes on {facts.dist_backend}: rows, counts and combined "
                                              "outputs bitwise the single-device reference (random, all tokens to "
                                              "one rank, a rank without tokens); a bad argument raised on every "
                                              "rank")


def checks() -> list[Check]:
    return [Check("ep", f"ep_group[{WORLD} processes]", ("ep_dispatch", "ep_combine"), _run)]
