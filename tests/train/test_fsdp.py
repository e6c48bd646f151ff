"""FSDP2 (``parallel.strategy: fsdp2``) on two CPU processes (torchrun, gloo) against DDP on the same config.

One module-scoped pair of runs (dense 2, indexer_warmup 1, sparse 1 steps; checkpoints after steps 3 and 4):
  * FSDP2 ends with the parameters of DDP within TOL, and its ranks agree (digests of the whole tensors);
  * its checkpoints have DDP's on-disk format (names, shapes, dtypes, optimizer layout and metadata);
  * its step-3 checkpoint resumed in a single process gives the step DDP's step-3 checkpoint gives;
  * resumed under FSDP2 on two processes it repeats its own uninterrupted step 4 bitwise.
Apart from it, a tied-embedding run: a single-process checkpoint resumed under FSDP2 on two processes.
Why not bitwise against DDP: DDP all-reduces whole gradient buckets while FSDP2 reduce-scatters per layer
and divides by the world size before and after the sum (gloo has no average), so float32 sums are rounded
in a different order; Muon's Newton-Schulz and Adam's normalisation then carry ~1e-7 relative differences
into the weights. TOL = 1e-5 absolute bounds that drift after 4 steps while the steps themselves move
weights by far more (checked, so a run that trains nothing cannot pass).
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from glm5_core.train import ConfigError, RunOptions, parse_config, pretrain
from tests.train.small_run import CORPUS, SMALL_MODEL

TOL = 1e-5
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
needs_torchrun = pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(TORCHRUN),
                                    reason="torchrun is not installed")


def _raw(root: Path) -> dict:
    corpus = root / "corpus"
    corpus.mkdir()
    for i, text in enumerate(CORPUS * 3):
        (corpus / f"doc{i:02d}.txt").write_text(text)
    return dict(
        seed=3, torch_threads=1, output_dir=str(root / "run"), model=dict(SMALL_MODEL),
        data=dict(source="path", path=str(corpus), seq_len=24, batch_size=4),  # 2 rows per rank
        schedule=dict(lr=1e-2, warmup_steps=1),
        stages=[dict(kind="dense", steps=2),
                dict(kind="indexer_warmup", steps=1, indexer_lr=5e-3, indexer_final_lr=2e-4),
                dict(kind="sparse", steps=1)],
        loss=dict(mtp_depths=2, mtp_weight=0.3), router=dict(bias_update_rate=1e-2),
        checkpoint=dict(every_steps=3, keep_last=2),
        logging=dict(progress_bar=False, tensorboard=False, plot=False, recall_every_steps=1),
    )


def _torchrun(config: Path, out: Path, *extra: str) -> dict:
    cmd = [TORCHRUN if os.path.exists(TORCHRUN) else "torchrun", "--standalone", "--nproc_per_node=2",
           "-m", "glm5_core.cli", "pretrain", "--config", str(config), "--backend", "cpu", "--output-dir", str(out),
           *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def _checkpoint(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def _records(run: Path):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _assert_close_models(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    worst = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    assert worst <= tol, f"max |difference| {worst:.3g} > {tol:g}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if shutil.which("torchrun") is None and not os.path.exists(TORCHRUN):
        pytest.skip("torchrun is not installed")
    root = tmp_path_factory.mktemp("fsdp2")
    raw = _raw(root)
    config = root / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    summaries = {s: _torchrun(config, root / s, "--parallel", s) for s in ("ddp", "fsdp2")}
    return dict(root=root, raw=raw, config=config, summaries=summaries)


@needs_torchrun
def test_fsdp2_ends_where_ddp_ends_and_its_ranks_agree(runs):
    root, summaries = runs["root"], runs["summaries"]
    assert summaries["fsdp2"]["parallel"] == "fsdp2" and summaries["ddp"]["parallel"] == "ddp"
    digests = summaries["fsdp2"]["parameter_digests"]
    assert len(digests) == 2 and digests[0] == digests[1], "FSDP2 ranks diverged (router biases or shards)"
    fsdp2, ddp = load_file(str(_checkpoint(root / "fsdp2", 4) / "model.safetensors")), \
        load_file(str(_checkpoint(root / "ddp", 4) / "model.safetensors"))
    _assert_close_models(fsdp2, ddp, TOL)
    from glm5_core.model import load_pretrained
    from glm5_core.model.hf_layout import to_transformers_form

    exported = load_pretrained(root / "fsdp2" / "final").state_dict()  # HF export built from the gathered weights
    _, want = to_transformers_form(parse_config(runs["raw"]).model_config(), fsdp2)  # as transformers computes
    assert exported.keys() == fsdp2.keys() and all(torch.equal(exported[k], want[k]) for k in fsdp2)
    before = load_file(str(_checkpoint(root / "ddp", 3) / "model.safetensors"))
    moved = max(float((ddp[k] - before[k]).abs().max()) for k in ddp)
    assert moved > 100 * TOL, f"the sparse step moved the weights by only {moved:.3g}"
    a, b = _records(root / "fsdp2"), _records(root / "ddp")
    assert [r["stage"] for r in a] == [r["stage"] for r in b] == ["dense", "dense", "indexer_warmup", "sparse"]
    for ra, rb in zip(a, b):
        for key in ("loss", "indexer_kl", "grad_norm", "expert_load_max_over_mean"):
            assert (ra.get(key) is None) == (rb.get(key) is None), key
            if ra.get(key) is not None:
                assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-6), (ra["step"], key)


@needs_torchrun
def test_fsdp2_ranks_hold_about_half_the_parameters_and_optimizer_state(runs):
    ddp, fsdp2 = runs["summaries"]["ddp"], runs["summaries"]["fsdp2"]
    whole = sum(t.numel() * t.element_size() for t in
                load_file(str(_checkpoint(runs["root"] / "ddp", 4) / "model.safetensors")).values())
    # DDP: every rank holds the whole model (the checkpoint also holds the few router-bias buffer bytes)
    assert 0.99 * whole <= ddp["parameter_bytes_per_rank"] <= whole
    for key in ("parameter_bytes_per_rank", "optimizer_state_bytes_per_rank"):
        # rank 0's dim-0 shards: half of each tensor, rounded up (rows that do not divide by 2)
        assert 0.45 * ddp[key] <= fsdp2[key] <= 0.55 * ddp[key], key


def _header(path: Path):
    with safe_open(str(path), framework="pt") as f:
        return {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()}, f.metadata()


@needs_torchrun
def test_fsdp2_checkpoints_have_the_ddp_format(runs):
    fsdp2, ddp = _checkpoint(runs["root"] / "fsdp2", 3), _checkpoint(runs["root"] / "ddp", 3)
    assert sorted(p.name for p in fsdp2.iterdir()) == sorted(p.name for p in ddp.iterdir())
    for name in ("model.safetensors", "optimizer.safetensors", "rng.safetensors"):
        assert _header(fsdp2 / name) == _header(ddp / name), name
    state_f, state_d = (json.loads((c / "trainer_state.json").read_text()) for c in (fsdp2, ddp))
    assert state_f.keys() == state_d.keys()
    python_rng = {state_f.pop("python_rng")[0], state_d.pop("python_rng")[0]}  # unseeded: differs run to run
    assert python_rng == {3} and state_f == state_d  # step, data position, world size, format version
    # whole tensors, not shards: every Muon momentum buffer and Adam moment is shaped like its parameter
    optim = load_file(str(fsdp2 / "optimizer.safetensors"))
    ddp_optim = load_file(str(ddp / "optimizer.safetensors"))
    assert all(optim[k].shape == ddp_optim[k].shape for k in optim)
    assert max(float((optim[k].double() - ddp_optim[k].double()).abs().max()) for k in optim) <= TOL


@needs_torchrun
def test_fsdp2_checkpoint_resumes_in_one_process_like_the_ddp_one(runs, tmp_path):
    cfg = parse_config(runs["raw"])
    resumed = {}
    for strategy in ("ddp", "fsdp2"):
        out = tmp_path / strategy
        pretrain(cfg, RunOptions(backend="cpu", output_dir=str(out),
                                 resume=str(_checkpoint(runs["root"] / strategy, 3))))
        resumed[strategy] = out
    a, b = _records(resumed["fsdp2"]), _records(resumed["ddp"])
    assert [r["step"] for r in a] == [r["step"] for r in b] == [4]  # a fresh output dir: the resumed step only
    two_process = _records(runs["root"] / "ddp")[-1]
    # abs: the KL (~2e-5 once every indexer is warmed up) is cross-entropy minus entropy, O(1) float32 terms,
    # so summing them in another order (one process or two) moves it by ~1e-8 whatever its size
    for key in ("loss", "lm_loss", "indexer_kl", "grad_norm"):
        assert a[0][key] == pytest.approx(b[0][key], rel=1e-4, abs=1e-7) == \
            pytest.approx(two_process[key], rel=1e-4, abs=1e-7), key
    final_f = load_file(str(_checkpoint(resumed["fsdp2"], 4) / "model.safetensors"))
    final_d = load_file(str(_checkpoint(resumed["ddp"], 4) / "model.safetensors"))
    _assert_close_models(final_f, final_d, TOL)
    # ... and the single-process step is the step the two-process runs took
    _assert_close_models(final_d, load_file(str(_checkpoint(runs["root"] / "ddp", 4) / "model.safetensors")), TOL)


@needs_torchrun
def test_fsdp2_resume_on_two_processes_repeats_its_run_bitwise(runs, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(runs["root"] / "fsdp2", out)
    shutil.rmtree(_checkpoint(out, 4))
    (out / "checkpoints" / "latest").write_text("step_00000003\n")
    _torchrun(runs["config"], out, "--parallel", "fsdp2", "--resume")
    again = load_file(str(_checkpoint(out, 4) / "model.safetensors"))
    first = load_file(str(_checkpoint(runs["root"] / "fsdp2", 4) / "model.safetensors"))
    assert again.keys() == first.keys()
    assert all(torch.equal(again[k], first[k]) for k in first)
    assert load_file(str(_checkpoint(out, 4) / "optimizer.safetensors")).keys() == \
        load_file(str(_checkpoint(runs["root"] / "fsdp2", 4) / "optimizer.safetensors")).keys()


@needs_torchrun
def test_fsdp2_resumes_and_saves_tied_embeddings_in_the_single_process_format(tmp_path):
    """tie_word_embeddings: a single-process checkpoint (the tied pair stored once, as lm_head.weight) resumed
    by FSDP2 on two processes (the sharded loader fills both names), whose own checkpoint has the same format
    and ends within TOL of the single-process run's uninterrupted step."""
    raw = _raw(tmp_path)
    raw["model"]["tie_word_embeddings"] = True
    raw["stages"] = [dict(kind="dense", steps=2)]
    raw["checkpoint"] = dict(every_steps=1, keep_last=2)
    single = tmp_path / "single"
    pretrain(parse_config(raw), RunOptions(backend="cpu", output_dir=str(single)))
    config = tmp_path / "tied.yaml"
    config.write_text(yaml.safe_dump(raw))
    sharded = tmp_path / "fsdp2"
    _torchrun(config, sharded, "--parallel", "fsdp2", "--resume", str(_checkpoint(single, 1)))
    want = load_file(str(_checkpoint(single, 2) / "model.safetensors"))
    assert "lm_head.weight" in want and "model.embed_tokens.weight" not in want
    assert (_header(_checkpoint(sharded, 2) / "model.safetensors")
            == _header(_checkpoint(single, 2) / "model.safetensors"))
    got = load_file(str(_checkpoint(sharded, 2) / "model.safetensors"))
    _assert_close_models(got, want, TOL)
    before = load_file(str(_checkpoint(single, 1) / "model.safetensors"))
    moved = float((want["lm_head.weight"] - before["lm_head.weight"]).abs().max())
    assert moved > 100 * TOL, f"step 2 moved the tied embedding by only {moved:.3g}"


