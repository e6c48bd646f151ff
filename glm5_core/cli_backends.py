"""``glm5 backends``: every backend, whether it is available (or why not), and what each op resolves to."""
from __future__ import annotations

import argparse
import json
from typing import Optional

from glm5_core import registry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from glm5_core.cli import add_backend_argument

    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of tables")
    add_backend_argument(parser, default=None, help="show only this backend, which must be available "
                                                    "(auto: the one this machine resolves to; default: all)")


def backend_report(names: Optional[list[str]] = None) -> list[dict]:
    """One record per backend (all, or ``names``): availability, devices and the per-op resolution."""
    records = []
    for name, be in registry.backends().items():
        if names is not None and name not in names:
            continue
        ok, reason = be.available()
        record = {
            "backend": name,
            "available": ok,
            "reason": reason,
            "device_type": be.device_type,
            "runtime_device": be.device() if ok else None,
            "dist_backend": be.dist_backend,
            "dtypes": sorted(str(dtype).removeprefix("torch.") for dtype in be.facts.dtypes),
            "ops": {},
        }
        try:
            for res in registry.explain(name, require=False):
                record["ops"][res.op] = {"impl": res.label, "reason": res.reason}
        except Exception as exc:  # a kernel table that cannot even be imported here
            record["ops_error"] = f"kernel table not loadable here: {exc!r}"
        if ok and be.details is not None:
            record["reason"] = f"{reason}; {be.details()}"
        records.append(record)
    return records


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [line.format(*header), line.format(*("-" * w for w in widths))]
    out += [line.format(*map(str, r)) for r in rows]
    return "\n".join(out)


def render(records: list[dict]) -> str:
    summary = [[r["backend"], "yes" if r["available"] else "no", r["device_type"], r["dist_backend"], r["reason"]]
               for r in records]
    parts = [_table(summary, ["backend", "available", "device", "dist", "status / reason"])]
    for r in records:
        where = f"tensors on '{r['runtime_device']}'" if r["available"] else "unavailable here; declared kernels"
        parts.append(f"\n{r['backend']} ({where}): op resolution")
        if "ops_error" in r:
            parts.append(r["ops_error"])
            continue
        rows = [[op, info["impl"], info["reason"]] for op, info in r["ops"].items()]
        parts.append(_table(rows, ["op", "implementation", "why the reference"]))
    return "\n".join(parts)


def run(args: argparse.Namespace) -> int:
    names = None
    if args.backend is not None:  # like every command: an unavailable backend is an error that says why
        names = [registry.require_available(registry.resolve_backend_name(args.backend)).name]
    records = backend_report(names)
    print(json.dumps(records, indent=2) if args.json else render(records))
    return 0
