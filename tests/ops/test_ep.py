"""The expert-parallel family (``glm5_core.ops.ep``) on real processes (gloo, 2 and 4 ranks) and in one.

Two baselines, both fp32:
* one process computing the CONCATENATED batch of the ranks with the single-device ops (``moe.dispatch``,
  ``moe.experts_reference``, ``moe.combine``): the row-order contract makes every expert's GEMM see the same
  matrix, so the forward and every gradient (x, routing weights, expert weights) are bitwise equal;
* each rank computing ITS OWN batch without expert parallelism (data parallel at the same world size), with a
  batch-invariant expert FFN (each row alone, as the forward at EP=N cannot be bitwise otherwise: CPU GEMMs give a
  row different bits in batches of other sizes): forward, dx and d(weights) bitwise; the expert-weight gradients,
  all-reduced over the ranks there and summed over all rows in one place here, agree to fp32 rounding of a
  reassociated sum (rtol 1e-5, atol 1e-6).
"""
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from glm5_core.ops import ep, moe

T, D, FF, K = 6, 8, 5, 2  # tokens per rank, hidden, expert FFN, top-k


def _inputs(world: int, E: int, routing: str, seed: int = 0):
    """Every rank's inputs, identical in every process: x [N*T, D], ids [N*T, K], weights, experts, cotangent."""
    g = torch.Generator().manual_seed(seed)
    n = world * T
    x = torch.randn(n, D, generator=g)
    weights = torch.rand(n, K, generator=g) + 0.1
    if routing == "random":
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    elif routing == "rank0_only":  # every token to rank 0's experts 0 and 1: the other ranks receive nothing
        ids = torch.tensor([[0, 1] if t % 2 else [1, 0] for t in range(n)])
    elif routing == "empty_rank1":  # rank 1 sends nothing (its tokens are cut below); expert E-1 receives none
        ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(n)])
    else:
        raise AssertionError(routing)
    experts = [torch.randn(E, FF, D, generator=g) * 0.3, torch.randn(E, FF, D, generator=g) * 0.3,
               torch.randn(E, D, FF, generator=g) * 0.3]
    cotangent = torch.randn(n, D, generator=g)
    return x, ids.to(torch.int32), weights, experts, cotangent


def _tokens_of(rank: int, routing: str) -> slice:
    if routing == "empty_rank1" and rank == 1:
        return slice(rank * T, rank * T)  # no tokens at all
    return slice(rank * T, (rank + 1) * T)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _rowwise_experts(rows, counts, w_gate, w_up, w_down):
    """The SwiGLU experts with each row computed alone: batch-invariant (a row's bits do not depend on the rows
    beside it), the property the per-rank baseline needs."""
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        for i in range(start, start + n):
            r = rows[i:i + 1]
            outs.append((F.silu(r @ w_gate[e].T) * (r @ w_up[e].T)) @ w_down[e].T)
        start += n
    return torch.cat(outs) if outs else rows.new_zeros(rows.shape)


def _single_device(x, ids, weights, experts, cotangent, experts_fn):
    """The MoE layer without expert parallelism: (out, dx, dweights, dexperts)."""
    x, weights, *experts = _leaves(x, weights, *experts)
    rows, sort_idx, counts = moe.dispatch(x, ids, num_experts=experts[0].shape[0])
    out = moe.combine(experts_fn(rows, counts, *experts), sort_idx, weights)
    (out * cotangent).sum().backward()
    return out.detach(), x.grad, weights.grad, [w.grad for w in experts]


def _expert_parallel(x, ids, weights, experts, cotangent, group, experts_fn):
    """The same layer with ``ep.dispatch`` / ``ep.combine``: this rank holds only its experts."""
    E = experts[0].shape[0]
    rank, world = ep.group_rank_size(group)
    L = E // world
    x, weights, *local = _leaves(x, weights, *(w[rank * L:(rank + 1) * L] for w in experts))
    handle = ep.dispatch(x, ids, weights, group=group, num_experts=E)
    assert handle.counts.shape == (L,) and int(handle.counts.sum()) == handle.rows.shape[0]
    out = ep.combine(experts_fn(handle.rows, handle.counts, *local), handle)
    (out * cotangent).sum().backward()
    return out.detach(), x.grad, weights.grad, [w.grad for w in local], handle


