"""The pretraining run config: typed dataclasses, every problem reported on its own line. This module declares;
reading a YAML file and the memory check are ``train/config_loader``'s.

Top level: ``seed``, ``output_dir``, ``torch_threads``. Sections: ``model`` (a preset plus GLM5Config
overrides), ``data``, ``optimizer``, ``schedule``, ``stages``, ``loss``, ``router``, ``checkpoint``, ``logging``,
``parallel``.
Stage kinds follow the DSA recipe (DeepSeek-V3.2 paper, section 2.1; GLM-5 report):
``dense`` (dense attention, LM + MTP loss, indexer idle),
``indexer_warmup`` (main model frozen, only the indexer trains on the KL to the dense attention),
``sparse`` (top-k attention; LM + MTP loss for the model, KL on the selected keys for the indexer; its target is
``loss.indexer_kl_target``: "selected", each head's softmax over the selected keys as Megatron-LM's DSA
``sparse_loss``, or "causal", the dense attention over every causal key renormalised on them).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from glm5_core import config_paths
from glm5_core.config_schema import convert_fields, field, non_negative, positive
from glm5_core.ops.selected_attention_target import NORMALISERS as INDEXER_KL_TARGETS
from glm5_core.optim import OptimizerConfig

STAGE_KINDS = ("dense", "indexer_warmup", "sparse")
MODEL_PRESETS = ("tiny", "tiny_glm53")
PARALLEL_STRATEGIES = ("ddp", "fsdp2")
MAX_SEED = 2 ** 64 - 1  # torch.manual_seed's largest


def _tokenizer_path(value: str, key: str) -> None:
    if value != "byte":
        config_paths.input_file(value, key)


@dataclasses.dataclass
class DataConfig:
    source: str = field("stdlib", choices=("stdlib", "path"))
    path: Optional[str] = field(None, check=config_paths.input_path)  # source "path": a .txt/.jsonl file or a folder
    text_key: str = "text"  # jsonl: the field holding the document text
    extensions: list[str] = field(factory=lambda: [".txt", ".md", ".py", ".jsonl"])  # folder: files to read
    tokenizer: str = field("byte", check=_tokenizer_path)  # "byte" or the path of an HF tokenizer.json
    eos_token: Optional[str] = None  # HF tokenizer: the token appended after each document
    shuffle: bool = True  # read documents in a seeded permutation (per epoch) instead of corpus order
    seq_len: int = field(128, **positive())
    batch_size: int = field(8, **positive())  # sequences per step, over all ranks


@dataclasses.dataclass
class ScheduleConfig:
    """Learning rate of the main model over the steps of the dense and sparse stages (counted together)."""

    lr: float = field(3e-3, **positive())
    warmup_steps: int = field(10, **non_negative())
    decay: str = field("cosine", choices=("cosine", "linear", "constant"))
    min_lr_ratio: float = field(0.1, range=(0.0, 1.0))


@dataclasses.dataclass
class StageConfig:
    kind: str = field("dense", choices=STAGE_KINDS)
    steps: int = field(1, **positive())
    name: Optional[str] = None  # shown in logs; defaults to kind
    # indexer learning rate, cosine from indexer_lr to indexer_final_lr over the stage (indexer_warmup, sparse);
    # unset in a sparse stage: the indexer follows the main schedule
    indexer_lr: Optional[float] = field(None, **positive())
    indexer_final_lr: Optional[float] = field(None, **positive())

    @property
    def label(self) -> str:
        return self.name or self.kind


@dataclasses.dataclass
class LossConfig:
    mtp_depths: int = field(1, **non_negative())  # recursive MTP depths in training (GLM-5: 3)
    mtp_weight: float = field(0.3, **non_negative())
    indexer_kl_weight: float = field(1.0, **positive())
    # the sparse stage's KL target: "selected" (each head's softmax over the selected keys, no pass over the others)
    # or "causal" (each head's softmax over every causal key, then renormalised on the selected ones)
    indexer_kl_target: str = field("selected", choices=INDEXER_KL_TARGETS)


@dataclasses.dataclass
class RouterConfig:
    bias_update_rate: float = field(1e-3, **non_negative())  # gamma of the aux-loss-free bias update


@dataclasses.dataclass
class CheckpointConfig:
    every_steps: int = field(0, **non_negative())  # 0: only at the end (and at --max-steps)
    keep_last: int = field(2, **positive())


@dataclasses.dataclass
class LoggingConfig:
    progress_bar: bool = True
    tensorboard: bool = True
    plot: bool = True
    recall_every_steps: int = field(10, **positive())  # dense and sparse stages: measure top-k recall every N steps


@dataclasses.dataclass
class ParallelConfig:
    """How the ranks of a ``torchrun`` job share the work: ``ddp`` replicates the model and all-reduces
    gradients; ``fsdp2`` shards parameters, gradients and optimizer state on dim 0 (FSDP2's ``fully_shard``).
    Both give every rank ``data.batch_size / world`` rows per step and save the same checkpoint format.

    ``ep`` (expert parallelism, off when unset): every rank holds ``n_routed_experts / ep`` experts and tokens move
    to them by all-to-all (``glm5_core.ops.ep``), on a 2-D DeviceMesh (world / ep, ep): FSDP2 shards the other
    parameters over every rank and the experts over the world / ep ranks that hold the same experts, as
    torchtitan does. It needs ``strategy: fsdp2`` (``--parallel ep=N`` sets both), saves sharded
    ``torch.distributed.checkpoint`` checkpoints, and ``ep: 1`` is the same layout without expert sharding (every
    expert on every rank, the batch-invariant experts kernel): the bitwise baseline of any EP size."""

    strategy: str = field("ddp", choices=PARALLEL_STRATEGIES)
    ep: Optional[int] = field(None, **positive())


def parallel_problems(parallel: ParallelConfig, n_routed_experts: int) -> list[str]:
    """The rules of ``parallel.ep`` against the model (``glm5 pretrain`` and ``glm5 rl`` alike)."""
    problems = []
    if parallel.ep is not None:
        if parallel.strategy != "fsdp2":
            problems.append(f"parallel.ep: expert parallelism shards with FSDP2; set parallel.strategy: fsdp2 "
                            f"(--parallel ep=N does), got strategy {parallel.strategy!r}")
        if n_routed_experts % parallel.ep:
            problems.append(f"parallel.ep: expected a divisor of model.n_routed_experts ({n_routed_experts}), "
                            f"got {parallel.ep}")
    return problems


@dataclasses.dataclass
class TrainConfig:
    seed: int = field(0, range=(0, MAX_SEED))
    output_dir: str = field("runs/pretrain", check=config_paths.output_dir)
    # CPU threads for torch's intra-op pool (0: torch's default). Small models on a few shared cores run
    # faster on 1 thread; a resumed run must use the same count to repeat the uninterrupted one bitwise.
    torch_threads: int = field(0, range=(0, 4096))
    model: dict[str, Any] = field(factory=lambda: {"preset": "tiny"})
    data: DataConfig = field(factory=DataConfig)
    optimizer: OptimizerConfig = field(factory=OptimizerConfig)
    schedule: ScheduleConfig = field(factory=ScheduleConfig)
    stages: list[StageConfig] = field(factory=lambda: [StageConfig()])
    loss: LossConfig = field(factory=LossConfig)
    router: RouterConfig = field(factory=RouterConfig)
    checkpoint: CheckpointConfig = field(factory=CheckpointConfig)
    logging: LoggingConfig = field(factory=LoggingConfig)
    parallel: ParallelConfig = field(factory=ParallelConfig)

    @property
    def total_steps(self) -> int:
        return sum(s.steps for s in self.stages)

    def model_config(self):
        """The GLM5Config this run trains (preset + overrides), once :meth:`rule_problems` found none."""
        from glm5_core.model import GLM5Config

        overrides = {k: v for k, v in self.model.items() if k != "preset"}
        return getattr(GLM5Config, self.model.get("preset", "tiny"))(**overrides)

    def rule_problems(self) -> list[str]:
        """The ``model`` section (GLM5Config's own declaration; its converted values replace the given ones),
        then the rules between sections."""
        return _model_problems(self) or _cross_problems(self)


def _model_problems(cfg: TrainConfig) -> list[str]:
    """``model``: a preset plus GLM5Config fields, each converted and checked by GLM5Config's own declaration;
    ``cfg.model`` keeps the converted values."""
    from glm5_core.model import GLM5Config

    problems: list[str] = []
    overrides = convert_fields(GLM5Config, cfg.model, "model.", problems, also_known=("preset",), exclude=("extra",))
    preset = cfg.model.get("preset", "tiny")
    if preset not in MODEL_PRESETS:
        problems.append(f"model.preset: expected one of {', '.join(MODEL_PRESETS)}, got {preset!r}")
    if problems:
        return problems
    cfg.model = {**cfg.model, **overrides}
    return dataclasses.replace(getattr(GLM5Config, preset)(), **overrides).problems("model.")


def _cross_problems(cfg: TrainConfig) -> list[str]:
    problems = cfg.optimizer.check()
    if not cfg.stages:
        problems.append("stages: expected at least one stage, got an empty list")
    for i, stage in enumerate(cfg.stages):
        if stage.kind == "dense" and (stage.indexer_lr is not None or stage.indexer_final_lr is not None):
            problems.append(f"stages[{i}].indexer_lr: a dense stage does not train the indexer; remove it "
                            f"(or set stages[{i}].kind to indexer_warmup or sparse)")
        if (stage.indexer_lr is None) != (stage.indexer_final_lr is None):
            problems.append(f"stages[{i}]: expected both indexer_lr and indexer_final_lr, or neither")
        elif stage.kind == "indexer_warmup" and stage.indexer_lr is None:
            problems.append(f"stages[{i}].indexer_lr: an indexer_warmup stage needs indexer_lr and "
                            "indexer_final_lr (GLM-5: 5e-3 -> 2e-4)")
    if cfg.data.source == "path" and not cfg.data.path:
        problems.append("data.path: expected a file or folder when data.source is 'path'")
    if cfg.data.tokenizer == "byte" and cfg.data.eos_token is not None:
        problems.append(f"data.eos_token: only read with an HF tokenizer.json (the byte tokenizer ends each "
                        f"document with token 256); remove it, got {cfg.data.eos_token!r}")
    if cfg.data.source == "stdlib" and cfg.data.path:
        problems.append("data.path: only read when data.source is 'path'; set source: path or remove it")
    model = cfg.model_config()
    problems += parallel_problems(cfg.parallel, model.n_routed_experts)
    if cfg.loss.mtp_depths > 0 and model.num_nextn_predict_layers == 0:
        problems.append(f"loss.mtp_depths: expected 0 when model.num_nextn_predict_layers is 0, "
                        f"got {cfg.loss.mtp_depths}")
    if cfg.data.seq_len > model.max_position_embeddings:
        problems.append(f"data.seq_len: expected <= model.max_position_embeddings ({model.max_position_embeddings}), "
                        f"got {cfg.data.seq_len}")
    elif cfg.loss.mtp_depths >= cfg.data.seq_len:
        problems.append(f"loss.mtp_depths: expected <= data.seq_len - 1 ({cfg.data.seq_len - 1}): a deeper MTP depth "
                        f"has no label in a sequence, got {cfg.loss.mtp_depths}")
    return problems
