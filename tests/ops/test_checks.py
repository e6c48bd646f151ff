"""Malformed inputs to every public op raise ValueError / TypeError naming the argument (property tests): the
argument and value checks of ``glm5_core.ops._checks`` as the entry points apply them."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glm5_core import testing
from glm5_core.ops import _checks, dsa, mla, moe, muon

MLA_SHAPE = testing.MLAShape(B=2, T=3, S=5, H=2, Dn=4, Dr=2, Dv=3, C=6)
IDX_SHAPE = testing.IndexerShape(B=2, T=3, S=5, H=2, D=4, K=3)
MOE_SHAPE = testing.MoEShape(N=5, E=8, K=2, G=2, TG=1, D=4, F=3)


def _mla_call(entry):
    def call(**a):
        return entry(a["q_nope"], a["q_pe"], a["c_kv"], a["k_pe"], a["w_uk"], a["w_uv"], scale=a["scale"],
                     start_pos=a["start_pos"])
    return call


def _sparse_call(entry):
    def call(**a):
        return entry(a["q_nope"], a["q_pe"], a["c_kv"], a["k_pe"], a["w_uk"], a["w_uv"], a["topk_idx"],
                     scale=a["scale"])
    return call


def valid_args(op):
    if op in ("mla.prefill", "mla.decode"):
        return {**testing.make_mla_inputs(MLA_SHAPE), "scale": 0.5, "start_pos": 2}
    if op in ("dsa.sparse_prefill", "dsa.sparse_decode"):
        return {**testing.make_sparse_inputs(MLA_SHAPE, 3), "scale": 0.5}
    if op in ("dsa.indexer_topk", "dsa.indexer_scores"):
        return {**testing.make_indexer_inputs(IDX_SHAPE), "topk": 3, "start_pos": 2}
    if op == "moe.route":
        return {**testing.make_route_inputs(MOE_SHAPE), "top_k": 2, "n_group": 2, "topk_group": 1,
                "routed_scaling_factor": 2.5}
    if op == "moe.dispatch":
        return {"x": testing.make_expert_inputs(MOE_SHAPE)["x"],
                "expert_ids": torch.randint(0, 8, (5, 2), dtype=torch.int32), "num_experts": 8}
    if op == "moe.experts":
        x = testing.make_expert_inputs(MOE_SHAPE)
        return {"x_sorted": x["x"], "counts": torch.tensor([2, 3, 0, 0, 0, 0, 0, 0]), "w_gate": x["w_gate"],
                "w_up": x["w_up"], "w_down": x["w_down"]}
    if op == "muon.orthogonalize":
        return {"G": torch.randn(4, 6), "steps": 5}
    raise AssertionError(op)


CALLS = {
    "mla.prefill": _mla_call(mla.prefill),
    "mla.decode": _mla_call(mla.decode),
    "dsa.sparse_prefill": _sparse_call(dsa.sparse_prefill),
    "dsa.sparse_decode": _sparse_call(dsa.sparse_decode),
    "dsa.indexer_topk": lambda **a: dsa.indexer_topk(a["q"], a["k"], a["w"], a["topk"], start_pos=a["start_pos"]),
    "dsa.indexer_scores": lambda **a: dsa.indexer_scores(a["q"], a["k"], a["w"], start_pos=a["start_pos"]),
    "moe.route": lambda **a: moe.route(a["logits"], a["bias"], top_k=a["top_k"], n_group=a["n_group"],
                                       topk_group=a["topk_group"], routed_scaling_factor=a["routed_scaling_factor"]),
    "moe.dispatch": lambda **a: moe.dispatch(a["x"], a["expert_ids"], num_experts=a["num_experts"]),
    "moe.experts": lambda **a: moe.experts(a["x_sorted"], a["counts"], a["w_gate"], a["w_up"],
                                                         a["w_down"]),
    "muon.orthogonalize": lambda **a: muon.orthogonalize(a["G"], steps=a["steps"]),
}

# (argument, dim) whose size no other argument constrains: growing them is valid input.
FREE_DIMS = {("k", 1), ("w_uv", 1), ("topk_idx", 2), ("expert_ids", 1), ("x", 1), ("logits", 0)}

CORRUPTIONS = ("drop_dim", "add_dim", "resize_dim", "int_dtype", "not_a_tensor", "meta_device", "nan")


def corrupt(value: torch.Tensor, how: str, dim_choice: int):
    if how == "not_a_tensor":
        return value.tolist()
    if how == "drop_dim":
        return value[0] if value.dim() > 0 else value.view(1)
    if how == "add_dim":
        return value.unsqueeze(0)
    if how == "resize_dim":
        d = dim_choice % value.dim()
        return torch.cat([value, value.narrow(d, 0, 1)], dim=d)
    if how == "int_dtype":
        return value.to(torch.int16 if value.is_floating_point() else torch.float32)
    if how == "meta_device":
        return value.to("meta")
    if how == "nan":
        out = value.clone()
        out.view(-1)[dim_choice % out.numel()] = math.nan
        return out
    raise AssertionError(how)


@settings(max_examples=400, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(op=st.sampled_from(sorted(CALLS)), how=st.sampled_from(CORRUPTIONS), which=st.integers(0, 50),
       dim_choice=st.integers(0, 7))
def test_malformed_tensor_arguments_are_rejected_by_name(op, how, which, dim_choice):
    args = valid_args(op)
    tensor_names = [k for k, v in args.items() if isinstance(v, torch.Tensor)]
    name = tensor_names[which % len(tensor_names)]
    if how == "nan" and (not args[name].is_floating_point() or op.startswith(("mla.", "dsa.sparse", "moe.disp",
                                                                                "moe.experts", "muon."))):
        return  # NaN is only rejected where it would corrupt a selection (top-k, routing)
    if op == "muon.orthogonalize" and how in ("resize_dim", "add_dim"):
        return  # any matrix shape and any batch of matrices is valid
    if how == "resize_dim" and (name, dim_choice % args[name].dim()) in FREE_DIMS:
        return
    if how == "meta_device" and len(tensor_names) == 1:
        return  # a device mix needs two tensors
    args[name] = corrupt(args[name], how, dim_choice)
    with pytest.raises((ValueError, TypeError)) as info:
        CALLS[op](**args)
    message = str(info.value)
    if how in ("not_a_tensor", "int_dtype", "add_dim", "drop_dim", "nan"):
        assert message.startswith(f"{name}:") or name in message, message
    else:
        assert any(n in message for n in args), message


@pytest.mark.parametrize("op,field,value", [
    ("dsa.indexer_topk", "topk", 0), ("dsa.indexer_topk", "topk", 2.5), ("dsa.indexer_topk", "start_pos", -1),
    ("dsa.indexer_topk", "start_pos", 3), ("mla.prefill", "scale", 0.0), ("mla.prefill", "scale", math.nan),
    ("mla.decode", "start_pos", torch.tensor([0, 9])), ("moe.route", "top_k", 9), ("moe.route", "n_group", 3),
    ("moe.route", "topk_group", 3), ("moe.route", "routed_scaling_factor", -1.0), ("moe.dispatch", "num_experts", 0),
    ("muon.orthogonalize", "steps", 0), ("dsa.sparse_decode", "topk_idx", torch.full((2, 3, 3), 7)),
    ("moe.dispatch", "expert_ids", torch.full((5, 2), 8)),
    ("moe.experts", "counts", torch.ones(8, dtype=torch.int64)),
    # sizes an argument asks for that no machine holds: [B, T, topk] int32 outputs, [E] int64 counts
    ("dsa.indexer_topk", "topk", 2**45), ("moe.dispatch", "num_experts", 2**50),
])
def test_bad_scalar_arguments_are_rejected_by_name(op, field, value):
    args = valid_args(op)
    args[field] = value
    with pytest.raises((ValueError, TypeError), match=field):
        CALLS[op](**args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [0, 17, 4095])  # first, a vector's middle, the last (a reduction's tail)
def test_finite_check_finds_any_single_nan_or_inf(dtype, bad, where):
    from glm5_core.ops import _checks

    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(where)).to(dtype)
    x[0, 0] = torch.finfo(dtype).max  # huge finite extremes pass
    x[0, 1] = torch.finfo(dtype).min
    _checks.finite("x", x)
    x.view(-1)[where] = bad
    with pytest.raises(ValueError, match="x: expected finite values"):
        _checks.finite("x", x)
    _checks.finite("empty", x[:0])  # nothing to check
    _checks.finite("ints", torch.arange(5))


def test_finite_check_stays_out_of_autograd():
    """The check on an input that requires grad (the router logits, the indexer's q / k / w) records nothing for
    backward: no saved-tensor hook sees the input (amin / amax under grad mode saved it twice, so an
    activation-offloading hook would copy it off the device twice per check)."""
    from glm5_core.ops import _checks

    leaf = torch.randn(6, 33, requires_grad=True)
    x = leaf * 2  # a non-leaf, as the ops get
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(tuple(t.shape)) or t, lambda t: t):
        _checks.finite("x", x)
        x.view(-1)[7].detach().fill_(math.nan)  # in place through a view: x's own graph untouched
        with pytest.raises(ValueError, match="x: expected finite values"):
            _checks.finite("x", x)
    assert packed == []


def test_fake_tensors_trace_shapes_with_the_value_checks_on():
    """Under FakeTensorMode (what the meta-device error advises for tracing shapes) the ops give outputs of the
    right shapes and dtypes: the value checks (NaN, index ranges, start positions) have no values to read and
    are skipped, as under torch.compile, instead of failing on a data-dependent read."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, w = torch.randn(2, 5, 4, 8), torch.randn(2, 9, 8), torch.randn(2, 5, 4)
        idx = dsa.indexer_topk(q, k, w, 3, start_pos=torch.tensor([4, 2]), backend="cpu")
        scores = dsa.indexer_scores(q, k, w, start_pos=4, backend="cpu")
        weights, ids = moe.route(torch.randn(7, 8), torch.zeros(8), top_k=2, backend="cpu")
    assert (idx.shape, idx.dtype) == ((2, 5, 3), torch.int32)
    assert (scores.shape, scores.dtype) == ((2, 5, 9), torch.float32)
    assert (weights.shape, ids.shape, ids.dtype) == ((7, 2), (7, 2), torch.int32)


def test_value_checks_can_be_switched_off_for_production_loops(monkeypatch):
    args = valid_args("moe.route")
    args["logits"] = args["logits"].clone()
    args["logits"][0, 0] = math.nan
    with pytest.raises(ValueError, match="logits"):
        CALLS["moe.route"](**args)
    monkeypatch.setenv("GLM5_CHECK_VALUES", "0")
    CALLS["moe.route"](**args)  # no device sync, no check: the caller vouches for the values
    args["top_k"] = 0
    with pytest.raises(ValueError, match="top_k"):  # argument and shape checks stay on
        CALLS["moe.route"](**args)


def test_combine_rejects_an_index_that_is_not_dispatch_permutation():
    weights = torch.rand(3, 2)
    y = torch.randn(6, 4)
    with pytest.raises(ValueError, match="sort_idx"):
        moe.combine(y, torch.tensor([0, 1, 2, 3, 4, 4]), weights)
    with pytest.raises(ValueError, match="sort_idx"):
        moe.combine(y, torch.tensor([0, 1, 2, 3, 4, 6]), weights)


def test_skip_value_checks_is_scoped_to_its_context_and_thread():
    import threading

    from glm5_core.ops import _checks, moe

    logits = torch.zeros(3, 4)
    logits[1, 2] = math.nan
    with pytest.raises(ValueError, match="logits"):
        moe.route(logits, None, top_k=2, backend="reference")
    seen_in_other_thread = []
    with _checks.skip_value_checks():
        assert not _checks.value_checks_enabled()
        worker = threading.Thread(target=lambda: seen_in_other_thread.append(_checks.value_checks_enabled()))
        worker.start()
        worker.join()
    assert seen_in_other_thread == [True]  # other threads keep their checks
    assert _checks.value_checks_enabled()  # restored on exit
    with pytest.raises(ValueError, match="logits"):
        moe.route(logits, None, top_k=2, backend="reference")


def test_value_checks_are_off_and_traceable_under_torch_compile():
    """Kernel wrappers ask value_checks_enabled() inside compiled code: it must fold to False without a graph
    break (a ContextVar read is untraceable), and must not turn the checks off outside compilation."""
    from glm5_core.ops import _checks

    def double_unless_checked(x):
        return x + 1 if _checks.value_checks_enabled() else x * 2

    compiled = torch.compile(double_unless_checked, fullgraph=True, backend="eager")
    x = torch.arange(3.0)
    torch.testing.assert_close(compiled(x), x * 2)
    assert _checks.value_checks_enabled()


@pytest.mark.parametrize("op", sorted(CALLS))
def test_inputs_all_on_meta_are_rejected_by_name(op):
    """Meta tensors have no values for the checks and selections to read: one ValueError naming an argument,
    the same for every op (not a Tensor.item() error from whichever value check comes first)."""
    args = {n: v.to("meta") if isinstance(v, torch.Tensor) else v for n, v in valid_args(op).items()}
    with pytest.raises(ValueError, match="meta") as info:
        CALLS[op](**args)
    assert str(info.value).split(":")[0] in args, info.value


@pytest.mark.parametrize("entry", ("indexer_topk", "indexer_scores"))
def test_zero_indexer_heads_are_rejected_on_every_backend(backend, entry):
    """H = 0: the reference raised IndexError while the native top-k returned the first k keys."""
    args = valid_args("dsa.indexer_topk")
    q, w = args["q"][:, :, :0], args["w"][:, :, :0]  # [B, T, 0, D], [B, T, 0]
    kwargs = {"topk": args["topk"]} if entry == "indexer_topk" else {}
    with pytest.raises(ValueError, match=r"q / w: .*H >= 1"):
        getattr(dsa, entry)(q, args["k"], w, start_pos=args["start_pos"], backend=backend, **kwargs)


@pytest.mark.parametrize("op", ("dsa.sparse_prefill", "dsa.sparse_decode"))
@pytest.mark.parametrize("empty", ("queries", "keys"))
def test_sparse_attention_without_queries_or_keys_is_rejected_on_every_backend(backend, op, empty):
    """T = 0 made the reference fail in torch.cat (the native kernel returned an empty tensor); S = 0 made it
    index an empty cache. Both are rejected as MLA rejects them."""
    args = valid_args(op)
    if empty == "queries":
        args.update(q_nope=args["q_nope"][:, :0], q_pe=args["q_pe"][:, :0], topk_idx=args["topk_idx"][:, :0])
    else:
        args.update(c_kv=args["c_kv"][:, :0], k_pe=args["k_pe"][:, :0], topk_idx=torch.full_like(args["topk_idx"], -1))
    entry = getattr(dsa, op.split(".")[1])
    with pytest.raises(ValueError, match=r"c_kv / q_nope: expected at least one key and one query"):
        entry(args["q_nope"], args["q_pe"], args["c_kv"], args["k_pe"], args["w_uk"], args["w_uv"], args["topk_idx"],
              scale=args["scale"], backend=backend)


@pytest.mark.parametrize("schedule", [
    muon.NSCoefficients("nan", ((math.nan, 1.0, 1.0),)),
    muon.NSCoefficients("inf", ((3.0, -math.inf, 1.0),)),
    muon.NSCoefficients("past fp32", ((1e300, -1.0, 1.0),)),
    muon.NSCoefficients("inf norm", ((3.0, -3.0, 1.0),), norm_scale=math.inf),
    muon.NSCoefficients("zero norm", ((3.0, -3.0, 1.0),), norm_scale=0.0),
    muon.NSCoefficients("no steps", ()),
    [(1e39, 0.0, 0.0)],
], ids=lambda s: getattr(s, "name", "triples"))
def test_newton_schulz_schedules_outside_float_range_are_rejected(backend, schedule):
    """A non-finite schedule turned every update into NaN without a word (or, natively, a 'cannot be converted
    to type float' error naming nothing); the schedule is checked however it is given."""
    with pytest.raises(ValueError, match="coefficients"):
        muon.orthogonalize(torch.randn(4, 6), coefficients=schedule, backend=backend)


def test_topk_wider_than_the_keys_pads_with_minus_one_on_every_backend(backend):
    """A topk far past S (still allocatable) follows the contract: k = min(topk, visible keys), then -1. The
    kernels size their working sets by min(topk, S), so a wide topk costs its output, nothing more."""
    args = valid_args("dsa.indexer_topk")
    topk = 4096
    got = dsa.indexer_topk(args["q"], args["k"], args["w"], topk, start_pos=args["start_pos"], backend=backend)
    want = dsa.indexer_topk_reference(args["q"], args["k"], args["w"], topk=topk, start_pos=args["start_pos"])
    assert got.shape == (2, 3, topk) and torch.equal(got, want)
    assert bool((got[..., args["k"].shape[1]:] == -1).all())


def test_cast_is_to_without_the_no_op_dispatch():
    """``cast`` returns the tensor itself when it has the dtype (as ``.to`` does) and ``.to``'s result otherwise,
    gradients included."""
    x = torch.randn(3, 4, requires_grad=True)
    assert _checks.cast(x, torch.float32) is x
    y = _checks.cast(x, torch.float64)
    assert y.dtype == torch.float64 and torch.equal(y, x.to(torch.float64))
    y.sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.ones(3, 4))
    b = torch.randn(5).bfloat16()
    assert torch.equal(_checks.cast(b, torch.float32), b.to(torch.float32))


def test_tensor_messages_name_the_expected_shape():
    """The expected shape (the legend, else built from the dims) is in every shape error, though it is built only
    when a check fails."""
    with pytest.raises(TypeError, match=r"q: expected a torch.Tensor \[B, \*, 4\], got int"):
        _checks.tensor("q", 3, dims=("B", None, 4), sizes={})
    with pytest.raises(ValueError, match=r"q: expected rank 3 \[B, \*, 4\], got shape \(2,\)"):
        _checks.tensor("q", torch.zeros(2), dims=("B", None, 4), sizes={})
    with pytest.raises(ValueError, match=r"q: expected \[B, \*, 4\] with size 4 at dim 2, got shape \(2, 3, 5\)"):
        _checks.tensor("q", torch.zeros(2, 3, 5), dims=("B", None, 4), sizes={})
    with pytest.raises(ValueError, match=r"k: expected \[rows, T\] with T=5 \(from an earlier argument\)"):
        _checks.tensor("k", torch.zeros(2, 3), dims=("B", "T"), sizes={"T": 5}, legend="[rows, T]")
    with pytest.raises(ValueError, match="meta device"):
        _checks.tensor("q", torch.empty(2, device="meta"), dims=(None,))
