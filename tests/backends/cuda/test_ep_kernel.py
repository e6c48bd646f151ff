"""The cuda expert-parallel kernels (backends/cuda/ep.py, DeepEP's ElasticBuffer) on a stand-in written from
DeepEP's source (tests/backends/cuda/deep_ep_standin.py, deep_ep 2.1.0 at dd758ca, none of glm5-core's code
inside), on 2 gloo processes: with a deterministic buffer the dispatch's rows, counts, handle, combine and gradients
are bitwise the reference's (bf16, uneven routing, a rank that receives nothing); with the arrival order of a
non-deterministic buffer the rows are not (why the kernel declines it); the rollout combine is DeepEP's sum (close,
not the contract); each decline names its reason; without deep_ep, `glm5 backends` says the reference runs."""
import datetime
import os
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from glm5_core import registry
from glm5_core.backends.cuda import ep as cuda_ep
from glm5_core.ops import ep

E, K, H, MAX_TOKENS = 8, 3, 16, 12


def _inputs(rank: int, routing: str):
    g = torch.Generator().manual_seed(100 + rank)
    T = 5 + 3 * rank
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if routing == "rank0_only":  # every token to experts of rank 0 (rank 1 receives nothing)
        ids = torch.stack([torch.randperm(E // 2, generator=g)[:K] for _ in range(T)])
    if routing == "one_expert" and rank == 0:  # every token of rank 0 names expert 5 in slot 0
        others = torch.tensor([e for e in range(E) if e != 5])
        ids = torch.stack([torch.cat([torch.tensor([5]), others[torch.randperm(E - 1, generator=g)[:K - 1]]])
                           for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    return x, ids.to(torch.int32), w


def _expert(rows):
    return (rows.float() * 1.5 - 0.25).to(rows.dtype)


def _bitwise(what, got, want):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.shape, want.shape)
    assert torch.equal(got.view(torch.int16) if got.dtype == torch.bfloat16 else got,
                       want.view(torch.int16) if want.dtype == torch.bfloat16 else want), what


def _run(x, ids, w, group, dispatch_fn):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    handle = dispatch_fn(x, ids, w)
    y = _expert(handle.rows)
    out = ep.combine_reference(y, handle.weights, handle)
    cot = torch.linspace(-1, 1, out.numel()).view_as(out).to(out.dtype)
    (out.float() * cot.float()).sum().backward()
    return handle, out, x.grad, w.grad


def _worker(rank: int, world: int, init_file: str) -> None:
    from tests.backends.cuda.deep_ep_standin import ElasticBuffer

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        group = dist.group.WORLD
        buffer = ElasticBuffer(group, num_max_tokens_per_rank=MAX_TOKENS, hidden=H, num_topk=K, deterministic=True,
                               allow_multiple_reduction=False, arrival="reversed")
        for routing in ("random", "rank0_only", "one_expert"):
            x, ids, w = _inputs(rank, routing)
            assert cuda_ep.dispatch_limits(x, ids, w, group=group, num_experts=E, buffer=buffer) == (True, "")
            got = _run(x, ids, w, group, lambda a, b, c: cuda_ep.dispatch(a, b, c, group=group, num_experts=E,
                                                                          buffer=buffer))
            want = _run(x, ids, w, group, lambda a, b, c: ep.dispatch_reference(a, b, c, group=group,
                                                                                num_experts=E))
            gh, wh = got[0], want[0]
            _bitwise(f"{routing}: rows", gh.rows, wh.rows)
            assert torch.equal(gh.counts, wh.counts), routing
            assert (gh.send_splits, gh.recv_splits) == (wh.send_splits, wh.recv_splits), routing
            assert torch.equal(gh.rank_order, wh.rank_order) and torch.equal(gh.sort_idx, wh.sort_idx), routing
            for what, g, r in zip(("out", "dx", "dweights"), got[1:], want[1:]):
                _bitwise(f"{routing}: {what}", g, r)
            if routing == "rank0_only" and rank == 1:
                assert gh.rows.shape[0] == 0
            # rollout: DeepEP's combine (the stand-in's statement of it), close to the contract, not bitwise
            with torch.inference_mode():
                h = cuda_ep.dispatch(x, ids, w, group=group, num_experts=E, buffer=buffer)
                assert cuda_ep.combine_limits(h.rows, h.weights, h) == (True, "")
                y = _expert(h.rows)
                fast = cuda_ep.combine(y, h.weights, h)
                exact = ep.combine_reference(y, h.weights, h)
            assert fast.dtype == torch.bfloat16 and torch.allclose(fast.float(), exact.float(), atol=0.05, rtol=0.02)
        # training: the combine declines (one line naming why and where it is used)
        x, ids, w = _inputs(rank, "random")
        h = cuda_ep.dispatch(x, ids, w, group=group, num_experts=E, buffer=buffer)
        ok, why = cuda_ep.combine_limits(h.rows, h.weights, h)
        assert not ok and "rollout only" in why and "training keeps the reference" in why and "\n" not in why
        ok, why = cuda_ep.combine_limits(h.rows, h.weights, ep.dispatch_reference(x, ids, w, group=group,
                                                                                  num_experts=E))
        assert not ok and "reference dispatch" in why
        # declines of dispatch, alike on every rank (the batch limit is agreed by one all-reduce)
        ok, why = cuda_ep.dispatch_limits(x.float(), ids, w, group=group, num_experts=E, buffer=buffer)
        assert not ok and "bfloat16" in why
        small = ElasticBuffer(group, num_max_tokens_per_rank=6, hidden=H, num_topk=K, deterministic=True)
        ok, why = cuda_ep.dispatch_limits(x, ids, w, group=group, num_experts=E, buffer=small)
        assert not ok and "a rank holds 8 tokens" in why and "num_max_tokens_per_rank=6" in why, why
        ok, why = cuda_ep.dispatch_limits(x, ids, w, group=group, num_experts=E)
        assert not ok and "use_buffer" in why
        with cuda_ep.use_buffer(small):
            assert cuda_ep.buffer_for(group)[0] is small
            assert "another process group" in cuda_ep.buffer_for(dist.new_group([0, 1]))[1]
        # the arrival order of a buffer without the deterministic epilogue is not the contract's row order
        loose = ElasticBuffer(group, num_max_tokens_per_rank=MAX_TOKENS, hidden=H, num_topk=K, deterministic=False,
                              arrival="reversed")
        ok, why = cuda_ep.dispatch_limits(x, ids, w, group=group, num_experts=E, buffer=loose)
        assert not ok and "deterministic=True" in why
        h = cuda_ep.dispatch(x, ids, w, group=group, num_experts=E, buffer=loose)
        ref = ep.dispatch_reference(x, ids, w, group=group, num_experts=E)
        assert torch.equal(h.counts, ref.counts) and not torch.equal(h.rows, ref.rows)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # see tests/train/test_distributed.py: gloo's threads may abort interpreter teardown


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_deep_ep_dispatch_keeps_the_contract_on_two_ranks(tmp_path, spawnable_test_modules):
    world = 2
    ctx = mp.start_processes(_worker, args=(world, str(tmp_path / "init")), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 180.0
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise AssertionError(f"{world} ranks still running: a rank hangs")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def test_one_process_declines_name_their_reason():
    x, ids, w = _inputs(0, "random")
    ok, why = cuda_ep.dispatch_limits(x, ids, w, group=None, num_experts=E)
    assert not ok and "no expert-parallel group" in why
    assert cuda_ep._dispatch_supports(x, ids, w, group=None, num_experts=E) == (
        False, "tensors are on cpu, DeepEP needs cuda tensors")
    handle = ep.dispatch_reference(x, ids, w, group=None, num_experts=E)
    ok, why = cuda_ep._combine_supports(handle.rows, w, handle)
    assert not ok and "reference dispatch" in why
    with pytest.raises(TypeError, match="buffer: expected a deep_ep.ElasticBuffer"):
        with cuda_ep.use_buffer(object()):
            pass
    with pytest.raises(ValueError, match="num_max_tokens_per_rank: expected a positive int, got 0"):
        cuda_ep.make_buffer(None, num_max_tokens_per_rank=0, hidden=H, num_topk=K)


def test_source_counts_from_the_metadata():
    # 2 ranks, 2 local experts, 3 received tokens (global index: rank 0 token 1, rank 1 token 0, rank 1 token 2)
    meta = torch.tensor([[1, 0, 0, -1], [12, 0, 1, 2], [14, 0, -1, 3]], dtype=torch.int32)
    counts = torch.tensor([2, 2])
    index = torch.arange(4)
    got = cuda_ep.source_counts(meta, 3, MAX_TOKENS, index, counts, 2, 4)
    assert got.tolist() == [[1, 0], [1, 2]]


def test_backends_listing_says_why_the_reference_runs_without_deep_ep(monkeypatch):
    if cuda_ep.L.deep_ep_importable()[0]:
        pytest.skip("deep_ep is importable here: the kernels are listed")
    reasons = {r.op: r.reason for r in registry.explain("cuda", require=False)}
    assert re.match(r"deep_ep is not importable: the reference \(all_to_all_single over NCCL\) runs",
                    reasons["ep_dispatch"])
    assert "rollout only" in reasons["ep_combine"] and "training keeps the reference" in reasons["ep_combine"]


def test_the_kernels_note_when_they_run():
    assert "rollout only" in cuda_ep.KERNELS["ep_combine"].note
    assert "training keeps the reference" in cuda_ep.KERNELS["ep_combine"].note
    assert "use_buffer" in cuda_ep.KERNELS["ep_dispatch"].note and cuda_ep.KERNELS["ep_dispatch"].differentiable