def _bitwise(what, got, want):
    assert got.dtype == want.dtype and torch.equal(got, want), \
        f"{what} differs: max |diff| {(got.double() - want.double()).abs().max() if got.numel() else 0}"


def _check_against_concatenated_batch(rank, world, group, E, routing):
    x, ids, weights, experts, cot = _inputs(world, E, routing)
    if routing == "empty_rank1":  # the single device sees only the tokens that exist
        keep = torch.ones(world * T, dtype=torch.bool)
        keep[T:2 * T] = False
        full = [t[keep] for t in (x, ids, weights, cot)]
    else:
        full = [x, ids, weights, cot]
    want = _single_device(full[0], full[1], full[2], experts, full[3], moe.experts_reference)
    mine = _tokens_of(rank, routing)
    got_out, got_dx, got_dw, got_dexp, handle = _expert_parallel(x[mine], ids[mine], weights[mine], experts,
                                                                 cot[mine], group, moe.experts_reference)
    # this rank's tokens in the concatenated batch (rank 1 removed in empty_rank1)
    before = sum(_tokens_of(r, routing).stop - _tokens_of(r, routing).start for r in range(rank))
    here = slice(before, before + got_out.shape[0])
    tag = f"rank {rank}/{world} {routing}"
    _bitwise(f"{tag}: out", got_out, want[0][here])
    _bitwise(f"{tag}: dx", got_dx, want[1][here])
    _bitwise(f"{tag}: dweights", got_dw, want[2][here])
    L = E // world
    for name, g, w in zip(("dw_gate", "dw_up", "dw_down"), got_dexp, want[3]):
        w = w[rank * L:(rank + 1) * L]
        if g is None:  # none of this rank's experts received a row: no gradient (the baseline's are zeros)
            assert routing == "rank0_only" and rank > 0 and not w.any(), (tag, name)
            continue
        _bitwise(f"{tag}: {name}", g, w)
    return handle


def _check_against_data_parallel(rank, world, group, E):
    """Per-rank batch without EP (batch-invariant experts): forward, dx, dweights bitwise; expert grads summed
    over ranks to tolerance."""
    x, ids, weights, experts, cot = _inputs(world, E, "random", seed=1)
    mine = slice(rank * T, (rank + 1) * T)
    want = _single_device(x[mine], ids[mine], weights[mine], experts, cot[mine], _rowwise_experts)
    got = _expert_parallel(x[mine], ids[mine], weights[mine], experts, cot[mine], group, _rowwise_experts)
    for what, g, w in zip(("out", "dx", "dweights"), got[:3], want[:3]):
        _bitwise(f"rank {rank}/{world} data-parallel baseline: {what}", g, w)
    L = E // world
    for g, w in zip(got[3], want[3]):
        dist.all_reduce(w, group=group)  # what DDP does with the replicated experts' gradients
        torch.testing.assert_close(g, w[rank * L:(rank + 1) * L], rtol=1e-5, atol=1e-6)


def _check_bad_arguments(rank, world, group):
    """Each bad argument is an error on every rank (the offending rank's own, a ValueError naming it elsewhere),
    and the group still works afterwards (no rank was left inside an exchange)."""
    x, ids, weights, _, _ = _inputs(world, 4 * world, "random")
    mine = slice(rank * T, (rank + 1) * T)
    x, ids, weights = x[mine], ids[mine], weights[mine]
    E = 4 * world
    bad_ids = ids.clone()
    bad_ids[0, 0] = E  # out of range
    repeated = ids.clone()
    repeated[2, 1] = repeated[2, 0]
    cases = [  # (args on rank 1 (others keep the good ones), message on rank 1, on the others)
        (dict(num_experts=E + 1), "num_experts: expected a multiple of the expert-parallel group size",
         "num_experts: expected a multiple of the expert-parallel group size"),  # every rank has it
        (dict(expert_ids=bad_ids), r"expert_ids: expected entries in \[0, ", r"rank\(s\) \[1\] .* rejected"),
        (dict(expert_ids=repeated), "expert_ids: expected K distinct experts per token, got token 2",
         r"rank\(s\) \[1\]"),
        (dict(num_experts=2 * E), "num_experts: expected num_experts equal on every rank",
         "num_experts: expected num_experts equal on every rank"),
        (dict(x=x.double()), "x: expected the dtype of x equal on every rank",
         "x: expected the dtype of x equal on every rank"),
    ]
    import re
    for i, (change, on_one, on_others) in enumerate(cases):
        args = dict(x=x, expert_ids=ids, weights=weights, num_experts=E)
        if rank == 1 or i == 0:
            args.update(change)
        try:
            ep.dispatch(args["x"], args["expert_ids"], args["weights"], group=group, num_experts=args["num_experts"])
        except ValueError as exc:
            assert re.search(on_one if rank == 1 else on_others, str(exc)), (rank, i, str(exc))
        else:
            raise AssertionError(f"rank {rank}: case {i} raised nothing")
    handle = ep.dispatch(x, ids, weights, group=group, num_experts=E)  # the group still works
    ep.combine(handle.rows, handle)


