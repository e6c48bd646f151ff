"""``glm5 rl``: asynchronous (or synchronous) RL from a pretraining checkpoint."""
from __future__ import annotations

import argparse
import json
import sys

from glm5_core.cli import add_backend_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML run config (e.g. configs/rl_tiny.yaml)")
    parser.add_argument("--checkpoint", default=None,
                        help="pretraining checkpoint directory (save_pretrained); default: random init of model.preset")
    parser.add_argument("--mode", choices=("sync", "async"), default=None, help="override the config's mode")
    parser.add_argument("--executor", choices=("local", "ray"), default=None,
                        help="where engine workers run (ray needs the [rl] extra)")
    parser.add_argument("--output-dir", default=None, help="override the config's output_dir")
    parser.add_argument("--max-minutes", type=float, default=None, help="override the wall-clock budget")
    parser.add_argument("--max-steps", type=int, default=None, help="override the number of trainer steps")
    parser.add_argument("--engine-url", action="append", default=None, metavar="URL",
                        help="an engine glm5 rl does not start (SGLang server or glm5 serve), http://HOST:PORT; "
                             "repeat for several (sets rollout.engine_urls)")
    parser.add_argument("--api-key", default=None, help="bearer token of the engines (sets rollout.api_key)")
    add_backend_argument(parser)


def run(args: argparse.Namespace) -> int:
    from glm5_core.registry import require_available, resolve_backend_name
    from glm5_core.rl.config import load_config
    from glm5_core.rl.driver import RLRun

    overrides = {k: v for k, v in (("mode", args.mode), ("executor", args.executor), ("output_dir", args.output_dir),
                                   ("max_minutes", args.max_minutes), ("max_steps", args.max_steps)) if v is not None}
    rollout = {k: v for k, v in (("engine_urls", args.engine_url), ("api_key", args.api_key)) if v is not None}
    cfg = load_config(args.config, overrides, rollout_overrides=rollout)
    backend = resolve_backend_name(args.backend)
    require_available(backend)
    from glm5_core.rl.driver import TrainerStarvedError

    try:
        summary = RLRun(cfg, checkpoint=args.checkpoint, backend=backend).run()
    except TrainerStarvedError as exc:
        print(f"glm5 rl: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    if summary.get("metrics_skipped"):
        print(f"rl: skipped {', '.join(summary['metrics_skipped'])}: pip install 'glm5-core[metrics]'", file=sys.stderr)
    return 0
