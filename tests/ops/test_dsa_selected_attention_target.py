"""The reference of ``dsa_selected_attention_target`` with ``normaliser="selected"`` against an independent fp64
dense computation (each head's scores over every key, masked to the row's valid selected keys, softmax, summed over
the heads, / H): odd shapes, K = 1, -1 padding, K past the keys, int and ragged [B] start positions, selected keys
past the query, query blocks that split T, fp32 / bf16 / fp64; rows sum to 1 (0 with no valid key, never NaN);
the op names a bad ``normaliser``."""
import pytest
import torch

from glm5_core import testing
from glm5_core.ops import dsa, selected_attention_target
from glm5_core.ops.mla import causal_mask
from tests.ops.selected_target_cases import SMALL_CASES, start_of

CASES = SMALL_CASES + (
    (testing.MLAShape(B=2, T=11, S=40, H=9, Dn=6, Dr=4, Dv=4, C=10), 7, 29),  # heads past one vector
)


def _inputs(shape, K, start, dtype, seed):
    """The op's inputs, the last slot of every row pointing at the last key slot (past every query but the last,
    and never a duplicate: rows that hold that key already keep their last slot)."""
    start_pos = start_of(shape, start)
    x = testing.make_sparse_inputs(shape, K, dtype=dtype, seed=seed, start_pos=start_pos)
    args = {n: x[n] for n in ("q_nope", "q_pe", "c_kv", "k_pe", "w_uk", "topk_idx")}
    idx = args["topk_idx"]
    holds_last = (idx[..., :-1] == shape.S - 1).any(-1)  # [B, T]
    idx[..., -1] = torch.where(holds_last, idx[..., -1], torch.full_like(idx[..., -1], shape.S - 1))
    return args, start_pos


def _dense_selected_target(args, scale, start_pos):
    """fp64, every [B, H, T, S] score: -inf off the row's valid selected keys, softmax over all S keys, head mean,
    gathered at topk_idx (0 at the -1 slots); a row with no valid key is 0."""
    x = {n: t.double() if t.is_floating_point() else t for n, t in args.items()}
    idx = x["topk_idx"].long()  # [B, T, K]
    B, T, K = idx.shape
    S, H = x["c_kv"].shape[1], x["w_uk"].shape[0]
    k_nope = torch.einsum("bsc,hdc->bshd", x["c_kv"], x["w_uk"])  # [B, S, H, Dn]
    scores = torch.einsum("bthd,bshd->bhts", x["q_nope"], k_nope)
    scores = (scores + torch.einsum("bthr,bsr->bhts", x["q_pe"], x["k_pe"])) * scale  # [B, H, T, S]
    chosen = torch.zeros(B, T, S + 1, dtype=torch.bool)  # column S collects the -1 slots
    chosen.scatter_(-1, torch.where(idx < 0, torch.full_like(idx, S), idx), True)
    keep = chosen[..., :S] & causal_mask(start_pos, B, T, S, "cpu")  # [B, T, S]
    probs = torch.softmax(scores.masked_fill(~keep.unsqueeze(1), float("-inf")), dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with no valid key
    target = probs.sum(dim=1) / H  # [B, T, S]
    return target.gather(-1, idx.clamp(min=0)).masked_fill(idx < 0, 0.0)  # [B, T, K]


@pytest.mark.parametrize("shape,K,start", CASES, ids=str)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=str)
@pytest.mark.parametrize("block", (3, 256))
def test_selected_normaliser_matches_the_dense_fp64_computation(monkeypatch, shape, K, start, dtype, block):
    monkeypatch.setattr(selected_attention_target, "QUERY_BLOCK", block)
    args, start_pos = _inputs(shape, K, start, dtype, seed=1)
    scale = (shape.Dn + shape.Dr) ** -0.5
    got = selected_attention_target.selected_attention_target_reference(**args, scale=scale, start_pos=start_pos,
                                                                        normaliser="selected")
    want = _dense_selected_target(args, scale, start_pos)
    tol = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-6}[dtype]  # bf16 inputs, fp32 compute
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    assert not torch.isnan(got).any()


@pytest.mark.parametrize("shape,K,start", CASES, ids=str)
def test_selected_rows_sum_to_one_and_keys_past_the_query_get_nothing(shape, K, start):
    args, start_pos = _inputs(shape, K, start, torch.float64, seed=2)
    got = dsa.selected_attention_target(**args, scale=0.3, start_pos=start_pos, normaliser="selected")
    first = start_pos.view(-1, 1) if isinstance(start_pos, torch.Tensor) else torch.full((shape.B, 1), start_pos)
    positions = first + torch.arange(shape.T).view(1, -1)  # [B, T]
    idx = args["topk_idx"].long()
    valid = (idx >= 0) & (idx <= positions.unsqueeze(-1))  # [B, T, K]
    assert torch.equal(got[~valid], torch.zeros_like(got[~valid]))
    sums = got.sum(-1)  # [B, T]
    has_key = valid.any(-1)
    torch.testing.assert_close(sums[has_key], torch.ones_like(sums[has_key]))
    assert torch.equal(sums[~has_key], torch.zeros_like(sums[~has_key]))
    assert shape.S == 1 or not has_key[0, 0]  # make_sparse_inputs' empty row (its last slot: key 0 when S = 1)


def test_the_two_normalisers_differ_and_causal_is_the_dense_target_gathered():
    from glm5_core.model import indexer_loss

    shape, K, start = CASES[4]
    args, start_pos = _inputs(shape, K, start, torch.float64, seed=3)
    dense = indexer_loss.attention_target(*(args[n] for n in ("q_nope", "q_pe", "c_kv", "k_pe", "w_uk")), scale=0.3,
                                          start_pos=start_pos)  # [B, T, S]
    idx = args["topk_idx"].long()
    gathered = dense.gather(-1, idx.clamp(min=0)).masked_fill(idx < 0, 0.0)
    causal = dsa.selected_attention_target(**args, scale=0.3, start_pos=start_pos, normaliser="causal")
    selected = dsa.selected_attention_target(**args, scale=0.3, start_pos=start_pos)  # the default
    torch.testing.assert_close(causal, gathered, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(selected, _dense_selected_target(args, 0.3, start_pos), rtol=1e-12, atol=1e-15)
    assert not torch.allclose(selected, causal)


@pytest.mark.parametrize("bad", ("dense", "Selected", None, 1))
def test_the_op_names_a_bad_normaliser(bad):
    shape, K, start = CASES[2]
    args, start_pos = _inputs(shape, K, start, torch.float32, seed=4)
    with pytest.raises(ValueError, match="normaliser: expected one of 'selected', 'causal'"):
        dsa.selected_attention_target(**args, scale=0.3, start_pos=start_pos, normaliser=bad)
