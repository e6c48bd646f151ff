"""The ascend MoE kernels on the executable vendor semantics: routing and dispatch must equal the reference
exactly (ids, weights, order, counts), experts and combine within tolerance."""
import itertools

import pytest
import torch

from glm5_core import testing
from glm5_core.backends.ascend import moe
from glm5_core.backends.ascend import moe_layouts as L
from glm5_core.ops.moe import combine_reference, dispatch_reference, experts_reference, route_reference
from tests.backends.ascend.vendor_semantics import AscendSemantics

TIE_ORDERS = ("high_first", "low_first")
ROUTE_SHAPES = (
    testing.MoEShape(N=1, E=3, K=1, G=1, TG=1, D=8, F=4),
    testing.MoEShape(N=37, E=12, K=3, G=1, TG=1, D=24, F=10),
    testing.MoEShape(N=9, E=8, K=8, G=1, TG=1, D=8, F=4),  # K = E: no extra candidate possible
)


@pytest.mark.parametrize("shape,dtype,ties,tie_order", list(itertools.product(
    ROUTE_SHAPES, (torch.float32, torch.bfloat16), (None, "integer"), TIE_ORDERS)), ids=str)
def test_route_matches_reference_exactly(shape, dtype, ties, tie_order):
    inputs = testing.make_route_inputs(shape, dtype=dtype, seed=6, ties=ties)
    kwargs = dict(top_k=shape.K, routed_scaling_factor=2.5)
    assert moe.route_limits(**inputs, **kwargs) == (True, "")
    weights, ids = moe.route(**inputs, **kwargs, npu=AscendSemantics(tie_order))
    ref_weights, ref_ids = route_reference(**inputs, **kwargs)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)


@pytest.mark.parametrize("renormalize,bias", [(False, True), (True, False)])
def test_route_without_renormalisation_or_bias(renormalize, bias):
    inputs = testing.make_route_inputs(ROUTE_SHAPES[1], seed=1, ties="integer")
    if not bias:
        inputs["bias"] = None
    kwargs = dict(top_k=4, renormalize=renormalize, routed_scaling_factor=1.5)
    weights, ids = moe.route(**inputs, **kwargs, npu=AscendSemantics())
    ref_weights, ref_ids = route_reference(**inputs, **kwargs)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)


def test_route_gradient_is_finite_when_a_score_underflows():
    """exp(-x) overflows for x < -88.7 (fp32): the scores' backward must still be finite, as the reference's."""
    logits = torch.tensor([[-100.0, 0.5, -200.0, 2.0]], requires_grad=True)
    L.sigmoid_scores(logits).sum().backward()
    expected = torch.sigmoid(logits.detach()) * (1 - torch.sigmoid(logits.detach()))
    assert torch.isfinite(logits.grad).all()
    torch.testing.assert_close(logits.grad, expected)


def test_gating_is_asked_for_one_extra_candidate_in_fp32():
    inputs = testing.make_route_inputs(ROUTE_SHAPES[1], dtype=torch.bfloat16)
    call = L.gating_call(inputs["logits"], inputs["bias"], 3, 2.5)
    assert call.k == 4 and call.x.dtype == call.bias.dtype == torch.float32
    assert torch.equal(call.x, inputs["logits"].float())
    assert call.kwargs()["norm_type"] == 1 and call.kwargs()["group_count"] == 1
    assert L.gating_call(inputs["logits"], None, 12, 1.0).k == 12


@pytest.mark.parametrize("change,needle", [
    (dict(score_func="softmax"), "sigmoid"),
    (dict(n_group=4, topk_group=2), "n_group"),
])
def test_route_limits(change, needle):
    inputs = testing.make_route_inputs(ROUTE_SHAPES[1])
    ok, why = moe.route_limits(**inputs, top_k=2, **change)
    assert not ok and needle in why


def test_route_limits_on_expert_count_and_dtype():
    two = testing.make_route_inputs(testing.MoEShape(N=3, E=2, K=1, G=1, TG=1, D=4, F=4))
    ok, why = moe.route_limits(**two, top_k=1)
    assert not ok and "E=2" in why
    wide = testing.make_route_inputs(testing.MoEShape(N=3, E=12, K=1, G=1, TG=1, D=4, F=4), dtype=torch.float64)
    ok, why = moe.route_limits(**wide, top_k=1)
    assert not ok and "float64" in why


