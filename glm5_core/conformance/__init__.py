"""Conformance suite: every check a backend must pass, shared by ``tests/conformance`` and ``glm5 conformance``.

A check runs one op (or a determinism property) of a backend on seeded inputs and compares the result with
the reference: floats against an fp64 run of the reference (``testing.compare_to_fp64``), integer outputs
(top-k, routing ids, dispatch order) exactly where the inputs make ties exact, and by the cross-backend
set rule elsewhere. ``glm5 conformance --backend X`` runs them all and writes a JSON and a Markdown report.

Layout: ``check.py`` (what a check and a result are), one module of checks per family (``mla.py``, ``dsa.py``,
``moe.py``, ``muon.py``, named by the ops' ``OpSpec.family``; each also gives its differentiable ops' backward
inputs), ``gradients.py`` and ``determinism.py`` (the properties checked across families), ``families.py``
(the families and their checks, derived from the op declarations), ``runner.py``, ``report.py`` and ``cli.py``.
"""
from glm5_core.conformance.check import DTYPE_NAMES, Check, CheckFn, GradCase, Result
from glm5_core.conformance.dsa import TOPK_REL_TOL
from glm5_core.conformance.families import FAMILIES, PROPERTY_FAMILIES, checks, family_module, family_names
from glm5_core.conformance.gradients import BF16_GRAD_OPS, GRAD_CASES, GRAD_EDGE_CASES, grad_ops
from glm5_core.conformance.report import environment, write_reports
from glm5_core.conformance.runner import assert_conforms, run_check

__all__ = ["BF16_GRAD_OPS", "DTYPE_NAMES", "FAMILIES", "GRAD_CASES", "GRAD_EDGE_CASES", "PROPERTY_FAMILIES",
           "TOPK_REL_TOL", "Check", "CheckFn", "GradCase", "Result", "assert_conforms", "checks", "environment",
           "family_module", "family_names", "grad_ops", "run_check", "write_reports"]
