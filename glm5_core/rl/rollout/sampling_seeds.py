"""Per-request sampling seeds: each generation of a trajectory gets a seed of its own (SGLang's
``sampling_params.sampling_seed``), a function of the run's seed, the trajectory id and the turn, so what it
samples does not depend on the requests it shared an engine with, the engine it ran on, or an engine's restart.
Trajectory ids are issued in order (``g<group>-<i>``), so a resumed run that continues the group numbering
draws what the uninterrupted run would have drawn."""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Optional

from glm5_core.rl.serving.protocol import MAX_SAMPLING_SEED


def sampling_seed(run_seed: int, trajectory_id: str, turn: int) -> int:
    """A seed in [0, 2**63) for generation ``turn`` (0-based) of ``trajectory_id`` in a run seeded ``run_seed``."""
    digest = hashlib.blake2b(f"{run_seed}/{trajectory_id}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % MAX_SAMPLING_SEED


def turn_sampling_params(temperature: float, top_p: float, max_new_tokens: int, stop_token_ids: Sequence[int],
                         run_seed: Optional[int], trajectory_id: str, turn: int) -> dict:
    """SGLang ``sampling_params`` of one generation; with ``run_seed`` set it carries the turn's ``sampling_seed``."""
    params = {"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens,
              "stop_token_ids": list(stop_token_ids)}
    if run_seed is not None:
        params["sampling_seed"] = sampling_seed(run_seed, trajectory_id, turn)
    return params
