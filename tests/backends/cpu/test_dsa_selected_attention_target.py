"""Native indexer-KL target at the selected keys vs the reference, both normalisers ("selected": the kernel's own
per-head normaliser over the selected keys; "causal": dense log-sum-exp pass + selected-keys kernel), judged
against an fp64 reference run: odd shapes, K = 1, -1-padded rows, K past the keys, int and ragged start positions,
keys past the query, heads past one vector, fp32 / bf16 / fp64, with and without the expanded keys; bitwise
repeatable across runs and thread counts; the custom op through ``opcheck``; the registry routes calls whose inputs
require grad to the kernel (the target is detached)."""
import pytest
import torch

from glm5_core import registry, testing
from glm5_core.backends.cpu import dsa_selected_attention_target as native_target
from glm5_core.ops import dsa
from glm5_core.ops.mla import causal_mask
from glm5_core.ops.selected_attention_target import expanded_keys, selected_attention_target_reference
from tests.ops.selected_target_cases import SMALL_CASES, as64, case_inputs, scale_of

NORMALISERS = ("selected", "causal")
CASES = SMALL_CASES + (
    (testing.MLAShape(B=2, T=33, S=300, H=19, Dn=16, Dr=8, Dv=8, C=24), 40, 267),  # heads past one vector
)


@pytest.mark.parametrize("shape,K,start", CASES, ids=str)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=str)
@pytest.mark.parametrize("with_keys", (False, True), ids=("latent", "expanded"))
@pytest.mark.parametrize("normaliser", NORMALISERS)
def test_target_matches_the_reference(native, shape, K, start, dtype, with_keys, normaliser):
    args, start_pos = case_inputs(shape, K, start, dtype, seed=3)
    kw = dict(scale=scale_of(shape), start_pos=start_pos, normaliser=normaliser)
    if with_keys:  # as the model gives them: in the compute dtype
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        kw["k_nope"] = expanded_keys(args["c_kv"].to(compute), args["w_uk"].to(compute))  # [B, S, H, Dn]
    out = native_target.selected_attention_target(**args, **kw)
    ref = selected_attention_target_reference(**args, **kw)
    kw64 = dict(kw, k_nope=kw["k_nope"].double()) if with_keys else kw
    exact = selected_attention_target_reference(**as64(args), **kw64)
    keep = args["topk_idx"] >= 0
    assert out.dtype == ref.dtype and torch.equal(out[~keep], torch.zeros_like(out[~keep]))
    verdict = testing.compare_to_fp64(out, ref, exact, dtype)
    assert verdict.passed, verdict.detail


@pytest.mark.parametrize("shape,K,start", CASES[2:], ids=str)
@pytest.mark.parametrize("normaliser", NORMALISERS)
def test_keys_past_the_query_get_no_mass(native, shape, K, start, normaliser):
    args, start_pos = case_inputs(shape, K, start, torch.float64, seed=4, past_the_query=True)
    kw = dict(scale=scale_of(shape), start_pos=start_pos, normaliser=normaliser)
    out = native_target.selected_attention_target(**args, **kw)
    ref = selected_attention_target_reference(**args, **kw)
    first = start_pos.view(-1, 1) if isinstance(start_pos, torch.Tensor) else torch.full((shape.B, 1), start_pos)
    positions = first + torch.arange(shape.T).view(1, -1)  # [B, T]
    past = positions < shape.S - 1  # the last slot's key is past these queries
    assert past.any() and torch.equal(out[..., -1][past], torch.zeros_like(out[..., -1][past]))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("normaliser", NORMALISERS)
def test_int64_indices_give_the_int32_result(native, normaliser):
    shape, K, start = CASES[4]
    args, start_pos = case_inputs(shape, K, start, torch.float32, seed=5)
    kw = dict(scale=scale_of(shape), start_pos=start_pos, normaliser=normaliser)
    out32 = native_target.selected_attention_target(**args, **kw)
    out64 = native_target.selected_attention_target(**dict(args, topk_idx=args["topk_idx"].long()), **kw)
    assert torch.equal(out32, out64)


