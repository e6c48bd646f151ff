"""Golden traces of expert-parallel training (as torchtitan's CI keeps loss traces): 20 steps of the small model
(2 layers, 4 experts, MTP; dense 12, indexer warm-up 3, sparse 5 steps) under ``torchrun`` on gloo, per setting:
EP=2 and EP=1 (no expert sharding) on 2 processes, EP=4 and EP=1 on 4 processes. Each trace holds every step's
loss, LM loss and gradient norm and the final parameter digest, as JSON floats (exact round trip).

Regenerate (about 2 minutes on 2 cores) after a change that moves the numbers on purpose, and say why in the commit:

    PYTHONPATH=$PWD python -m tests.train.ep_golden            # all settings
    PYTHONPATH=$PWD python -m tests.train.ep_golden ep2 ep1_w2  # some

The runs use the reference kernels (``GLM5_SKIP_EXT=1``) and one thread; a trace is bitwise only on the
environment it records (torch version, CPU capability): ``environment_differs`` names what differs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml

from tests.train.small_run import CORPUS, SMALL_MODEL

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "ep_golden"
SETTINGS = {"ep2": (2, 2), "ep1_w2": (2, 1), "ep4": (4, 4), "ep1_w4": (4, 1)}  # name -> (processes, EP size)
STEPS = 20


def config(tmp: Path) -> Path:
    corpus = tmp / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(CORPUS * 3):
        (corpus / f"doc{i:02d}.txt").write_text(text)
    raw = dict(seed=3, torch_threads=1, output_dir=str(tmp / "run"), model=dict(SMALL_MODEL),
               data=dict(source="path", path=str(corpus), seq_len=24, batch_size=4),
               schedule=dict(lr=1e-2, warmup_steps=2),
               stages=[dict(kind="dense", steps=12),
                       dict(kind="indexer_warmup", steps=3, indexer_lr=5e-3, indexer_final_lr=2e-4),
                       dict(kind="sparse", steps=5)],
               loss=dict(mtp_depths=1, mtp_weight=0.3), router=dict(bias_update_rate=1e-2),
               checkpoint=dict(every_steps=0, keep_last=2),
               logging=dict(progress_bar=False, tensorboard=False, plot=False, recall_every_steps=5))
    path = tmp / "ep.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def environment() -> dict:
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def environment_differs(golden: dict) -> str:
    """'' when this machine is the golden's environment, else what differs."""
    here = environment()
    return "; ".join(f"{k}: golden {golden['environment'].get(k)!r}, here {v!r}" for k, v in here.items()
                     if golden["environment"].get(k) != v)


def torchrun_cmd(processes: int) -> list[str]:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [torchrun if os.path.exists(torchrun) else "torchrun", "--standalone", f"--nproc_per_node={processes}"]


def pretrain_args(tmp: Path, ep: int, out: Path, *, max_steps: int | None = None, resume: bool = False,
                  settings: tuple[str, ...] = ()) -> list[str]:
    """``glm5 pretrain``'s arguments (after ``pretrain``) for one run of the golden config."""
    args = ["--config", str(config(tmp)), "--backend", "cpu", "--output-dir", str(out), "--parallel", f"ep={ep}"]
    for setting in settings:
        args += ["--set", setting]
    if max_steps is not None:
        args += ["--max-steps", str(max_steps)]
    if resume:
        args += ["--resume"]
    return args


def run_env() -> dict:
    """The environment of the runs: one thread, the reference kernels, this checkout first on the path."""
    root = str(Path(__file__).resolve().parents[2])
    return dict(os.environ, OMP_NUM_THREADS="1", GLM5_SKIP_EXT="1",
                PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))


def run(tmp: Path, processes: int, ep: int, *, max_steps: int | None = None, resume: bool = False,
        output: Path | None = None, settings: tuple[str, ...] = ()) -> dict:
    """One ``glm5 pretrain --parallel ep=N`` run under torchrun; returns its trace."""
    out = output or tmp / f"run_p{processes}_ep{ep}"
    cmd = torchrun_cmd(processes) + ["-m", "glm5_core.cli", "pretrain"] + \
        pretrain_args(tmp, ep, out, max_steps=max_steps, resume=resume, settings=settings)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=run_env())
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return trace(out)


def trace_records(out: Path) -> dict:
    """The steps logged in ``metrics.jsonl`` (a killed run has no summary)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"steps": [r["step"] for r in records], "loss": [r["loss"] for r in records],
            "lm_loss": [r.get("lm_loss") for r in records], "grad_norm": [r["grad_norm"] for r in records]}


def trace(out: Path) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    return {**trace_records(out), "parameter_digest": summary["parameter_digests"][0],
            "digests_agree": len(set(summary["parameter_digests"])) == 1}


def load(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def main(names: list[str]) -> None:
    import tempfile

    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name in names or list(SETTINGS):
        processes, ep = SETTINGS[name]
        with tempfile.TemporaryDirectory() as tmp:
            got = run(Path(tmp), processes, ep)
        got.update(setting=name, processes=processes, ep=ep, environment=environment(),
                   command=f"PYTHONPATH=$PWD python -m tests.train.ep_golden {name}")
        (FIXTURES / f"{name}.json").write_text(json.dumps(got, indent=1) + "\n")
        print(f"{name}: loss {got['loss'][0]:.6f} -> {got['loss'][-1]:.6f}, digest {got['parameter_digest'][:12]}")


if __name__ == "__main__":
    main(sys.argv[1:])
