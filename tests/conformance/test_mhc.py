"""Conformance of every backend under test for the mhc family (checks defined in glm5_core.conformance)."""
import pytest

from glm5_core import conformance


@pytest.mark.parametrize("check", conformance.checks("mhc"), ids=str)
def test_mhc(backend, check):
    conformance.assert_conforms(backend, check)
