"""Public entry points of the four op families. Each validates its arguments, then dispatches through
the registry to the resolved backend kernel or to the pure-torch reference in the same module."""
from glm5_core.ops import dsa, mla, moe, muon

__all__ = ["dsa", "mla", "moe", "muon"]