@pytest.mark.parametrize("normaliser", NORMALISERS)
def test_bitwise_repeatable_across_runs_and_thread_counts(native, threads, normaliser):
    shape, K, start = CASES[5]
    args, start_pos = case_inputs(shape, K, start, torch.float32, seed=6)
    kw = dict(scale=scale_of(shape), start_pos=start_pos, normaliser=normaliser)
    results = []
    for n in (1, 2, 3, 2):
        torch.set_num_threads(n)
        results.append(native_target.selected_attention_target(**args, **kw))
    for other in results[1:]:
        assert torch.equal(results[0], other)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
@pytest.mark.parametrize("normaliser", NORMALISERS)
def test_custom_op_passes_opcheck(native, dtype, normaliser):
    shape, K, start = CASES[4]
    args, start_pos = case_inputs(shape, K, start, dtype, seed=7)
    k_nope = expanded_keys(args["c_kv"], args["w_uk"])  # [B, S, H, Dn]
    if normaliser == "causal":
        lse = native_target.dense_lse(args["q_nope"], args["q_pe"], k_nope, args["k_pe"], scale=0.3,
                                      start_pos=start_pos)  # [B, T, H]
    else:
        lse = args["q_nope"].new_empty(0)  # the kernel's own normaliser over the selected keys
    torch.library.opcheck(torch.ops.glm5_cpu.selected_attention_target,
                          (args["q_nope"], args["q_pe"], k_nope, args["k_pe"], lse, args["topk_idx"],
                           start_pos.long(), 0.3))


def test_dense_lse_is_each_heads_causal_log_sum_exp(native):
    shape, K, start = CASES[4]
    args, start_pos = case_inputs(shape, K, start, torch.float64, seed=8)
    k_nope = expanded_keys(args["c_kv"], args["w_uk"])  # [B, S, H, Dn]
    lse = native_target.dense_lse(args["q_nope"], args["q_pe"], k_nope, args["k_pe"], scale=0.3, start_pos=start_pos)
    scores = torch.einsum("bthd,bshd->bths", args["q_nope"], k_nope)
    scores = scores + torch.einsum("bthr,bsr->bths", args["q_pe"], args["k_pe"])  # [B, T, H, S]
    visible = causal_mask(start_pos, shape.B, shape.T, shape.S, scores.device)  # [B, T, S]
    want = torch.logsumexp((scores * 0.3).masked_fill(~visible.unsqueeze(2), float("-inf")), dim=-1)  # [B, T, H]
    torch.testing.assert_close(lse, want, rtol=1e-12, atol=1e-12)


def test_kernel_rejects_an_index_past_the_keys(native):
    shape, K, start = CASES[2]
    args, start_pos = case_inputs(shape, K, start, torch.float32, seed=9)
    k_nope = expanded_keys(args["c_kv"], args["w_uk"])
    lse = torch.zeros(shape.B, shape.T, shape.H)
    bad = args["topk_idx"].clone()
    bad[1, 3, 0] = shape.S
    with pytest.raises(IndexError, match="past the keys"):
        torch.ops.glm5_cpu.selected_attention_target(args["q_nope"], args["q_pe"], k_nope, args["k_pe"], lse, bad,
                                                     torch.zeros(shape.B, dtype=torch.int64), 0.3)


def test_entry_point_names_a_bad_argument():
    shape, K, start = CASES[2]
    args, start_pos = case_inputs(shape, K, start, torch.float32, seed=10)
    with pytest.raises(ValueError, match="topk_idx: expected entries in"):
        dsa.selected_attention_target(**dict(args, topk_idx=args["topk_idx"].clamp(min=0) + shape.S), scale=0.3,
                                      start_pos=0)
    with pytest.raises(ValueError, match="start_pos"):
        dsa.selected_attention_target(**args, scale=0.3, start_pos=1)
    with pytest.raises(ValueError, match="k_nope: expected"):
        dsa.selected_attention_target(**args, scale=0.3, start_pos=0, k_nope=torch.zeros(shape.B, shape.S, 1, 1))
    with pytest.raises(ValueError, match="scale"):
        dsa.selected_attention_target(**args, scale=-1.0, start_pos=0)
    with pytest.raises(TypeError, match=r"share one dtype, got q_nope: torch.float32, .*, w_uk: torch.float64$"):
        dsa.selected_attention_target(**dict(args, w_uk=args["w_uk"].double()), scale=0.3, start_pos=0)
    with pytest.raises(ValueError, match=r"^c_kv: expected .*\[B, S, C\]"):
        dsa.selected_attention_target(**dict(args, c_kv=args["c_kv"][0]), scale=0.3, start_pos=0)


