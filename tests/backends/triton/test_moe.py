"""MoE routing, dispatch / combine and grouped SwiGLU experts (Triton) against the reference."""
import pytest
import torch

from glm5_core import testing
from glm5_core.ops import moe
from tests.backends.triton.helpers import assert_close, kernel

ROUTES = [  # (N, E, K, n_group, topk_group, score_func, bias)
    (37, 12, 3, 1, 1, "sigmoid", True),
    (20, 16, 4, 4, 2, "sigmoid", True),
    (9, 10, 2, 5, 2, "softmax", False),
    (6, 8, 3, 8, 4, "sigmoid", True),  # one expert per group
    (5, 6, 6, 1, 1, "softmax", True),  # K = E
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ROUTES, ids=str)
def test_route_matches_reference(case, dtype, device):
    N, E, K, G, TG, score_func, with_bias = case
    logits = testing.randn((N, E), seed=N, dtype=dtype, device=device)
    logits[0] = 0.0  # all experts tie
    logits[1, ::2] = 0.5  # ties among a subset
    bias = testing.randn((E,), seed=E, device=device, scale=0.1) if with_bias else None
    kwargs = dict(top_k=K, score_func=score_func, n_group=G, topk_group=TG, renormalize=True,
                  routed_scaling_factor=2.5)
    weights, ids = kernel("moe_route")(logits, bias, **kwargs)
    ref_w, ref_ids = moe.route_reference(logits, bias, **kwargs)
    assert ids.dtype == torch.int32 and torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-6)


def test_route_without_renormalisation_and_tied_groups(device):
    logits = torch.zeros(4, 16, device=device)  # every group ties: lower group ids win
    w, ids = kernel("moe_route")(logits, None, top_k=3, n_group=4, topk_group=2, renormalize=False)
    ref_w, ref_ids = moe.route_reference(logits, None, top_k=3, n_group=4, topk_group=2, renormalize=False)
    assert torch.equal(ids, ref_ids) and torch.equal(ids[0].cpu(), torch.tensor([0, 1, 2], dtype=torch.int32))
    torch.testing.assert_close(w, ref_w)


@pytest.mark.parametrize("layout", ["column", "expanded"])
def test_route_with_a_non_contiguous_bias(layout, device):
    """A bias viewed out of a larger tensor (a column of a per-layer table, an expanded scalar)."""
    N, E = 11, 12
    logits = testing.randn((N, E), seed=21, device=device)
    if layout == "column":
        bias = testing.randn((E, 3), seed=22, device=device)[:, 1]  # stride 3
    else:
        bias = torch.tensor([0.25], device=device).expand(E)  # stride 0
    assert not bias.is_contiguous()
    weights, ids = kernel("moe_route")(logits, bias, top_k=4, routed_scaling_factor=2.5)
    ref_w, ref_ids = moe.route_reference(logits, bias, top_k=4, routed_scaling_factor=2.5)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_dispatch_and_combine_match_reference(dtype, device):
    N, K, E, D = 23, 3, 7, 20
    x = testing.randn((N, D), seed=1, dtype=dtype, device=device)
    ids = torch.randint(0, E - 1, (N, K), generator=testing.generator(2)).to(device=device, dtype=torch.int32)
    ids[:4] = 2  # many copies of one expert, expert E-1 gets none
    x_sorted, sort_idx, counts = kernel("moe_dispatch")(x, ids, num_experts=E)
    ref = moe.dispatch_reference(x, ids, num_experts=E)
    assert torch.equal(x_sorted, ref[0]) and torch.equal(sort_idx, ref[1]) and torch.equal(counts, ref[2])
    if dtype == torch.float64:
        return  # combine declines fp64 (reference runs)
    weights = torch.rand((N, K), generator=testing.generator(3)).to(device)
    y = testing.randn((N * K, D), seed=4, dtype=dtype, device=device)
    out = kernel("moe_combine")(y, sort_idx, weights)
    assert_close(out, moe.combine_reference(y, sort_idx, weights), dtype, "combine")


