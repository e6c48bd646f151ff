"""What a resumed RL run needs of its starting checkpoint (``--checkpoint``), recorded when the run starts.

A resume point (``checkpoints/step_N``) holds the policy's weights, optimizer and RNG, so of the starting
checkpoint a resume needs only the policy's *architecture*: for a ``save_pretrained`` checkpoint its config.json
and dtype (a ``glm5 pretrain`` checkpoint or none at all: ``model.preset`` in the run's config). The tokenizer
(``rollout.tokenizer``) and a distillation teacher (``train.teacher_checkpoint``) are config keys, read from
where they name, and no reference policy is kept (the losses use the rollout log-probs). The starting *weights*
are needed only while the run holds no resume point yet: it then starts over from step 0.

So a fresh run writes into ``rl_run.json`` (key ``policy``): the model's config (``save_pretrained`` checkpoints;
None: built from ``model.preset``), its dtype, why its MTP module is absent (if it is), and the size and
modification time (ns) of each file at the top of the checkpoint folder. A resume with a resume point
rebuilds the policy from that record and reads nothing of the checkpoint; one without a resume point refuses,
in one line naming the file, a starting checkpoint that is gone or whose files changed since the run started.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def checkpoint_files(checkpoint: Optional[str]) -> Optional[dict[str, dict[str, int]]]:
    """{file name: {"size", "mtime_ns"}} of the regular files at the top of the ``checkpoint`` folder (links
    are not followed); None without a checkpoint."""
    if checkpoint is None:
        return None
    files = {}
    with os.scandir(checkpoint) as entries:
        for entry in entries:
            if entry.is_file(follow_symlinks=False):
                stat = entry.stat(follow_symlinks=False)
                files[entry.name] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return dict(sorted(files.items()))


def describe(model, checkpoint: Optional[str]) -> dict[str, Any]:
    """The record a fresh run writes (``rl_run.json``'s ``policy``) for the policy built from ``checkpoint``."""
    from_config = checkpoint is not None and os.path.isfile(os.path.join(checkpoint, "config.json"))
    dtype = model.model.embed_tokens.weight.dtype
    return {"config": model.config.to_hf_dict() if from_config else None,
            "dtype": next(name for name, d in DTYPES.items() if d == dtype),
            "mtp_absent_reason": getattr(model, "mtp_absent_reason", None),
            "files": checkpoint_files(checkpoint)}


def _checked(record: Any, where: str) -> dict[str, Any]:
    """The record's types (the run file is read as untrusted); the config's values GLM5Config checks itself."""
    if not isinstance(record, dict):
        raise ValueError(f"--resume: {where}: policy: expected an object, got {type(record).__name__}")
    if not isinstance(record.get("config"), (dict, type(None))):
        raise ValueError(f"--resume: {where}: policy.config: expected an object or null, got "
                         f"{type(record.get('config')).__name__}")
    if record.get("dtype") not in DTYPES:
        raise ValueError(f"--resume: {where}: policy.dtype: expected one of {sorted(DTYPES)}, got "
                         f"{record.get('dtype')!r:.40}")
    if not isinstance(record.get("mtp_absent_reason"), (str, type(None))):
        raise ValueError(f"--resume: {where}: policy.mtp_absent_reason: expected a string or null")
    files = record.get("files")
    if files is not None and not (isinstance(files, dict) and all(
            isinstance(v, dict) and all(isinstance(v.get(k), int) and not isinstance(v.get(k), bool)
                                        for k in ("size", "mtime_ns")) for v in files.values())):
        raise ValueError(f"--resume: {where}: policy.files: expected null or {{name: {{size, mtime_ns}}}} "
                         f"(ints), got {files!r:.60}")
    return record


def check_unchanged(record: Any, checkpoint: Optional[str], out_dir: str, where: str) -> None:
    """Refuse (ValueError, one line naming the file) a starting checkpoint that is gone or changed since the run
    in ``out_dir`` started: a run with no resume point yet starts over from it."""
    files = _checked(record, where).get("files")
    if checkpoint is None or files is None:
        return
    why = f"the run in {out_dir!r} holds no resume point yet and starts over from its starting checkpoint"
    if not os.path.isdir(checkpoint):
        raise ValueError(f"--resume: {why} {checkpoint!r}, which is gone; restore it, or start a new run")
    now = checkpoint_files(checkpoint)
    for name in sorted(set(files) | set(now)):
        if files.get(name) != now.get(name):
            change = ("is gone" if name not in now else "is new" if name not in files else
                      f"changed (size {files[name]['size']} -> {now[name]['size']}, modified "
                      f"{files[name]['mtime_ns']} -> {now[name]['mtime_ns']} ns)")
            raise ValueError(f"--resume: {why}, but {os.path.join(checkpoint, name)} {change} since the run "
                             f"started; restore that checkpoint, or start a new run")


def recorded_config(record: Any, where: str) -> Optional[dict[str, Any]]:
    """The config.json dict the policy was built from; None: ``model.preset`` built it."""
    return _checked(record, where)["config"]


def rebuild(record: Any, backend: Optional[str], device: torch.device, weights: Path, where: str):
    """The policy of a record with a config, on ``device``; its weights are then loaded from the resume point's
    ``weights`` file, whose header is checked against the rebuilt architecture before anything is allocated."""
    from glm5_core.model import GLM5Config, GLM5ForCausalLM
    from glm5_core.train.checkpoint import check_model_file

    record = _checked(record, where)
    try:
        config = GLM5Config.from_hf_dict(record["config"])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--resume: {where}: policy.config: {exc}") from None
    dtype = DTYPES[record["dtype"]]
    with torch.device("meta"):
        shape_only = GLM5ForCausalLM(config, backend=backend).to(dtype)
    check_model_file(weights, shape_only)  # the sizes come from the weights file, not from the record alone
    model = GLM5ForCausalLM(config, backend=backend).to(device=device, dtype=dtype)  # as load_pretrained casts it
    if record["mtp_absent_reason"]:
        model.mtp_absent_reason = record["mtp_absent_reason"]
    return model
