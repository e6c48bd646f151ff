"""Resume points of an RL run (``glm5 rl --resume DIR``), written and read by ``glm5 pretrain``'s checkpoint code.

``<output_dir>/rl_run.json`` (written atomically before anything else of a fresh run) marks the folder as an RL
run's: its config (``rollout.api_key`` left out), the ``--checkpoint`` the policy started from, and what a resume
rebuilds the policy from without that checkpoint (``policy``, see ``starting_policy``). A fresh run
refuses a folder that is not empty; ``--resume`` refuses one without this file, or whose config differs from
this run's in anything but :data:`RESUMABLE_KEYS` (a key added to the config schema since the run started
matches while it is left at its default).

``<output_dir>/checkpoints/step_N/`` (N = policy version) are ``glm5_core.train.checkpoint`` folders: published
atomically, pruned by write history, recovered after a kill at any point (``checkpoint_folders``):
  model.safetensors       the policy's weights
  optimizer.safetensors   AdamW's state (optimizer part ``adamw``)
  rng.safetensors         torch's CPU (and accelerator) RNG states
  trainer_state.json      step, Python's RNG state, and under ``data`` the run state below (RL_STATE_FORMAT)
The run state (JSON; readers ignore keys they do not know, so later versions may add some):
  env           the environment's ``state_dict()`` (the built-ins: their problem RNG)
  runner        the next group number (trajectory ids, hence sampling seeds, go on from it), failure counts
  buffer        drop counters, the staleness histogram, trajectories trained
  eval          ``history``: one entry per evaluation, ``{"step": N, "eval_reward": r}`` (held-out metrics of
                another evaluation plug in as more keys of an entry); ``start``: the step-0 evaluation
A sync run with per-request sampling seeds (spawned engines) resumes bitwise: a buffer holds no trajectory
between sync steps. Async runs resume from the step, not bitwise (see docs/rl-resume.md).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Optional

from glm5_core.config_schema import as_plain
from glm5_core.rl import starting_policy
from glm5_core.safe_files import read_json

RUN_FILE = "rl_run.json"
RUN_FILE_FORMAT = 1
RL_STATE_FORMAT = 1
MAX_RUN_FILE_BYTES = 4 * 1024 * 1024
MAX_RESUME_STEP = 2 ** 40  # far beyond any run: the step is checked against the config after loading
# config keys a resume may change: budgets, where logs and engines are, evaluation (no effect on training)
RUN_FOLDERS = ("checkpoints", "weights", "tensorboard")  # what a run keeps in its output dir as folders
RESUMABLE_KEYS = ("output_dir", "max_steps", "max_minutes", "torch_threads", "train.max_idle_minutes",
                  "rollout.engine_urls", "rollout.api_key", "checkpoint", "eval")


def plain_config(cfg) -> dict[str, Any]:
    """The config as JSON types, without the engines' bearer token (never written to disk)."""
    plain = json.loads(json.dumps(as_plain(cfg)))
    plain.get("rollout", {}).pop("api_key", None)
    return plain


def _resumable(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RESUMABLE_KEYS)


def first_difference(saved: Any, current: Any, prefix: str = "", defaults: Any = None) -> Optional[str]:
    """The first config key whose value differs (keys in :data:`RESUMABLE_KEYS` aside), as one line. A key the
    earlier run's config lacks (written by a version without it) matches when this config leaves it at its
    default (``defaults``: the default config, as JSON types, or None)."""
    defaults = defaults if isinstance(defaults, dict) else {}
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in list(current) + [k for k in saved if k not in current]:
            name = f"{prefix}{key}"
            if _resumable(name):
                continue
            if key not in saved and key in current and key in defaults and current[key] == defaults[key]:
                continue
            if key not in saved or key not in current:
                return f"{name}: {'not in the earlier run' if key not in saved else 'not in this config'}"
            found = first_difference(saved[key], current[key], name + ".", defaults.get(key))
            if found:
                return found
        return None
    if saved != current:
        return f"{prefix.rstrip('.')}: the earlier run had {json.dumps(saved)[:80]}, this config has " \
               f"{json.dumps(current)[:80]}"
    return None


