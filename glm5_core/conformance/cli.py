"""``glm5 conformance``: run a backend's checks (all, or some families) and write the JSON and Markdown reports."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from glm5_core import registry
from glm5_core.conformance.families import checks, family_names
from glm5_core.conformance.report import write_reports
from glm5_core.conformance.runner import run_check


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from glm5_core.cli import add_backend_argument

    add_backend_argument(parser)
    parser.add_argument("--out", default="conformance-report", help="folder for the JSON and Markdown reports")
    parser.add_argument("--family", choices=family_names(), action="append",
                        help="run only these op families (repeatable; default: all)")
    parser.add_argument("--strict", action="store_true", help="same as GLM5_STRICT=1: every reference fallback fails")


def run(args: argparse.Namespace) -> int:
    if args.strict:
        os.environ["GLM5_STRICT"] = "1"
    backend = registry.require_available(registry.resolve_backend_name(args.backend)).name
    out_dir = Path(args.out)
    try:  # before the checks run, not after
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out: cannot create the report folder {str(out_dir)!r}: {exc.strerror}") from exc
    selected = [c for fam in (args.family or family_names()) for c in checks(fam)]
    results = []
    try:
        from tqdm import tqdm

        progress = tqdm(selected, desc=f"conformance[{backend}]", unit="check", leave=False, disable=None)
    except ImportError:
        progress = selected
    for check in progress:
        results.append(run_check(check, backend))
    paths = write_reports(results, backend, out_dir)
    bad = [r for r in results if r.status in ("fail", "error")]
    n_fallback = sum(r.status == "fallback" for r in results)
    n_pass = sum(r.status == "pass" for r in results)
    print(f"{backend}: {n_pass} passed, {len(bad)} failed, {n_fallback} passed on the reference fallback")
    for r in bad[:20]:
        print(f"  FAIL {r.check}: {r.detail.splitlines()[0] if r.detail else ''}")
    if registry.strict_mode():
        missing = sorted({op for r in bad for op in r.ops if "GLM5_STRICT" in r.detail})
        if missing:
            print(f"GLM5_STRICT=1: {backend} lacks {', '.join(missing)}")
    print(f"reports: {paths['json']}  {paths['markdown']}")
    return 1 if bad else 0

