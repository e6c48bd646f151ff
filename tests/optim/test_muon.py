"""Muon against a plain per-parameter, per-head reference step (glm5_core.optim.muon_reference_step)."""
import math

import pytest
import torch

from glm5_core.ops import muon as muon_ops
from glm5_core.optim import Muon, muon_reference_step, update_scale

TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _param(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(torch.randn(shape, generator=g, dtype=torch.float64).to(dtype))


def _grads(shape, dtype, steps, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for _ in range(steps)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape,split_heads,split_dim", [
    ((7, 5), None, 0), ((5, 13), None, 0), ((12, 9), 3, 0), ((6, 20), 4, 1), ((21, 10), 7, 0),
    ((4, 3, 5), None, 0), ((6, 2, 3), 2, 0), ((4, 3, 5), 3, 1),  # conv-like: one [rows, prod(rest)] matrix
])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("scale_mode", ["match_rms_adamw", "original"])
def test_steps_match_the_reference(dtype, shape, split_heads, split_dim, nesterov, scale_mode):
    hyper = dict(lr=0.03, momentum=0.9, nesterov=nesterov, weight_decay=0.1, ns_steps=5,
                 coefficients="polar_express", scale_mode=scale_mode)
    p = _param(shape, dtype, seed=1)
    opt = Muon([dict(params=[p], split_heads=split_heads, split_dim=split_dim)], **hyper)
    ref_p, ref_buf = p.detach().clone(), torch.zeros_like(p)
    for grad in _grads(shape, dtype, steps=3, seed=2):
        p.grad = grad.clone()
        opt.step()
        ref_p, ref_buf = muon_reference_step(ref_p, grad, ref_buf, split_heads=split_heads, split_dim=split_dim,
                                             **hyper)
    torch.testing.assert_close(p.detach(), ref_p, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], ref_buf, atol=TOL[dtype], rtol=TOL[dtype])


def test_bf16_parameters_follow_the_reference():
    shape = (16, 24)
    p = _param(shape, torch.bfloat16, seed=3)
    start = p.detach().clone()
    opt = Muon([p], lr=0.05, weight_decay=0.0)
    grad = _grads(shape, torch.bfloat16, 1, seed=4)[0]
    p.grad = grad
    opt.step()
    ref, _ = muon_reference_step(start.float(), grad.float(), torch.zeros(shape), lr=0.05, momentum=0.95,
                                 nesterov=True, weight_decay=0.0, ns_steps=5, coefficients="polar_express",
                                 scale_mode="match_rms_adamw")
    assert p.dtype == torch.bfloat16
    torch.testing.assert_close(p.detach().float(), ref, atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])


@pytest.mark.parametrize("dim", [0, 1])
def test_muon_split_equals_orthogonalising_each_head_alone(dim):
    heads, block = 4, (6, 10) if dim == 0 else (10, 6)
    shape = (heads * block[0], block[1]) if dim == 0 else (block[0], heads * block[1])
    p = _param(shape, torch.float64, seed=5)
    start = p.detach().clone()
    grad = _grads(shape, torch.float64, 1, seed=6)[0]
    lr = 0.1
    # momentum 0 and no weight decay: the step is exactly -lr * scale * orthogonalize(grad) per head.
    opt = Muon([dict(params=[p], split_heads=heads, split_dim=dim)], lr=lr, momentum=0.0, nesterov=False)
    p.grad = grad
    opt.step()
    expected = torch.cat([
        muon_ops.orthogonalize(g, coefficients="polar_express") * update_scale(*g.shape)
        for g in torch.chunk(grad, heads, dim=dim)
    ], dim=dim)
    torch.testing.assert_close(p.detach(), start - lr * expected, atol=1e-10, rtol=1e-10)
    whole = muon_ops.orthogonalize(grad, coefficients="polar_express") * update_scale(*grad.shape)
    assert not torch.allclose(p.detach(), start - lr * whole, atol=1e-3), "split must differ from the whole matrix"


@pytest.mark.parametrize("mode", ["match_rms_adamw", "original"])
def test_update_scale_uses_the_block_shape(mode):
    # Row blocks of [8, 4] from a [32, 4] matrix: both scale modes give different numbers for block and whole.
    heads, shape = 4, (32, 4)
    assert update_scale(8, 4, mode) != update_scale(32, 4, mode)
    p = _param(shape, torch.float64, seed=7)
    start = p.detach().clone()
    grad = _grads(shape, torch.float64, 1, seed=8)[0]
    opt = Muon([dict(params=[p], split_heads=heads, split_dim=0)], lr=1.0, momentum=0.0, nesterov=False,
               scale_mode=mode)
    p.grad = grad
    opt.step()
    step = start - p.detach()  # [32, 4]
    for g, s in zip(torch.chunk(grad, heads), torch.chunk(step, heads)):
        ortho = muon_ops.orthogonalize(g)
        ratio = (s.norm() / ortho.norm()).item()
        assert math.isclose(ratio, update_scale(8, 4, mode), rel_tol=1e-9)


