"""Render saved pytest-benchmark JSON into readable tables and a PNG plot: per group (one op, size and
device), each implementation's median and its speed-up over the group's baseline (the reference when the group
has it), and a summary of every backend's and peer's speed-up over the reference, group by group.

    pytest benchmarks --backends cpu,reference --benchmark-json bench.json
    python benchmarks/render.py bench.json            # prints the tables, writes bench.md and bench.png
    python benchmarks/render.py a.json b.json --out both   # several runs' files, one report

The baseline of a group is the first implementation (``extra_info['impl']``) of ``--baseline`` present in it;
speed-up = baseline median / this median (> 1: faster than the baseline).
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

BASELINES = "reference,hf_loop,torch_muon_loop,dense_reference,batched,torch.optim.Muon"


def load_groups(*paths: Path) -> dict[str, list[dict]]:
    """{group: [benchmark]} of pytest-benchmark JSON files, in order. Raises ValueError naming the file and what is
    wrong."""
    groups: dict[str, list[dict]] = collections.OrderedDict()
    for path in paths:
        for bench in _benchmarks(path):
            groups.setdefault(bench.get("group") or bench["name"], []).append(bench)
    return groups


def _benchmarks(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: expected a pytest-benchmark JSON file (--benchmark-json), got {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
        raise ValueError(f"{path}: expected a pytest-benchmark JSON file with a 'benchmarks' list")
    for bench in data["benchmarks"]:
        if (not isinstance(bench, dict) or not isinstance(bench.get("stats"), dict) or "name" not in bench
                or not isinstance(bench["stats"].get("median"), (int, float))):
            raise ValueError(f"{path}: expected every benchmark to have a name and a median in its stats")
        if not isinstance(bench.setdefault("extra_info", {}), dict):
            raise ValueError(f"{path}: expected every benchmark's extra_info to be a mapping")
    return data["benchmarks"]


def _impl(bench: dict) -> str:
    return bench["extra_info"].get("impl", bench["name"])


def baseline_of(benches: list[dict], baselines: list[str]):
    by_impl = {_impl(b): b for b in benches}
    return next(((n, by_impl[n]) for n in baselines if n in by_impl), (None, None))


def _fmt_extra(extra: dict) -> str:
    shown = []
    for key, value in extra.items():
        if key in ("impl", "kind", "device", "T", "S", "H", "D", "K", "N", "E", "C", "F", "flops", "shape", "matrices"):
            continue
        if key.endswith("bytes"):
            shown.append(f"{key}={value / 2**20:.0f} MiB")
        elif isinstance(value, float):
            shown.append(f"{key}={value:.3g}")
        else:
            shown.append(f"{key}={value}")
    return ", ".join(shown)


def _speedups(groups: dict[str, list[dict]]) -> list[str]:
    """The summary: per group with a reference, each backend's speed-up over it (a column per backend), and the
    peers' and other variants' in one column."""
    with_reference = {g: benches for g, benches in groups.items() if any(_impl(b) == "reference" for b in benches)}
    backends = list(dict.fromkeys(_impl(b) for benches in with_reference.values() for b in benches
                                  if b["extra_info"].get("kind") == "backend"))
    lines = ["## Speed-up over the reference", "",
             "Reference median / implementation median, on the same inputs and device (> 1: faster than the "
             "reference; - : not timed there).", ""]
    if not with_reference:
        return lines + ["(no group has the reference)", ""]
    header = ["group", "reference (ms)", *backends, "peers and variants"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for group, benches in with_reference.items():
        by_impl = {_impl(b): b for b in benches}
        ref = by_impl["reference"]["stats"]["median"]

        def ratio(name, by_impl=by_impl, ref=ref):
            median = by_impl[name]["stats"]["median"]
            return f"{ref / median:.2f}x" if median > 0 else "-"

        cells = [ratio(n) if n in by_impl else "-" for n in backends]
        peers = ", ".join(f"{n} {ratio(n)}" for n in by_impl if n != "reference" and n not in backends) or "-"
        lines.append(f"| {group} | {ref * 1e3:.2f} | " + "".join(f"{c} | " for c in cells) + f"{peers} |")
    return lines + [""]


def markdown(groups: dict[str, list[dict]], baselines: list[str]) -> str:
    lines = _speedups(groups)
    for group, benches in groups.items():
        base_name, base = baseline_of(benches, baselines)
        lines += [f"### {group}", "",
                  f"| impl | median (ms) | rounds | speed-up vs {base_name or 'baseline'} | extra |",
                  "|---|---|---|---|---|"]
        for b in benches:
            median = b["stats"]["median"]
            ratio = f"{base['stats']['median'] / median:.2f}x" if base is not None and median > 0 else "-"
            lines.append(f"| {_impl(b)} | {median * 1e3:.2f} | {b['stats'].get('rounds', '-')} | {ratio} | "
                         f"{_fmt_extra(b['extra_info'])} |")
        lines.append("")
    return "\n".join(lines)


def plot(groups: dict[str, list[dict]], out: Path, baselines: list[str]) -> None:
    """One panel per group: each implementation's median (ms), labelled with its speed-up over the baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heights = [0.6 + 0.35 * len(benches) for benches in groups.values()]
    fig, axes = plt.subplots(len(groups), 1, figsize=(9, 0.8 + sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (group, benches) in zip(axes[:, 0], groups.items()):
        base_name, base = baseline_of(benches, baselines)
        names = [_impl(b) for b in benches]
        if len(set(names)) < len(names):  # the same impl twice (another parameter): the test ids tell them apart
            names = [b["name"].partition("[")[2].rstrip("]") or b["name"] for b in benches]
        medians = [b["stats"]["median"] * 1e3 for b in benches]
        colors = ["tab:gray" if n == base_name else "tab:blue" for n in names]
        bars = ax.barh(names, medians, color=colors)
        ax.invert_yaxis()
        if base is not None:
            labels = [f" {base['stats']['median'] * 1e3 / m:.2f}x" if m > 0 else "" for m in medians]
            ax.bar_label(bars, labels=labels, fontsize=8)
        ax.set_xlim(0, max(medians) * 1.25 if medians and max(medians) > 0 else 1)
        ax.set_title(group + (f"  (labels: speed-up vs {base_name})" if base_name else ""), fontsize=9)
        ax.set_xlabel("median ms", fontsize=8)
        ax.tick_params(labelsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, nargs="+", help="pytest-benchmark --benchmark-json output(s)")
    parser.add_argument("--baseline", default=BASELINES,
                        help="comma-separated impl names, first present in a group is its baseline")
    parser.add_argument("--out", type=Path, default=None, help="output stem (default: next to the first JSON)")
    parser.add_argument("--no-plot", action="store_true", help="write the tables only (no matplotlib needed)")
    args = parser.parse_args(argv)
    try:
        groups = load_groups(*args.json)
    except ValueError as exc:
        print(f"render.py: {exc}", file=sys.stderr)
        return 2
    if not groups:
        print(f"render.py: {', '.join(map(str, args.json))}: expected benchmarks, got none (all skipped?)",
              file=sys.stderr)
        return 2
    baselines = args.baseline.split(",")
    stem = args.out or args.json[0].with_suffix("")
    table = markdown(groups, baselines)
    print(table)
    Path(f"{stem}.md").write_text(table)
    written = [f"{stem}.md"]
    if not args.no_plot:
        try:
            plot(groups, Path(f"{stem}.png"), baselines)
            written.append(f"{stem}.png")
        except ImportError:
            print("render.py: matplotlib is not installed (pip install 'glm5-core[bench]'): no plot", file=sys.stderr)
    print(f"wrote {' and '.join(written)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
