"""pytest-benchmark configuration shared by the op-family benchmark files.

Default sizes run in about a minute per file (fit for CI). ``--bench-large`` adds the issue-target
sizes (minutes each, GiB of memory for the references). Every benchmark sets ``benchmark.group`` to
"<op> <size>" and ``extra_info`` (implementation, size, and measured extras such as peak memory), which
``benchmarks/render.py`` turns into tables, ratios and a plot.
"""
import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--bench-large", action="store_true", default=False,
                     help="also run the issue-target sizes (slow, GiB of memory)")


def pytest_configure(config):
    config.addinivalue_line("markers", "large: issue-target size, runs only with --bench-large")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--bench-large"):
        return
    skip = pytest.mark.skip(reason="issue-target size: pass --bench-large")
    for item in items:
        if "large" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _native_extension_status():
    """Build the native extension before timing anything, and record whether it is there."""
    from glm5_core.backends.cpu import backend

    status = backend.status()
    print(f"\n[glm5 bench] cpu backend: {status.describe()}; torch threads: {torch.get_num_threads()}")
    return status
