"""The conformance families follow the op declarations (``OpSpec.family``): every declared op is checked in its
family, and a family's checks are found in its module ``glm5_core.conformance.<family>`` by the runner, the
reports and the CLI alike, without a list of them to edit."""
import argparse
import sys
import types

import pytest

from glm5_core import conformance, registry, testing
from glm5_core.conformance import cli, families
from glm5_core.opspec import OpSpec


def test_every_declared_op_is_checked_in_its_family():
    for name, spec in registry.op_specs().items():
        assert spec.family in conformance.FAMILIES, name
        assert any(name in check.ops for check in conformance.checks(spec.family)), name


def test_the_families_are_the_declared_ones_in_order_then_the_properties():
    declared = tuple(dict.fromkeys(spec.family for spec in registry.op_specs().values()))
    assert conformance.FAMILIES == conformance.family_names() == declared + ("gradients", "determinism")
    assert [f for f in declared if f in ("mla", "dsa", "moe", "muon")] == ["mla", "dsa", "moe", "muon"]


@pytest.fixture
def foo_family(monkeypatch):
    """An op ``foo_double`` of a new family ``foo`` (declared after the others), its checks in a module
    ``glm5_core.conformance.foo``."""
    def double_reference(x):
        return 2 * x

    def check_double(backend, device):
        x = testing.randn((3,), seed=0)
        return testing.Comparison(True, 0.0, 0.0, f"{float(double_reference(x).sum()):.3f}")

    specs = {**registry.op_specs(), "foo_double": OpSpec("foo_double", double_reference, family="foo")}
    monkeypatch.setattr(registry, "op_specs", lambda: specs)
    module = types.ModuleType("glm5_core.conformance.foo")
    module.checks = lambda: [conformance.Check("foo", "foo_double[fp32]", ("foo_double",), check_double)]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_a_new_familys_checks_are_found_in_its_module(foo_family):
    assert conformance.family_names()[-3:] == ("foo", "gradients", "determinism")
    assert [c.name for c in conformance.checks("foo")] == ["foo_double[fp32]"]
    names = [c.name for c in conformance.checks()]
    assert names.index("foo_double[fp32]") == len(names) - len(conformance.checks("gradients")) - len(
        conformance.checks("determinism")) - 1
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert parser.parse_args(["--family", "foo"]).family == ["foo"]


def test_the_report_has_a_section_per_family_found(foo_family, tmp_path):
    result = conformance.Result("foo", "foo_double[fp32]", ["foo_double"], "pass", 0.0, 0.0, "fine", 0.1)
    paths = conformance.write_reports([result], "cpu", tmp_path)
    markdown = paths["markdown"].read_text()
    assert "## foo\n" in markdown and "| `foo_double[fp32]` | pass |" in markdown


def test_a_family_without_a_checks_module_is_an_error_naming_it_and_its_ops(monkeypatch, foo_family):
    monkeypatch.delitem(sys.modules, foo_family.__name__)
    with pytest.raises(ValueError, match=r"family 'foo' \(of foo_double\).*glm5_core\.conformance\.foo"):
        conformance.checks("foo")
    with pytest.raises(ValueError, match="family 'runner'"):  # a module of the package, but not of checks
        families.family_module("runner")


def test_an_unknown_family_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match=r"family: expected one of \('mla', .*got 'nope'"):
        conformance.checks("nope")
