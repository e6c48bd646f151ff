"""`glm5 rl --resume DIR`: a sync run SIGKILLed after a resume point and resumed ends with bitwise the weights
(and optimizer state) of an uninterrupted run; an async run resumes from its step; a resume refuses another
config, a fresh run refuses a folder that is not empty, and a tampered resume point is refused in one line."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from glm5_core.cli import main
from glm5_core.rl import run_state
from glm5_core.rl.config_loader import config_from_dict
from glm5_core.rl.driver import RLRun

REPO = Path(__file__).resolve().parents[2]
# spawned engines with one slot and no prefix cache: every request is computed alone, so its logits do not
# depend on the batches it shared (they do in the last bit, measured on CPU), and its sampling seed fixes its draws
TINY = {
    "seed": 3, "mode": "sync", "max_minutes": 5, "max_steps": 5, "torch_threads": 1,
    "env": {"name": "arithmetic", "max_operand": 2, "max_new_tokens": 2},
    "model": {"preset": "tiny", "overrides": {"index_topk": 8}},
    "rollout": {"num_engines": 1, "max_batch": 1, "max_len": 32, "group_size": 2, "episode_threads": 4,
                "prefix_cache_entries": 0},
    "train": {"batch_size": 4, "optim": {"lr": 3e-3}},
    "checkpoint": {"every_steps": 1, "keep_last": 10},
    "eval": {"every": 0, "samples_per_problem": 1},
}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> str:
    """A distillation teacher: a random-init policy scores 0 on arithmetic, so its group advantages are 0 and
    the weights would never move; the per-token distillation advantage makes every step depend on what was
    sampled."""
    from glm5_core.model import GLM5Config, GLM5ForCausalLM
    from glm5_core.model.checkpoint import save_pretrained

    torch.manual_seed(5)
    folder = tmp_path_factory.mktemp("teacher") / "hf"
    save_pretrained(GLM5ForCausalLM(GLM5Config.tiny(index_topk=8)), folder)
    return str(folder)


def _config_file(tmp_path: Path, name: str = "rl.yaml", **overrides) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({**TINY, **overrides}))
    return path


def _glm5_rl(*args: str, **popen) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "glm5_core.cli", "rl", "--backend", "cpu", *args], cwd=REPO,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **popen)


def _latest_step(out: Path) -> int:
    try:
        names = (out / "checkpoints" / "latest").read_text().split()
    except FileNotFoundError:
        return 0
    return int(names[0][len("step_"):]) if names else 0


def _finished(proc: subprocess.Popen, what: str) -> None:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"{what}: exit {proc.returncode}: {err[-2000:]}"


def test_a_killed_sync_run_resumes_to_the_weights_of_an_uninterrupted_run(tmp_path, teacher):
    config = _config_file(tmp_path, train={**TINY["train"], "teacher_checkpoint": teacher,
                                           "optim": {**TINY["train"]["optim"], "distill_coef": 1.0}})
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    uninterrupted = _glm5_rl("--config", str(config), "--output-dir", str(whole))
    victim = _glm5_rl("--config", str(config), "--output-dir", str(killed), start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while _latest_step(killed) < 2 and victim.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert victim.poll() is None, f"the run ended before it was killed: {victim.stderr.read()[-2000:]}"
        os.killpg(victim.pid, signal.SIGKILL)  # the driver and its engine workers
        victim.wait(timeout=60)
    finally:
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
    assert 2 <= _latest_step(killed) < TINY["max_steps"], "the kill did not land mid-run"
    _finished(_glm5_rl("--config", str(config), "--resume", str(killed)), "resume")
    _finished(uninterrupted, "uninterrupted run")

    final = f"checkpoints/step_{TINY['max_steps']:08d}"
    for name in ("model.safetensors", "optimizer.safetensors"):
        want, got = load_file(whole / final / name), load_file(killed / final / name)
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want), f"{name} differs after the resume"
    before, after = (load_file(whole / f"checkpoints/step_{step:08d}/model.safetensors")
                     for step in (TINY["max_steps"] - 1, TINY["max_steps"]))
    assert not all(torch.equal(before[k], after[k]) for k in after), "the last step changed nothing: a vacuous test"
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["steps"] == TINY["max_steps"] and summary["resumed_at_step"] >= 2
    assert summary["trained_trajectories"] == TINY["max_steps"] * TINY["train"]["batch_size"]
    steps = [row["step"] for row in map(json.loads, (killed / "metrics.jsonl").read_text().splitlines())
             if "reward" in row]
    assert steps == list(range(1, TINY["max_steps"] + 1)), "the metrics history has gaps or repeats"


def test_an_async_run_resumes_from_its_step(tmp_path):
    cfg = config_from_dict({**TINY, "mode": "async", "max_steps": 2, "output_dir": str(tmp_path / "run"),
                            "rollout": {**TINY["rollout"], "max_inflight_groups": 2, "max_buffered": 8}})
    first = RLRun(cfg, log=lambda m: None).run()
    assert first["steps"] == 2
    resumed = RLRun(config_from_dict({**run_state.plain_config(cfg), "max_steps": 3}), log=lambda m: None,
                    resume=True)
    assert resumed.trainer.version == 2 and resumed.runner.state_dict()["next_group"] >= 2
    summary = resumed.run()
    assert summary["steps"] == 3 and summary["resumed_at_step"] == 2
    assert run_state.RunState.from_json(json.loads((tmp_path / "run/checkpoints/step_00000003/trainer_state.json")
                                                   .read_text())["data"], "state").runner["next_group"] >= 3


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_resume_refuses_a_folder_of_another_config(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_state.write_run_file(str(run_dir), config_from_dict({**TINY, "output_dir": str(run_dir)}), None)
    other = _config_file(tmp_path, "other.yaml", seed=4)
    line = _one_line_error(capsys, ["rl", "--config", str(other), "--resume", str(run_dir), "--backend", "cpu"])
    assert "another config" in line and "seed: the earlier run had 3, this config has 4" in line
    # budgets, evaluation and checkpointing may change: the same config with more steps gets past the check
    same = config_from_dict({**TINY, "output_dir": str(run_dir), "max_steps": 50, "eval": {"every": 5}})
    assert run_state.check_same_run(str(run_dir), same, None) is None
    with pytest.raises(ValueError, match="--checkpoint: the run in .* started from None"):
        run_state.check_same_run(str(run_dir), same, str(tmp_path / "another_policy"))


def test_a_run_of_an_earlier_version_resumes_while_new_config_keys_keep_their_defaults(tmp_path):
    """rl_run.json written by a version whose config had no rollout.sampling_seeds / rollout.speculative: the
    same config resumes (the keys are at their defaults); setting one of them is a difference."""
    run_dir = tmp_path / "run"
    cfg = config_from_dict({**TINY, "output_dir": str(run_dir)})
    run_state.write_run_file(str(run_dir), cfg, None)
    path = run_dir / run_state.RUN_FILE
    body = json.loads(path.read_text())
    for key in ("sampling_seeds", "speculative"):
        del body["config"]["rollout"][key]
    path.write_text(json.dumps(body))
    assert run_state.check_same_run(str(run_dir), cfg, None) is None
    seeded = config_from_dict({**TINY, "output_dir": str(run_dir),
                               "rollout": {**TINY["rollout"], "sampling_seeds": True}})
    with pytest.raises(ValueError, match="rollout.sampling_seeds: not in the earlier run"):
        run_state.check_same_run(str(run_dir), seeded, None)


def test_a_fresh_run_refuses_a_folder_that_is_not_empty(tmp_path, capsys):
    config = _config_file(tmp_path)
    earlier = tmp_path / "earlier"
    run_state.write_run_file(str(earlier), config_from_dict({**TINY, "output_dir": str(earlier)}), None)
    line = _one_line_error(capsys, ["rl", "--config", str(config), "--output-dir", str(earlier), "--backend", "cpu"])
    assert "already holds an earlier RL run" in line and f"--resume {earlier}" in line
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    line = _one_line_error(capsys, ["rl", "--config", str(config), "--output-dir", str(other), "--backend", "cpu"])
    assert "already holds 1 entries (notes.txt)" in line
    line = _one_line_error(capsys, ["rl", "--config", str(config), "--resume", str(other), "--backend", "cpu"])
    assert "holds no RL run" in line
    assert (other / "notes.txt").read_text() == "mine" and sorted(os.listdir(other)) == ["notes.txt"]


@pytest.mark.parametrize("name", ["checkpoints", "weights", "tensorboard"])
def test_a_resume_refuses_a_run_folder_that_is_a_file(tmp_path, name):
    """A file where the run keeps a folder: refused before anything is built (checkpoints: the resume would
    start over and fail at its first save; weights, tensorboard: a FileExistsError traceback)."""
    run_dir = tmp_path / "run"
    run_state.write_run_file(str(run_dir), config_from_dict({**TINY, "output_dir": str(run_dir)}), None)
    (run_dir / name).write_text("not a folder")
    with pytest.raises(ValueError, match=f"--resume: .*{name}' is not a folder"):
        run_state.check_output_dir(str(run_dir), resume=True)
    (run_dir / name).unlink()
    (tmp_path / "elsewhere").mkdir()
    (run_dir / name).symlink_to(tmp_path / "elsewhere")  # a folder on another disk, linked in: allowed
    run_state.check_output_dir(str(run_dir), resume=True)


def test_a_run_file_whose_writer_was_killed_does_not_block_the_folder(tmp_path):
    """A kill between writing ``rl_run.json.tmp-<pid>`` and its rename left the folder refused by a fresh run
    ("already holds 1 entries") and by --resume ("no RL run"): the debris of a dead writer is removed, the
    folder is empty again; a live writer's file is left alone."""
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is free now
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / f"rl_run.json.tmp-{dead.pid}").write_text('{"format": 1, "conf')  # torn by the kill
    run_state.check_output_dir(str(run_dir), resume=False)
    assert list(run_dir.iterdir()) == []
    (run_dir / f"rl_run.json.tmp-{os.getpid()}").write_text("{}")  # this process is alive: not debris
    with pytest.raises(ValueError, match="already holds 1 entries"):
        run_state.check_output_dir(str(run_dir), resume=False)


