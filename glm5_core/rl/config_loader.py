"""An RL config from YAML: the declarations of ``rl/config`` built and checked, then the run checked against
the policy's architecture and this machine's memory (``rl/run_memory``) before anything is built.

Every problem is one line naming its full key; all of them are raised together as one :class:`ConfigError`."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from glm5_core.config_schema import ConfigError, build
from glm5_core.config_yaml import apply_overrides, assign, blame_overrides, load_mapping
from glm5_core.rl.config import RLConfig
from glm5_core.rl.run_memory import memory_problems


def size_problems(cfg: RLConfig, model) -> List[str]:
    """Problems of run ``cfg`` with policy architecture ``model`` (a GLM5Config: the preset's, or the one a
    ``--checkpoint`` holds): sequence length, MTP drafts, the codec's vocabulary and the memory the run needs
    on this machine."""
    if cfg.rollout.max_len > model.max_position_embeddings:
        return [f"rollout.max_len: expected <= the model's max_position_embeddings="
                f"{model.max_position_embeddings}, got {cfg.rollout.max_len}"]
    if cfg.rollout.speculative is not None and not model.num_nextn_predict_layers:
        return ["rollout.speculative: expected a model with MTP weights (num_nextn_predict_layers > 0) to draft "
                "with, got a model without"]
    return _codec_problems(cfg, model.vocab_size) or memory_problems(cfg, model)


def _codec_problems(cfg: RLConfig, vocab_size: int) -> List[str]:
    """The environments' codec (``rollout.tokenizer``, else bytes at ``env.byte_offset``) fits ``vocab_size``."""
    from glm5_core.rl.rollout.run_codec import TOKENIZER_KEY, run_codec, vocab_problem

    path = cfg.rollout.tokenizer
    if path is not None and "byte_offset" in cfg.env:
        return [f"env.byte_offset: the byte codec's offset, unused with {TOKENIZER_KEY}; remove env.byte_offset"]
    try:
        codec = run_codec(path, cfg.env.get("byte_offset", 0))
    except ValueError as exc:
        return [str(exc)]
    problem = vocab_problem(codec, vocab_size, TOKENIZER_KEY if path is not None else "env.byte_offset")
    return [problem] if problem else []


def config_from_dict(data: Dict[str, Any], source: str = "config") -> RLConfig:
    """The config of parsed YAML ``data``: its fields, the rules between them, and (for a ``model.preset``
    architecture) :func:`size_problems`; raises :class:`ConfigError` listing the problems."""
    if not isinstance(data, dict):
        raise ConfigError([f"expected a mapping of sections at the top level, got {type(data).__name__}"], source)
    problems: List[str] = []
    cfg = build(RLConfig, data, "", problems)
    if problems:
        raise ConfigError(problems, source)
    problems = cfg.rule_problems()
    if not problems:
        model = cfg.model_config()
        problems = size_problems(cfg, model) if model is not None else []
    if problems:
        raise ConfigError(problems, source)
    return cfg


def load_config(path: str, sets: Sequence[str] = (), values: Optional[Dict[str, Any]] = None) -> RLConfig:
    """A YAML file (an empty one: every default), then ``--set KEY=VALUE`` overrides ``sets`` (VALUE read as
    YAML), then ``values`` (dotted key -> value, as command-line flags give them)."""
    data = apply_overrides(load_mapping(path, empty={}), sets)
    for key, value in (values or {}).items():
        assign(data, key, value)
    try:
        return config_from_dict(data, str(path))
    except ConfigError as exc:
        raise blame_overrides(exc, sets) from None