def test_same_shape_matrices_are_batched_without_changing_results():
    shapes = [(9, 5), (9, 5), (5, 9), (9, 5)]
    together = [_param(s, torch.float64, seed=i) for i, s in enumerate(shapes)]
    alone = [torch.nn.Parameter(p.detach().clone()) for p in together]
    grads = [_grads(s, torch.float64, 1, seed=10 + i)[0] for i, s in enumerate(shapes)]
    opt_together = Muon(together, lr=0.02)
    opts_alone = [Muon([p], lr=0.02) for p in alone]
    for p, q, g in zip(together, alone, grads):
        p.grad, q.grad = g.clone(), g.clone()
    opt_together.step()
    for opt in opts_alone:
        opt.step()
    for p, q in zip(together, alone):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-12, rtol=1e-12)


def test_parameters_without_grad_are_untouched():
    frozen, live = _param((6, 4), torch.float32, 1), _param((6, 4), torch.float32, 2)
    before = frozen.detach().clone()
    opt = Muon([frozen, live], lr=0.1, weight_decay=0.5)
    live.grad = torch.ones(6, 4)
    opt.step()
    assert torch.equal(frozen.detach(), before)
    assert frozen not in opt.state
    assert not torch.equal(live.detach(), _param((6, 4), torch.float32, 2).detach())


