"""Enflame backend: GCUs through torch_gcu (device type ``gcu``): torch operators, with an int32-only top-k (the
GCU computes no int64). Facts and sources: docs/vendors/gcu.md."""
