"""``check_same_on_every_rank`` on 2 gloo ranks: equal values pass; a value that differs on one rank (a nested
key, a list entry, a key only one rank has) is a ValueError on every rank naming the rank and the keys."""
import os

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from glm5_core.train.distributed import DistContext, check_same_on_every_rank

WORLD = 2
BASE = {"seed": 3, "optimizer": {"weight_decay": 0.1, "betas": [0.9, 0.95]}, "stages": [{"kind": "dense"}]}
# (what rank 1 changes, the message every rank must raise; None: no error)
CASES = [
    (lambda v: v, None),
    (lambda v: v["optimizer"].update(weight_decay=0.5),
     r"config: expected the same on every rank; rank 1 differs from rank 0 in 1 key\(s\): "
     r"optimizer\.weight_decay: 0\.1 on rank 0, 0\.5 on rank 1"),
    (lambda v: v["optimizer"]["betas"].__setitem__(1, 0.99),
     r"rank 1 differs .* optimizer\.betas: \[0\.9, 0\.95\] on rank 0"),
    (lambda v: v.update(extra=1), r"1 key\(s\): extra: '<absent>' on rank 0, 1 on rank 1"),
]


def _worker(rank: int, init_file: str) -> None:
    import copy
    import re

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        ctx = DistContext(rank=rank, world_size=WORLD)
        for change, message in CASES:
            value = copy.deepcopy(BASE)
            if rank == 1:
                change(value)
            if message is None:
                check_same_on_every_rank("config", value, ctx)
                continue
            try:
                check_same_on_every_rank("config", value, ctx)
            except ValueError as exc:
                assert re.search(message, str(exc)), (rank, str(exc))
            else:
                raise AssertionError(f"rank {rank}: no error for {message!r}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # done and torn down: leave without interpreter teardown, where gloo's threads now and then abort a
    # finished process ("terminate called without an active exception") on an oversubscribed machine
    os._exit(0)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_a_value_that_differs_between_ranks_is_an_error_on_every_rank(tmp_path, spawnable_test_modules):
    mp.spawn(_worker, args=(str(tmp_path / "init"),), nprocs=WORLD, join=True)



def _pretrain_worker(rank: int, root: str, raw: dict) -> None:
    """One rank of a 2-rank pretrain whose config differs on rank 1 (weight_decay); writes what it raised."""
    import copy
    import os
    import pathlib

    from glm5_core.train import RunOptions, parse_config, pretrain

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    raw = copy.deepcopy(raw)
    raw.setdefault("optimizer", {})["weight_decay"] = 0.1 if rank == 0 else 0.5
    outcome = "no error"
    try:
        pretrain(parse_config(raw), RunOptions(backend="cpu"))
    except ValueError as exc:
        outcome = str(exc)
    # a group left up after the error makes gloo abort the process at exit (SIGABRT instead of the error)
    outcome += f"\ngroup left up: {dist.is_initialized()}"
    pathlib.Path(root, f"rank{rank}.txt").write_text(outcome)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_pretrain_refuses_ranks_whose_configs_differ(small_raw, tmp_path, spawnable_test_modules, monkeypatch):
    import socket

    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
    small_raw["data"]["batch_size"] = 4
    small_raw["stages"] = [dict(kind="dense", steps=1)]
    mp.spawn(_pretrain_worker, args=(str(tmp_path), small_raw), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        said = (tmp_path / f"rank{rank}.txt").read_text()
        assert "config: expected the same on every rank" in said, (rank, said)
        assert "optimizer.weight_decay: 0.1 on rank 0, 0.5 on rank 1" in said, (rank, said)
        assert said.endswith("group left up: False"), (rank, said)


def test_every_trainable_parameter_is_used_so_ddp_needs_no_unused_search():
    """DDP runs without find_unused_parameters (its warning printed on every rank, every run): what a stage
    cannot use is frozen, the MTP module included when loss.mtp_depths is 0 (it never runs then)."""
    import torch

    from glm5_core.model import GLM5Config, GLM5ForCausalLM
    from glm5_core.train.config import StageConfig
    from glm5_core.train.trainer import _set_trainable
    from tests.train.small_run import SMALL_MODEL

    cfg = GLM5Config.tiny(**{k: v for k, v in SMALL_MODEL.items() if k != "preset"})
    model = GLM5ForCausalLM(cfg, backend="cpu")
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    for depths in (0, 2):
        _set_trainable(model, StageConfig(kind="sparse", steps=1), depths)
        out = model(ids, indexer_loss=True, mtp_depths=depths)
        loss = out.logits.float().logsumexp(-1).mean() + out.indexer_kl
        if depths:
            loss = loss + sum(m.float().logsumexp(-1).mean() for m in out.mtp_logits)
        model.zero_grad(set_to_none=True)
        loss.backward()
        unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert not unused, (depths, unused[:5])
        assert any(not p.requires_grad for p in model.model.mtp.parameters()) == (depths == 0)
