"""The collectives of sharded Muon on 3 gloo ranks: one ``all_to_all_single`` per bucket in each direction
(no gather or scatter, which HCCL lacks), with uneven splits (owners hold 2, 1 or 0 matrices of a bucket;
shards of 3, 3 and 1 rows, or 1, 1 and none), and the step still repeats the unsharded Muon step
(parameters and momentum buffers).

Buckets (one per block shape and group): (7, 5) x 4 -> owners 0, 1, 2, 0; (2, 6) x 1 -> rank 0 alone owns
it and rank 2's shard is empty; Muon Split (6, 4) x 2 in row blocks of (2, 4) -> owners 0, 1.
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from glm5_core.optim import Muon

WORLD = 3
# (shape, split_heads) in one group per split setting; every one FSDP2's Shard(0)
PARAMS = [((7, 5), None), ((7, 5), None), ((7, 5), None), ((7, 5), None), ((2, 6), None), ((6, 4), 3), ((6, 4), 3)]
BUCKETS = 3
TOL = 1e-6


def _worker(rank: int, init_file: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        _compare(init_device_mesh("cpu", (WORLD,)))
        dist.barrier()  # no rank tears gloo down while another still talks to it
    finally:
        dist.destroy_process_group()
    # done and torn down: leave without interpreter teardown, where gloo's threads now and then abort a
    # finished process ("terminate called without an active exception") on an oversubscribed machine
    os._exit(0)


def _counting(calls: dict, name: str):
    real = getattr(dist, name)

    def wrapper(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return real(*args, **kwargs)
    return real, wrapper


def _compare(mesh) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    gen = torch.Generator().manual_seed(11)
    starts = [torch.randn(shape, generator=gen) for shape, _ in PARAMS]
    plain = [torch.nn.Parameter(t.clone()) for t in starts]
    sharded = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in starts]

    def groups(params):
        by_split = {}
        for p, (_, heads) in zip(params, PARAMS):
            by_split.setdefault(heads, []).append(p)
        return [dict(params=ps, split_heads=heads, split_dim=0) for heads, ps in by_split.items()]

    hyper = dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.1, ns_steps=5)
    opt_plain, opt_sharded = Muon(groups(plain), **hyper), Muon(groups(sharded), **hyper)
    for _ in range(2):
        for p, q in zip(plain, sharded):
            grad = torch.randn(p.shape, generator=gen)  # same on every rank
            p.grad = grad.clone()
            q.grad = distribute_tensor(grad.clone(), mesh, q.placements)
        opt_plain.step()
        calls = {}
        patched = {name: _counting(calls, name) for name in ("all_to_all_single", "gather", "scatter", "all_gather",
                                                             "broadcast", "send", "recv")}
        for name, (_, wrapper) in patched.items():
            setattr(dist, name, wrapper)
        try:
            opt_sharded.step()
        finally:
            for name, (real, _) in patched.items():
                setattr(dist, name, real)
        assert calls == {"all_to_all_single": 2 * BUCKETS}, calls
    for i, (p, q) in enumerate(zip(plain, sharded)):
        torch.testing.assert_close(q.detach().full_tensor(), p.detach(), atol=TOL, rtol=TOL,
                                   msg=lambda m, i=i: f"param {i} {PARAMS[i]}: {m}")
        torch.testing.assert_close(opt_sharded.state[q]["momentum_buffer"].full_tensor(),
                                   opt_plain.state[p]["momentum_buffer"], atol=TOL, rtol=TOL)
        assert not torch.equal(p.detach(), starts[i]), f"param {i} did not move"


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_sharded_muon_uses_one_all_to_all_per_bucket_and_direction(tmp_path, spawnable_test_modules):
    mp.spawn(_worker, args=(str(tmp_path / "init"),), nprocs=WORLD, join=True)