def test_calls_whose_inputs_require_grad_take_the_native_kernel(native):
    shape, K, start = CASES[2]
    args, start_pos = case_inputs(shape, K, start, torch.float32, seed=11)
    leaves = {n: t.clone().requires_grad_(True) if t.is_floating_point() else t for n, t in args.items()}
    with registry.record_reference_runs() as ran:
        out = dsa.selected_attention_target(**leaves, scale=0.3, start_pos=0, backend="cpu")
    assert ran == [] and not out.requires_grad


def test_the_selected_kernel_needs_no_dense_pass(native, monkeypatch):
    """"selected" never asks torch's flash kernel for the dense log-sum-exp ("causal" does)."""
    shape, K, start = CASES[5]
    args, start_pos = case_inputs(shape, K, start, torch.float32, seed=12)
    calls, lse = [], native_target._lse

    def counted(*a, **k):
        calls.append(1)
        return lse(*a, **k)

    monkeypatch.setattr(native_target, "_lse", counted)
    native_target.selected_attention_target(**args, scale=0.3, start_pos=start_pos, normaliser="selected")
    assert calls == []
    native_target.selected_attention_target(**args, scale=0.3, start_pos=start_pos, normaliser="causal")
    assert calls != []


def test_selected_kernel_rows_sum_to_one(native):
    shape, K, start = CASES[5]
    args, start_pos = case_inputs(shape, K, start, torch.float32, seed=13, past_the_query=True)
    out = native_target.selected_attention_target(**args, scale=scale_of(shape), start_pos=start_pos,
                                                  normaliser="selected")
    sums = out.double().sum(-1)  # [B, T]
    empty = sums == 0
    assert empty[0, 0] and empty.sum() == 1  # make_sparse_inputs' one row with no key
    torch.testing.assert_close(sums[~empty], torch.ones_like(sums[~empty]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("H,wide", ((1, 8), (2, 8), (3, 6), (4, 8)))
@pytest.mark.parametrize("K", (1, 7, 40))
@pytest.mark.parametrize("nthreads", (1, 2))
def test_packed_heads_are_bitwise_the_eight_lane_kernel(native, threads, H, wide, K, nthreads):
    """H <= 4 heads take the packed kernel (two keys per 8-lane vector); `wide` heads (5 to 8) the 8-lane kernel.
    With the "causal" normaliser an added head whose lse is huge adds exp(...) = +0 to every head sum, and the two
    results are the same head sum times 1 / H and 1 / wide: wide / H is a power of two (fl(1 / wide) = fl(1 / H) *
    H / wide), so packed == eight-lane * wide / H, bit for bit, where nothing is subnormal (checked)."""
    torch.set_num_threads(nthreads)
    B, T, S, Dn, R = 2, 9, 37, 13, 5  # odd sizes: odd key counts (a repeated last key in the last pair)
    gen = torch.Generator().manual_seed(40 + K)
    q_nope, q_pe = torch.randn(B, T, wide, Dn, generator=gen), torch.randn(B, T, wide, R, generator=gen)
    k_nope, k_pe = torch.randn(B, S, wide, Dn, generator=gen), torch.randn(B, S, R, generator=gen)
    lse = torch.rand(B, T, wide, generator=gen) * 4 + 2
    lse[..., H:] = 1e30  # the added heads: exp(score - lse) = 0
    idx = torch.randint(-1, S, (B, T, K), generator=gen)
    idx[0, 1] = -1  # a row with no key
    idx[1, 2, -1] = idx[1, 2, 0]  # a repeated key
    start = torch.tensor([S - T, 3])  # keys past some queries
    heads = slice(0, H)
    packed = torch.ops.glm5_cpu.selected_attention_target(q_nope[:, :, heads], q_pe[:, :, heads],
                                                          k_nope[:, :, heads], k_pe, lse[..., heads].contiguous(),
                                                          idx, start, 0.3)
    eight_lane = torch.ops.glm5_cpu.selected_attention_target(q_nope, q_pe, k_nope, k_pe, lse, idx, start, 0.3)
    assert packed.gt(0).any() and packed[packed.ne(0)].abs().min() >= torch.finfo(torch.float32).tiny
    assert torch.equal(packed, eight_lane * (wide // H))
