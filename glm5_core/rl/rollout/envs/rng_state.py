"""A ``random.Random``'s state as JSON and back, for environments that draw their tasks from one (resume)."""
from __future__ import annotations

import math
import random
from typing import Any

STATE_WORDS = 625  # random.getstate()[1]: the Mersenne Twister's 624 words and its position


def rng_state_dict(rng: random.Random) -> dict[str, Any]:
    version, words, gauss_next = rng.getstate()
    return {"rng": [version, list(words), gauss_next]}


def load_rng_state(rng: random.Random, state: Any, where: str = "env") -> None:
    """Restore ``rng`` from :func:`rng_state_dict`'s output, checked first (the file it came from is untrusted)."""
    value = state.get("rng") if isinstance(state, dict) else None
    ok = (isinstance(value, list) and len(value) == 3 and isinstance(value[0], int) and
          isinstance(value[1], list) and len(value[1]) == STATE_WORDS and
          all(isinstance(w, int) and not isinstance(w, bool) and 0 <= w < 2 ** 32 for w in value[1]) and
          (value[2] is None or (isinstance(value[2], float) and math.isfinite(value[2]))))
    if not ok:
        raise ValueError(f"{where}.rng: expected [version, [{STATE_WORDS} ints in [0, 2**32)], null or a float] as "
                         f"random.getstate() gives it, got {str(value)[:60]}")
    try:
        rng.setstate((value[0], tuple(value[1]), value[2]))
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"{where}.rng: not a valid random.Random state ({exc})") from None
