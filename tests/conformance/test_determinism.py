"""Conformance of every backend under test for the determinism family (checks defined in glm5_core.conformance)."""
import pytest

from glm5_core import conformance


@pytest.mark.parametrize("check", conformance.checks("determinism"), ids=str)
def test_determinism(backend, check):
    conformance.assert_conforms(backend, check)