@pytest.fixture
def resume_point(tmp_path):
    """A run folder with one resume point at step 0 (no engine started), and its config file."""
    run_dir = tmp_path / "run"
    run = RLRun(config_from_dict({**TINY, "output_dir": str(run_dir)}), log=lambda m: None)
    try:
        run.save_resume_point()
    finally:
        run._teardown()
    return run_dir, _config_file(tmp_path)


def _edit_state(folder: Path, edit) -> None:
    path = folder / "trainer_state.json"
    state = json.loads(path.read_text())
    edit(state["data"])
    path.write_text(json.dumps(state))


@pytest.mark.parametrize("case, expected", [
    ("next_group", "data.runner.next_group: expected an int >= 0, got -1"),
    ("env_rng", "data.env.rng: expected [version, [625 ints"),
    ("histogram", "data.buffer.staleness_histogram.0: expected an int >= 0, got 'x'"),
    ("format", "data.format: expected 1 (an RL run's state), got 7"),
    ("no_runner", "data.runner: expected an object, got NoneType"),
    ("truncated_model", "model.safetensors"),
])
def test_a_tampered_resume_point_is_refused_in_one_line(resume_point, capsys, case, expected):
    run_dir, config = resume_point
    folder = run_dir / "checkpoints" / "step_00000000"
    if case == "next_group":
        _edit_state(folder, lambda d: d["runner"].update(next_group=-1))
    elif case == "env_rng":
        _edit_state(folder, lambda d: d["env"]["rng"][1].pop())
    elif case == "histogram":
        _edit_state(folder, lambda d: d["buffer"].update(staleness_histogram={"0": "x"}))
    elif case == "format":
        _edit_state(folder, lambda d: d.update(format=7))
    elif case == "no_runner":
        _edit_state(folder, lambda d: d.pop("runner"))
    else:
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[:len(data) // 2])
    line = _one_line_error(capsys, ["rl", "--config", str(config), "--resume", str(run_dir)])
    assert expected in line, line


def test_a_resume_point_restores_the_run_state(resume_point):
    """What the fixture saved comes back (the values the kill test relies on, checked without engines)."""
    run_dir, _ = resume_point
    folder = run_dir / "checkpoints" / "step_00000000"
    _edit_state(folder, lambda d: d["runner"].update(next_group=7, issued=14))
    weights = load_file(folder / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 1
    save_file(weights, str(folder / "model.safetensors"))
    run = RLRun(config_from_dict({**TINY, "output_dir": str(run_dir)}), log=lambda m: None, resume=True)
    try:
        assert run.runner.state_dict()["next_group"] == 7 and run.runner.issued_total() == 14
        assert torch.equal(run.model.state_dict()[name], weights[name])
    finally:
        run._teardown()


def test_a_run_killed_before_its_first_resume_point_starts_over(tmp_path):
    """Killed before any checkpoint was published (a half-written one is what the killed writer leaves): the
    resume recovers the folder and starts at step 0, which repeats the run exactly."""
    run_dir = tmp_path / "run"
    cfg = config_from_dict({**TINY, "output_dir": str(run_dir)})
    run_state.write_run_file(str(run_dir), cfg, None)
    half = run_dir / "checkpoints" / ".tmp-step_00000001-999999"
    half.mkdir(parents=True)
    (half / "model.safetensors").write_bytes(b"\0" * 16)
    lines = []
    run = RLRun(cfg, log=lines.append, resume=True)
    try:
        assert run.trainer.version == 0 and run.runner.state_dict()["next_group"] == 0
        assert any("starting the run over from step 0" in line for line in lines)
        assert not half.exists()
    finally:
        run._teardown()


def test_the_metrics_history_is_cut_back_to_the_resume_point(tmp_path):
    from glm5_core.rl.metrics import MetricsLogger, rows_up_to

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval_reward": 0.1}] + [{"step": s, "reward": s / 10} for s in (1, 2, 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + [{"step": 3, "summary": {}}]) + '{"step": 4, "re')
    assert rows_up_to(str(path), 2) == rows[:3]  # later rows, summaries and the torn last line go
    logger = MetricsLogger(str(tmp_path), tensorboard=False, resume_step=2)
    logger.log(3, {"reward": 0.5})
    logger.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:3] + [{"step": 3, "reward": 0.5}]
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2: not valid JSON"):
        rows_up_to(str(path), 5)


def _save_start(folder: Path, seed: int) -> None:
    """A bf16 save_pretrained starting checkpoint (architecture and dtype come from its config.json)."""
    from glm5_core.model import GLM5Config, GLM5ForCausalLM
    from glm5_core.model.checkpoint import save_pretrained

    torch.manual_seed(seed)
    save_pretrained(GLM5ForCausalLM(GLM5Config.tiny(index_topk=8)).to(torch.bfloat16), folder)


def _tensors(model):
    return {name: t.detach().clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}


@pytest.mark.parametrize("resume_point_written", [True, False], ids=["resume_point", "none_yet"])
def test_a_resume_needs_the_starting_checkpoint_only_before_its_first_resume_point(tmp_path, capsys,
                                                                                   resume_point_written):
    """With a resume point the run dir holds everything: the policy is rebuilt from what rl_run.json recorded
    (config, dtype) and the resume point's weights, the starting checkpoint deleted. Without one the run starts
    over from the starting checkpoint, so a changed or deleted one is refused in one line naming the file."""
    start, run_dir = tmp_path / "start", tmp_path / "run"
    _save_start(start, seed=11)
    cfg = config_from_dict({**TINY, "output_dir": str(run_dir)})
    run = RLRun(cfg, checkpoint=str(start), log=lambda m: None)
    try:
        if resume_point_written:
            run.save_resume_point()
        before = _tensors(run.model)
    finally:
        run._teardown()
    if resume_point_written:
        shutil.rmtree(start)
        resumed = RLRun(cfg, log=lambda m: None, resume=True)
        try:
            after = _tensors(resumed.model)
        finally:
            resumed._teardown()
        assert before.keys() == after.keys()
        for name, want in before.items():
            assert after[name].dtype == want.dtype and torch.equal(after[name], want), name
        return
    config = _config_file(tmp_path)
    _save_start(start, seed=12)  # rewritten with other weights
    line = _one_line_error(capsys, ["rl", "--config", str(config), "--resume", str(run_dir)])
    assert "holds no resume point yet" in line and f"but {start / 'config.json'} changed (size" in line, line
    shutil.rmtree(start)
    line = _one_line_error(capsys, ["rl", "--config", str(config), "--resume", str(run_dir)])
    assert f"starting checkpoint {str(start)!r}, which is gone" in line, line
