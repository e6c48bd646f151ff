"""``ep_group[2 processes]``: the expert-parallel contract checked on real processes by ``glm5 conformance``."""
import os

import pytest

from glm5_core import device_kinds
from glm5_core.conformance import ep_group
from glm5_core.conformance.check import NotRunnable
from glm5_core.conformance.runner import run_check


def _lying_worker(rank, backend, device_type, dist_backend, host, init_file, result_dir, simulated_backend=None):
    """A rank that reports a difference, as a backend whose rows came out in another order would."""
    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w", encoding="utf-8") as f:
        f.write("random: received rows differ from the reference's" if rank == 1 else "")


def test_the_reference_passes_on_two_gloo_processes():
    (check,) = ep_group.checks()
    result = run_check(check, "cpu")
    # cpu has no ep kernels: the reference ran in both processes, and the contract held
    assert result.status == "fallback" and "2 processes on gloo" in result.detail, result.detail


def test_a_simulated_vendor_runs_the_check_in_its_processes_too():
    """Each spawned rank installs the parent's simulated stack again (it is installed per process): before, the
    ranks of ``glm5 conformance --backend musa --simulate`` found torch_musa absent and the check failed."""
    from glm5_core import registry
    from glm5_core.backends import simulated

    (check,) = ep_group.checks()
    with simulated.simulate("musa"):
        result = run_check(check, "musa")
    registry.reset()
    assert result.status == "fallback" and "2 processes on gloo" in result.detail, result.detail


def test_a_rank_reporting_a_difference_fails_the_check(monkeypatch, spawnable_test_modules):
    monkeypatch.setattr(ep_group, "_worker", _lying_worker)  # spawn pickles it by name: this module's function
    result = ep_group._run("cpu", "cpu")
    assert not result.passed and "rank 1: random: received rows differ" in result.detail


def test_an_accelerator_backend_with_one_device_is_not_run_rather_than_passed(monkeypatch):
    host = device_kinds.device_types()["cpu"]
    fake = type(host)(device_type="cpu", dist_backend="gloo", count=lambda: 1,
                      visible_devices_env="FAKE_VISIBLE_DEVICES")
    monkeypatch.setattr(device_kinds, "device_types", lambda: {"cpu": fake})
    assert not fake.is_host
    with pytest.raises(NotRunnable, match="needs 2 cpu devices"):
        ep_group._run("cpu", "cpu")
