"""``glm5 pretrain --parallel ep=N`` on real gloo processes (torchrun): training at EP=2 / EP=4 tracks the run without
expert sharding at the same world size (EP=1) to the fp32 tolerance table and repeats its golden trace bitwise
(``tests/train/ep_golden.py`` made them; its docstring has the command); a sharded (DCP) checkpoint written at
EP=2 and stopped mid-run resumes at EP=4, EP=2 and EP=1 on the same curve; the refusals of a bad ``ep``.

The default run re-runs 4 of EP=2's 20 golden steps on 2 processes (then resumes on one process) and compares
the stored 20-step traces of EP=2 / EP=4 with EP=1's; the 4-process re-run and the resume at EP=4 / EP=2 / EP=1
are marked slow.
"""
import os
import shutil
import signal
import subprocess
import time

import pytest
import torch

from glm5_core.testing import TOLERANCES
from glm5_core.train import checkpoint as ckpt
from glm5_core.train.config import TrainConfig
from glm5_core.train.config_loader import load_config
from glm5_core.train.trainer import RunOptions, pretrain
from tests.train import ep_golden, ep_kill

ATOL, RTOL = TOLERANCES[torch.float32]

pytestmark = pytest.mark.skipif(shutil.which(ep_golden.torchrun_cmd(1)[0]) is None, reason="torchrun is not installed")


def _golden(name: str) -> dict:
    golden = ep_golden.load(name)
    differs = ep_golden.environment_differs(golden)
    if differs:
        pytest.skip(f"golden trace {name} was made elsewhere ({differs}): regenerate with {golden['command']}")
    return golden


def _same_trace(got: dict, golden: dict, steps: int) -> None:
    """Bitwise: the first ``steps`` steps' loss, LM loss and gradient norm."""
    for key in ("loss", "lm_loss", "grad_norm"):
        assert got[key][:steps] == golden[key][:steps], f"{key} differs from the golden trace {golden['setting']}"


def _tracks(got: dict, baseline: dict, steps: int) -> None:
    """To the fp32 tolerance table: every step's loss and gradient norm."""
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor(got[key][:steps], dtype=torch.float64),
                                   torch.tensor(baseline[key][:steps], dtype=torch.float64), atol=ATOL, rtol=RTOL,
                                   msg=lambda m, key=key: f"{key}: {m}")


def test_ep2_matches_golden_and_resumes_on_one_process(tmp_path):
    """EP=2 on 2 processes: 4 steps bitwise its golden trace and to tolerance the EP=1 run's; the DCP checkpoint
    at step 4 resumes on ONE process, at EP=1 (every expert whole there; steps 5..7) and without parallel.ep
    (step 5), tracking the golden."""
    golden, baseline = _golden("ep2"), _golden("ep1_w2")
    out = tmp_path / "ep2"
    got = ep_golden.run(tmp_path, 2, 2, max_steps=4, output=out)
    assert got["steps"] == [1, 2, 3, 4] and got["digests_agree"]
    _same_trace(got, golden, 4)
    _tracks(got, baseline, 4)
    shards = sorted((out / "checkpoints" / "step_00000004" / "dcp").glob("*.safetensors"))
    assert len(shards) == 2  # one file per rank, each with only its own experts (no rank wrote the whole model)
    from safetensors import safe_open

    held = []
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            held.append(sorted({k.split(".experts.")[1].split(".")[0] for k in f.keys() if ".experts." in k}))
    assert held == [["0", "1"], ["2", "3"]], held
    plain = tmp_path / "plain"  # a run without parallel.ep resumes the sharded checkpoint too
    shutil.copytree(out, plain)
    cfg = load_config(ep_golden.config(tmp_path), [], {"output_dir": str(plain)})
    pretrain(cfg, RunOptions(backend="cpu", output_dir=str(plain), resume=str(plain), max_steps=5))
    _tracks({k: v[4:] for k, v in ep_golden.trace(plain).items() if isinstance(v, list)},
            {k: v[4:5] for k, v in golden.items() if isinstance(v, list)}, 1)
    cfg = load_config(ep_golden.config(tmp_path), [], {"output_dir": str(out), "parallel.ep": 1,
                                                       "parallel.strategy": "fsdp2"})
    pretrain(cfg, RunOptions(backend="cpu", output_dir=str(out), resume=str(out), max_steps=7))
    resumed = ep_golden.trace(out)
    assert resumed["steps"] == list(range(1, 8))
    _tracks({k: v[4:] for k, v in resumed.items() if isinstance(v, list)},
            {k: v[4:] for k, v in golden.items() if isinstance(v, list)}, 3)


