"""``glm5 rl``: asynchronous (or synchronous) RL from a pretraining checkpoint.

    glm5 rl --config configs/rl_tiny.yaml --checkpoint runs/tiny/final [--set rollout.max_batch=32] [--check-config]
    glm5 rl --config configs/rl_tiny.yaml --resume runs/rl_tiny       # continue a stopped run in its folder

A fresh run refuses an output dir that is not empty (one line, exit 2): continue the run there with --resume.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import yaml

from glm5_core.cli import add_backend_argument, add_config_arguments
from glm5_core.train.cli import parse_parallel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, set_example="rollout.max_batch=32", example="configs/rl_tiny.yaml")
    parser.add_argument("--checkpoint", default=None,
                        help="pretraining checkpoint directory (save_pretrained); default: random init of model.preset")
    parser.add_argument("--mode", choices=("sync", "async"), default=None, help="override the config's mode")
    parser.add_argument("--executor", choices=("local", "ray"), default=None,
                        help="where engine workers run (ray needs the [rl] extra)")
    parser.add_argument("--output-dir", default=None, help="override the config's output_dir")
    parser.add_argument("--resume", default=None, metavar="DIR",
                        help="continue the run in DIR (its output dir) from its newest resume point, with the "
                             "same config (budgets, evaluation and engine URLs may change)")
    parser.add_argument("--max-minutes", type=float, default=None, help="override the wall-clock budget")
    parser.add_argument("--max-steps", type=int, default=None, help="override the number of trainer steps")
    parser.add_argument("--engine-url", action="append", default=None, metavar="URL",
                        help="an engine glm5 rl does not start (SGLang server or glm5 serve), http://HOST:PORT; "
                             "repeat for several (sets rollout.engine_urls)")
    parser.add_argument("--api-key", default=None, help="bearer token of the engines (sets rollout.api_key)")
    parser.add_argument("--parallel", type=parse_parallel, default=None, metavar="{ddp,fsdp2,ep=N}",
                        help="the policy trainer's layout, as glm5 pretrain's: ep=N sets parallel.ep = N and "
                             "parallel.strategy = fsdp2 (see docs/expert-parallel.md); overrides the config's "
                             "parallel section")
    add_backend_argument(parser)


def _checked_config(args: argparse.Namespace):
    """The config with --set and the override flags, checked against the architecture the run will train
    (``--checkpoint``'s config.json when it has one) before anything is built."""
    from glm5_core.config_schema import ConfigError
    from glm5_core.rl.config_loader import load_config, size_problems

    if args.resume is not None and args.output_dir is not None and \
            os.path.abspath(args.output_dir) != os.path.abspath(args.resume):
        raise ValueError(f"--output-dir: a resumed run continues in its own folder (--resume {args.resume}), "
                         f"got {args.output_dir}")
    output_dir = args.resume if args.resume is not None else args.output_dir
    flags = {k: v for k, v in (("mode", args.mode), ("executor", args.executor), ("output_dir", output_dir),
                               ("max_minutes", args.max_minutes), ("max_steps", args.max_steps)) if v is not None}
    sets = list(args.set or [])  # --engine-url / --api-key are --set of their keys (JSON is YAML)
    if args.engine_url is not None:
        sets.append(f"rollout.engine_urls={json.dumps(args.engine_url)}")
    if args.api_key is not None:
        sets.append(f"rollout.api_key={json.dumps(args.api_key)}")
    flags.update(args.parallel or {})  # applied after --set, and checked with the config
    cfg = load_config(args.config, sets, flags)
    if args.checkpoint and os.path.isfile(os.path.join(args.checkpoint, "config.json")):
        from glm5_core.model.checkpoint import load_hf_config

        problems = size_problems(cfg, load_hf_config(args.checkpoint))
        if problems:
            raise ConfigError(problems, f"{args.config} with --checkpoint {args.checkpoint}")
    return cfg


def run(args: argparse.Namespace) -> int:
    cfg = _checked_config(args)
    if args.check_config:
        from glm5_core.config_schema import as_plain

        print(yaml.safe_dump(as_plain(cfg), sort_keys=False), end="")
        return 0
    from glm5_core.registry import require_available, resolve_backend_name

    backend = resolve_backend_name(args.backend)
    require_available(backend)
    from glm5_core.rl.policy import parallel_world, torchrun_problem

    if parallel_world()[1] > 1:  # torchrun: every rank refuses alike, before any joins the process group
        problem = torchrun_problem(cfg, args.resume is not None)
        if problem:
            raise ValueError(problem)
        from glm5_core.rl.run_state import check_output_dir

        check_output_dir(cfg.output_dir, False)  # rank 0's driver checks it again; a refusal here is every rank's
        return _run_ranks(cfg, args, backend)
    return _run_driver(cfg, args, backend)


def _run_ranks(cfg, args: argparse.Namespace, backend: str) -> int:
    """``glm5 rl`` under torchrun: rank 0 runs the driver, the others their share of each training step
    (``driver.follow_training``) until rank 0 releases them, whatever way its run ended."""
    from glm5_core.registry import get_backend
    from glm5_core.rl.algorithm.trainer import release_followers
    from glm5_core.rl.driver import follow_training
    from glm5_core.train import distributed as dist_utils

    ctx = dist_utils.init_distributed(get_backend(backend))
    ended = False
    try:
        if ctx.rank != 0:
            follow_training(cfg, args.checkpoint, backend)
            code = 0
        else:
            try:
                code = _run_driver(cfg, args, backend)
            finally:
                release_followers()
        ended = True
        return code
    finally:
        if ended:
            dist_utils.shutdown(ctx)
        else:
            dist_utils.abandon()


def _run_driver(cfg, args: argparse.Namespace, backend: str) -> int:
    from glm5_core.rl.driver import FleetUnreachableError, RLRun, TrainerStarvedError
    from glm5_core.rl.fleet.weight_sync import WeightPushError
    from glm5_core.rl.rollout.envs.openai_agent import AgentError
    from glm5_core.rl.rollout.rewards import RewardError

    try:
        summary = RLRun(cfg, checkpoint=args.checkpoint, backend=backend, resume=args.resume is not None).run()
    except (TrainerStarvedError, FleetUnreachableError, RewardError, AgentError, WeightPushError) as exc:
        print(f"glm5 rl: error: {exc}", file=sys.stderr)
        return 1
    print(summary_line(summary, cfg.output_dir))
    if summary.get("metrics_skipped"):
        print(f"rl: skipped {', '.join(summary['metrics_skipped'])}: pip install 'glm5-core[metrics]'", file=sys.stderr)
    return 0


FAILURE_COUNTS = ("env_failures", "rollout_failures", "reward_failures", "failed_requests", "failed_pushes",
                  "failed_restarts", "dropped_stale")


def summary_line(summary: dict, output_dir: str) -> str:
    """The run in one human line (as pretraining ends): steps, the eval reward from start to end, throughput,
    the failures when there were any, where the results are. The whole summary is in ``summary.json``."""
    parts = [f"{summary['steps']} steps ({summary['mode']})"]
    partial = summary.get("partial")
    if isinstance(partial, dict):
        parts[0] += (f", partial run: the max_minutes budget ended it before max_steps {partial.get('max_steps')}"
                     f" (the reward curve plots the steps trained)")
    start, end = summary.get("eval_reward_start"), summary.get("eval_reward_end")
    if end is None:
        parts.append("no evaluation")
    elif start is None:
        parts.append(f"eval reward {end:.3f} (end)")
    else:
        parts.append(f"eval reward {start:.3f} (step 0) -> {end:.3f} (step {summary['steps']})")
    parts.append(f"{summary['trained_tokens_per_s']:.0f} trained tokens/s")
    counts = {name: summary.get(name) for name in FAILURE_COUNTS}
    failures = [f"{name} {count}" for name, count in counts.items() if isinstance(count, int) and count > 0]
    agent = summary.get("agent_failures")
    if isinstance(agent, dict) and any(agent.values()):
        failures.append(f"agent_failures {sum(agent.values())}")
    if summary.get("producer_errors"):
        failures.append(f"producer errors {len(summary['producer_errors'])}")
    if failures:
        parts.append(", ".join(failures))
    parts.append(f"{summary['elapsed_s']:.0f} s; results in {output_dir} (summary.json)")
    return "rl: " + "; ".join(parts)
