"""Helpers for the benchmarks: peak extra memory in a fresh process, and the fp32 GEMM rate (which
implementations to time: ``_backends.py``).

Peak extra memory: a child Python process builds the inputs, runs the op once on a tiny problem (so
libraries, thread pools and the native extension are loaded), reads its resident set size (RSS, from
/proc/self/statm), then runs the op once on the real inputs while a sampling thread reads the RSS every
millisecond. Peak sampled RSS minus the RSS before the call is the most memory the op held beyond its
inputs (page-granular, allocator caching included; a peak shorter than the sampling period can be
missed). The getrusage high-water mark is not used: transient peaks of input construction would mask
the op's own.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from typing import Callable

import torch

_CHILD = """
import json, os, threading, time, torch
torch.manual_seed(0)
PAGE = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE
{setup}
def run(inputs):
{run}
run(make({warm_args}))
inputs = make({args})
before = rss()
peak = [before]
done = threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.001)
sampler = threading.Thread(target=sample)
sampler.start()
run(inputs)
done.set()
sampler.join()
peak[0] = max(peak[0], rss())
print(json.dumps({{"peak_extra_bytes": peak[0] - before}}))
"""


def peak_extra_bytes(setup: str, run: str, args: str, warm_args: str, timeout: float = 1800.0) -> int:
    """``setup`` defines ``make(*args) -> inputs``; ``run`` is the body of ``run(inputs)`` (indented by us)."""
    code = _CHILD.format(setup=textwrap.dedent(setup), run=textwrap.indent(textwrap.dedent(run), "    "),
                         args=args, warm_args=warm_args)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"memory probe failed: {result.stderr[-2000:]}")
    return int(json.loads(result.stdout.strip().splitlines()[-1])["peak_extra_bytes"])


def median_seconds(fn: Callable[[], object], repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def fp32_matmul_rate(rows: int, depth: int, cols: int, repeats: int = 3) -> float:
    """FLOP/s of one fp32 [rows, depth] @ [depth, cols] GEMM, median of ``repeats``."""
    a = torch.randn(rows, depth)
    b = torch.randn(depth, cols)
    seconds = median_seconds(lambda: a @ b, repeats)
    return 2.0 * rows * depth * cols / seconds
