"""The Triton indexer-KL target at the selected keys (``dsa_selected_attention_target`` of cuda / rocm) against the
reference, both normalisers, judged against an fp64 reference run: odd shapes, K = 1, K past the causal keys, -1
padded and all -1 rows, keys past the query, int and per-row start positions, 1 and odd heads, head / key / row
tiles that do not divide the sizes, fp32 / bf16 / fp16 inputs, latent or expanded keys; bitwise repeatable; fp64
declined with a reason (the fp64 reference runs); the op's conformance checks run the kernels, not the reference."""
import pytest
import torch

from glm5_core import conformance, registry, testing
from glm5_core.ops import dsa
from glm5_core.ops.selected_attention_target import expanded_keys
from tests.backends.triton.helpers import kernel
from tests.ops.selected_target_cases import SMALL_CASES, as64, case_inputs, scale_of

OP = "dsa_selected_attention_target"
NORMALISERS = ("selected", "causal")
TILES = {"heads": 2, "keys": 8, "rows": 16, "cols": 16}  # smaller than the shapes: every loop runs several tiles
CASES = SMALL_CASES + (
    (testing.MLAShape(B=2, T=7, S=27, H=5, Dn=8, Dr=4, Dv=4, C=20), 19, 20),  # several key / head / row tiles
)


def _check(out, args, kw, dtype):
    ref = dsa.selected_attention_target_reference(**args, **kw)
    kw64 = dict(kw, k_nope=kw["k_nope"].double()) if "k_nope" in kw else kw
    exact = dsa.selected_attention_target_reference(**as64(args), **kw64)
    keep = args["topk_idx"] >= 0
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.equal(out[~keep], torch.zeros_like(out[~keep]))  # the -1 slots
    verdict = testing.compare_to_fp64(out, ref, exact, dtype)
    assert verdict.passed, verdict.detail


@pytest.mark.parametrize("shape,K,start", CASES, ids=str)
@pytest.mark.parametrize("normaliser", NORMALISERS)
def test_target_matches_the_reference_through_small_tiles(shape, K, start, normaliser, device):
    from glm5_core.backends.triton import dsa_selected_attention_target as attention_target
    from glm5_core.backends.triton.launch import LaunchConfig

    args, start_pos = case_inputs(shape, K, start, torch.float32, seed=3, past_the_query=True)
    args = {n: t.to(device) for n, t in args.items()}
    kw = dict(scale=scale_of(shape), start_pos=start_pos, normaliser=normaliser)
    out = attention_target.selected_attention_target(**args, **kw, config=LaunchConfig(blocks=TILES))
    _check(out, args, kw, torch.float32)


VENDOR_CASES = [("cuda", dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)] + [("rocm", torch.float32)]


@pytest.mark.parametrize("vendor,dtype", VENDOR_CASES, ids=str)
@pytest.mark.parametrize("normaliser", NORMALISERS)
def test_each_vendor_table_matches_the_reference(vendor, dtype, normaliser, device):
    shape, K, start = CASES[-1]
    args, start_pos = case_inputs(shape, K, start, dtype, seed=5, past_the_query=True)
    args = {n: t.to(device) for n, t in args.items()}
    args["topk_idx"][1, 2, 3:5] = args["topk_idx"][1, 2, 5]  # a key selected several times counts several times
    kw = dict(scale=scale_of(shape), start_pos=start_pos, normaliser=normaliser)
    _check(kernel(OP, vendor)(**args, **kw), args, kw, dtype)


@pytest.mark.parametrize("normaliser", NORMALISERS)
def test_the_expanded_keys_give_the_same_target(normaliser, device):
    shape, K, start = SMALL_CASES[-1]  # ragged starts
    args, start_pos = case_inputs(shape, K, start, torch.bfloat16, seed=7)
    args = {n: t.to(device) for n, t in args.items()}
    k_nope = expanded_keys(args["c_kv"].float(), args["w_uk"].float())  # [B, S, H, Dn], as the model gives them
    kw = dict(scale=scale_of(shape), start_pos=start_pos, normaliser=normaliser, k_nope=k_nope)
    _check(kernel(OP)(**args, **kw), args, kw, torch.bfloat16)


