"""Muon on DTensor parameters (FSDP2's dim-0 shards, and a replicated layout) on 2 gloo ranks repeats the
unsharded Muon step on the same whole gradients: parameters and momentum buffers, over several steps.

Shapes are chosen so rows do not divide by the world size (the last rank's shard is shorter, or empty for
a 1-row matrix), several parameters share a block shape (round-robin owners within one batched bucket), and
Muon Split cuts row and column blocks. Tolerance: 1e-6 (fp32) / 1e-12 (fp64) relative; the owner
orthogonalises a different batch of matrices than the unsharded step does, which may change the last bit.
"""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from glm5_core.optim import Muon
from glm5_core.optim import muon as muon_module

WORLD = 2
# (shape, split_heads, split_dim, placement): "shard" is FSDP2's Shard(0), "replicate" the gathered fallback
PARAMS = [
    ((7, 5), None, 0, "shard"), ((7, 5), None, 0, "shard"), ((7, 5), None, 0, "shard"),  # one bucket, 2 owners
    ((5, 13), None, 0, "shard"), ((1, 6), None, 0, "shard"),  # 1 row: rank 1 holds an empty shard
    ((5, 2, 3), None, 0, "shard"),  # flattened to [5, 6]
    ((9, 6), 3, 0, "shard"), ((9, 6), 3, 0, "shard"),  # Muon Split, row blocks [3, 6]
    ((3, 12), 4, 1, "shard"),  # Muon Split, column blocks [3, 3]
    ((6, 4), None, 0, "replicate"),
]
TOL = {torch.float32: 1e-6, torch.float64: 1e-12}
CASES = [(torch.float32, True), (torch.float64, False)]  # (dtype, nesterov)


def _worker(rank: int, init_file: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        for dtype, nesterov in CASES:
            _compare(mesh, dtype, nesterov)
        dist.barrier()  # neither rank tears gloo down while the other still talks to it
    finally:
        dist.destroy_process_group()
    # done and torn down: leave without interpreter teardown, where gloo's threads now and then abort a
    # finished process ("terminate called without an active exception") on an oversubscribed machine
    os._exit(0)


def _compare(mesh, dtype: torch.dtype, nesterov: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(5)
    starts = [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for shape, *_ in PARAMS]
    plain = [torch.nn.Parameter(t.clone()) for t in starts]
    sharded = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0) if how == "shard" else Replicate()]))
               for t, (_, _, _, how) in zip(starts, PARAMS)]
    hyper = dict(lr=0.02, momentum=0.9, nesterov=nesterov, weight_decay=0.1, ns_steps=5)

    def groups(params):  # one group per Muon Split setting, as build_optimizer makes them
        by_split = {}
        for p, (_, heads, dim, _) in zip(params, PARAMS):
            by_split.setdefault((heads, dim), []).append(p)
        return [dict(params=ps, split_heads=heads, split_dim=dim) for (heads, dim), ps in by_split.items()]

    opt_plain, opt_sharded = Muon(groups(plain), **hyper), Muon(groups(sharded), **hyper)
    orthogonalised = []  # matrices this rank orthogonalised in the sharded steps
    real = muon_module.muon_ops.orthogonalize

    def counting(G, **kwargs):
        orthogonalised.append(G.shape[0])
        return real(G, **kwargs)

    for _ in range(3):
        for p, q in zip(plain, sharded):
            grad = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype)  # same on both ranks
            p.grad = grad.clone()
            q.grad = distribute_tensor(grad.clone(), mesh, q.placements)
        opt_plain.step()
        muon_module.muon_ops.orthogonalize = counting
        try:
            opt_sharded.step()
        finally:
            muon_module.muon_ops.orthogonalize = real
    # each dim-0 sharded matrix is orthogonalised once, by its owner; the replicated one on every rank
    blocks = [heads or 1 for _, heads, _, _ in PARAMS]
    mine = sum(orthogonalised) // 3
    counts = torch.tensor([mine])
    dist.all_reduce(counts)
    expected = sum(b for b, (*_, how) in zip(blocks, PARAMS) if how == "shard") + \
        WORLD * sum(b for b, (*_, how) in zip(blocks, PARAMS) if how == "replicate")
    assert int(counts) == expected and mine < sum(blocks), (mine, int(counts), expected)
    tol = TOL[dtype]
    for i, (p, q) in enumerate(zip(plain, sharded)):
        assert p.shape == q.shape
        torch.testing.assert_close(q.detach().full_tensor(), p.detach(), atol=tol, rtol=tol,
                                   msg=lambda m, i=i: f"param {i} {PARAMS[i]}: {m}")
        torch.testing.assert_close(opt_sharded.state[q]["momentum_buffer"].full_tensor(),
                                   opt_plain.state[p]["momentum_buffer"], atol=tol, rtol=tol)
        assert not torch.equal(p.detach(), starts[i]), f"param {i} did not move"


def test_sharded_muon_matches_unsharded(tmp_path, spawnable_test_modules):
    mp.spawn(_worker, args=(str(tmp_path / "init"),), nprocs=WORLD, join=True)
