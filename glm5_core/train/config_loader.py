"""A pretraining config from YAML: the declarations of ``train/config`` built and checked, then the run checked
against this machine's memory (``train/step_memory``) before the model is built.

Every problem is one line naming its full key; all of them are raised together as one :class:`ConfigError`."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from glm5_core.config_schema import ConfigError, build
from glm5_core.config_yaml import load_config_file
from glm5_core.train.config import TrainConfig
from glm5_core.train.step_memory import memory_problems


def parse_config(raw: Any, source: str = "config") -> TrainConfig:
    """Validate parsed YAML, then check that the run fits this machine's memory; raise :class:`ConfigError`
    listing every problem, one per line."""
    if not isinstance(raw, dict):
        raise ConfigError([f"expected a mapping of sections at the top level, got {type(raw).__name__}"], source)
    problems: list[str] = []
    cfg = build(TrainConfig, raw, "", problems)
    if not problems:
        problems = cfg.rule_problems() or memory_problems(cfg)
    if problems:
        raise ConfigError(problems, source)
    return cfg


def load_config(path, sets: Sequence[str] = (), values: Optional[dict[str, Any]] = None) -> TrainConfig:
    """A YAML file (see ``glm5_core.config_yaml`` for what is refused) with ``--set KEY=VALUE`` overrides ``sets``,
    then ``values`` (dotted key -> value, as command-line flags give them) assigned as they are."""
    return load_config_file(path, sets, values, parse_config)
