"""``glm5 conformance``: run a backend's checks (all, or some families) and write the JSON and Markdown reports."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from glm5_core import registry
from glm5_core.conformance.check import check_dtypes
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
    parser.add_argument("--simulate", action="store_true",
                        help="run on the backend's simulated device: its vendor stack's documented surface on this "
                             "host, kernels on CPU tensors (Triton under TRITON_INTERPRET=1); reports say simulated")


def run(args: argparse.Namespace) -> int:
    if args.strict:
        os.environ["GLM5_STRICT"] = "1"
    if getattr(args, "simulate", False):
        if args.backend in (None, "", "auto"):
            raise ValueError("--simulate: expected --backend <name> (a backend with a simulated stack), got auto")
        from glm5_core.backends import simulated

        name = registry.resolve_backend_name(args.backend)
        with simulated.simulate(name) as status:
            print(f"{name}: {status}")
            return _run(args, {"simulated": status})
    return _run(args, {})


def _skipped(check, facts) -> list:
    """The dtypes of ``check`` (its name's dtype tags) that the backend's devices do not compute."""
    return [dtype for dtype in check_dtypes(check) if not facts.supports(dtype)]


def _run(args: argparse.Namespace, extra: dict) -> int:
    backend = registry.require_available(registry.resolve_backend_name(args.backend)).name
    out_dir = Path(args.out)
    try:  # before the checks run, not after
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out: cannot create the report folder {str(out_dir)!r}: {exc.strerror}") from exc
    selected = [c for fam in (args.family or family_names()) for c in checks(fam)]
    facts = registry.get_backend(backend).facts
    skipped = [c for c in selected if _skipped(c, facts)]
    if skipped:
        lacking = sorted({str(d).removeprefix("torch.") for c in skipped for d in _skipped(c, facts)})
        print(f"{backend}: {len(skipped)} checks skipped: its devices compute no {', '.join(lacking)}")
        selected = [c for c in selected if c not in skipped]
    results = []
    try:
        from tqdm import tqdm

        progress = tqdm(selected, desc=f"conformance[{backend}]", unit="check", leave=False, disable=None)
    except ImportError:
        progress = selected
    for check in progress:
        results.append(run_check(check, backend))
    paths = write_reports(results, backend, out_dir, extra_environment=extra)
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

