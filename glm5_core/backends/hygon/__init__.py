"""Hygon backend: Hygon DCUs through the DTK torch build (``torch ...+das...dtk...``), a HIP build that presents them
as torch's ``cuda`` device type. Facts and sources: docs/vendors/hygon.md."""
