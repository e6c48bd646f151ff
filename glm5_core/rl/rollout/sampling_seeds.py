"""Per-request sampling seeds: each generation of a trajectory gets a seed of its own (SGLang's
``sampling_params.sampling_seed``), a function of the run's seed, the trajectory id and the turn, so what it
samples does not depend on the requests it shared an engine with, the engine it ran on, or an engine's restart.
Trajectory ids are issued in order (``g<group>-<i>``), so a resumed run that continues the group numbering
draws what the uninterrupted run would have drawn."""
from __future__ import annotations

import hashlib

from glm5_core.rl.serving.protocol import MAX_SAMPLING_SEED


def sampling_seed(run_seed: int, trajectory_id: str, turn: int) -> int:
    """A seed in [0, 2**63) for generation ``turn`` (0-based) of ``trajectory_id`` in a run seeded ``run_seed``."""
    digest = hashlib.blake2b(f"{run_seed}/{trajectory_id}/{turn}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % MAX_SAMPLING_SEED
