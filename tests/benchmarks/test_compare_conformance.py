"""benchmarks/compare_conformance.py: equal reports (times and dates apart) pass; a changed status, max error or
detail, a missing check or a reordering is reported and exits 1."""
import copy
import json

import pytest

SCRIPT = "compare_conformance"  # what the bench fixture loads


def _report(date="2024-01-01T00:00:00+00:00", seconds=0.5):
    result = {"family": "moe", "check": "moe_route[x]", "ops": ["moe_route"], "status": "pass", "max_error": 1e-7,
              "allowed": 1e-5, "detail": "max |err| 1e-07", "seconds": seconds}
    second = {**result, "check": "moe_route[y]", "max_error": 2e-7}
    return {"environment": {"backend": "cpu", "date": date}, "summary": {"pass": 2, "fail": 0},
            "coverage": [{"op": "moe_route", "implementation": "cpu", "reason": ""}], "results": [result, second]}


def _write(tmp_path, name, report):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "conformance-cpu.json").write_text(json.dumps(report))
    return str(folder)


def test_equal_reports_pass_whatever_their_times(bench, tmp_path, capsys):
    before = _write(tmp_path, "before", _report())
    after = _write(tmp_path, "after", _report(date="2025-06-01T00:00:00+00:00", seconds=9.0))
    assert bench.main([before, after]) == 0
    assert "2 checks: status, max error, allowance and detail equal" in capsys.readouterr().out


@pytest.mark.parametrize("key, value", [("status", "fallback"), ("max_error", 1.1e-7), ("detail", "other")])
def test_a_changed_field_of_a_check_fails_naming_it(bench, tmp_path, capsys, key, value):
    changed = _report()
    changed["results"][1][key] = value
    assert bench.main([_write(tmp_path, "before", _report()), _write(tmp_path, "after", changed)]) == 1
    assert f"moe_route[y]: {key}:" in capsys.readouterr().out


def test_a_missing_or_reordered_check_fails(bench, tmp_path, capsys):
    before = _write(tmp_path, "before", _report())
    missing = copy.deepcopy(_report())
    missing["results"].pop()
    assert bench.main([before, _write(tmp_path, "missing", missing)]) == 1
    assert "only before: ['moe_route[y]']" in capsys.readouterr().out
    reordered = copy.deepcopy(_report())
    reordered["results"].reverse()
    assert bench.main([before, _write(tmp_path, "reordered", reordered)]) == 1
    assert "another order" in capsys.readouterr().out


def test_a_folder_without_one_report_is_an_error_naming_it(bench, tmp_path):
    with pytest.raises(ValueError, match="expected one conformance-<backend>.json"):
        bench.main([str(tmp_path), str(tmp_path)])
