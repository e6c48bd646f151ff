"""kill -9 at each stage of a checkpoint write (``checkpoint.WRITE_STAGES``), re-writes included: at that
moment ``latest`` resolves to a complete checkpoint that loads, and after :func:`recover` (what every run does
first) it resolves to the newest one that was complete, with nothing of the killed writer left.

One host process builds a small model once; for each case it prepares a checkpoints root, forks a writer that
stops (sleeps) when ``save_checkpoint`` reaches the stage, and SIGKILLs it there, so the kill lands at exactly
that stage. Scenarios: a new step; a re-write of the step ``latest`` names; a fresh run re-writing an earlier
run's older step; a re-write of the only checkpoint (keep_last 1).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from glm5_core.model import GLM5Config, GLM5ForCausalLM
from glm5_core.optim import OptimizerConfig, build_optimizer
from glm5_core.train.checkpoint import WRITE_STAGES, load_checkpoint, resolve_checkpoint
from glm5_core.train.checkpoint_folders import is_complete, recover
from tests.train.small_run import small_model_kwargs

MODEL = small_model_kwargs()

# scenario: (the writes before, then the killed write), each (step, keep_last, history): history None continues
# what `latest` records, [] is a fresh run's first write
SCENARIOS = {
    "new_step": ([(1, 2, None), (2, 2, None)], (3, 2, None)),
    "rewrite_latest": ([(1, 2, None), (2, 2, None)], (2, 2, None)),
    "rewrite_only_checkpoint": ([(1, 1, None)], (1, 1, None)),
    # an earlier run left step_5 and step_6; a fresh run wrote step_1 and now re-writes step_5, which is in no
    # history (`latest` lists step_1 alone)
    "fresh_run_rewrites_earlier_runs_step": ([(5, 2, None), (6, 2, None), (1, 2, [])], (5, 2, ["step_00000001"])),
}

HOST = r"""
import json, os, signal, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)  # no thread pool: the writer is forked
from glm5_core.model import GLM5Config, GLM5ForCausalLM
from glm5_core.optim import OptimizerConfig, build_optimizer
from glm5_core.train.checkpoint import save_checkpoint

model_cfg, scenarios, stages = (json.loads(arg) for arg in (sys.argv[1], sys.argv[3], sys.argv[4]))
base = Path(sys.argv[2])
model = GLM5ForCausalLM(GLM5Config.tiny(**model_cfg))
model.reset_parameters(seed=0)
optimizer = build_optimizer(model, OptimizerConfig(), num_heads=model_cfg["num_attention_heads"], lr=1e-2)

def save(root, step, keep_last, writer, history=None, on_stage=None):
    save_checkpoint(root, step=step, model=model, optimizer=optimizer, data_state={"writer": writer}, world_size=1,
                    device_type="cpu", keep_last=keep_last, history=history, on_stage=on_stage)

reached = {}
for name, (before, (step, keep_last, history)) in scenarios.items():
    for stage in stages:
        root = base / f"{name}-{stage}"
        for old_step, old_keep, old_history in before:
            save(root, old_step, old_keep, "first", old_history)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the writer: stops at `stage` until it is killed
            os.close(r)
            def stop(current):
                if current == stage:
                    os.write(w, str(os.getpid()).encode())
                    time.sleep(600)
            try:
                save(root, step, keep_last, "second", history, stop)
            finally:
                os._exit(0)
        os.close(w)
        got = os.read(r, 32)  # the writer's PID once it stopped at the stage; b"" if it ended first
        os.close(r)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        reached[root.name] = bool(got) and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
print(json.dumps(reached))
"""


def _writer(folder: Path) -> str:
    return json.loads((folder / "trainer_state.json").read_text())["data"]["writer"]


def _expected(scenario: str, stage: str):
    """(folder name, writer) `latest` resolves to after recover(), killed just before ``stage``."""
    done = WRITE_STAGES.index(stage)
    published = done > WRITE_STAGES.index("latest")  # `latest` names the new write
    moved_in = done > WRITE_STAGES.index("set_aside")  # its folder replaced the old one of the same name
    before, (step, _, _) = SCENARIOS[scenario]
    if published or (moved_in and scenario in ("rewrite_latest", "rewrite_only_checkpoint")):
        return f"step_{step:08d}", "second"
    return f"step_{before[-1][0]:08d}", "first"


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    base = tmp_path_factory.mktemp("killed")
    if not hasattr(os, "fork"):
        pytest.skip("needs os.fork")
    out = subprocess.run([sys.executable, "-c", HOST, json.dumps(MODEL), str(base), json.dumps(SCENARIOS),
                          json.dumps(WRITE_STAGES)], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    reached = json.loads(out.stdout.strip().splitlines()[-1])
    return base, reached


def _loads(folder: Path) -> None:
    model = GLM5ForCausalLM(GLM5Config.tiny(**MODEL))
    optimizer = build_optimizer(model, OptimizerConfig(), num_heads=MODEL["num_attention_heads"], lr=1e-2)
    load_checkpoint(folder, model=model, optimizer=optimizer, total_steps=10, world_size=1, device_type="cpu")
    model.reset_parameters(seed=0)  # the weights the host saved
    saved = model.state_dict()
    load_checkpoint(folder, model=model, optimizer=optimizer, total_steps=10, world_size=1, device_type="cpu")
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("stage", WRITE_STAGES)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_latest_is_valid_after_a_kill_at_each_stage(killed, scenario, stage):
    base, reached = killed
    root = base / f"{scenario}-{stage}"
    assert reached[root.name], "the writer did not stop at the stage"
    messages = []
    at_kill = resolve_checkpoint(root, log=messages.append)  # what a reader sees at that moment, read-only
    assert (at_kill / "trainer_state.json").is_file() and len(messages) <= 1
    _loads(at_kill)

    recover(root, log=messages.append)
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]
    before, _ = SCENARIOS[scenario]  # none is lost (pruning, the last stage, never ran)
    assert all(is_complete(root / f"step_{step:08d}") for step, _, _ in before)
    folder = resolve_checkpoint(root)
    assert is_complete(folder) and (folder.name, _writer(folder)) == _expected(scenario, stage)
    _loads(folder)
