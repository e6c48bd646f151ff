"""``glm5 pretrain`` under torchrun that stops (sleeps) at a chosen point of a sharded (DCP) checkpoint write, so
that a test can SIGKILL every rank exactly there (``tests/train/test_expert_parallel_training.py``):

    torchrun ... -m tests.train.ep_kill STAGE STEP MARKERS -- <glm5 pretrain arguments>

Every rank writes its PID to ``MARKERS/pid-<rank>`` first (torchrun starts each rank in a session of its own, so
the test kills them by PID). STAGE, reached when the run is about to write checkpoint STEP (each paused rank
writes ``MARKERS/paused-<rank>``):
  training    every rank, before the write starts: the steps since the last checkpoint are trained, not saved
  dcp_write   rank 1 before it writes its shard file, while rank 0 writes its own and waits for rank 1 in DCP's
              collective: a half-written checkpoint (rank 0's shard alone in the temporary folder)
  rename      rank 0, the folder fully written (every shard, rng, trainer_state.json), before it is moved in
  latest      rank 0, the folder moved in (``step_N``), before ``latest`` names it
(the stages of ``checkpoint_folders.publish`` after ``latest`` are the single-process kill test's, the same code.)
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

STAGES = ("training", "dcp_write", "rename", "latest")


def _pause(markers: Path) -> None:
    (markers / f"paused-{os.environ['RANK']}").write_text(str(os.getpid()))
    while True:  # until SIGKILL
        time.sleep(60)


def _install(stage: str, kill_step: int, markers: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from glm5_core.train import checkpoint_folders, dcp_checkpoint

    rank = int(os.environ["RANK"])
    real_save, real_publish, real_write = (dcp_checkpoint.save, checkpoint_folders.publish,
                                           dcp.HuggingFaceStorageWriter.write_data)

    def save(root, *, step: int, **kwargs):
        if step != kill_step:
            return real_save(root, step=step, **kwargs)
        if stage == "training":
            _pause(markers)
        if stage == "dcp_write" and rank == 1:
            def write_data(self, plan, planner):
                _pause(markers)
                return real_write(self, plan, planner)
            dcp.HuggingFaceStorageWriter.write_data = write_data
        if stage in ("rename", "latest") and rank == 0:
            def publish(*args, **kw):
                return real_publish(*args, **kw, on_stage=lambda name: _pause(markers) if name == stage else None)
            checkpoint_folders.publish = publish
        return real_save(root, step=step, **kwargs)

    dcp_checkpoint.save = save


def main(argv: list[str]) -> int:
    stage, kill_step, markers = argv[0], int(argv[1]), Path(argv[2])
    if stage not in STAGES or argv[3] != "--":
        raise SystemExit(f"usage: ep_kill {{{','.join(STAGES)}}} STEP MARKERS -- <glm5 pretrain arguments>")
    (markers / f"pid-{os.environ['RANK']}").write_text(str(os.getpid()))
    _install(stage, kill_step, markers)
    from glm5_core.cli import main as cli

    return cli(["pretrain", *argv[4:]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
