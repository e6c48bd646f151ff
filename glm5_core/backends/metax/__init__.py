"""MetaX backend: MetaX GPUs (C500, C550) through MetaX's torch build (``torch ...+metax``), which presents them as
torch's ``cuda`` device type. Facts and sources: docs/vendors/metax.md."""
