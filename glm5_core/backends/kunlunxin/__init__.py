"""Kunlunxin backend: Kunlunxin XPUs through Kunlunxin's torch build, which presents them as torch's ``cuda`` device
type; told apart from NVIDIA by Kunlunxin's own SMI tool. Facts and sources: docs/vendors/kunlunxin.md."""