# --------------------------------------------------------------------------------------------- dispatch
def _expert_ids(N, K, E, seed):
    """Distinct experts per token, with expert E-1 left without tokens."""
    g = testing.generator(seed)
    return torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(N)]).to(torch.int32)


def test_row_idx_type_1_is_read_as_sorted_row_to_flat_assignment():
    """expert ids [[2, 0], [1, 0]] (flat 0..3 -> experts 2, 0, 1, 0): a stable sort puts flat 1, 3, 2, 0 in
    rows 0..3, and row_idx_type 1 returns exactly that (sortedRowIdx), which is our sort_idx as it is."""
    ids = torch.tensor([[2, 0], [1, 0]], dtype=torch.int32)
    x = torch.arange(2.0).view(2, 1)
    _, expanded_row_idx, _, _ = AscendSemantics("low_first").npu_moe_init_routing_v2(
        x, ids, **L.init_routing_kwargs(2, 2, 3))
    assert expanded_row_idx.tolist() == [1, 3, 2, 0]
    sort_idx = L.sort_order(expanded_row_idx)
    assert sort_idx.dtype == torch.int64 and sort_idx.tolist() == [1, 3, 2, 0]


class _SpyInitRouting(AscendSemantics):
    def npu_moe_init_routing_v2(self, *args, **kwargs):
        out = super().npu_moe_init_routing_v2(*args, **kwargs)
        self.expanded_x = out[0]
        return out


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_dispatch_keeps_the_vendor_rows_when_its_sort_is_stable(dtype):
    """A stable vendor sort must be taken as it is: the rows the vendor gathered are returned, not
    gathered a second time (reading the row index the wrong way round always rebuilt them)."""
    N, K, E, D = 11, 3, 6, 5
    x = testing.randn((N, D), seed=3, dtype=dtype)
    ids = _expert_ids(N, K, E, seed=4)
    spy = _SpyInitRouting("low_first")
    x_sorted, sort_idx, _ = moe.dispatch(x, ids, num_experts=E, npu=spy)
    assert x_sorted is spy.expanded_x
    assert torch.equal(sort_idx, dispatch_reference(x, ids, num_experts=E)[1])


@pytest.mark.parametrize("dtype,tie_order", list(itertools.product((torch.float32, torch.bfloat16), TIE_ORDERS)),
                         ids=str)
def test_dispatch_matches_reference_exactly(dtype, tie_order):
    N, K, E, D = 11, 3, 6, 5
    x = testing.randn((N, D), seed=3, dtype=dtype)
    ids = _expert_ids(N, K, E, seed=4)
    assert moe.dispatch_limits(x, ids, num_experts=E) == (True, "")
    x_sorted, sort_idx, counts = moe.dispatch(x, ids, num_experts=E, npu=AscendSemantics(tie_order))
    ref = dispatch_reference(x, ids, num_experts=E)
    assert sort_idx.dtype == counts.dtype == torch.int64
    assert torch.equal(sort_idx, ref[1]) and torch.equal(x_sorted, ref[0]) and torch.equal(counts, ref[2])
    assert counts[-1] == 0


def test_stability_check_spots_reordered_rows():
    flat = torch.tensor([1, 0, 1, 0])
    assert L.is_stable_expert_order(torch.tensor([1, 3, 0, 2]), flat)
    assert not L.is_stable_expert_order(torch.tensor([3, 1, 0, 2]), flat)
    assert not L.is_stable_expert_order(torch.tensor([0, 2, 1, 3]), flat)


# ---------------------------------------------------------------------------------------------- experts
@pytest.mark.parametrize("dtype", testing.FLOAT_DTYPES_UNDER_TEST, ids=str)
def test_experts_match_reference(dtype):
    shape = testing.MoEShape(N=9, E=4, K=2, G=1, TG=1, D=24, F=10)
    w = testing.make_expert_inputs(shape, dtype=dtype, seed=8)
    x_sorted, _, counts = dispatch_reference(w["x"], _expert_ids(shape.N, shape.K, shape.E, seed=2),
                                             num_experts=shape.E)
    args = (x_sorted, counts, w["w_gate"], w["w_up"], w["w_down"])
    assert moe.experts_limits(*args) == (True, "")
    npu = AscendSemantics()
    out = moe.experts(*args, npu=npu)
    assert npu.calls == ["npu_grouped_matmul"] * 3 and out.dtype == dtype
    ref = experts_reference(*args)
    exact = experts_reference(*(a.double() if a.is_floating_point() else a for a in args))
    result = testing.compare_to_fp64(out, ref, exact, dtype)
    assert result.passed, result.detail