@pytest.mark.parametrize("normaliser", NORMALISERS)
def test_non_finite_scores_give_nan_where_the_reference_does(normaliser, device):
    """An inf / NaN input makes NaN wherever the reference's softmax meets it, never a finite target: an inf in
    one head's q_pe (that head's scores +-inf, NaN in its softmax) and a NaN in one key's c_kv (every head's score
    at that key). The lse kernels used to map a NaN sum to the "no key" +inf and drop the head (p = 0), so the
    target stayed finite and the KL trained on 2/3 of a row."""
    from glm5_core.backends.triton import dsa_selected_attention_target as attention_target
    from glm5_core.backends.triton.launch import LaunchConfig

    shape, K, start = CASES[-1]
    args, start_pos = case_inputs(shape, K, start, torch.float32, seed=3)
    args["q_pe"][1, 2, 0, 0] = float("inf")  # row (1, 2), head 0
    args["c_kv"][0, start + 3, 1] = float("nan")  # a key of batch row 0 seen by its queries t >= 3
    kw = dict(scale=scale_of(shape), start_pos=start_pos, normaliser=normaliser)
    ref = dsa.selected_attention_target_reference(**args, **kw)
    args = {n: t.to(device) for n, t in args.items()}
    out = attention_target.selected_attention_target(**args, **kw, config=LaunchConfig(blocks=TILES)).cpu()
    assert ref[1, 2].isnan().all() and ref.isnan().any(-1).sum() > 1 and not ref.isnan().all()
    assert torch.equal(out.isnan(), ref.isnan())
    finite = ~ref.isnan()
    torch.testing.assert_close(out[finite], ref[finite], atol=2e-5, rtol=2e-5)


def test_the_target_is_bitwise_repeatable(device):
    shape, K, start = CASES[-1]
    args, start_pos = case_inputs(shape, K, start, torch.float32, seed=9)
    args = {n: t.to(device) for n, t in args.items()}
    for normaliser in NORMALISERS:
        runs = [kernel(OP)(**args, scale=0.2, start_pos=start_pos, normaliser=normaliser) for _ in range(2)]
        assert torch.equal(runs[0], runs[1]), normaliser


def test_no_selected_keys_gives_an_empty_target(device):
    shape = SMALL_CASES[1][0]
    args, _ = case_inputs(shape, 1, 8, torch.float32, seed=1)
    args = {n: t.to(device) for n, t in args.items()}
    args["topk_idx"] = args["topk_idx"][..., :0]
    out = kernel(OP)(**args, scale=0.3, start_pos=8)
    assert out.shape == (shape.B, shape.T, 0) and out.dtype == torch.float32


def test_fp64_is_declined_with_a_reason_and_runs_the_reference():
    shape, K, start = SMALL_CASES[1]
    args, start_pos = case_inputs(shape, K, start, torch.float64, seed=2)
    ok, why = kernel(OP).supports(**args, scale=0.3, start_pos=start_pos)
    assert not ok and "fp64" in why
    ok, why = kernel(OP).supports(**case_inputs(shape, K, start, torch.float32, seed=2)[0], scale=0.3,
                                  start_pos=start_pos, normaliser="causal")
    assert ok, why
    with registry.record_fallbacks() as declined:
        out = dsa.selected_attention_target(**args, scale=0.3, start_pos=start_pos, backend="cuda")
    assert out.dtype == torch.float64 and [op for op, _ in declined] == [OP]
    assert torch.equal(out, dsa.selected_attention_target_reference(**args, scale=0.3, start_pos=start_pos))


def test_the_supports_hook_declines_widths_over_the_shared_memory():
    def verdict(backend, C):
        args, _ = case_inputs(testing.MLAShape(B=1, T=1, S=2, H=1, Dn=4, Dr=64, Dv=4, C=C), 1, 0, torch.float32, 0)
        return kernel(OP, backend).supports(**args, scale=1.0, start_pos=0)

    assert verdict("cuda", 512)[0] and verdict("rocm", 512)[0]  # GLM-5's latent width
    ok, why = verdict("rocm", 1024)
    assert not ok and "shared memory" in why and "C=1024" in why


@pytest.mark.parametrize("vendor", ("cuda", "rocm"))
def test_the_conformance_checks_run_the_kernels(vendor):
    assert not registry.runs_reference(OP, vendor)
    shape = str(testing.MLA_SHAPES[1])  # (tests/conformance runs them all; here: that they run the kernels)
    checks = [c for c in conformance.checks("dsa") if c.ops == (OP,) and "fp32" in c.name and "ragged" in c.name
              and shape in c.name]
    assert len(checks) == 2  # both normalisers
    for check in checks:
        result = conformance.run_check(check, vendor)
        assert result.status == "pass", f"{check.name}: {result.status}: {result.detail}"
