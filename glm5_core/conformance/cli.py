"""``glm5 conformance``: run a backend's checks (all, or some families) and write the JSON and Markdown reports."""
from __future__ import annotations

import argparse
import os
import sys
import time
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
    parser.add_argument("--no-reuse", action="store_true",
                        help="with --simulate: run every check, reusing no result another backend's simulated run "
                             "computed under an identical key (check, kernels, launch configurations, dtype set, "
                             "host, sources; glm5_core.conformance.reuse)")


def family_line(backend: str, family: str, results: list, seconds: float, reused: int = 0) -> str:
    """One family's outcome, the progress line printed when it finishes."""
    counts = {status: sum(r.status == status for r in results)
              for status in ("pass", "fail", "error", "fallback", "not_run")}
    text = (f"conformance[{backend}] {family}: {len(results)} checks, {counts['pass']} passed, "
            f"{counts['fail'] + counts['error']} failed")
    if counts["fallback"]:
        text += f", {counts['fallback']} on the reference fallback"
    if counts["not_run"]:
        text += f", {counts['not_run']} not run here"
    if reused:
        text += f" ({reused} reused from an identical simulated run)"
    return f"{text} ({seconds:.0f} s)"


def run_with_progress(families: list[str], backend: str, stream=None, keep=None, cache=None) -> list:
    """Run the checks of ``families`` on ``backend`` (those ``keep(check)`` accepts, default all); progress on
    ``stream`` (stderr): on a terminal a bar naming the family and check running, and everywhere one line per family
    when it finishes (nothing else in a log). ``cache``: a ``reuse.ResultCache`` whose stored results are taken
    instead of running (and which stores what runs)."""
    stream = sys.stderr if stream is None else stream
    selected = {family: [c for c in checks(family) if keep is None or keep(c)] for family in families}
    bar = None
    if stream.isatty():
        try:
            from tqdm import tqdm

            bar = tqdm(total=sum(map(len, selected.values())), desc=f"conformance[{backend}]", unit="check",
                       leave=False, file=stream, dynamic_ncols=True)
        except ImportError:
            bar = None
    results = []
    for family, family_checks in selected.items():
        started, mine, reused_before = time.perf_counter(), [], cache.reused if cache is not None else 0
        for check in family_checks:
            if bar is not None:
                bar.set_postfix_str(f"{family}: {check.name}", refresh=True)
            result = cache.get(check) if cache is not None else None
            if result is None:
                result = run_check(check, backend)
                if cache is not None:
                    cache.put(check, result)
            mine.append(result)
            if bar is not None:
                bar.update(1)
        results += mine
        line = family_line(backend, family, mine, time.perf_counter() - started,
                           cache.reused - reused_before if cache is not None else 0)
        if bar is not None:
            bar.write(line, file=stream)
        else:
            print(line, file=stream, flush=True)
    if bar is not None:
        bar.close()
    return results


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
    families = list(dict.fromkeys(args.family or family_names()))
    facts = registry.get_backend(backend).facts
    skipped = [c for fam in families for c in checks(fam) if _skipped(c, facts)]
    if skipped:
        lacking = sorted({str(d).removeprefix("torch.") for c in skipped for d in _skipped(c, facts)})
        print(f"{backend}: {len(skipped)} checks skipped: its devices compute no {', '.join(lacking)}")
    cache = None
    if extra.get("simulated") and not getattr(args, "no_reuse", False):
        from glm5_core.conformance.reuse import ResultCache

        cache = ResultCache(backend)
    results = run_with_progress(families, backend, keep=lambda check: not _skipped(check, facts), cache=cache)
    if cache is not None:
        extra = {**extra, "reused": f"{cache.reused} results reused from identical simulated runs ({cache.folder})"}
    paths = write_reports(results, backend, out_dir, extra_environment=extra)
    bad = [r for r in results if r.status in ("fail", "error")]
    n_fallback = sum(r.status == "fallback" for r in results)
    n_pass = sum(r.status == "pass" for r in results)
    print(f"{backend}: {n_pass} passed, {len(bad)} failed, {n_fallback} passed on the reference fallback"
          + (f" ({cache.reused} reused from an identical simulated run, cache {cache.folder})" if cache else ""))
    for r in bad[:20]:
        print(f"  FAIL {r.check}: {r.detail.splitlines()[0] if r.detail else ''}")
    if registry.strict_mode():
        missing = sorted({op for r in bad for op in r.ops if "GLM5_STRICT" in r.detail})
        if missing:
            print(f"GLM5_STRICT=1: {backend} lacks {', '.join(missing)}")
    print(f"reports: {paths['json']}  {paths['markdown']}")
    return 1 if bad else 0

