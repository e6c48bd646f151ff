"""Conformance checks of the KDA family (``glm5_core.ops.kda``): each op against the reference (outputs and final
states), the chunked and recurrent forms agreeing (outputs and states, fp64), a prefill then decode steps
equalling one longer prefill (KDA and the conv), and the backward inputs of ``kda_chunked`` / ``kda_causal_conv``.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from glm5_core import registry, testing
from glm5_core.conformance.check import DTYPE_NAMES, Check, CheckFn, GradCase, fp64
from glm5_core.ops import kda


def _flat(out) -> torch.Tensor:
    """(o, state) -> one fp64 vector (the state may be None)."""
    return torch.cat([t.detach().to(torch.float64).flatten() for t in out if t is not None])


def _both(cmp_o: testing.Comparison, cmp_s: testing.Comparison) -> testing.Comparison:
    worst = cmp_o if not cmp_o.passed or cmp_s.passed else cmp_s
    return testing.Comparison(cmp_o.passed and cmp_s.passed, worst.max_error, worst.allowed,
                              f"output: {cmp_o.detail}; state: {cmp_s.detail}")


def _kda_check(op: str, shape: testing.KDAShape, dtype: torch.dtype, l2norm: bool) -> CheckFn:
    def fn(backend: str, device: str) -> testing.Comparison:
        x = testing.make_kda_inputs(shape, dtype=dtype, device=device, seed=3)
        extra = {"chunk_size": shape.C} if op == "kda_chunked" else {}
        entry = kda.chunked if op == "kda_chunked" else kda.recurrent
        o, s = entry(**x, output_final_state=True, use_qk_l2norm=l2norm, backend=backend, **extra)
        ref = registry.reference(op)
        ro, rs = ref(**x, output_final_state=True, use_qk_l2norm=l2norm, **extra)
        eo, es = ref(**fp64(x), output_final_state=True, use_qk_l2norm=l2norm, **extra)
        return _both(testing.compare_to_fp64(o, ro, eo, dtype), testing.compare_to_fp64(s, rs, es, dtype))

    return fn


def _conv_check(op: str, shape: testing.KDAShape, dtype: torch.dtype) -> CheckFn:
    def fn(backend: str, device: str) -> testing.Comparison:
        x = testing.make_conv_inputs(shape, dtype=dtype, device=device, seed=5)
        ref = registry.reference(op)
        if op == "kda_causal_conv":
            got = kda.causal_conv(**x, output_final_state=True, backend=backend)
            want, exact = ref(**x, output_final_state=True), ref(**fp64(x), output_final_state=True)
        else:
            x["x"] = x["x"][:, 0]
            got = kda.causal_conv_update(**x, backend=backend)
            want, exact = ref(**x), ref(**fp64(x))
        return _both(testing.compare_to_fp64(got[0], want[0], exact[0], dtype),
                     testing.compare_to_fp64(got[1], want[1], exact[1], dtype))

    return fn


def _agree(what: str, a, b, limit: float) -> testing.Comparison:
    err = float((_flat(a) - _flat(b)).abs().max())
    return testing.Comparison(err <= limit, err, limit, f"max |{what}| = {err:.3g} (fp64, outputs and states)")


def _chunked_vs_recurrent(shape: testing.KDAShape) -> CheckFn:
    """The backend's chunked and recurrent forms agree in fp64 (outputs and final states), to the fp64 atol."""

    def fn(backend: str, device: str) -> testing.Comparison:
        x = testing.make_kda_inputs(shape, dtype=torch.float64, device=device, seed=7)
        a = kda.chunked(**x, output_final_state=True, chunk_size=shape.C, use_qk_l2norm=True, backend=backend)
        b = kda.recurrent(**x, output_final_state=True, use_qk_l2norm=True, backend=backend)
        return _agree("chunked - recurrent", a, b, testing.TOLERANCES[torch.float64][0])

    return fn


