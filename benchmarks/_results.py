"""Writes a benchmark script's result to ``benchmarks/results/`` (JSON, with the command inside) and shows it."""
from __future__ import annotations

import json
import os


def write_json(path: str, result: dict, shown: dict = None) -> None:
    """Save ``result`` at ``path`` (folders created) and print ``shown`` (default: the whole result)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result if shown is None else shown, indent=2))
