"""Every backend keeps gradients wherever the reference does, and they match (checks in
glm5_core.conformance.gradients); every differentiable op, and only those, has a gradient check."""
import pytest

from glm5_core import conformance, registry


@pytest.mark.parametrize("check", conformance.checks("gradients"), ids=str)
def test_gradients(backend, check):
    conformance.assert_conforms(backend, check)


def test_every_differentiable_op_has_a_gradient_check_and_only_those():
    checked = {check.ops[0] for check in conformance.checks("gradients")}
    assert checked == {name for name, spec in registry.op_specs().items() if spec.differentiable}
    assert checked == set(conformance.GRAD_CASES)


def test_a_differentiable_op_without_gradient_inputs_is_an_error_naming_it(monkeypatch):
    monkeypatch.delitem(conformance.GRAD_CASES, "moe_route")
    check = next(c for c in conformance.checks("gradients") if c.ops == ("moe_route",))
    result = conformance.run_check(check, "cpu")
    assert result.status == "error" and "moe_route is declared differentiable" in result.detail
