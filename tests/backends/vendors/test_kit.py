"""The vendor kit's commands refuse what they cannot do in one line, exit status 2: ``glm5 conformance --simulate``
without a backend or for a backend without a simulated stack, ``benchmarks/vendor/run.sh`` with a bad option. (The
kit's full runs are in benchmarks/results/vendors_simulated_s14.md.)"""
import os
import subprocess

import pytest

from glm5_core.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.parametrize("argv, message", [
    (["conformance", "--simulate"], "--simulate: expected --backend <name>"),
    (["conformance", "--simulate", "--backend", "cuda"], "expected a backend with a simulated stack (gcu, hygon, "
                                                          "kunlunxin, metax, mlu, musa), got 'cuda'"),
])
def test_conformance_simulate_refuses_in_one_line(argv, message, capsys, tmp_path):
    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_run_sh_gives_the_interpreted_benchmarks_a_budget_all_cases_start_in():
    """Interpreted (``--simulate``) each kernel case takes seconds to minutes on a shared host: with the hardware's
    120 s budget the last cases were skipped and run.sh exited 1 on a healthy backend (session 14's runs)."""
    script = open(os.path.join(ROOT, "benchmarks", "vendor", "run.sh"), encoding="utf-8").read()
    assert 'BUDGET_S=120; if [ -n "$SIM" ]; then BUDGET_S=900; fi' in script and '--budget-s "$BUDGET_S"' in script


def test_run_sh_refuses_a_bad_option_in_one_line():
    done = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "vendor", "run.sh"), "musa", "--fast"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip() == "run.sh: expected --simulate or nothing, got --fast"