def _prefill_then_decode(shape: testing.KDAShape, steps: int = 3) -> CheckFn:
    """Chunked prefill of T tokens then ``steps`` recurrent decode steps (KDA and the conv update) equals a chunked
    prefill of T + steps tokens, in fp64 (outputs of the decoded tokens and the final states)."""

    def fn(backend: str, device: str) -> testing.Comparison:
        s = testing.KDAShape(shape.B, shape.T + steps, shape.H, shape.K, shape.V, shape.C, shape.W)
        x = testing.make_kda_inputs(s, dtype=torch.float64, device=device, seed=9, initial_state=False)
        c = testing.make_conv_inputs(s, dtype=torch.float64, device=device, seed=9, conv_state=False)
        T = shape.T
        full = kda.chunked(**x, output_final_state=True, chunk_size=s.C, use_qk_l2norm=True, backend=backend)
        conv_full = kda.causal_conv(**c, output_final_state=True, backend=backend)
        head = {k: v[:, :T] for k, v in x.items()}
        _, state = kda.chunked(**head, output_final_state=True, chunk_size=s.C, use_qk_l2norm=True, backend=backend)
        _, conv_state = kda.causal_conv(c["x"][:, :T], c["weight"], output_final_state=True, backend=backend)
        outs, conv_outs = [], []
        for t in range(T, T + steps):
            step = {k: v[:, t:t + 1] for k, v in x.items()}
            o, state = kda.recurrent(**step, initial_state=state, output_final_state=True, use_qk_l2norm=True,
                                     backend=backend)
            co, conv_state = kda.causal_conv_update(c["x"][:, t], conv_state, c["weight"], backend=backend)
            outs.append(o)
            conv_outs.append(co.unsqueeze(1))
        decoded = (torch.cat(outs, dim=1), state, torch.cat(conv_outs, dim=1), conv_state)
        whole = (full[0][:, T:], full[1], conv_full[0][:, T:], conv_full[1])
        return _agree("prefill + decode - longer prefill", decoded, whole, testing.TOLERANCES[torch.float64][0])

    return fn


def _repeatable(runs: int = 3) -> CheckFn:
    """The backend's chunked forward + backward (its output, final state, every input's gradient), recurrent
    step and conv are the same bits run to run (fp32, T not a multiple of the chunk)."""

    def fn(backend: str, device: str) -> testing.Comparison:
        shape = testing.KDAShape(B=2, T=11, H=2, K=8, V=4, C=4)  # three chunks, the last partial
        x = testing.make_kda_inputs(shape, device=device, seed=11)
        c = testing.make_conv_inputs(shape, device=device, seed=11)

        def once():
            leaves = {k: v.clone().requires_grad_() for k, v in x.items()}
            o, s = kda.chunked(**leaves, output_final_state=True, chunk_size=shape.C, use_qk_l2norm=True,
                               backend=backend)
            (o.float().square().sum() + s.sum()).backward()
            with torch.no_grad():
                r = kda.recurrent(**x, output_final_state=True, use_qk_l2norm=True, backend=backend)
                cv = kda.causal_conv(**c, output_final_state=True, backend=backend)
            return [o, s, *r, *cv, *(leaves[k].grad for k in sorted(leaves))]

        first = once()
        for i in range(1, runs):
            if not all(torch.equal(a, b) for a, b in zip(first, once())):
                return testing.Comparison(False, float("inf"), 0.0, f"run {i} differs from run 0")
        return testing.Comparison(True, 0.0, 0.0, f"{runs} runs bitwise identical (outputs, states, gradients)")

    return fn


