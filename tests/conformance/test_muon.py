"""Conformance of every backend under test for the muon family (checks defined in glm5_core.conformance)."""
import pytest

from glm5_core import conformance


@pytest.mark.parametrize("check", conformance.checks("muon"), ids=str)
def test_muon(backend, check):
    conformance.assert_conforms(backend, check)
