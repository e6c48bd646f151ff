"""The MoE layer under expert parallelism (``GLM5ForCausalLM.shard_experts``) on real gloo processes: the whole
model's forward at EP=N is bitwise the same model without expert parallelism at the same world size and per-rank
batch (logits, every MoE layer's output, the selected experts); and the experts kernel it runs
(``moe.experts_batch_invariant``) is batch-invariant on its own.

The no-EP baseline is the same model with ``shard_experts(None)`` (every expert on every rank, the same
batch-invariant experts, no communication); a plain model (``moe.fused_experts``) is not batch-invariant, which
``test_plain_experts_are_not_batch_invariant`` shows, so it cannot be the bitwise baseline.
"""
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from glm5_core.model import GLM5Config, GLM5ForCausalLM
from glm5_core.ops import moe

TINY = dict(num_hidden_layers=3, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
            n_routed_experts=8, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, index_n_heads=2, index_head_dim=16, index_topk=8,
            indexer_types=["full", "full", "full"], num_nextn_predict_layers=0)


def _experts_inputs(M=70, D=24, F=40, E=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(M, D, generator=g), torch.randn(E, F, D, generator=g) * 0.2,
            torch.randn(E, F, D, generator=g) * 0.2, torch.randn(E, D, F, generator=g) * 0.2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_batch_invariant_row_by_row(dtype):
    """Each row of ``experts_batch_invariant`` has the same bits whatever rows share the call: alone, among
    other rows of its expert at any position, with other experts' rows around; and it is the experts' function
    (``experts_reference``) to fp32 rounding."""
    x, wg, wu, wd = (t.to(dtype) for t in _experts_inputs())
    counts = torch.tensor([30, 1, 39])
    full = moe.experts_batch_invariant(x, counts, wg, wu, wd)
    torch.testing.assert_close(full.float(), moe.experts_reference(x, counts, wg, wu, wd).float(),
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    for row, expert in ((0, 0), (17, 0), (29, 0), (30, 1), (31, 2), (50, 2), (69, 2)):
        alone = torch.zeros(3, dtype=torch.int64)
        alone[expert] = 1
        assert torch.equal(moe.experts_batch_invariant(x[row:row + 1], alone, wg, wu, wd)[0], full[row]), row
    # expert 2's rows reversed, with a different first expert block: the same rows, the same bits
    rows = torch.cat([x[5:12], x[31:70].flip(0)])
    got = moe.experts_batch_invariant(rows, torch.tensor([7, 0, 39]), wg, wu, wd)
    assert torch.equal(got[:7], full[5:12]) and torch.equal(got[7:], full[31:70].flip(0))


def test_experts_batch_invariant_keeps_the_glm53_clamp():
    """GLM-5.3's clamped SwiGLU (swiglu_limit) holds under expert parallelism too: the batch-invariant experts
    compute experts_reference's clamped function (they ignored the clamp when the two branches met)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 8, generator=g, dtype=torch.float64) * 3
    counts = torch.tensor([10, 0, 27])
    w = [torch.randn(3, 6, 8, generator=g, dtype=torch.float64), torch.randn(3, 6, 8, generator=g,
         dtype=torch.float64), torch.randn(3, 8, 6, generator=g, dtype=torch.float64)]
    want = moe.experts_reference(x, counts, *w, swiglu_limit=0.5)
    torch.testing.assert_close(moe.experts_batch_invariant(x, counts, *w, swiglu_limit=0.5), want)
    assert not torch.allclose(moe.experts_batch_invariant(x, counts, *w), want)  # the clamp is active here


def test_plain_experts_are_not_batch_invariant():
    """Why the batch-invariant kernel exists: the experts reference (one GEMM per expert over all its rows)
    gives a row other bits when it shares the GEMM with other rows (MKL picks other kernels by row count).
    Fails where the BLAS happens to be batch-invariant for these shapes (then the property is free)."""
    x, wg, wu, wd = _experts_inputs(M=64, D=256, F=128, E=1)
    full = moe.experts_reference(x, torch.tensor([64]), wg, wu, wd)
    alone = [moe.experts_reference(x[i:i + 1], torch.tensor([1]), wg, wu, wd)[0] for i in range(8)]
    assert any(not torch.equal(a, full[i]) for i, a in enumerate(alone))


def _model(seed=0):
    torch.manual_seed(seed)
    model = GLM5ForCausalLM(GLM5Config.tiny(**TINY), backend="cpu")
    model.reset_parameters(seed=seed)
    return model.eval()


def _batch(rank, B=2, T=12):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, 264, (B, T), generator=g)


def _moe_outputs(model):
    """Every MoE layer's output [B, T, D], kept as the layers compute them (the decoder layer calls
    ``route_and_run``, wrapped here)."""
    got = []

    def keeping(run):
        def wrapped(*args, **kwargs):
            out = run(*args, **kwargs)
            got.append(out[0].detach().clone())
            return out
        return wrapped

    for layer in model.moe_layers():
        layer.route_and_run = keeping(layer.route_and_run)
    return got


def _forward(model, rank):
    outs = _moe_outputs(model)
    with torch.no_grad():
        out = model(_batch(rank), attention="dense")
    return out.logits, outs, out.expert_ids


def _worker(rank, world, ep_sizes, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        plain = _model().shard_experts(None)  # no EP: every expert here
        logits0, moe0, ids0 = _forward(plain, rank)
        for ep_size in ep_sizes:
            _check_ep(rank, world, ep_size, logits0, moe0, ids0)
        queue.put((rank, "ok"))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        import traceback

        queue.put((rank, f"{exc!r} {traceback.format_exc()[-600:]}"))
    finally:
        dist.destroy_process_group()


def _check_ep(rank, world, ep_size, logits0, moe0, ids0):
    """EP groups of ``ep_size`` consecutive ranks: this rank's forward bitwise the no-EP one."""
    groups = [dist.new_group(list(range(s, s + ep_size))) for s in range(0, world, ep_size)]  # every rank makes all
    group = groups[rank // ep_size]
    sharded = _model().shard_experts(group)
    held = sorted(int(k) for k in sharded.moe_layers()[0].experts.keys())
    L = 8 // ep_size
    assert held == list(range((rank % ep_size) * L, (rank % ep_size + 1) * L)), held
    logits1, moe1, ids1 = _forward(sharded, rank)
    assert torch.equal(logits0, logits1), (rank, (logits0 - logits1).abs().max())
    assert len(moe0) == len(moe1) == 2
    for a, b in zip(moe0, moe1):
        assert torch.equal(a, b), (rank, (a - b).abs().max())
    for a, b in zip(ids0, ids1):
        assert torch.equal(a, b)


def _run(world, *ep_sizes):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, ep_sizes, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert results == {r: "ok" for r in range(world)}, results


def test_forward_bitwise_ep2(spawnable_test_modules):
    """EP=2 on 2 ranks: logits, MoE outputs and selected experts bitwise the no-EP model's on each rank's batch."""
    _run(2, 2)


@pytest.mark.slow
def test_forward_bitwise_ep4(spawnable_test_modules):
    """EP=4 on 4 ranks, and EP=2 inside a world of 4 (two expert-parallel groups)."""
    _run(4, 4, 2)
