"""Executors start, watch and replace rollout-engine workers: local processes or Ray actors."""
