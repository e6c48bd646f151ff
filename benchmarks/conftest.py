"""pytest-benchmark configuration shared by the op-family benchmark files.

Default sizes run in about a minute per file (fit for CI). ``--bench-large`` adds the issue-target
sizes (minutes each, GiB of memory for the references). ``--backends`` (or ``GLM5_BENCH_BACKENDS``) picks the
backends timed: ``all`` (default: every available one on its own device; cuda under Triton's interpreter only by
name) or a comma-separated list such as ``cpu,reference``;
a benchmark taking the ``impl`` fixture runs once per implementation (the reference, its peers, each backend:
``benchmarks/_backends.py``), one taking ``backend`` once per requested backend. Every benchmark sets
``benchmark.group`` to "<op> <size> [<device>]" and ``extra_info`` (implementation, size, and measured extras
such as peak memory), which ``benchmarks/render.py`` turns into tables, ratios and a plot.
"""
import os

import pytest
import torch
from _backends import ENV, impls, parse_request


def pytest_addoption(parser):
    parser.addoption("--bench-large", action="store_true", default=False,
                     help="also run the issue-target sizes (slow, GiB of memory)")
    parser.addoption("--backends", default=None,
                     help=f"backends to time: 'all' (default: every available one on its own device) or a "
                          f"comma-separated list such as cpu,cuda,reference (also the environment variable {ENV})")


def requested_backends(config) -> list:
    text = config.getoption("--backends")
    source = "--backends"
    if text is None:
        text, source = os.environ.get(ENV), ENV
    try:
        return parse_request(text)
    except ValueError as exc:
        raise pytest.UsageError(str(exc).replace("--backends", source, 1)) from None


def pytest_configure(config):
    config.addinivalue_line("markers", "large: issue-target size, runs only with --bench-large")
    config.addinivalue_line("markers", "peers(*names): what a user would time instead of glm5-core (the `impl` "
                                       "fixture adds them beside the reference)")
    requested_backends(config)  # an unknown name stops the run here, in one line


def pytest_generate_tests(metafunc):
    if "impl" not in metafunc.fixturenames and "backend" not in metafunc.fixturenames:
        return
    requested = requested_backends(metafunc.config)
    marker = metafunc.definition.get_closest_marker("peers")
    peers = marker.args if marker is not None else ()
    for fixture in ("impl", "backend"):
        if fixture not in metafunc.fixturenames:
            continue
        cases = [(impl, why) for impl, why in impls(requested, peers)
                 if fixture == "impl" or impl.kind == "backend"]
        params = [pytest.param(impl if fixture == "impl" else impl.name, id=impl.id,
                               marks=[pytest.mark.skip(reason=why)] if why else [])
                  for impl, why in cases]
        metafunc.parametrize(fixture, params)


def pytest_collection_modifyitems(config, items):
    if config.getoption("--bench-large"):
        return
    skip = pytest.mark.skip(reason="issue-target size: pass --bench-large")
    for item in items:
        if "large" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _native_extension_status(request):
    """Build the native extension before timing anything (when the cpu backend is timed), and say its state."""
    if "cpu" not in requested_backends(request.config):
        return None
    from glm5_core.backends.cpu import backend

    status = backend.status()
    print(f"\n[glm5 bench] cpu backend: {status.describe()}; torch threads: {torch.get_num_threads()}")
    return status