def _is_dead_run_file_write(out_dir: str, name: str) -> bool:
    """``rl_run.json.tmp-<pid>`` left by a writer that no longer runs (killed before its rename): debris, not a run."""
    prefix = f"{RUN_FILE}.tmp-"
    pid = name[len(prefix):]
    if not name.startswith(prefix) or not pid.isdigit() or len(pid) > 9 or \
            not os.path.isfile(os.path.join(out_dir, name)):
        return False
    try:
        os.kill(int(pid), 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except OSError:  # it exists (another user's)
        return False
    return False  # it exists: a run writing it now


def check_output_dir(out_dir: str, resume: bool) -> None:
    """A fresh run needs a new or empty folder; a resume needs a folder holding an RL run (``rl_run.json``).
    A run file whose writer was killed before its rename is removed: the run it began never started."""
    entries = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    for name in [e for e in entries if _is_dead_run_file_write(out_dir, e)]:
        os.remove(os.path.join(out_dir, name))
        entries.remove(name)
    if resume and RUN_FILE not in entries:
        raise ValueError(f"--resume: {out_dir!r} holds no RL run (no {RUN_FILE}); expected the output dir of an "
                         f"earlier glm5 rl run")
    for name in RUN_FOLDERS if resume else ():  # the run reads and writes them as folders
        path = os.path.join(out_dir, name)
        if os.path.lexists(path) and not os.path.isdir(path):
            raise ValueError(f"--resume: {path!r} is not a folder (expected the {name} folder glm5 rl writes, "
                             f"or nothing)")
    if not resume and entries:
        kind = "an earlier RL run" if RUN_FILE in entries else f"{len(entries)} entries ({', '.join(entries[:3])})"
        raise ValueError(f"output_dir: {out_dir!r} already holds {kind}; continue it with --resume {out_dir}, or "
                         f"pick a new or empty folder")


def write_run_file(out_dir: str, cfg, policy_checkpoint: Optional[str], policy: Optional[dict] = None) -> None:
    """``policy``: what a resume rebuilds the policy from (``starting_policy.describe``)."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, RUN_FILE)
    tmp = f"{path}.tmp-{os.getpid()}"
    body = {"format": RUN_FILE_FORMAT, "config": plain_config(cfg), "checkpoint": _abs(policy_checkpoint)}
    if policy is not None:
        body["policy"] = policy
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(body, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _abs(path: Optional[str]) -> Optional[str]:
    return None if path is None else os.path.abspath(path)


def read_run_file(out_dir: str) -> dict[str, Any]:
    """``rl_run.json`` of the run in ``out_dir``, its top-level types checked (ValueError, one line)."""
    path = os.path.join(out_dir, RUN_FILE)
    saved = read_json(path, root=out_dir, max_bytes=MAX_RUN_FILE_BYTES)
    if not isinstance(saved, dict) or saved.get("format") != RUN_FILE_FORMAT or not isinstance(
            saved.get("config"), dict) or not isinstance(saved.get("checkpoint"), (str, type(None))):
        raise ValueError(f"--resume: {path}: expected format {RUN_FILE_FORMAT} with a config and a checkpoint "
                         f"(as glm5 rl writes it), got {str(saved)[:80]}")
    return saved


def check_same_run(out_dir: str, cfg, policy_checkpoint: Optional[str]) -> Optional[str]:
    """Refuse (ValueError, one line) a resume whose config or ``--checkpoint`` differs from the earlier run's;
    returns the ``--checkpoint`` the run started from (used when this resume names none)."""
    saved = read_run_file(out_dir)
    difference = first_difference(saved["config"], plain_config(cfg), defaults=plain_config(type(cfg)()))
    if difference:
        raise ValueError(f"--resume: {out_dir!r} holds a run of another config ({difference}); resume with the "
                         f"earlier run's config, or start this one in a new folder")
    started_from = saved["checkpoint"]
    if policy_checkpoint is not None and _abs(policy_checkpoint) != started_from:
        raise ValueError(f"--checkpoint: the run in {out_dir!r} started from {started_from!r}, got "
                         f"{_abs(policy_checkpoint)!r}; drop --checkpoint to resume (the weights are in the run)")
    return started_from


def _counter(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key}: expected an int >= 0, got {value!r:.60}")
    return value


def _section(state: dict, key: str) -> dict:
    value = state.get(key)
    if not isinstance(value, dict):
        raise ValueError(f"{key}: expected an object, got {type(value).__name__}")
    return value


@dataclasses.dataclass
class RunState:
    """What a resume restores besides weights, optimizer and RNG (``trainer_state.json``'s ``data``)."""

    env: dict[str, Any]
    runner: dict[str, int]
    buffer: dict[str, Any]
    eval_history: list[dict[str, Any]]
    eval_start: Optional[float]

    def to_json(self) -> dict[str, Any]:
        return {"format": RL_STATE_FORMAT, "env": self.env, "runner": self.runner, "buffer": self.buffer,
                "eval": {"history": self.eval_history, "start": self.eval_start}}

    @classmethod
    def from_json(cls, state: Any, where: str) -> RunState:
        """The run state of a checkpoint, its types checked (values a component restores it checks itself)."""
        try:
            if not isinstance(state, dict) or state.get("format") != RL_STATE_FORMAT:
                raise ValueError(f"format: expected {RL_STATE_FORMAT} (an RL run's state), got "
                                 f"{state.get('format') if isinstance(state, dict) else state!r:.60}")
            runner = {k: _counter(v, f"runner.{k}") for k, v in _section(state, "runner").items()}
            evaluation = _section(state, "eval")
            history = evaluation.get("history", [])
            if not isinstance(history, list) or not all(
                    isinstance(e, dict) and not isinstance(e.get("step"), bool) and isinstance(e.get("step"), int)
                    for e in history):
                raise ValueError(f"eval.history: expected a list of objects with an int step, got {history!r:.60}")
            start = evaluation.get("start")
            if start is not None and (isinstance(start, bool) or not isinstance(start, (int, float))):
                raise ValueError(f"eval.start: expected null or a number, got {start!r:.60}")
            return cls(_section(state, "env"), runner, _section(state, "buffer"), history, start)
        except ValueError as exc:
            raise ValueError(f"checkpoint: {where} data.{exc}") from None


def checkpoints_root(out_dir: str) -> Path:
    return Path(out_dir) / "checkpoints"


def _optimizer_parts(trainer):
    """The trainer's AdamW as the one part of a ``HybridOptimizer``, the form the checkpoint code reads/writes."""
    from glm5_core.optim.hybrid import HybridOptimizer

    return HybridOptimizer({"adamw": trainer.optimizer}, [])


def save_resume_point(out_dir: str, trainer, state: RunState, *, keep_last: int, history: list[str]) -> list[str]:
    """Write ``checkpoints/step_<version>`` (atomically, see ``checkpoint_folders``); returns the new history."""
    from glm5_core.rl.device import module_device
    from glm5_core.train import checkpoint as ckpt
    from glm5_core.train import checkpoint_folders as folders

    root = checkpoints_root(out_dir)
    ckpt.save_checkpoint(root, step=trainer.version, model=trainer.model, optimizer=_optimizer_parts(trainer),
                         data_state=state.to_json(), world_size=1, device_type=module_device(trainer.model).type,
                         keep_last=keep_last, history=history)
    return folders.read_history(root)


def resume_point_weights(out_dir: str, log) -> Optional[Path]:
    """The newest resume point's ``model.safetensors`` (what a killed writer left is recovered first); None when
    the run wrote none yet."""
    from glm5_core.train import checkpoint_folders as folders

    root = checkpoints_root(out_dir)
    folders.recover(root, log=log)
    if not os.path.lexists(root / folders.LATEST):
        return None
    return folders.resolve_checkpoint(root, log=log) / "model.safetensors"


def load_resume_point(out_dir: str, trainer, log) -> Optional[tuple[RunState, list[str]]]:
    """Restore weights, optimizer state, RNG and version from the newest resume point of ``out_dir`` (what a
    killed writer left is recovered first); None when the run wrote none yet (it then starts over, which
    repeats it exactly). Returns the run state and the checkpoint history the run continues."""
    from glm5_core.rl.device import module_device
    from glm5_core.train import checkpoint as ckpt
    from glm5_core.train import checkpoint_folders as folders

    root = checkpoints_root(out_dir)
    folders.recover(root, log=log)
    if not os.path.lexists(root / folders.LATEST):
        return None
    folder = folders.resolve_checkpoint(root, log=log)
    loaded = ckpt.load_checkpoint(folder, model=trainer.model, optimizer=_optimizer_parts(trainer),
                                  total_steps=MAX_RESUME_STEP, world_size=1,
                                  device_type=module_device(trainer.model).type)
    trainer.step_count = loaded["step"]
    return RunState.from_json(loaded["data"], str(folder / "trainer_state.json")), folders.lineage(root, folder)


def start(out_dir: str, cfg, checkpoint: Optional[str], trainer, model, resume: bool,
          log) -> Optional[tuple[RunState, list[str]]]:
    """A fresh run records itself (``rl_run.json``, with what ``starting_policy`` needs of ``model``); a resumed
    one loads its latest resume point into ``trainer``: (its state, the checkpoint history), None if it has none
    yet (the run starts over from step 0, and says so)."""
    if not resume:
        write_run_file(out_dir, cfg, checkpoint, starting_policy.describe(model, checkpoint))
        return None
    resumed = load_resume_point(out_dir, trainer, log)
    if resumed is None:
        log(f"[rl] resume: {out_dir} holds no resume point yet; starting the run over from step 0")
    return resumed