# ------------------------------------------------------------------------------------------ config / API


def test_parallel_strategy_is_validated(small_raw):
    assert parse_config(small_raw).parallel.strategy == "ddp"
    small_raw["parallel"] = {"strategy": "fsdp2"}
    assert parse_config(small_raw).parallel.strategy == "fsdp2"
    small_raw["parallel"] = {"strategy": "fsdp"}
    with pytest.raises(ValueError, match=r"parallel\.strategy: expected one of 'ddp', 'fsdp2', got 'fsdp'"):
        parse_config(small_raw)
    small_raw["parallel"] = "fsdp2"
    with pytest.raises(ConfigError, match=r"parallel: expected a mapping, got 'fsdp2'"):
        parse_config(small_raw)
    small_raw["parallel"] = {"stratgy": "fsdp2"}
    with pytest.raises(ConfigError, match=r"parallel\.stratgy: unknown key; did you mean 'strategy'"):
        parse_config(small_raw)


def test_cli_parallel_flag_is_checked_and_overrides_the_config(small_raw, tmp_path, capsys):
    from glm5_core.cli import main

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(small_raw))
    with pytest.raises(SystemExit):
        main(["pretrain", "--config", str(path), "--parallel", "zero3"])
    assert "argument --parallel: expected one of ddp, fsdp2 or ep=N (N >= 1), got 'zero3'" in capsys.readouterr().err
    # one process: fsdp2 has nothing to shard and trains exactly as ddp does (the model stays whole)
    out = tmp_path / "one"
    assert main(["pretrain", "--config", str(path), "--backend", "cpu", "--output-dir", str(out),
                 "--max-steps", "1", "--parallel", "fsdp2"]) == 0
    single = pretrain(parse_config(small_raw), RunOptions(backend="cpu", output_dir=str(tmp_path / "ddp"), max_steps=1))
    assert json.loads((out / "summary.json").read_text())["parameter_digests"] == single["parameter_digests"]