def checks() -> list[Check]:
    # every shape in fp32; bf16 / fp16 on the odd-T and the one-token shapes; q / k not normalised on one
    # (kept small: every check runs on the Triton backends under the interpreter in CI)
    cases = [(shape, torch.float32, True) for shape in testing.KDA_SHAPES]
    cases += [(shape, dtype, True) for shape in testing.KDA_SHAPES[:2] for dtype in (torch.bfloat16, torch.float16)]
    cases += [(testing.KDA_SHAPES[0], torch.float32, False)]
    out = []
    for op in ("kda_chunked", "kda_recurrent"):
        for shape, dtype, l2norm in cases:
            name = f"{op}[{DTYPE_NAMES[dtype]}-{shape}{'' if l2norm else '-no_l2norm'}]"
            out.append(Check("kda", name, (op,), _kda_check(op, shape, dtype, l2norm)))
    conv_cases = [(testing.KDA_SHAPES[0], dtype) for dtype in testing.FLOAT_DTYPES_UNDER_TEST]
    conv_cases += [(testing.KDA_SHAPES[1], torch.float32)]
    for op in ("kda_causal_conv", "kda_causal_conv_update"):
        for shape, dtype in conv_cases:
            out.append(Check("kda", f"{op}[{DTYPE_NAMES[dtype]}-{shape}]", (op,), _conv_check(op, shape, dtype)))
    for shape in (testing.KDA_SHAPES[0], testing.KDA_SHAPES[2]):  # a partial last chunk; whole chunks
        out.append(Check("kda", f"kda_chunked_vs_recurrent[fp64-{shape}]", ("kda_chunked", "kda_recurrent"),
                         _chunked_vs_recurrent(shape), against_reference=False))
    out.append(Check("kda", f"kda_prefill_then_decode[fp64-{testing.KDA_SHAPES[0]}]",
                     ("kda_chunked", "kda_recurrent", "kda_causal_conv", "kda_causal_conv_update"),
                     _prefill_then_decode(testing.KDA_SHAPES[0]), against_reference=False))
    out.append(Check("kda", "kda_repeatability[fp32]",
                     ("kda_chunked", "kda_recurrent", "kda_causal_conv"), _repeatable(), against_reference=False))
    return out


# --------------------------------------------------------------------------------------------- gradients
_GRAD_SHAPE = testing.KDAShape(B=1, T=11, H=2, K=8, V=4, C=4)


def _chunked_grad(device: str, shape: testing.KDAShape = _GRAD_SHAPE, *, initial_state: bool = True,
                  output_final_state: bool = True, use_qk_l2norm: bool = True) -> GradCase:
    """Through the output and the final state (cat'd), from an initial state: every input's gradient (the
    edge cases: no initial state, the output alone, q and k not normalised)."""
    x = testing.make_kda_inputs(shape, device=device, seed=23, initial_state=initial_state)
    kw = dict(output_final_state=output_final_state, chunk_size=shape.C, use_qk_l2norm=use_qk_l2norm)

    def entry(be, **t):
        return torch.cat([p.flatten() for p in kda.chunked(**t, **kw, backend=be) if p is not None])

    def ref(**t):
        return torch.cat([p.flatten() for p in kda.chunked_reference(**t, **kw) if p is not None])

    return entry, ref, x


def _conv_grad(device: str, shape: testing.KDAShape = _GRAD_SHAPE, *, bias: bool = False,
               activation: Optional[str] = "silu") -> GradCase:
    x = testing.make_conv_inputs(shape, device=device, seed=29)
    if bias:
        x["bias"] = testing.randn((x["x"].shape[-1],), seed=30, device=device)

    def entry(be, **t):
        return torch.cat([p.flatten() for p in kda.causal_conv(**t, activation=activation, output_final_state=True,
                                                               backend=be)])

    def ref(**t):
        return torch.cat([p.flatten() for p in kda.causal_conv_reference(**t, activation=activation,
                                                                         output_final_state=True)])

    return entry, ref, x


# Inputs of the backward check of each differentiable op of the family (see ``gradients.py``).
GRAD_CASES: dict[str, Callable[[str], GradCase]] = {"kda_chunked": _chunked_grad, "kda_causal_conv": _conv_grad}
GRAD_EDGE_CASES: tuple[tuple[str, str, Callable[[str], GradCase]], ...] = (
    ("kda_chunked", "T1-no_state", lambda dev: _chunked_grad(dev, testing.KDAShape(2, 1, 2, 8, 4, C=4),
                                                             initial_state=False)),
    ("kda_chunked", "output_only-no_l2norm-odd_dims",
     lambda dev: _chunked_grad(dev, testing.KDAShape(1, 6, 1, 5, 3, C=4), output_final_state=False,
                               use_qk_l2norm=False)),
    ("kda_causal_conv", "T2-bias-no_activation",  # T < W - 1: the new state holds conv-state rows
     lambda dev: _conv_grad(dev, testing.KDAShape(2, 2, 1, 4, 4), bias=True, activation=None)),
)
