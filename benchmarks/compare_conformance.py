"""Compare two ``glm5 conformance`` JSON reports check by check: the same checks in the same order, each with
the same family, ops, status, max error, allowance and detail (the run's time and environment are ignored); the
summary and the op coverage equal too. For changes that must not touch what conformance reports.

    python benchmarks/compare_conformance.py BEFORE AFTER   # reports or their folders; exit 1 on a difference
"""
import json
import sys
from pathlib import Path

COMPARED = ("family", "ops", "status", "max_error", "allowed", "detail")


def load(path: str) -> dict:
    """The report at ``path``: a ``conformance-<backend>.json`` or the folder holding exactly one."""
    p = Path(path)
    if p.is_dir():
        found = sorted(p.glob("conformance-*.json"))
        if len(found) != 1:
            raise ValueError(f"{path}: expected one conformance-<backend>.json in the folder, got {len(found)}")
        p = found[0]
    return json.loads(p.read_text(encoding="utf-8"))


def differences(before: dict, after: dict) -> list[str]:
    """One line per difference between the two reports (empty: they report the same)."""
    out = []
    names = [[r["check"] for r in report["results"]] for report in (before, after)]
    if names[0] != names[1]:
        only = [sorted(set(names[0]) - set(names[1])), sorted(set(names[1]) - set(names[0]))]
        out.append(f"checks differ: {len(names[0])} vs {len(names[1])}; only before: {only[0][:5]}; "
                   f"only after: {only[1][:5]}" + ("" if any(only) else " (same checks, another order)"))
    after_by_name = {r["check"]: r for r in after["results"]}
    for a in before["results"]:
        b = after_by_name.get(a["check"])
        if b is None:
            continue
        for key in COMPARED:
            if a.get(key) != b.get(key):
                out.append(f"{a['check']}: {key}: {a.get(key)!r} -> {b.get(key)!r}")
    for key in ("summary", "coverage"):
        if before.get(key) != after.get(key):
            out.append(f"{key}: {before.get(key)!r} -> {after.get(key)!r}")
    return out


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: compare_conformance.py BEFORE AFTER (reports or their folders)", file=sys.stderr)
        return 2
    before, after = (load(path) for path in args)
    diffs = differences(before, after)
    for line in diffs:
        print(line)
    n = len(before["results"])
    print(f"{n} checks: " + (f"{len(diffs)} differences" if diffs else
                             f"status, max error, allowance and detail equal for every check ({before['summary']})"))
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
