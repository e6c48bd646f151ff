"""Render saved pytest-benchmark JSON into a Markdown table (per group: median, ratio to the group's
baseline, extra_info) and a PNG bar plot of medians.

    python benchmarks/render.py benchmarks/results/cpu_large.json --baseline reference,hf_loop,torch_muon_loop,dense_reference

The baseline of a group is the first implementation (``extra_info['impl']``) of ``--baseline`` present in it;
ratio = baseline median / this median (> 1: faster than the baseline).
"""  # noqa: E501 (the command line above is copied as is)
from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path


def load_groups(path: Path) -> dict[str, list[dict]]:
    data = json.loads(path.read_text())
    groups: dict[str, list[dict]] = collections.OrderedDict()
    for bench in data.get("benchmarks", []):
        groups.setdefault(bench.get("group") or bench["name"], []).append(bench)
    return groups


def _fmt_extra(extra: dict) -> str:
    shown = []
    for key, value in extra.items():
        if key in ("impl", "T", "S", "H", "D", "K", "N", "E", "C", "F", "flops", "shape", "matrices"):
            continue
        if key.endswith("bytes"):
            shown.append(f"{key}={value / 2**20:.0f} MiB")
        elif isinstance(value, float):
            shown.append(f"{key}={value:.3g}")
        else:
            shown.append(f"{key}={value}")
    return ", ".join(shown)


def markdown(groups: dict[str, list[dict]], baselines: list[str]) -> str:
    lines = []
    for group, benches in groups.items():
        by_impl = {b["extra_info"].get("impl", b["name"]): b for b in benches}
        base = next((by_impl[n] for n in baselines if n in by_impl), None)
        lines += [f"### {group}", "", "| impl | median (ms) | rounds | speed-up vs baseline | extra |",
                  "|---|---|---|---|---|"]
        for impl, b in by_impl.items():
            median = b["stats"]["median"]
            ratio = f"{base['stats']['median'] / median:.2f}x" if base is not None else "-"
            lines.append(f"| {impl} | {median * 1e3:.2f} | {b['stats']['rounds']} | {ratio} | "
                         f"{_fmt_extra(b['extra_info'])} |")
        lines.append("")
    return "\n".join(lines)


def plot(groups: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(groups), 1, figsize=(8, 1.6 + 1.1 * len(groups) * 1.6), squeeze=False)
    for ax, (group, benches) in zip(axes[:, 0], groups.items()):
        names = [b["extra_info"].get("impl", b["name"]) for b in benches]
        medians = [b["stats"]["median"] * 1e3 for b in benches]
        ax.barh(names, medians, color="tab:blue")
        ax.set_title(group, fontsize=9)
        ax.set_xlabel("median ms")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, help="pytest-benchmark --benchmark-json output")
    parser.add_argument("--baseline", default="reference,hf_loop,torch_muon_loop,dense_reference,batched",
                        help="comma-separated impl names, first present in a group is its baseline")
    parser.add_argument("--out", type=Path, default=None, help="output stem (default: next to the JSON)")
    args = parser.parse_args(argv)
    groups = load_groups(args.json)
    if not groups:
        raise SystemExit(f"{args.json}: no benchmarks in the file")
    stem = args.out or args.json.with_suffix("")
    Path(f"{stem}.md").write_text(markdown(groups, args.baseline.split(",")))
    plot(groups, Path(f"{stem}.png"))
    print(f"wrote {stem}.md and {stem}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
