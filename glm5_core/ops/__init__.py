"""Public entry points of the op families. Each validates its arguments, then dispatches through
the registry to the resolved backend kernel or to the pure-torch reference in the same module.

Each family module declares its ops in a tuple ``OPS`` of :class:`~glm5_core.opspec.OpSpec`, next to their
references; ``FAMILY_MODULES`` is the one list of family modules the registry reads (in this order: the order
of ``registry.OP_NAMES``, ``explain()`` and the conformance reports)."""
from glm5_core.ops import dsa, ep, kda, mhc, mla, moe, muon

FAMILY_MODULES = (mla, dsa, kda, moe, ep, muon, mhc)

__all__ = ["FAMILY_MODULES", "dsa", "ep", "kda", "mhc", "mla", "moe", "muon"]
