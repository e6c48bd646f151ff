"""In-process A/B of ``PretrainTrainer.train_step`` for one stage of a pretraining config: this tree ("new") against the
functions of a base tree ("old"), interleaved step by step in one process (a loaded machine drifts between runs).

"old" runs the base tree's code of the functions named by ``--swap`` (their code objects are swapped in before
each old step; their signatures and globals must match) and drops the forward keywords named by ``--drop-kwarg``
(arguments the base model does not take). Two trainers with the same seed train side by side, so each step's
metrics must agree; the script says whether they did. Process time, one thread, medians.

    git archive BASE | tar -x -C /tmp/base
    python benchmarks/stage_step_ab.py sparse --base-tree /tmp/base --steps 40 \\
        --swap glm5_core.ops._checks:finite --swap glm5_core.model.indexer_loss:_kl

``--base-extension``: "old" steps also run the base tree's native CPU extension (its csrc built beside this tree's
under another op namespace, ``benchmarks/_base_extension.py``), for A/Bs of a C++ change.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

WARMUP_STEPS = 3  # per variant, not timed
METRICS = ("stage", "loss", "lm_loss", "mtp_loss", "indexer_kl", "topk_recall", "grad_norm")


def _unwrapped(fn):
    return getattr(fn, "__wrapped__", fn)  # torch.no_grad() and friends wrap with functools.wraps


def _base_function(base_tree: Path, spec: str):
    module_name, name = spec.split(":")
    path = base_tree / (module_name.replace(".", "/") + ".py")
    loader_spec = importlib.util.spec_from_file_location(f"_base_{module_name}", path)
    module = importlib.util.module_from_spec(loader_spec)
    loader_spec.loader.exec_module(module)
    return _unwrapped(getattr(importlib.import_module(module_name), name)), _unwrapped(getattr(module, name))


def _stage_steps(stages, kind: str):
    """(first global step, step count) of the config's first stage of ``kind``; None if it has none."""
    first = 0
    for stage in stages:
        if stage.kind == kind:
            return first, stage.steps
        first += stage.steps
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=("dense", "indexer_warmup", "sparse"))
    parser.add_argument("--base-tree", type=Path, required=True)
    parser.add_argument("--swap", action="append", default=[], metavar="MODULE:FUNCTION")
    parser.add_argument("--base-extension", action="store_true",
                        help="old steps run the base tree's native CPU extension (built beside this tree's)")
    parser.add_argument("--drop-kwarg", action="append", default=[], metavar="NAME")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps: expected >= 1, got {args.steps}")
    if not (args.base_tree / "glm5_core").is_dir():
        parser.error(f"--base-tree: expected a source tree holding glm5_core/, got {args.base_tree}")
    if args.base_extension and not any((args.base_tree / "glm5_core/backends/cpu/csrc").glob("cpu_*.cpp")):
        parser.error(f"--base-extension: expected {args.base_tree}/glm5_core/backends/cpu/csrc/cpu_*.cpp, got none")
    for spec in args.swap:
        module_name, _, name = spec.partition(":")
        if not name or not (args.base_tree / (module_name.replace(".", "/") + ".py")).is_file():
            parser.error(f"--swap: expected MODULE:FUNCTION of a module in the base tree, got {spec!r}")

    import torch

    from glm5_core.train.config_loader import load_config
    from glm5_core.train.trainer import PretrainTrainer, RunOptions

    if args.base_extension:
        import _base_extension  # benchmarks/, the script's folder

        _base_extension.build(args.base_tree)

    def kernels(variant: str):
        return _base_extension.kernels(variant) if args.base_extension else contextlib.nullcontext()

    swaps = [_base_function(args.base_tree, spec) for spec in args.swap]  # (this tree's function, base's)
    new_code = [fn.__code__ for fn, _ in swaps]

    def use(variant: str) -> None:
        for (fn, base), code in zip(swaps, new_code):
            fn.__code__ = base.__code__ if variant == "old" else code

    cfg = load_config(args.config)
    span = _stage_steps(cfg.stages, args.stage)
    if span is None:
        parser.error(f"stage: {args.config} has no {args.stage} stage")
    start, length = span
    if WARMUP_STEPS + args.steps > length:
        parser.error(f"--steps: expected <= {length - WARMUP_STEPS} ({args.stage} has {length} steps in "
                     f"{args.config}, {WARMUP_STEPS} of them warm-up), got {args.steps}")
    torch.set_num_threads(1)
    trainers = {v: PretrainTrainer(cfg, RunOptions(output_dir=f"/tmp/stage_step_ab_{v}")) for v in ("old", "new")}
    own_kwargs = trainers["old"]._forward_kwargs

    def base_kwargs(stage, step):
        return {k: v for k, v in own_kwargs(stage, step).items() if k not in args.drop_kwarg}

    trainers["old"]._forward_kwargs = base_kwargs
    times = {"old": [], "new": []}
    records = {"old": [], "new": []}
    try:
        for i, step in enumerate(range(start, start + WARMUP_STEPS + args.steps)):
            for v in (("old", "new") if i % 2 == 0 else ("new", "old")):
                use(v)
                t0 = time.process_time()
                with kernels(v):
                    record = trainers[v].train_step(step)
                if i >= WARMUP_STEPS:
                    times[v].append(time.process_time() - t0)
                records[v].append({k: record.get(k) for k in METRICS})
    finally:
        use("new")  # this tree's code back, whatever happened
    old, new = (statistics.median(times[v]) * 1e3 for v in ("old", "new"))
    result = {"stage": args.stage, "first_step": start, "steps": args.steps, "old_ms": round(old, 1),
              "new_ms": round(new, 1), "ratio": round(new / old, 3),
              "median_step_pair_ratio": round(statistics.median(b / a for a, b in zip(times["old"], times["new"])), 3),
              "metrics_identical": records["old"] == records["new"],
              "stage_labels": sorted({r["stage"] for r in records["new"]}), "swapped": args.swap,
              "base_extension": args.base_extension,
              "dropped_kwargs": args.drop_kwarg}
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
