"""Sparse MLA attention (Triton, forward + backward) and dense MLA decode against the reference."""
import pytest
import torch

from glm5_core import testing
from glm5_core.ops import dsa, mla
from tests.backends.triton.helpers import assert_close, kernel

SHAPE = testing.MLAShape(B=2, T=3, S=19, H=3, Dn=8, Dr=4, Dv=6, C=24)
ARGS = ("q_nope", "q_pe", "c_kv", "k_pe", "w_uk", "w_uv")


def _inputs(dtype, device, K=7, seed=0):
    x = testing.make_sparse_inputs(SHAPE, K, dtype=dtype, device=device, seed=seed)
    x["topk_idx"][1, 1, :3] = x["topk_idx"][1, 1, 3]  # a key selected several times counts several times
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op", ["dsa_sparse_decode", "dsa_sparse_prefill"])
def test_forward_matches_reference(op, dtype, device):
    x = _inputs(dtype, device)
    out = kernel(op)(*(x[a] for a in ARGS), x["topk_idx"], scale=0.31)
    ref = dsa.sparse_attention_reference(*(x[a] for a in ARGS), x["topk_idx"], scale=0.31)
    assert out.dtype == dtype and out.shape == ref.shape
    assert_close(out, ref, dtype, op)
    assert (out[0, 0] == 0).all()  # the row with no selected key


@pytest.mark.parametrize("op", ["dsa_sparse_decode", "dsa_sparse_prefill"])
def test_non_finite_scores_give_nan_where_the_reference_does(op, device):
    """An inf in one head's q_pe and a NaN in one key's c_kv give NaN where the reference does (those heads /
    the rows selecting that key), never zeros: the forward used to take a NaN row sum for "no key" and write
    0 for the head, a silently finite attention output. The row with no selected key still gives 0."""
    x = _inputs(torch.float32, "cpu")
    x["q_pe"][1, 2, 0, 0] = float("inf")  # row (1, 2), head 0: its scores +-inf
    nan_key = int(x["topk_idx"][0, 1, 1])  # not key 0, which the reference gathers (times 0) for -1 slots
    x["c_kv"][0, nan_key, 5] = float("nan")  # every head's score and value at that key
    ref = dsa.sparse_attention_reference(*(x[a] for a in ARGS), x["topk_idx"], scale=0.31)
    assert ref[1, 2, 0].isnan().all() and not ref[1, 2, 1:].isnan().any() and ref[0, 1].isnan().all()
    x = {n: t.to(device) for n, t in x.items()}
    out = kernel(op)(*(x[a] for a in ARGS), x["topk_idx"], scale=0.31).cpu()
    assert torch.equal(out.isnan(), ref.isnan())
    assert (out[0, 0] == 0).all()
    finite = ~ref.isnan()
    torch.testing.assert_close(out[finite], ref[finite], atol=2e-5, rtol=2e-5)


def test_backward_matches_reference_autograd(device):
    x = _inputs(torch.float32, device, K=9, seed=2)
    ours = {a: x[a].clone().requires_grad_() for a in ARGS}
    theirs = {a: x[a].clone().requires_grad_() for a in ARGS}
    out = kernel("dsa_sparse_prefill")(*ours.values(), x["topk_idx"], scale=0.27)
    ref = dsa.sparse_attention_reference(*theirs.values(), x["topk_idx"], scale=0.27)
    grad = testing.randn(out.shape, seed=9, device=device)
    out.backward(grad)
    ref.backward(grad)
    for a in ARGS:
        torch.testing.assert_close(ours[a].grad, theirs[a].grad, atol=2e-5, rtol=2e-5, msg=lambda m, a=a: f"d{a}: {m}")


