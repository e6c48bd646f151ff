"""Compare two pretraining runs' ``metrics.jsonl``: every non-timing field must be equal (torchtitan's rule for
changes that should not touch numerics).

    python benchmarks/compare_runs.py runs/before/metrics.jsonl runs/after/metrics.jsonl   # exit 1 on a difference
"""
import json
import sys


def _timing(key: str) -> bool:
    return "time" in key or "per_s" in key or key.endswith("_s")


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: compare_runs.py BEFORE.jsonl AFTER.jsonl", file=sys.stderr)
        return 2
    runs = []
    for path in args:
        with open(path, encoding="utf-8") as f:
            runs.append([json.loads(line) for line in f if line.strip()])
    before, after = runs
    if len(before) != len(after):
        print(f"{len(before)} vs {len(after)} records")
        return 1
    differing = 0
    for a, b in zip(before, after):
        for key in sorted(set(a) | set(b)):
            if not _timing(key) and a.get(key) != b.get(key):
                differing += 1
                if differing <= 10:
                    print(f"step {a.get('step')}: {key}: {a.get(key)!r} vs {b.get(key)!r}")
    print(f"{len(before)} records compared, {differing} differing values")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