def _worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        group = dist.group.WORLD
        E = 2 * world
        for routing in ("random", "rank0_only", "empty_rank1"):
            handle = _check_against_concatenated_batch(rank, world, group, E, routing)
            if routing == "rank0_only" and rank > 0:
                assert handle.rows.shape[0] == 0, "a rank holding no chosen expert receives nothing"
            if routing == "empty_rank1" and rank == 1:
                assert sum(handle.send_splits) == 0
        _check_against_data_parallel(rank, world, group, E)
        if world == 2:
            _check_bad_arguments(rank, world, group)
            # a group of size 1 (each rank alone): no exchange, bitwise moe.dispatch / moe.combine
            singles = [dist.new_group([r]) for r in range(world)]
            x, ids, weights, experts, cot = _inputs(1, E, "random", seed=rank)
            got = _expert_parallel(x, ids, weights, experts, cot, singles[rank], moe.experts_reference)
            want = _single_device(x, ids, weights, experts, cot, moe.experts_reference)
            for what, g, w in zip(("out", "dx", "dweights"), got[:3], want[:3]):
                _bitwise(f"group of size 1: {what}", g, w)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # see tests/train/test_distributed.py: gloo's threads may abort interpreter teardown


def _spawn(world: int, tmp_path, timeout: float = 180.0) -> None:
    """Run ``_worker`` on ``world`` processes; a rank hanging past ``timeout`` fails the test (never hangs it)."""
    _spawn_target(_worker, world, tmp_path, timeout)


def _spawn_target(worker, world: int, tmp_path, timeout: float = 180.0) -> None:
    """Run ``worker(rank, world, init_file)`` on ``world`` processes, failing (never hanging) past ``timeout``."""
    ctx = mp.start_processes(worker, args=(world, str(tmp_path / "init")), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise AssertionError(f"{world} ranks still running after {timeout} s: a rank hangs")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_layer_equals_one_device(world, tmp_path, spawnable_test_modules):
    _spawn(world, tmp_path)


# --------------------------------------------------------------------------------------------- one process
def test_without_a_group_dispatch_and_combine_are_bitwise_the_single_device_ops():
    x, ids, weights, experts, cot = _inputs(3, 8, "random")
    got = _expert_parallel(x, ids, weights, experts, cot, None, moe.experts_reference)
    want = _single_device(x, ids, weights, experts, cot, moe.experts_reference)
    for what, g, w in zip(("out", "dx", "dweights"), got[:3], want[:3]):
        _bitwise(what, g, w)
    for g, w in zip(got[3], want[3]):
        _bitwise("dexperts", g, w)
    rows, _, counts = moe.dispatch(x, ids, num_experts=8)
    _bitwise("rows", got[4].rows, rows)
    _bitwise("counts", got[4].counts, counts)


def test_argument_errors_name_the_argument():
    x, ids, weights, _, _ = _inputs(1, 4, "random")
    with pytest.raises(TypeError, match="group: expected a torch.distributed.ProcessGroup or None, got str"):
        ep.dispatch(x, ids, weights, group="world", num_experts=4)
    with pytest.raises(ValueError, match="weights: expected"):
        ep.dispatch(x, ids, weights[:, :1], group=None, num_experts=4)
    with pytest.raises(ValueError, match=r"expert_ids: expected entries in \[0, 3\], got range"):
        ep.dispatch(x, ids + 1 + ids.max(), weights, group=None, num_experts=4)
    handle = ep.dispatch(x, ids, weights, group=None, num_experts=4)
    with pytest.raises(TypeError, match="handle: expected the DispatchHandle"):
        ep.combine(handle.rows, (handle.rows,))
    with pytest.raises(ValueError, match="rows: expected"):
        ep.combine(handle.rows[1:], handle)
