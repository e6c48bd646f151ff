"""The conformance reports of one backend's run: ``conformance-<backend>.json`` (environment, summary, op coverage,
every result) and ``conformance-<backend>.md`` (the same for reading, one table per family)."""
from __future__ import annotations

import dataclasses
import datetime
import json
import platform as py_platform
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

import torch

from glm5_core import registry
from glm5_core.conformance.check import Result
from glm5_core.conformance.families import family_names


def environment(backend: str) -> dict[str, str]:
    be = registry.get_backend(backend)
    ok, reason = be.available()
    return {
        "backend": backend,
        "status": reason,
        "device": be.device() if ok else be.device_type,
        "torch": torch.__version__,
        "python": py_platform.python_version(),
        "machine": f"{py_platform.system()} {py_platform.machine()}",
        "strict": str(registry.strict_mode()),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_reports(results: list[Result], backend: str, out_dir: Path,
                  extra_environment: Optional[Mapping[str, str]] = None) -> dict[str, Path]:
    """The JSON and Markdown reports; ``extra_environment`` is added to the environment (``simulated``: the run was
    on a simulated device, and what it was)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "error", "fallback", "not_run")}
    coverage = [{"op": r.op, "implementation": r.label, "reason": r.reason} for r in registry.explain(backend)]
    payload = {"environment": {**environment(backend), **(extra_environment or {})}, "summary": counts,
               "coverage": coverage, "results": [dataclasses.asdict(r) for r in results]}
    json_path = out_dir / f"conformance-{backend}.json"
    json_path.write_text(json.dumps(payload, indent=2))
    env = payload["environment"]
    lines = [f"# glm5-core conformance report: `{backend}`", "",
             " | ".join(f"**{k}**: {v}" for k, v in env.items()), "",
             f"**{counts['pass']} passed, {counts['fail'] + counts['error']} failed**, "
             f"{counts['fallback']} ran the reference fallback"
             + (f", {counts['not_run']} could not run here (see their detail)" if counts["not_run"] else "") + ".",
             "", "## Op coverage", "",
             "| op | implementation | why the reference |", "|---|---|---|"]
    lines += [f"| {c['op']} | `{c['implementation']}` | {c['reason']} |" for c in coverage]
    for family in family_names():
        rows = [r for r in results if r.family == family]
        if not rows:
            continue
        lines += ["", f"## {family}", "", "| check | status | max error | allowed | detail |", "|---|---|---|---|---|"]
        for r in rows:
            err = "" if r.max_error is None else f"{r.max_error:.3g}"
            allowed = "" if r.allowed is None else f"{r.allowed:.3g}"
            detail = r.detail.splitlines()[0].replace("|", "\\|") if r.detail else ""
            lines.append(f"| `{r.check}` | {r.status} | {err} | {allowed} | {detail} |")
    md_path = out_dir / f"conformance-{backend}.md"
    md_path.write_text("\n".join(lines) + "\n")
    return {"json": json_path, "markdown": md_path}