@pytest.mark.parametrize("kwargs,match", [
    (dict(params=[torch.nn.Parameter(torch.ones(4))]), "matrices"),
    (dict(params=[dict(params=[torch.nn.Parameter(torch.ones(6, 4))], split_heads=4)]), "split_heads"),
    (dict(params=[torch.nn.Parameter(torch.ones(6, 4))], scale_mode="rms"), "scale_mode"),
    (dict(params=[torch.nn.Parameter(torch.ones(6, 4))], momentum=1.0), "momentum"),
    (dict(params=[torch.nn.Parameter(torch.ones(6, 4))], coefficients="newton"), "coefficients"),
    (dict(params=[torch.nn.Parameter(torch.ones(6, 4))], ns_dtype="bf16"), "ns_dtype: expected"),
    (dict(params=[torch.nn.Parameter(torch.ones(6, 4))], ns_dtype=torch.float16), "ns_dtype: expected"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Muon(**kwargs)


@pytest.mark.parametrize("group,match", [
    (dict(params=[torch.nn.Parameter(torch.ones(4))]), "matrices"),
    (dict(params=[torch.nn.Parameter(torch.ones(6, 4))], split_heads=4), "split_heads"),
    (dict(params=[torch.nn.Parameter(torch.ones(6, 4))], momentum=1.5), "momentum"),
    (dict(params=[torch.nn.Parameter(torch.ones(6, 4))], lr=-0.1), "lr"),
    (dict(params=[torch.nn.Parameter(torch.ones(6, 4))], weight_decay=-1.0), "weight_decay"),
    (dict(params=[torch.nn.Parameter(torch.ones(6, 4))], scale_mode="rms"), "scale_mode"),
    (dict(params=[torch.nn.Parameter(torch.ones(6, 4))], coefficients="newton"), "coefficients"),
    (dict(params=[torch.nn.Parameter(torch.ones(6, 4))], nesterov="no"), "nesterov"),  # was read as True
    (dict(params=[torch.nn.Parameter(torch.ones(6, 4))], ns_steps=0), "ns_steps"),  # failed only at step()
    (dict(params=[torch.nn.Parameter(torch.ones(6, 4))], ns_dtype="half"), "ns_dtype"),
])
def test_group_values_are_checked_in_the_constructor_and_in_add_param_group(group, match):
    """A group's own values override the defaults, so they get the defaults' checks, also for groups added later
    (a vector added by add_param_group was silently stepped as an [n, 1] matrix)."""
    with pytest.raises((ValueError, TypeError), match=match):
        Muon([group], lr=0.02)
    opt = Muon([_param((5, 3), torch.float32, seed=1)], lr=0.02)
    with pytest.raises((ValueError, TypeError), match=match):
        opt.add_param_group(group)
    assert len(opt.param_groups) == 1  # the rejected group is not kept
    opt.add_param_group(dict(params=[_param((6, 4), torch.float32, seed=2)], split_heads=2, momentum=0.5))
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["momentum"] == 0.5


@pytest.mark.parametrize("shape,split_heads,split_dim", [((7, 5), None, 0), ((12, 9), 3, 0), ((6, 20), 4, 1)])
@pytest.mark.parametrize("ns_dtype", ["bfloat16", torch.bfloat16])
def test_bf16_newton_schulz_steps_match_the_reference(shape, split_heads, split_dim, ns_dtype):
    """The group option reaches the kernel: the same steps as the plain reference step iterating in bf16,
    and not the fp32 iteration's (which the reference step's default gives)."""
    hyper = dict(lr=0.03, momentum=0.9, nesterov=True, weight_decay=0.1, ns_steps=5, coefficients="polar_express",
                 scale_mode="match_rms_adamw")
    p = _param(shape, torch.float32, seed=1)
    opt = Muon([dict(params=[p], split_heads=split_heads, split_dim=split_dim, ns_dtype=ns_dtype)], **hyper)
    assert opt.param_groups[0]["ns_dtype"] == "bfloat16"  # a name, so state_dict stays JSON
    ref_p, ref_buf, fp32_p, fp32_buf = p.detach().clone(), torch.zeros_like(p), p.detach().clone(), torch.zeros_like(p)
    for grad in _grads(shape, torch.float32, steps=3, seed=2):
        p.grad = grad.clone()
        opt.step()
        ref_p, ref_buf = muon_reference_step(ref_p, grad, ref_buf, split_heads=split_heads, split_dim=split_dim,
                                             ns_dtype="bfloat16", **hyper)
        fp32_p, fp32_buf = muon_reference_step(fp32_p, grad, fp32_buf, split_heads=split_heads,
                                               split_dim=split_dim, **hyper)
    # bf16 compute: lr * scale * (a few bf16 roundings of O ~ 1 / sqrt(n)) per step
    torch.testing.assert_close(p.detach(), ref_p, atol=2e-4, rtol=0)
    assert float((p.detach() - fp32_p).abs().max()) > 2e-4


def test_auto_ns_dtype_follows_the_device(monkeypatch):
    shape = (12, 9)
    runs = {}
    for label, native in (("auto_native", True), ("auto_emulated", False)):
        monkeypatch.setattr(muon_ops, "native_bf16_gemm", lambda device, native=native: native)
        p = _param(shape, torch.float32, seed=1)
        opt = Muon([p], lr=0.03, ns_dtype="auto")
        p.grad = _grads(shape, torch.float32, 1, seed=2)[0]
        opt.step()
        runs[label] = p.detach()
    for ns_dtype in ("bfloat16", "float32"):
        p = _param(shape, torch.float32, seed=1)
        opt = Muon([p], lr=0.03, ns_dtype=ns_dtype)
        p.grad = _grads(shape, torch.float32, 1, seed=2)[0]
        opt.step()
        runs[ns_dtype] = p.detach()
    assert torch.equal(runs["auto_native"], runs["bfloat16"])
    assert torch.equal(runs["auto_emulated"], runs["float32"])
    assert not torch.equal(runs["bfloat16"], runs["float32"])


def test_a_state_dict_from_before_ns_dtype_loads_and_steps_as_float32():
    """``Muon.load_state_dict`` of a state dict saved before the ``ns_dtype`` option existed (its groups lack
    the key): the groups take float32, what such runs iterated in, and the next step equals a fresh fp32 run's
    (torch's load_state_dict replaces the groups by the saved ones, so a missing key used to fail the step)."""
    shape, grads = (12, 9), _grads((12, 9), torch.float32, steps=2, seed=2)
    runs = []
    for old_format in (False, True):
        p = _param(shape, torch.float32, seed=1)
        opt = Muon([p], lr=0.03, ns_dtype="float32")
        p.grad = grads[0].clone()
        opt.step()
        saved = opt.state_dict()
        if old_format:
            saved["param_groups"] = [{k: v for k, v in g.items() if k != "ns_dtype"} for g in saved["param_groups"]]
        resumed = torch.nn.Parameter(p.detach().clone())
        opt = Muon([resumed], lr=0.03, ns_dtype="bfloat16")  # the loaded groups decide, as for every option
        opt.load_state_dict(saved)
        assert opt.param_groups[0]["ns_dtype"] == "float32"
        resumed.grad = grads[1].clone()
        opt.step()
        runs.append(resumed.detach())
    assert torch.equal(runs[0], runs[1])
