"""``torch.autograd.gradcheck`` (fp64, tiny sizes) of the expert-parallel MoE layer built from ``ep.dispatch``,
the experts and ``ep.combine``, on 2 gloo processes: the analytical gradients (dispatch's backward is a combine,
combine's a dispatch) against finite differences, with respect to x, the routing weights and the expert weights.

gradcheck sees one function of the WHOLE problem on every rank: each rank holds a copy of every rank's tokens and
of all E experts, takes its own tokens and its own L experts, runs the layer, and returns the whole output (each
rank's tokens placed in a zero buffer and summed over the ranks; the backward takes this rank's block). The
inputs pass an identity whose backward sums the gradient over the ranks, so every rank's gradient is the full
one, including what flowed to experts on the other rank. Every rank makes the same calls in the same order
(gradcheck perturbs the same element everywhere), so the collectives pair up.

Routings: random; uneven (every token to rank 0's experts: rank 1's experts receive nothing, rank 1 still sends);
one expert receiving nothing while rank 1 has no tokens at all.
"""
import datetime
import os

import pytest
import torch
import torch.distributed as dist

from glm5_core.ops import ep, moe
from tests.ops.test_ep import _spawn_target

T, D, FF, K, WORLD = 3, 2, 2, 2, 2  # tokens per rank, hidden, expert FFN, top-k, ranks
E = 2 * WORLD  # 2 experts per rank


class _SumOverRanksInBackward(torch.autograd.Function):
    """Identity; the backward sums the gradient over the ranks (each rank's copy of an input is the same
    variable, and each rank's graph holds only part of its uses)."""

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _GatherBlocks(torch.autograd.Function):
    """This rank's rows [n, D] placed at ``start`` in a [total, D] zero buffer, summed over the ranks (so the
    whole output); the backward is this rank's block of the (same on every rank) output gradient."""

    @staticmethod
    def forward(ctx, local, start, total):
        ctx.block = (start, start + local.shape[0])
        out = local.new_zeros(total, local.shape[1])
        out[start:start + local.shape[0]] = local
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.block
        return grad[a:b].clone(), None, None


def _problem(routing: str):
    """The whole problem, the same in every process: x [N*T, D], ids [N*T, K], weights, experts [E, ...], and
    the token blocks of the ranks."""
    g = torch.Generator().manual_seed(7)
    n = WORLD * T
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    weights = torch.rand(n, K, generator=g, dtype=torch.float64) + 0.1
    blocks = [(r * T, (r + 1) * T) for r in range(WORLD)]
    if routing == "random":
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    elif routing == "rank0_only":  # rank 1's experts (2, 3) receive nothing
        ids = torch.tensor([[0, 1] if t % 2 else [1, 0] for t in range(n)])
    elif routing == "empty_rank1":  # rank 1 has no tokens; expert E-1 receives nothing
        ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(n)])
        blocks = [(0, T), (T, T)]
        x, weights, ids = x[:T], weights[:T], ids[:T]
    else:
        raise AssertionError(routing)
    experts = [torch.randn(E, FF, D, generator=g, dtype=torch.float64) * 0.5,
               torch.randn(E, FF, D, generator=g, dtype=torch.float64) * 0.5,
               torch.randn(E, D, FF, generator=g, dtype=torch.float64) * 0.5]
    return x, ids.to(torch.int32), weights, experts, blocks


def _layer(rank: int, ids, blocks, group):
    """The whole-problem function of (x, weights, w_gate, w_up, w_down) this rank evaluates."""
    a, b = blocks[rank]
    L = E // WORLD

    def layer(x, weights, w_gate, w_up, w_down):
        x, weights, w_gate, w_up, w_down = (_SumOverRanksInBackward.apply(t) for t in (x, weights, w_gate, w_up,
                                                                                        w_down))
        handle = ep.dispatch(x[a:b], ids[a:b], weights[a:b], group=group, num_experts=E)
        local = [w[rank * L:(rank + 1) * L] for w in (w_gate, w_up, w_down)]
        rows = moe.experts_reference(handle.rows, handle.counts, *local)  # [R, D]
        out = ep.combine(rows, handle)  # [b - a, D]
        # every input in this rank's graph (a zero term), so every rank's backward runs each input's sum over
        # the ranks, in the same order, even when its experts receive nothing or it has no tokens
        tie = sum(t.sum() for t in (x, weights, w_gate, w_up, w_down)) * 0
        return _GatherBlocks.apply(out + tie, a, x.shape[0])

    return layer


def _worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for routing in ("random", "rank0_only", "empty_rank1"):
            x, ids, weights, experts, blocks = _problem(routing)
            inputs = [t.clone().requires_grad_() for t in (x, weights, *experts)]
            layer = _layer(rank, ids, blocks, dist.group.WORLD)
            with torch.no_grad():
                handle = ep.dispatch(x[slice(*blocks[rank])], ids[slice(*blocks[rank])],
                                     weights[slice(*blocks[rank])], group=dist.group.WORLD, num_experts=E)
            if routing == "rank0_only" and rank == 1:
                assert handle.rows.shape[0] == 0  # the uneven case is what it says
            if routing == "empty_rank1":
                if rank == 1:
                    assert handle.counts[-1] == 0 and sum(handle.send_splits) == 0
            assert torch.autograd.gradcheck(layer, inputs, eps=1e-6, atol=1e-8, rtol=1e-6, nondet_tol=0.0,
                                            check_undefined_grad=False), routing
            # the gradients reach every input: none is identically zero (an expert receiving nothing has a
            # zero gradient, the others do not)
            out = layer(*inputs)
            grads = torch.autograd.grad(out, inputs, torch.ones_like(out))
            assert all(bool(g.abs().sum() > 0) for g in grads), routing
            L = E // WORLD
            for g in grads[2:]:
                got = [bool(g[e].abs().sum() > 0) for e in range(E)]
                received = set(ids.flatten().tolist())
                assert got == [e in received for e in range(E)], (routing, got, L)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # see tests/train/test_distributed.py: gloo's threads may abort interpreter teardown


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_dispatch_combine_gradcheck_fp64_on_two_ranks(tmp_path, spawnable_test_modules):
    _spawn_target(_worker, WORLD, tmp_path, timeout=240.0)