def test_sharding_needs_a_process_group():
    from glm5_core.model import GLM5Config, GLM5ForCausalLM
    from glm5_core.train.fsdp import shard_model

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("a process group is already up in this process")
    model = GLM5ForCausalLM(GLM5Config.tiny())
    with pytest.raises(ValueError, match="parallel.strategy: 'fsdp2' needs a process group"):
        shard_model(model, "cpu", 2)


# ------------------------------------------------------------------------------------------ sharded resume memory


class _Toy(torch.nn.Module):
    """Rows that do not divide by 2 (7, 3) and a 1-row matrix (rank 1's shard empty); vectors for AdamW."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(6, 7), torch.nn.Linear(7, 3), torch.nn.Linear(3, 1, bias=False)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _toy_sharded(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    from glm5_core.optim import Muon
    from glm5_core.optim.hybrid import HybridOptimizer
    from glm5_core.train.fsdp import fully_shard_function

    torch.manual_seed(0)
    model = _Toy()
    fully_shard_function()(model, mesh=init_device_mesh("cpu", (world,)))
    matrices = [p for p in model.parameters() if p.dim() == 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    optimizers = {"muon": Muon(matrices, lr=0.05, momentum=0.9),
                  "adamw": torch.optim.AdamW(vectors, lr=0.01, foreach=False)}
    return model, HybridOptimizer(optimizers, [])


def _tracking_safe_open(real, reads: dict):
    """safe_open whose get_tensor records how many whole state tensors (all but ``step``) are alive at once."""
    import weakref

    class Tracking:
        def __init__(self, *args, **kwargs):
            self.file = real(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def __getattr__(self, name):
            return getattr(self.file, name)

        def get_tensor(self, name):
            t = self.file.get_tensor(name)
            if name.count("/") == 2 and not name.endswith("/step"):
                reads.setdefault("refs", []).append(weakref.ref(t))
                alive = sum(ref() is not None for ref in reads["refs"])
                reads["most_alive"] = max(reads.get("most_alive", 0), alive)
            return t
    return Tracking


def _resume_memory_worker(rank: int, init_file: str, root: str) -> None:
    import torch.distributed as dist

    from glm5_core.train import checkpoint as ckpt
    from glm5_core.train.fsdp import full_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model, opt = _toy_sharded(2)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
        model(x[rank::2]).pow(2).sum().backward()
        opt.step()
        ckpt.save_checkpoint(Path(root), step=1, model=model, optimizer=opt, data_state={}, world_size=2,
                                      device_type="cpu", keep_last=1, write=rank == 0)
        dist.barrier()
        folder = Path(root) / "step_00000001"
        fresh, fresh_opt = _toy_sharded(2)
        reads = {}
        import safetensors  # the checkpoint reader opens files through glm5_core.safe_files -> safetensors

        real = safetensors.safe_open
        safetensors.safe_open = _tracking_safe_open(real, reads)
        try:
            ckpt.load_checkpoint(folder, model=fresh, optimizer=fresh_opt, total_steps=1, world_size=2,
                                 device_type="cpu")
        finally:
            safetensors.safe_open = real
        # 3 momentum buffers + 2 x 2 Adam moments read, at most one parameter's (2 moments) held whole at once
        assert len(reads["refs"]) == 7 and reads["most_alive"] <= 2, (len(reads["refs"]), reads["most_alive"])
        for part, o in opt.optimizers.items():  # the loaded shards are the saved run's shards
            loaded = fresh_opt.optimizers[part]
            for p, q in zip(o.param_groups[0]["params"], loaded.param_groups[0]["params"]):
                for key, value in o.state[p].items():
                    assert torch.equal(full_tensor(loaded.state[q][key]), full_tensor(value)), (part, key)
        assert all(torch.equal(full_tensor(p.detach()), full_tensor(q.detach()))
                   for p, q in zip(model.parameters(), fresh.parameters()))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # done and torn down: leave without interpreter teardown, where gloo's threads now and then abort a
    # finished process ("terminate called without an active exception") on an oversubscribed machine
    os._exit(0)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_sharded_resume_holds_one_parameters_whole_optimizer_state_at_a_time(tmp_path, spawnable_test_modules):
    """Every rank reads the whole checkpoint; reading all optimizer state before cutting it to shards held the
    whole optimizer state on every rank of a node at once (11 of 11 tensors on a 5-parameter toy)."""
    import torch.multiprocessing as mp

    mp.spawn(_resume_memory_worker, args=(str(tmp_path / "init"), str(tmp_path / "ckpt")), nprocs=2, join=True)
