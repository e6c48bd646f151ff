"""The optional fused ``ep_experts`` slot (dispatch + grouped SwiGLU + combine): its reference composes
ep.dispatch + moe.experts + ep.combine, a backend without a fused kernel runs its own parts, and at EP=2 on gloo
each rank's output is bitwise the one-device routed FFN over the concatenated batch."""
import datetime
import os

import pytest
import torch
import torch.distributed as dist

from glm5_core import registry
from glm5_core.ops import ep, moe
from tests.ops.test_ep import _spawn_target


def _problem(T=7, E=8, K=2, D=16, F=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    weights = torch.rand(T, K, generator=g)
    experts = (torch.randn(E, F, D, generator=g) * 0.2, torch.randn(E, F, D, generator=g) * 0.2,
               torch.randn(E, D, F, generator=g) * 0.2)
    return x, ids, weights, experts


def test_the_slot_is_a_composite_of_dispatch_experts_combine():
    spec = registry.op_spec("ep_experts")
    assert spec.is_composite and spec.parts == ("ep_dispatch", "moe_experts", "ep_combine") and spec.differentiable


def test_without_a_group_it_is_the_single_device_routed_ffn_bitwise():
    x, ids, weights, experts = _problem()
    want = moe.fused_experts_reference(x, weights, ids, *experts)
    assert torch.equal(ep.experts_reference(x, ids, weights, *experts, group=None, num_experts=8), want)
    # the composite on the cpu backend's parts (its moe_experts kernel: tolerance, not bitwise)
    got = ep.experts_composite(x, ids, weights, *experts, group=None, num_experts=8, backend="cpu")
    torch.testing.assert_close(got, want)


def test_gradients_reach_x_weights_and_experts():
    x, ids, weights, experts = _problem(seed=1)
    leaves = [t.clone().requires_grad_() for t in (x, weights, *experts)]
    ep.experts(leaves[0], ids, leaves[1], *leaves[2:], group=None, num_experts=8, backend="cpu").sum().backward()
    ref = [t.clone().requires_grad_() for t in (x, weights, *experts)]
    moe.fused_experts_reference(ref[0], ref[1], ids, *ref[2:]).sum().backward()
    for a, b in zip(leaves, ref):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("name,bad,needle", [
    ("w_gate", lambda e: (e[0][:, :, :3], e[1], e[2]), "w_gate"),
    ("w_up", lambda e: (e[0], e[1][:4], e[2]), "w_up"),
    ("w_down", lambda e: (e[0], e[1], e[2].transpose(1, 2)), "w_down"),
])
def test_expert_weights_of_the_wrong_shape_are_refused_naming_them(name, bad, needle):
    x, ids, weights, experts = _problem()
    with pytest.raises(ValueError, match=needle):
        ep.experts(x, ids, weights, *bad(experts), group=None, num_experts=8)


def _worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        E, L = 8, 8 // world
        parts = [_problem(T=5 + r, E=E, seed=10 + r) for r in range(world)]
        experts = parts[0][3]  # one model: the same experts on every rank, sharded
        x = torch.cat([p[0] for p in parts])
        ids = torch.cat([p[1] for p in parts])
        weights = torch.cat([p[2] for p in parts])
        want = moe.fused_experts_reference(x, weights, ids, *experts)
        mine = tuple(t[rank * L:(rank + 1) * L] for t in experts)
        got = ep.experts(parts[rank][0], parts[rank][1], parts[rank][2], *mine, group=dist.group.WORLD,
                         num_experts=E)
        start = sum(5 + r for r in range(rank))
        assert torch.equal(got, want[start:start + 5 + rank]), f"rank {rank}: differs from the one-device FFN"
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # gloo's threads may abort interpreter teardown (tests/ops/test_ep.py)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_at_ep2_each_rank_gets_the_one_device_result_bitwise(tmp_path, spawnable_test_modules):
    _spawn_target(_worker, 2, tmp_path)
