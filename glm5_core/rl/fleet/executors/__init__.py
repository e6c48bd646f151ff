"""Executors start, watch and replace rollout-engine workers: local processes or Ray actors."""


def build_executor(cfg, spec):
    """The executor of RLConfig ``cfg``: the engines at ``rollout.engine_urls``, else workers spawned by
    ``executor`` (``local`` processes or ``ray`` actors), each booted from ``spec(name)`` (a WorkerSpec)."""
    if cfg.rollout.engine_urls is not None:
        from glm5_core.rl.fleet.executors.external import ExternalEngines

        return ExternalEngines(cfg.rollout.engine_urls)
    if cfg.executor == "ray":
        from glm5_core.rl.fleet.executors.ray_executor import RayExecutor

        return RayExecutor(spec)
    from glm5_core.rl.fleet.executors.local import LocalProcessExecutor

    return LocalProcessExecutor(spec)
