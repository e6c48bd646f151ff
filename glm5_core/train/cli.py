"""``glm5 pretrain``: train a GLM-5-style model from a YAML config.

    glm5 pretrain --config configs/tiny.yaml [--backend cpu] [--output-dir runs/x] [--resume [PATH]] [--max-steps N]
    glm5 pretrain --config configs/tiny.yaml --set data.batch_size=16 --set 'stages[0].steps=50' --check-config
    torchrun --nproc_per_node=2 -m glm5_core.cli pretrain --config configs/tiny.yaml --output-dir runs/tiny_ddp
    torchrun --nproc_per_node=2 -m glm5_core.cli pretrain --config configs/tiny.yaml --parallel fsdp2 \
        --output-dir runs/tiny_fsdp2      # DDP above (one process per device), sharded here

A fresh run refuses an output dir that is not empty (one line, exit 2), as ``glm5 rl`` does: continue the run there
with --resume, or pick a new or empty folder (--output-dir).
"""
from __future__ import annotations

import argparse
import os
import sys

import yaml

from glm5_core.cli import add_backend_argument, add_config_arguments
from glm5_core.train.config import PARALLEL_STRATEGIES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, set_example="data.batch_size=16", example="configs/tiny.yaml")
    add_backend_argument(parser)
    parser.add_argument("--output-dir", default=None, help="where metrics, plots and checkpoints go "
                        "(default: the config's output_dir)")
    parser.add_argument("--resume", nargs="?", const="", default=None, metavar="PATH",
                        help="continue from a checkpoint folder, a checkpoints root or a run folder "
                             "(no PATH: the output dir's latest checkpoint)")
    parser.add_argument("--parallel", type=parse_parallel, default=None, metavar="{ddp,fsdp2,ep=N}",
                        help="data parallelism under torchrun: ddp (replicated) or fsdp2 (sharded parameters, "
                             "gradients and optimizer state); ep=N: expert parallelism over N ranks with FSDP2 "
                             "(parallel.ep = N, parallel.strategy = fsdp2); overrides the config's parallel section")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="stop after this many steps of the schedule (a checkpoint is written there)")


def parse_parallel(text: str) -> dict[str, object]:
    """``--parallel``: ``ddp``, ``fsdp2`` or ``ep=N`` -> the parallel.* keys it sets."""
    if text in PARALLEL_STRATEGIES:
        return {"parallel.strategy": text}
    if text.startswith("ep="):
        value = text[3:]
        if value.isdigit() and int(value) >= 1:
            return {"parallel.strategy": "fsdp2", "parallel.ep": int(value)}
    raise argparse.ArgumentTypeError(f"expected one of {', '.join(PARALLEL_STRATEGIES)} or ep=N (N >= 1), "
                                     f"got {text!r}")


def check_fresh_output_dir(output_dir: str) -> None:
    """A run without --resume needs a new or empty folder: it would overwrite ``final/``, ``summary.json`` and
    ``metrics.jsonl`` of the run there. Checked by the writing rank (global rank 0) before any rank starts."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    entries = sorted(os.listdir(output_dir)) if os.path.isdir(output_dir) else []
    if entries:
        kind = "an earlier run" if "checkpoints" in entries else f"{len(entries)} entries ({', '.join(entries[:3])})"
        raise ValueError(f"output_dir: {output_dir!r} already holds {kind}; continue it with --resume {output_dir}, "
                         f"or pick a new or empty folder")


def run_folder_of(path: str):
    """The run folder a ``--resume PATH`` points into (PATH itself, its ``checkpoints/`` root, or one checkpoint
    in it), or None when PATH is no run's."""
    here = os.path.abspath(path)
    for candidate in (here, os.path.dirname(here), os.path.dirname(os.path.dirname(here))):
        if os.path.isdir(os.path.join(candidate, "checkpoints")):
            return candidate
    return None


def run(args: argparse.Namespace) -> int:
    from glm5_core.config_schema import as_plain
    from glm5_core.train.config_loader import load_config
    from glm5_core.train.trainer import LAST_LOSS_WINDOW, RunOptions, pretrain

    if args.max_steps is not None and args.max_steps < 1:
        raise ValueError(f"--max-steps: expected an int >= 1, got {args.max_steps}")
    flags = {"output_dir": args.output_dir} if args.output_dir is not None else {}
    resumed_run = run_folder_of(args.resume) if args.resume else None
    if resumed_run is not None and args.output_dir is None:  # the run continues in its own folder
        flags["output_dir"] = resumed_run
    flags.update(args.parallel or {})  # applied after --set, and checked with the config
    cfg = load_config(args.config, args.set, flags)
    if args.check_config:
        print(yaml.safe_dump(as_plain(cfg), sort_keys=False), end="")
        return 0
    output_dir = cfg.output_dir
    resume = None if args.resume is None else (args.resume or output_dir)
    if resume is None or (resumed_run is not None and os.path.abspath(output_dir) != resumed_run):
        check_fresh_output_dir(output_dir)  # a resumed run written elsewhere must not overwrite another run
    summary = pretrain(cfg, RunOptions(backend=args.backend, output_dir=output_dir, resume=resume,
                                       max_steps=args.max_steps))
    start, stop = summary["steps"]
    if "hf_checkpoint" not in summary:  # not rank 0: rank 0 writes the results and reports them
        return 0
    if start == stop:  # resumed at the end of the schedule (or at --max-steps): no step ran, no rate to report
        print(f"nothing to train: the checkpoint is at step {start}, where this run stops; results in {output_dir}")
    elif "first_lm_loss" in summary:
        print(f"stages: {', '.join(summary['stages'])}; LM loss {summary['first_lm_loss']:.3f} (step 1) -> "
              f"{summary['last_lm_loss']:.3f} (mean of the last {LAST_LOSS_WINDOW} steps); "
              f"{summary['median_tokens_per_s']:.0f} tokens/s median on {summary['backend']} "
              f"x {summary['world_size']}; {summary['wall_s']:.0f} s; results in {output_dir}"
              + (f"; partial run: steps 1-{summary['partial']['steps_done']} of {summary['partial']['total_steps']}"
                 f" (--resume continues), plotted" if summary.get("partial") else ""))
    if summary.get("metrics_skipped"):
        print(f"pretrain: skipped {', '.join(summary['metrics_skipped'])}: pip install 'glm5-core[metrics]'",
              file=sys.stderr)
    return 0