def test_backward_is_run_to_run_identical(device):
    x = _inputs(torch.float32, device, K=9, seed=4)
    grads = []
    for _ in range(2):
        c_kv = x["c_kv"].clone().requires_grad_()
        out = kernel("dsa_sparse_prefill")(x["q_nope"], x["q_pe"], c_kv, x["k_pe"], x["w_uk"], x["w_uv"],
                                           x["topk_idx"], scale=0.3)
        out.sum().backward()
        grads.append(c_kv.grad)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dense_decode_through_the_sparse_kernel(dtype, device):
    x = testing.make_mla_inputs(SHAPE, dtype=dtype, device=device, seed=3)
    start = torch.tensor([SHAPE.S - SHAPE.T, 5], device=device)  # ragged: row 1 ignores later slots
    out = kernel("mla_decode")(*(x[a] for a in ARGS), scale=0.3, start_pos=start)
    assert_close(out, mla.decode_reference(*(x[a] for a in ARGS), scale=0.3, start_pos=start), dtype, "mla_decode")


def test_supports_declines_fp64_and_long_dense_decode():
    x = _inputs(torch.float64, "cpu")
    ok, why = kernel("dsa_sparse_decode").supports(*(x[a] for a in ARGS), x["topk_idx"], scale=1.0)
    assert not ok and "fp64" in why
    long_q = torch.zeros(1, 65, 1, 8)
    ok, why = kernel("mla_decode").supports(long_q, long_q[..., :4], torch.zeros(1, 70, 8), torch.zeros(1, 70, 4),
                                            torch.zeros(1, 8, 8), torch.zeros(1, 8, 8), scale=1.0, start_pos=0)
    assert not ok and "65" in why


def test_the_tensor_core_path_is_taken_for_bf16_inputs_only():
    from glm5_core.backends.triton.sparse_mla import uses_tensor_cores

    bf16 = _inputs(torch.bfloat16, "cpu")
    assert uses_tensor_cores(*(bf16[a] for a in ARGS[:4]))
    for dtype in (torch.float32, torch.float16):
        x = _inputs(dtype, "cpu")
        assert not uses_tensor_cores(*(x[a] for a in ARGS[:4])), dtype
    assert not uses_tensor_cores(bf16["q_nope"], bf16["q_pe"], bf16["c_kv"].float(), bf16["k_pe"])


def test_round_to_bf16_is_the_round_to_nearest_even_cast(device):
    """The interpreter's emulation of the tensor-core operands rounds like torch's (and the GPU's) fp32 -> bf16."""
    import triton

    from tests.backends.triton.bf16_round_probe import round_kernel

    ties = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 2 ** -130 * 3], dtype=torch.float32)  # halfway
    x = torch.cat([ties, testing.randn((200,), seed=3) * 100, testing.randn((50,), seed=4) * 1e-30]).to(device)
    out = torch.empty_like(x)
    round_kernel[(triton.cdiv(x.numel(), 64),)](x, out, x.numel(), BLOCK=64)
    assert torch.equal(out, x.to(torch.bfloat16).float())


def test_bf16_prefill_rounds_the_tensor_core_operands(device):
    """On bf16 inputs the kernels also round the probabilities to bf16 (a tensor-core operand of p @ c_kv): the
    result differs from the exact-fp32 path on the same bf16 values, by about one bf16 rounding."""
    from glm5_core.backends.cuda.launch import CUDA_CONFIGS
    from glm5_core.backends.triton import sparse_mla, table

    x = _inputs(torch.bfloat16, device, K=9, seed=6)
    q_lat = mla.absorb_query(x["q_nope"].float(), x["w_uk"].float())
    operands = [t.to(torch.bfloat16).contiguous() for t in (q_lat, x["q_pe"], x["c_kv"], x["k_pe"])]  # bf16 values
    config = table.launch_config(CUDA_CONFIGS, "sparse_mla")
    exact, _ = sparse_mla.latent_forward(*(t.float() for t in operands), x["topk_idx"], 0.3, config)
    rounded, _ = sparse_mla.latent_forward(*operands, x["topk_idx"], 0.3, config, tensor_cores=True)
    diff = float((exact - rounded).abs().max())
    assert 0 < diff <= 2 ** -7 * float(exact.abs().max())