def test_combine_takes_an_int32_sort_idx(device):
    """sort_idx as int32 (other stacks' routing ops return int32 row maps); the kernel widens the rows it
    reads to int64, since row * D passes 2^31 for M * D >= 2^31 (not allocated here)."""
    N, K, E, D = 13, 2, 5, 9
    ids = torch.randint(0, E, (N, K), generator=testing.generator(5)).to(device=device, dtype=torch.int32)
    _, sort_idx, _ = moe.dispatch_reference(testing.randn((N, D), seed=6, device=device), ids, num_experts=E)
    y = testing.randn((N * K, D), seed=7, device=device)
    weights = torch.rand((N, K), generator=testing.generator(8)).to(device)
    out = kernel("moe_combine")(y, sort_idx.to(torch.int32), weights)
    assert_close(out, moe.combine_reference(y, sort_idx, weights), torch.float32, "combine int32")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_experts_matches_reference(dtype, device):
    E, D, F = 5, 24, 40
    counts = torch.tensor([7, 0, 70, 1, 3], device=device)  # an empty expert, one spanning two row tiles
    M = int(counts.sum())
    x = testing.randn((M, D), seed=5, dtype=dtype, device=device)
    w_gate, w_up = (testing.randn((E, F, D), seed=s, dtype=dtype, device=device, scale=0.2) for s in (6, 7))
    w_down = testing.randn((E, D, F), seed=8, dtype=dtype, device=device, scale=0.2)
    out = kernel("moe_experts")(x, counts, w_gate, w_up, w_down)
    assert_close(out, moe.experts_reference(x, counts, w_gate, w_up, w_down), dtype, "experts")


def test_tile_schedule_covers_every_row_once():
    from glm5_core.backends.triton.moe_experts import tile_schedule

    experts, row0, row1 = tile_schedule(torch.tensor([3, 0, 9, 1]), block_m=4)
    assert experts.tolist() == [0, 2, 2, 2, 3]
    assert row0.tolist() == [0, 3, 7, 11, 12] and row1.tolist() == [3, 12, 12, 12, 13]


def _grads(fn, leaves, *args, cotangent):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    fn(*leaves, *args).backward(cotangent)
    return [t.grad for t in leaves]


def test_experts_backward_matches_reference(device):
    E, D, F = 5, 24, 40
    counts = torch.tensor([7, 0, 70, 1, 3], device=device)  # an empty expert, one spanning two row tiles
    M = int(counts.sum())
    x = testing.randn((M, D), seed=15, device=device)
    w_gate, w_up = (testing.randn((E, F, D), seed=s, device=device, scale=0.2) for s in (16, 17))
    w_down = testing.randn((E, D, F), seed=18, device=device, scale=0.2)
    cotangent = testing.randn((M, D), seed=19, device=device)

    def call(fn):
        return _grads(lambda x, wg, wu, wd: fn(x, counts, wg, wu, wd), [x, w_gate, w_up, w_down], cotangent=cotangent)

    ours, ref = call(kernel("moe_experts")), call(moe.experts_reference)
    for name, a, b in zip(("x_sorted", "w_gate", "w_up", "w_down"), ours, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert_close(a, b, torch.float32, f"d{name}")
    for grad in ours[1:]:
        assert torch.equal(grad[1], torch.zeros_like(grad[1]))  # the expert with no row


def test_combine_and_dispatch_backward_match_reference(device):
    N, K, E, D = 11, 3, 6, 20
    x = testing.randn((N, D), seed=20, device=device)
    ids = torch.randint(0, E - 1, (N, K), generator=testing.generator(21)).to(device=device, dtype=torch.int32)
    weights = torch.rand((N, K), generator=testing.generator(22)).to(device)
    y = testing.randn((N * K, D), seed=23, device=device)
    _, sort_idx, _ = moe.dispatch_reference(x, ids, num_experts=E)
    d_out = testing.randn((N, D), seed=24, device=device)
    ours_y, ours_w = _grads(lambda y, w: kernel("moe_combine")(y, sort_idx, w), [y, weights], cotangent=d_out)
    ref_y, ref_w = _grads(lambda y, w: moe.combine_reference(y, sort_idx, w), [y, weights], cotangent=d_out)
    assert_close(ours_y, ref_y, torch.float32, "d y_sorted")
    assert_close(ours_w, ref_w, torch.float32, "d weights")
    d_sorted = testing.randn((N * K, D), seed=25, device=device)
    ours_x = _grads(lambda x: kernel("moe_dispatch")(x, ids, num_experts=E)[0], [x], cotangent=d_sorted)[0]
    ref_x = _grads(lambda x: moe.dispatch_reference(x, ids, num_experts=E)[0], [x], cotangent=d_sorted)[0]
    assert_close(ours_x, ref_x, torch.float32, "d x")
