"""Conformance of every backend under test for the mla family (checks defined in glm5_core.conformance)."""
import pytest

from glm5_core import conformance


@pytest.mark.parametrize("check", conformance.checks("mla"), ids=str)
def test_mla(backend, check):
    conformance.assert_conforms(backend, check)
