"""Agent rollout: environments, the token-in-token-out gateway that records every generation of a trajectory,
and the runner that drives environment <-> gateway <-> router <-> engines."""
