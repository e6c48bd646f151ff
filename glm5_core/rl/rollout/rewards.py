"""Reward plug-ins: the ``reward`` section replaces the environment's own reward of every trajectory.

    reward: {path: "pkg.module:factory", on_failure: zero, ...}   # factory(**other keys) -> fn(input) -> float
    reward: {url: "http://127.0.0.1:8000/score", timeout_s: 30, retries: 2, backoff_s: 0.5,
             max_response_bytes: 65536, api_key: null, on_failure: fail}

A reward function receives :func:`reward_input` (a JSON-ready dict: ids, decoded text where the environment
has a codec, the environment's own reward) and returns a finite number. ``on_failure`` says what a failed
reward (an exception, a non-number, a server that did not answer) does: ``fail`` ends the run with
:class:`RewardError`, ``zero`` scores the trajectory 0 and ``drop`` leaves its group untrained (as an
environment failure); ``zero`` and ``drop`` count the failure (``reward_failures`` in the summary).
"""
from __future__ import annotations

import math
import threading
from typing import Any, Callable, Optional

from glm5_core.config_schema import shown, unknown_key

FAILURE_POLICIES = ("fail", "zero", "drop")
URL_KEYS = ("url", "timeout_s", "retries", "backoff_s", "max_response_bytes", "api_key", "on_failure")
RewardFn = Callable[[dict[str, Any]], float]


class RewardError(RuntimeError):
    """A reward failed under ``reward.on_failure: fail``: the run stops."""


class RewardScorer:
    """``scorer(payload)``: the reward (a float), or None when the failure policy drops the trajectory."""

    def __init__(self, fn: RewardFn, on_failure: str = "fail", name: str = "reward"):
        if on_failure not in FAILURE_POLICIES:
            raise ValueError(f"on_failure: expected one of {', '.join(map(repr, FAILURE_POLICIES))}, "
                             f"got {shown(on_failure)}")
        self.fn, self.on_failure, self.name = fn, on_failure, name
        self._lock = threading.Lock()
        self.failures = 0
        self.last_error = ""

    def __call__(self, payload: dict[str, Any]) -> Optional[float]:
        try:
            value = self.fn(payload)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"expected a finite number, got {shown(value)}")
            return float(value)
        except Exception as exc:
            message = f"{self.name} failed for trajectory {payload.get('trajectory_id')!r}: " \
                      f"{type(exc).__name__}: {exc}"
            if self.on_failure == "fail":
                raise RewardError(message + " (reward.on_failure: fail)") from exc
            with self._lock:
                self.failures += 1
                self.last_error = message
            return 0.0 if self.on_failure == "zero" else None


def reward_input(trajectory_id: str, episode, samples, decode: Optional[Callable] = None) -> dict[str, Any]:
    """What a reward function scores: the first prompt, every sampled token (in order), the last sample's
    whole token sequence, the environment's own reward and info; text fields where ``decode`` is given."""
    prompt: list[int] = []
    if samples:
        first = samples[0]
        prompt = first.tokens[:first.loss_mask.index(1)] if 1 in first.loss_mask else list(first.tokens)
    response = [t for s in samples for t, m in zip(s.tokens, s.loss_mask) if m]
    tokens = list(samples[-1].tokens) if samples else []
    out = {"trajectory_id": trajectory_id, "group_id": episode.group_id, "prompt_ids": prompt,
           "response_ids": response, "tokens": tokens, "num_turns": episode.num_turns,
           "env_reward": float(episode.reward), "info": dict(episode.info())}
    if decode is not None:
        out.update(prompt=decode(prompt), response=decode(response), text=decode(tokens))
    return out


def _url_scorer(cfg: dict[str, Any]) -> RewardScorer:
    from glm5_core.rl.rollout.reward_client import HttpRewardClient

    unknown = [k for k in cfg if k not in URL_KEYS]
    if unknown:
        raise ValueError(unknown_key("reward.", str(unknown[0]), URL_KEYS))
    kwargs = {k: v for k, v in cfg.items() if k not in ("url", "on_failure")}
    try:
        client = HttpRewardClient(cfg["url"], **kwargs)
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message if message.startswith("reward.") else f"reward.{message}") from None
    return RewardScorer(client, cfg.get("on_failure", "fail"), name=f"reward server {client.url}")


def _path_scorer(cfg: dict[str, Any]) -> RewardScorer:
    from glm5_core.rl.plugins import load_object

    factory = load_object(cfg["path"], "reward.path")
    kwargs = {k: v for k, v in cfg.items() if k not in ("path", "on_failure")}
    try:
        fn = factory(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"reward.path: {cfg['path']}(**{sorted(kwargs)}) refused its arguments "
                         f"({type(exc).__name__}: {exc})") from None
    if not callable(fn):
        raise ValueError(f"reward.path: expected {cfg['path']!r} to be a factory returning a reward function "
                         f"(input dict -> float), it returned a {type(fn).__name__}")
    return RewardScorer(fn, cfg.get("on_failure", "fail"), name=f"reward {cfg['path']}")


def build_reward(cfg: Optional[dict[str, Any]]) -> Optional[RewardScorer]:
    """The scorer of a ``reward`` section (None: the environment's own reward)."""
    if cfg is None:
        return None
    if not isinstance(cfg, dict) or ("url" in cfg) == ("path" in cfg):
        raise ValueError(f"reward: expected a mapping with 'path' (a factory 'pkg.module:name') or 'url' (a "
                         f"reward server), exactly one, got {shown(cfg)}")
    on_failure = cfg.get("on_failure", "fail")
    if on_failure not in FAILURE_POLICIES:
        raise ValueError(f"reward.on_failure: expected one of {', '.join(map(repr, FAILURE_POLICIES))}, "
                         f"got {shown(on_failure)}")
    return _url_scorer(cfg) if "url" in cfg else _path_scorer(cfg)


def reward_problems(cfg: Optional[dict[str, Any]]) -> list[str]:
    try:
        build_reward(cfg)
    except ValueError as exc:
        return [str(exc)]
    return []
