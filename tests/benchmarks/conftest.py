"""``bench``: the benchmark script a test module names in ``SCRIPT`` (``benchmarks/<SCRIPT>.py``), loaded fresh."""
import pytest

from tests.benchmarks.bench_scripts import load_benchmark


@pytest.fixture
def bench(monkeypatch, request):
    return load_benchmark(monkeypatch, request.module.SCRIPT)