def test_ep2_within_four_processes_trains_on_gloo(tmp_path):
    """EP=2 inside 4 processes (2 data-parallel copies of each expert group: FSDP2 reduce-scatters the experts'
    gradients over them with the world-size divide factor). It died at the first backward on gloo ("Cannot use
    ReduceOp.PREMUL_SUM with Gloo": docs/expert-parallel.md's first command); its steps track EP=1 on 4."""
    got = ep_golden.run(tmp_path, 4, 2, max_steps=3)
    assert got["steps"] == [1, 2, 3] and got["digests_agree"]
    _tracks(got, _golden("ep1_w4"), 3)


@pytest.mark.parametrize("processes", [2, 4])
def test_golden_traces_track_the_runs_without_ep(processes):
    """The stored 20-step traces: EP=N within the fp32 tolerance table of EP=1 at the same world size, every step
    (the traces were made by one command, ``tests.train.ep_golden``; the run-to-run tests below re-run them)."""
    ep = _golden(f"ep{processes}")
    baseline = _golden(f"ep1_w{processes}")
    assert ep["steps"] == baseline["steps"] == list(range(1, ep_golden.STEPS + 1))
    assert ep["digests_agree"] and baseline["digests_agree"]
    _tracks(ep, baseline, ep_golden.STEPS)


@pytest.mark.slow
def test_ep4_twenty_steps_repeat_the_golden_trace(tmp_path):
    """20 steps at EP=4 on 4 processes: bitwise the golden trace (loss, LM loss, gradient norm, final digest),
    digests equal on every rank. (EP=2 repeats its golden in the default run, 4 steps.)"""
    golden = _golden("ep4")
    got = ep_golden.run(tmp_path, 4, 4)
    _same_trace(got, golden, ep_golden.STEPS)
    assert got["parameter_digest"] == golden["parameter_digest"] and got["digests_agree"]


