"""``glm5 backends``: every backend, whether it is available (or why not), and what each op resolves to.

The default view fits 120 columns: the status table (reasons wrapped), one matrix of ops by backends (a letter
per cell, the backend columns split into blocks where they would not fit), and one line per backend whose kernel
table cannot load here with the install command. ``--verbose``: each op's implementation and why the reference
runs, per backend. Everything is driven by the registry's backend list: no vendor is named here.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import textwrap
from typing import Optional

from glm5_core import registry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from glm5_core.cli import add_backend_argument

    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of tables")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="per backend, each op's implementation and why the reference runs (wide tables)")
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
            hint = install_hint(name, exc)
            if hint:
                record["install_hint"] = hint
        if ok and be.details is not None:
            record["reason"] = f"{reason}; {be.details()}"
        records.append(record)
    return records


def _extras() -> tuple[str, ...]:
    """The extras of the installed glm5-core distribution (none when it runs from a source tree only)."""
    try:
        return tuple(importlib.metadata.metadata("glm5-core").get_all("Provides-Extra") or ())
    except importlib.metadata.PackageNotFoundError:
        return ()


def install_hint(backend: str, exc: BaseException) -> str:
    """What installs the module a backend's kernel table failed to import: the backend's extra when the
    distribution declares one of its name, else the module itself; "" for another error."""
    missing = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
    if not missing:
        return ""
    root = missing.split(".")[0]
    if backend in _extras():
        return f"the {root} module is missing: pip install 'glm5-core[{backend}]'"
    return f"the {root} module is missing: install it (pip install {root})"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [line.format(*header), line.format(*("-" * w for w in widths))]
    out += [line.format(*map(str, r)) for r in rows]
    return "\n".join(out)


WIDTH = 120
CELLS = {"kernel": "K", "parts": "P", "reference": "r", "unknown": "?"}


def _cell(info: dict) -> str:
    if info["impl"] == "reference":
        return CELLS["reference"]
    return CELLS["parts"] if "composite" in info["impl"] else CELLS["kernel"]


def _wrapped_table(rows: list[list[str]], header: list[str], width: int = WIDTH) -> str:
    """``_table`` with its last column wrapped so every line fits ``width``."""
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header) - 1)]
    indent = sum(widths) + 2 * len(widths)
    room = max(20, width - indent)
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [(line.format(*header[:-1]) + "  " + header[-1]).rstrip(),
           (line.format(*("-" * w for w in widths)) + "  " + "-" * min(room, len(header[-1]) + 8))]
    for r in rows:
        pieces = textwrap.wrap(str(r[-1]), room, break_long_words=True, break_on_hyphens=False) or [""]
        out.append((line.format(*map(str, r[:-1])) + "  " + pieces[0]).rstrip())
        out += [" " * indent + piece for piece in pieces[1:]]
    return "\n".join(out)


def render_compact(records: list[dict], width: int = WIDTH) -> str:
    """The default view (see the module docstring); every line fits ``width``."""
    summary = [[r["backend"], "yes" if r["available"] else "no", r["device_type"], r["dist_backend"], r["reason"]]
               for r in records]
    parts = [_wrapped_table(summary, ["backend", "available", "device", "dist", "status / reason"], width)]
    ops = list(dict.fromkeys(op for r in records for op in r["ops"]))
    op_width = max([len(op) for op in ops] + [2])
    legend = (f"op resolution: {CELLS['kernel']} the backend's kernel, {CELLS['parts']} its kernels for the parts, "
              f"{CELLS['reference']} the reference, {CELLS['unknown']} kernel table not loadable here "
              f"(an unavailable backend: what it declares)")
    parts.append("\n" + "\n".join(textwrap.wrap(legend, width)))
    block: list[dict] = []
    blocks = [block]
    used = op_width
    for r in records:  # backend columns, in blocks that fit the width
        need = 2 + max(len(r["backend"]), 1)
        if block and used + need > width:
            block, used = [], op_width
            blocks.append(block)
        block.append(r)
        used += need
    for group in blocks:
        header = "op".ljust(op_width) + "".join("  " + r["backend"] for r in group)
        lines = [header, "-" * len(header)]
        for op in ops:
            cells = "".join("  " + (_cell(r["ops"][op]) if op in r["ops"] else CELLS["unknown"])
                            .ljust(len(r["backend"])) for r in group)
            lines.append((op.ljust(op_width) + cells).rstrip())
        parts.append("\n".join(lines))
    notes = []
    for r in records:
        if "ops_error" in r:
            text = f"{r['backend']}: {r['ops_error']}" + (f"; {r['install_hint']}" if r.get("install_hint") else "")
            notes += textwrap.wrap(text, width, subsequent_indent="  ", break_long_words=True)
    notes.append("each op's implementation and why the reference runs: glm5 backends --verbose")
    parts.append("\n" + "\n".join(notes))
    return "\n".join(parts)


def render(records: list[dict]) -> str:
    """The ``--verbose`` view: per backend, each op's implementation and why the reference runs."""
    summary = [[r["backend"], "yes" if r["available"] else "no", r["device_type"], r["dist_backend"], r["reason"]]
               for r in records]
    parts = [_table(summary, ["backend", "available", "device", "dist", "status / reason"])]
    for r in records:
        where = f"tensors on '{r['runtime_device']}'" if r["available"] else "unavailable here; declared kernels"
        parts.append(f"\n{r['backend']} ({where}): op resolution")
        if "ops_error" in r:
            parts.append(r["ops_error"] + (f"; {r['install_hint']}" if r.get("install_hint") else ""))
            continue
        rows = [[op, info["impl"], info["reason"]] for op, info in r["ops"].items()]
        parts.append(_table(rows, ["op", "implementation", "why the reference"]))
    return "\n".join(parts)


def run(args: argparse.Namespace) -> int:
    names = None
    if args.backend is not None:  # like every command: an unavailable backend is an error that says why
        names = [registry.require_available(registry.resolve_backend_name(args.backend)).name]
    records = backend_report(names)
    if args.json:
        print(json.dumps(records, indent=2))
    else:
        print(render(records) if args.verbose else render_compact(records))
    return 0