def test_matmul_weights_are_transposed_views():
    w = torch.randn(3, 5, 7)
    view = L.as_matmul_weight(w)
    assert tuple(view.shape) == (3, 7, 5) and view.data_ptr() == w.data_ptr()
    assert L.cumulative_groups(torch.tensor([2, 0, 3])).tolist() == [2, 2, 5]


def test_experts_limits():
    shape = testing.MoEShape(N=2, E=1025, K=1, G=1, TG=1, D=4, F=4)
    w = testing.make_expert_inputs(shape)
    ok, why = moe.experts_limits(w["x"], torch.zeros(1025, dtype=torch.int64).index_fill(0, torch.tensor([0]), 2),
                                 w["w_gate"], w["w_up"], w["w_down"])
    assert not ok and "1024" in why


# ---------------------------------------------------------------------------------------------- combine
def test_column_major_src_to_dst():
    sort_idx = torch.tensor([3, 0, 4, 1, 5, 2])  # sorted row -> flat n*K + j, N=3, K=2
    out = L.column_major_src_to_dst(sort_idx, num_rows=3, top_k=2)
    assert out.dtype == torch.int32
    # flat f sits at sorted row inverse[f] = [1, 3, 5, 0, 2, 4]; column-major lists j=0 rows, then j=1 rows
    assert out.tolist() == [1, 5, 2, 3, 0, 4]


def _combine_inputs(dtype, seed=0):
    N, K, E, D = 13, 3, 7, 6
    ids = _expert_ids(N, K, E, seed=seed)
    _, sort_idx, _ = dispatch_reference(torch.zeros(N, 1), ids, num_experts=E)
    y_sorted = testing.randn((N * K, D), seed=seed + 1, dtype=dtype)
    weights = testing.randn((N, K), seed=seed + 2).abs()
    return y_sorted, sort_idx, weights


@pytest.mark.parametrize("dtype", testing.FLOAT_DTYPES_UNDER_TEST, ids=str)
def test_combine_matches_reference(dtype):
    args = _combine_inputs(dtype)
    assert moe.combine_limits(*args) == (True, "")
    out = moe.combine(*args, npu=AscendSemantics())
    ref = combine_reference(*args)
    exact = combine_reference(*(a.double() if a.is_floating_point() else a for a in args))
    result = testing.compare_to_fp64(out, ref, exact, dtype)
    assert out.dtype == dtype and result.passed, result.detail


class _RowMajorFinalize(AscendSemantics):
    """A backend bug to be caught: the vendor reading our column-major indices as row-major."""

    def npu_moe_finalize_routing(self, *args, drop_pad_mode=0):
        return super().npu_moe_finalize_routing(*args, drop_pad_mode=2)


def test_a_transposed_src_to_dst_is_detected():
    args = _combine_inputs(torch.float32, seed=3)
    out = moe.combine(*args, npu=_RowMajorFinalize())
    assert not torch.allclose(out, combine_reference(*args))


def test_moe_layer_end_to_end_in_bf16():
    shape = testing.MoEShape(N=21, E=8, K=2, G=1, TG=1, D=16, F=12)
    route_in = testing.make_route_inputs(shape, seed=2)
    w = testing.make_expert_inputs(shape, dtype=torch.bfloat16, seed=5)

    def layer(route_fn, dispatch_fn, experts_fn, combine_fn):
        weights, ids = route_fn(**route_in, top_k=shape.K, routed_scaling_factor=2.5)
        x_sorted, sort_idx, counts = dispatch_fn(w["x"], ids, num_experts=shape.E)
        y = experts_fn(x_sorted, counts, w["w_gate"], w["w_up"], w["w_down"])
        return combine_fn(y, sort_idx, weights)

    npu = AscendSemantics()
    out = layer(*(lambda *a, f=f, **k: f(*a, **k, npu=npu)
                  for f in (moe.route, moe.dispatch, moe.experts, moe.combine)))
    ref = layer(route_reference, dispatch_reference, experts_reference, combine_reference)
    atol, rtol = testing.TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol * 4, rtol=rtol * 4)
