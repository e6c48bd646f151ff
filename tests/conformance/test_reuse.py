"""``glm5 conformance --simulate`` reuses a check's result only across backends whose run has an identical key
(glm5_core.conformance.reuse): musa and kunlunxin (the same kernels, 64 KiB tiles at 4 warps, no fp64) share, mlu
(1 warp) and metax (fp64) do not; a reused result says so; a stored file that is not exactly its key's result is
ignored; ``--no-reuse`` and real (not simulated) runs reuse nothing."""
import dataclasses
import json

import pytest

from glm5_core import conformance, registry
from glm5_core.backends import simulated
from glm5_core.cli import main
from glm5_core.conformance import reuse
from glm5_core.conformance.runner import run_check


@pytest.fixture
def cheap_check():
    return conformance.checks("mhc")[0]


def _cache(backend, folder):
    with simulated.simulate(backend):
        return reuse.ResultCache(backend, folder)


def test_a_result_is_reused_only_under_an_identical_key(tmp_path, cheap_check):
    with simulated.simulate("musa"):
        computed = reuse.ResultCache("musa", tmp_path)
        result = run_check(cheap_check, "musa")
        assert result.status == "pass"
        computed.put(cheap_check, result)
    kunlunxin = _cache("kunlunxin", tmp_path)
    got = kunlunxin.get(cheap_check)
    assert got is not None and got.status == "pass" and got.max_error == result.max_error
    assert "reused: computed by musa's simulated run under an identical key" in got.detail and kunlunxin.reused == 1
    for other, differs in (("mlu", "launch"), ("metax", "dtypes")):  # 1 warp; fp64 (and its build string)
        cache = _cache(other, tmp_path)
        assert cache.get(cheap_check) is None
        assert {k for k in cache.run if cache.run[k] != computed.run[k]} == {differs}
    metax, hygon = _cache("metax", tmp_path), _cache("hygon", tmp_path)  # both patch torch.__version__
    assert metax.run == hygon.run
    registry.reset()


def test_a_stored_file_that_is_not_its_keys_result_is_ignored(tmp_path, cheap_check):
    cache = _cache("musa", tmp_path)
    with simulated.simulate("musa"):
        cache.put(cheap_check, run_check(cheap_check, "musa"))
    path = tmp_path / f"{reuse.check_key(cache.run, cheap_check)}.json"
    good = json.loads(path.read_text())
    assert cache.get(cheap_check) is not None
    for bad in ({**good, "result": {**good["result"], "status": "error"}},
                {**good, "result": {**good["result"], "check": "another"}},
                {**good, "result": {**good["result"], "max_error": "0"}},
                {**good, "key": "0" * 64}, [good]):
        path.write_text(json.dumps(bad))
        assert cache.get(cheap_check) is None
    path.write_text("{not json")
    assert cache.get(cheap_check) is None
    path.unlink()
    failed = dataclasses.replace(run_check(cheap_check, "musa"), status="fail")
    cache.put(cheap_check, failed)  # a failure is never stored: each backend runs it again
    assert not path.exists() and cache.get(cheap_check) is None
    cache.run = {**cache.run, "source": "another tree"}  # an edited source tree is another key
    path.write_text(json.dumps(good))
    assert cache.get(cheap_check) is None
    registry.reset()


def test_the_cli_reuses_under_simulate_and_says_so_and_no_reuse_runs_everything(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GLM5_CONFORMANCE_CACHE", str(tmp_path / "cache"))
    n = len(conformance.checks("mhc"))
    runs = [("musa", [], 0), ("kunlunxin", [], n), ("kunlunxin", ["--no-reuse"], 0)]
    for i, (backend, extra, reused) in enumerate(runs):
        assert main(["conformance", "--backend", backend, "--simulate", "--family", "mhc", *extra,
                     "--out", str(tmp_path / str(i))]) == 0
        out, err = capsys.readouterr()
        assert (f"passed on the reference fallback ({reused} reused from an identical simulated run" in out) \
            == (not extra)
        assert (f"({reused} reused from an identical simulated run)" in err) == bool(reused)
    report = json.loads((tmp_path / "1" / "conformance-kunlunxin.json").read_text())
    assert report["environment"]["reused"].startswith(f"{n} results reused from identical simulated runs")
    assert all("reused: computed by musa" in r["detail"] for r in report["results"])
    assert main(["conformance", "--backend", "cpu", "--family", "mhc", "--out", str(tmp_path / "cpu")]) == 0
    assert "reused" not in capsys.readouterr().out  # a real device's results are its own
    registry.reset()