def _killed_at(tmp_path, stage: str, kill_step: int, out, every: int) -> None:
    """Run EP=2 on 2 processes (torchrun) with a checkpoint every ``every`` steps until it stops at ``stage`` of
    checkpoint ``kill_step``'s write (``tests/train/ep_kill.py``), then SIGKILL every rank there at once (and the
    torchrun agent if it outlives them). Returns when no rank is left."""
    markers = tmp_path / f"markers-{stage}"
    markers.mkdir()
    paused = {"training": ("0", "1"), "dcp_write": ("1",), "rename": ("0",), "latest": ("0",)}[stage]
    cmd = ep_golden.torchrun_cmd(2) + ["-m", "tests.train.ep_kill", stage, str(kill_step), str(markers), "--"] + \
        ep_golden.pretrain_args(tmp_path, 2, out, settings=(f"checkpoint.every_steps={every}",))
    log = open(tmp_path / f"killed-{stage}.log", "w")
    agent = subprocess.Popen(cmd, env=ep_golden.run_env(), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    try:
        while not (all((markers / f"paused-{r}").exists() for r in paused) and
                   (stage != "dcp_write" or list(out.glob("checkpoints/.tmp-*/dcp/*.safetensors")))):
            assert agent.poll() is None, f"{stage}: the run ended before the kill:\n" + \
                (tmp_path / f"killed-{stage}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"{stage}: the run did not reach the stage"
            time.sleep(0.2)
        ranks = [int((markers / f"pid-{r}").read_text()) for r in ("0", "1")]
        for pid in ranks:
            os.kill(pid, signal.SIGKILL)
        try:
            agent.wait(timeout=60)  # it reaps the killed ranks and exits on its own
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
        for pid in ranks:
            while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
                time.sleep(0.1)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        log.close()


def _last_complete_before_kill(out, stage: str, kill_step: int, every: int) -> int:
    """What a resume takes after the kill, checked on disk: the checkpoint ``every`` steps before ``kill_step``
    (``latest`` did not name step ``kill_step`` yet); a dcp_write kill left a half-written folder with rank 0's
    shard alone, a rename kill a fully written one, a latest kill step ``kill_step`` in place, unnamed."""
    root = out / "checkpoints"
    assert ckpt.resolve_checkpoint(out).name == f"step_{kill_step - every:08d}"
    tmp = list(root.glob(".tmp-*"))
    if stage == "dcp_write":
        assert len(tmp) == 1 and not (tmp[0] / "trainer_state.json").exists()
        assert len(list((tmp[0] / "dcp").glob("*.safetensors"))) == 1
    if stage == "rename":
        assert len(tmp) == 1 and (tmp[0] / "trainer_state.json").exists()
    if stage == "latest":
        assert (root / f"step_{kill_step:08d}" / "trainer_state.json").exists()
    return kill_step - every


def test_killed_during_a_dcp_save_at_ep2_resumes_on_one_process(tmp_path):
    """SIGKILL of every rank of an EP=2 run while it writes the DCP checkpoint of step 4 (rank 0's shard written,
    rank 1's not): the resume takes step 2, the last complete checkpoint, on ONE process at EP=1 and steps 3..4
    track the uninterrupted run (the golden trace); the killed run's steps were bitwise the golden's."""
    golden = _golden("ep2")
    out = tmp_path / "killed"
    _killed_at(tmp_path, "dcp_write", 4, out, every=2)
    before = ep_golden.trace_records(out)
    assert before["steps"] == [1, 2, 3, 4]
    _same_trace(before, golden, 4)
    step = _last_complete_before_kill(out, "dcp_write", 4, every=2)
    cfg = load_config(ep_golden.config(tmp_path), [], {"output_dir": str(out), "parallel.ep": 1,
                                                       "parallel.strategy": "fsdp2"})
    pretrain(cfg, RunOptions(backend="cpu", output_dir=str(out), resume=str(out), max_steps=4))
    resumed = ep_golden.trace(out)
    assert resumed["steps"] == [1, 2, 3, 4]
    _tracks({k: v[step:] for k, v in resumed.items() if isinstance(v, list)},
            {k: v[step:4] for k, v in golden.items() if isinstance(v, list)}, 4 - step)
    assert not list((out / "checkpoints").glob(".tmp-*"))  # the killed writer's half folder was removed


@pytest.mark.slow
@pytest.mark.parametrize("stage", ep_kill.STAGES)
def test_killed_at_ep2_resumes_at_ep4_ep2_and_ep1(tmp_path, stage):
    """Every rank of an EP=2 run SIGKILLed at ``stage`` of the checkpoint write of step 12 (a checkpoint every 6
    steps): the resume takes step 6 and continues at EP=2 on 2 processes bitwise the uninterrupted run (the
    golden trace); after the kill during the DCP write also at EP=4 on 4 processes and at EP=1 on 2, tracking
    it to the tolerance table."""
    golden = _golden("ep2")
    killed = tmp_path / "killed"
    _killed_at(tmp_path, stage, 12, killed, every=6)
    step = _last_complete_before_kill(killed, stage, 12, every=6)
    assert step == 6
    settings = ((2, 2), (4, 4), (2, 1)) if stage == "dcp_write" else ((2, 2),)
    for processes, ep in settings:
        out = tmp_path / f"resume_p{processes}_ep{ep}"
        shutil.copytree(killed, out)
        got = ep_golden.run(tmp_path, processes, ep, resume=True, output=out)
        assert got["steps"] == list(range(1, ep_golden.STEPS + 1))
        if (processes, ep) == (2, 2):
            _same_trace(got, golden, ep_golden.STEPS)
            assert got["parameter_digest"] == golden["parameter_digest"]
        _tracks(got, golden, ep_golden.STEPS)


def test_ep_must_divide_the_experts(tmp_path):
    """parallel.ep that does not divide n_routed_experts (4): one config problem naming the key."""
    raw_path = ep_golden.config(tmp_path)
    with pytest.raises(ValueError, match=r"parallel\.ep: expected a divisor of model\.n_routed_experts \(4\), got 3"):
        load_config(raw_path, [], {"parallel.ep": 3, "parallel.strategy": "fsdp2"})
    with pytest.raises(ValueError, match="parallel.ep: expert parallelism shards with FSDP2"):
        load_config(raw_path, [], {"parallel.ep": 2})


def test_ep_must_divide_the_world_size(tmp_path):
    """ep=2 on one process: refused before any step, naming the key and the world size."""
    cfg = load_config(ep_golden.config(tmp_path), [], {"parallel.ep": 2, "parallel.strategy": "fsdp2",
                                                       "output_dir": str(tmp_path / "x")})
    assert isinstance(cfg, TrainConfig)
    with pytest.raises(ValueError, match=r"parallel\.ep: expected a divisor of the world size 1, got 2"):
        pretrain(cfg, RunOptions(backend="cpu"))


def test_cli_parallel_ep_refusals_are_one_line(tmp_path, capsys):
    """--parallel ep=3 (4 experts) and --parallel ep=x: one error line on stderr (argparse's usage before a
    malformed flag), no traceback, exit status 2."""
    from glm5_core.cli import main

    cfg = ep_golden.config(tmp_path)
    for flag, expected in (("ep=3", "parallel.ep: expected a divisor of model.n_routed_experts"),
                           ("ep=x", "argument --parallel: expected one of ddp, fsdp2 or ep=N")):
        try:
            code = main(["pretrain", "--config", str(cfg), "--parallel", flag, "--check-config"])
        except SystemExit as exc:
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2, err
        errors = [line for line in err.splitlines() if "error" in line]
        assert len(errors) == 1 and expected in errors[0] and "Traceback" not in err, err
