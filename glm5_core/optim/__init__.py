"""Muon (+ Muon Split) for hidden matrices, AdamW for embeddings, head, norms, biases and the DSA indexer."""
from glm5_core.optim.hybrid import HybridOptimizer, MuonConfig, OptimizerConfig, build_optimizer
from glm5_core.optim.muon import SCALE_MODES, Muon, muon_reference_step, update_scale
from glm5_core.optim.param_groups import Assignment, assign_parameters

__all__ = [
    "Assignment",
    "HybridOptimizer",
    "Muon",
    "MuonConfig",
    "OptimizerConfig",
    "SCALE_MODES",
    "assign_parameters",
    "build_optimizer",
    "muon_reference_step",
    "update_scale",
]
