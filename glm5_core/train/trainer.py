"""The pretraining loop: stages of the DSA recipe, Muon + AdamW, aux-loss-free balancing, checkpoints, metrics.

Per stage (``StageConfig.kind``):
  dense           trains everything but the indexer on LM + mtp_weight * MTP loss, dense attention;
                  every ``recall_every_steps`` the forward also measures the (untrained) indexer's top-k recall
  indexer_warmup  trains only the indexers (the MTP layer's included, over the loss.mtp_depths depths) on
                  KL(p || softmax(I)) against the dense attention; main model frozen
  sparse          top-k attention; LM + MTP loss for the model, indexer_kl_weight * KL on the selected keys for
                  the indexer (the model detaches the indexer's input, so each learns only from its own loss),
                  against loss.indexer_kl_target; the top-k recall (the dense target's mass on the selected keys,
                  one more pass over every key) only every ``recall_every_steps``
Router biases move by the aux-loss-free rule after every step that trains the main model, from expert counts
summed over the ranks. Everything that decides a step's numbers (the stage, the learning rates, the batch)
is a function of the step and the restored state, so a resumed run repeats an uninterrupted one bitwise.

Data parallelism under torchrun (``parallel.strategy``): ``ddp`` re-wraps the model in DDP at each stage
change (the trainable set changes); ``fsdp2`` shards it once (``fsdp.py``) and steps Muon / AdamW on the
shards. Both save whole-tensor checkpoints in one format (``checkpoint.py``).
"""
from __future__ import annotations

import collections
import dataclasses
import gc
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import torch

from glm5_core import registry
from glm5_core.model import GLM5ForCausalLM, save_pretrained
from glm5_core.model.checkpoint import RUN_EXPORT_DIR
from glm5_core.ops import ep as ep_ops
from glm5_core.optim import build_optimizer
from glm5_core.train import checkpoint as ckpt
from glm5_core.train import checkpoint_folders as ckpt_folders
from glm5_core.train import dcp_checkpoint, fsdp
from glm5_core.train import distributed as dist_utils
from glm5_core.train.config import StageConfig, TrainConfig
from glm5_core.train.data import build_packer
from glm5_core.train.losses import mtp_loss, next_token_loss
from glm5_core.train.metrics import PLOT_FILE, MetricsLogger, load_balance, plot_losses, read_records
from glm5_core.train.schedule import StageSchedule

SUMMARY_FILE = "summary.json"
EXPORT_DIR = RUN_EXPORT_DIR  # HF glm_moe_dsa layout of the weights at the end of the run (for glm5 rl / export-onnx)
LAST_LOSS_WINDOW = 50  # the summary's end loss: mean LM loss of this many last steps (batches vary a lot)
SCHEDULED_KEYS = ("lr", "initial_lr")  # optimizer-group keys the schedule sets every step


@dataclasses.dataclass
class RunOptions:
    backend: str = "auto"
    output_dir: Optional[str] = None  # overrides cfg.output_dir
    resume: Optional[str] = None  # a checkpoint folder, a checkpoints root or an output dir
    max_steps: Optional[int] = None  # stop (and checkpoint) after this many steps of the schedule


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def _quiet(message: str) -> None:
    """Ranks other than 0 stay silent (rank 0 says it once)."""


def _reference_report(ran: list[tuple[str, str]]) -> dict[str, dict[str, int]]:
    """{op: {why: calls}} of the ops that computed with the reference during one step (empty: kernels only)."""
    report: dict[str, dict[str, int]] = {}
    for op, why in ran:
        report.setdefault(op, {})
        report[op][why] = report[op].get(why, 0) + 1
    return report


def _set_trainable(model: GLM5ForCausalLM, stage: StageConfig, mtp_depths: int) -> None:
    """dense: all but the indexer; indexer_warmup: only the indexer; sparse: everything. The MTP module trains
    only with ``mtp_depths`` > 0 (with 0 it never runs). So every trainable parameter takes part in every step
    of its stage, and DDP needs no ``find_unused_parameters`` (its extra graph traversal, and its warning)."""
    indexer_ids = {id(p) for p in model.indexer_parameters()}
    mtp = model.model.mtp
    idle = {id(p) for p in mtp.parameters()} if mtp is not None and mtp_depths == 0 else set()
    for p in model.parameters():
        is_indexer = id(p) in indexer_ids
        if id(p) in idle:
            p.requires_grad_(False)
        elif stage.kind == "dense":
            p.requires_grad_(not is_indexer)
        elif stage.kind == "indexer_warmup":
            p.requires_grad_(is_indexer)
        else:
            p.requires_grad_(True)


def _restore_configured_hyperparameters(groups: list[dict], configured: list[dict]) -> list[str]:
    """Loading an optimizer's state dict also loads the hyper-parameters saved with it. The config wins, as
    it does for the learning rate (set every step by the schedule): put its values back into ``groups`` and
    return ``"group.key: checkpoint -> config"`` for each one that differed."""
    changed = []
    for group, wanted in zip(groups, configured):
        for key, value in wanted.items():
            saved = group.get(key)
            if key not in SCHEDULED_KEYS and _as_list(saved) != _as_list(value):  # JSON gives lists, configs tuples
                changed.append(f"{group.get('name', '?')}.{key}: {saved!r} -> {value!r}")
                group[key] = value
    return changed


def _as_list(value):
    return list(value) if isinstance(value, tuple) else value


def _set_learning_rates(optimizer, lrs: dict[str, float], muon_lr_ratio: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lrs[group["role"]] * (muon_lr_ratio if group["optimizer"] == "muon" else 1.0)


def _checkpoint_due(cfg: TrainConfig, done: int, stop: int) -> bool:
    every = cfg.checkpoint.every_steps
    return done == stop or (every > 0 and done % every == 0)


def build_model(model_cfg, *, backend: Optional[str], seed: int, device: torch.device,
                expert_parallel: bool = False, ep_group=None) -> GLM5ForCausalLM:
    """The driver's model: built, initialised from ``seed`` and moved to ``device``. ``expert_parallel``: every
    MoE layer on ``ep_group`` (None: a group of one), and this rank never holds the other ranks' experts, not
    even while building (``GLM5ForCausalLM(expert_shard=...)``, as torchtitan builds on the meta device and
    materialises its shards only): its experts get the values a whole build gives them, bit for bit."""
    shard = ep_ops.group_rank_size(ep_group) if expert_parallel else None
    model = GLM5ForCausalLM(model_cfg, backend=backend, expert_shard=shard)
    model.reset_parameters(seed=seed)
    if expert_parallel:
        model.shard_experts(ep_group)
    return model.to(device)


class PretrainTrainer:
    def __init__(self, cfg: TrainConfig, options: RunOptions):
        self.cfg, self.options = cfg, options
        self.backend = registry.require_available(registry.resolve_backend_name(options.backend))
        self.output_dir = Path(options.output_dir or cfg.output_dir)
        self.dist = dist_utils.init_distributed(self.backend)
        # ranks that read different configs would train on silently (DDP replicas diverge, FSDP2 shards move by
        # different rules); output_dir is left out: only rank 0 writes
        dist_utils.check_same_on_every_rank(
            "config", {**dataclasses.asdict(cfg), "output_dir": None, "backend": self.backend.name,
                       "resume": options.resume is not None, "max_steps": options.max_steps}, self.dist)
        if cfg.data.batch_size % self.dist.world_size:
            raise ValueError(f"data.batch_size: expected a multiple of the world size {self.dist.world_size}, "
                             f"got {cfg.data.batch_size}")
        self.schedule = StageSchedule(cfg.stages, cfg.schedule)
        self.packer = build_packer(cfg.data, cfg.seed)
        model_cfg = cfg.model_config()
        vocab = self.packer.stream.tokenizer.vocab_size
        if model_cfg.vocab_size < vocab:
            raise ValueError(f"model.vocab_size: expected >= the tokenizer's vocabulary ({vocab}), "
                             f"got {model_cfg.vocab_size}")
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        torch.manual_seed(cfg.seed)
        layout = fsdp.expert_layout(cfg.parallel.ep, device_type=self.dist.device.type,
                                    world_size=self.dist.world_size)
        self.model = build_model(model_cfg, backend=self.backend.name, seed=cfg.seed, device=self.dist.device,
                                 expert_parallel=layout is not None,
                                 ep_group=layout.ep_group if layout is not None else None)
        # fsdp2 on one process has nothing to shard: the model stays whole, as with ddp.
        plan = fsdp.parallelize(self.model, strategy=cfg.parallel.strategy, ep=cfg.parallel.ep,
                                device_type=self.dist.device.type, rank=self.dist.rank,
                                world_size=self.dist.world_size, layout=layout)
        self.sharded, self.ep_group, self.expert_params = plan.sharded, plan.ep_group, plan.expert_params
        self.optimizer = build_optimizer(self.model, cfg.optimizer, num_heads=model_cfg.num_attention_heads,
                                         lr=cfg.schedule.lr, backend=self.backend.name)
        self.start_step = 0
        checkpoints = self.output_dir / "checkpoints"
        if self.dist.is_main:  # what a killed earlier run left there, before any rank reads it
            ckpt_folders.recover(checkpoints)
        dist_utils.barrier(self.dist)
        self._history: list[str] = []  # this run's checkpoints, newest first: the only ones it prunes
        if options.resume:
            configured = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            folder = ckpt.resolve_checkpoint(Path(options.resume), log=_stderr if self.dist.is_main else _quiet)
            if dcp_checkpoint.is_dcp_checkpoint(folder):  # sharded: any EP size and world size, EP or not
                state = dcp_checkpoint.load(folder, model=self.model, optimizer=self.optimizer,
                                            total_steps=self.schedule.total_steps, device_type=self.dist.device.type)
            elif cfg.parallel.ep is not None:
                raise ValueError(f"--resume: {folder} holds whole-tensor files (a run without parallel.ep); an "
                                 f"expert-parallel run resumes from sharded checkpoints only")
            else:
                state = ckpt.load_checkpoint(folder, model=self.model,
                                             optimizer=self.optimizer, total_steps=self.schedule.total_steps,
                                             world_size=self.dist.world_size, device_type=self.dist.device.type)
            self._history = ckpt_folders.lineage(checkpoints, folder)
            changed = _restore_configured_hyperparameters(self.optimizer.param_groups, configured)
            if changed and self.dist.is_main:
                print(f"resume: the config's optimizer settings replace the checkpoint's: {'; '.join(changed)}",
                      file=sys.stderr)
            self.packer.load_state_dict(state["data"])
            self.start_step = state["step"]
        self.stop_step = self.schedule.total_steps if options.max_steps is None else \
            min(self.schedule.total_steps, options.max_steps)
        if self.stop_step < self.start_step:
            raise ValueError(f"max_steps: expected >= the resumed checkpoint's step {self.start_step}, "
                             f"got {options.max_steps}")
        self._stage_index: Optional[int] = None  # the stage the model is set up for
        # ddp: DDP-wrapped for the current stage's trainable set; fsdp2: the sharded model itself (FSDP2
        # follows requires_grad changes without re-wrapping)
        self._wrapped: torch.nn.Module = self.model

    # ------------------------------------------------------------------------------------ one step
    def _forward_kwargs(self, stage: StageConfig, step: int) -> dict:
        if stage.kind == "indexer_warmup":  # the MTP layer's indexer warms up too (its sparse stage uses it); the
            # loss is the KL alone: no lm_head
            return dict(attention="dense", indexer_loss=True, mtp_depths=self.cfg.loss.mtp_depths, return_logits=False)
        measure = step % self.cfg.logging.recall_every_steps == 0
        if stage.kind == "sparse":  # the KL trains the indexer every step; the recall is logged on measure steps
            return dict(attention="sparse", indexer_loss=True, mtp_depths=self.cfg.loss.mtp_depths,
                        indexer_kl_target=self.cfg.loss.indexer_kl_target, measure_recall=measure)
        return dict(attention=stage.kind, indexer_loss=measure, mtp_depths=self.cfg.loss.mtp_depths)

    def _step(self, wrapped: torch.nn.Module, stage: StageConfig, step: int) -> dict:
        cfg, d = self.cfg, self.dist
        rows = self.packer.next_batch()[d.rank::d.world_size].to(d.device)  # [B / world, T + 1]
        out = wrapped(rows[:, :-1], **self._forward_kwargs(stage, step))
        lm = mtp = None
        if stage.kind == "indexer_warmup":
            loss = cfg.loss.indexer_kl_weight * out.indexer_kl
        else:
            lm = next_token_loss(out.logits, rows[:, 1:])
            mtp = mtp_loss(out.mtp_logits, rows)
            loss = lm if mtp is None else lm + cfg.loss.mtp_weight * mtp
            if stage.kind == "sparse":
                loss = loss + cfg.loss.indexer_kl_weight * out.indexer_kl
        loss.backward()
        trainable = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = None
        if cfg.optimizer.grad_clip > 0 and trainable:
            grad_norm = float(fsdp.clip_grad_norm(trainable, cfg.optimizer.grad_clip, ep_group=self.ep_group,
                                                  expert_params=self.expert_params))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        counts = dist_utils.all_reduce_sum(out.expert_counts.clone(), d)  # [moe layers, E]
        if stage.kind != "indexer_warmup" and cfg.router.bias_update_rate > 0 and counts.numel():
            self.model.update_router_biases(counts, cfg.router.bias_update_rate)
        values = {"loss": loss, "lm_loss": lm, "mtp_loss": mtp, "indexer_kl": out.indexer_kl,
                  "topk_recall": out.topk_recall}
        present = {k: float(v.detach()) for k, v in values.items() if v is not None}
        averaged = dict(zip(present, dist_utils.mean_across_ranks(list(present.values()), d)))
        averaged["grad_norm"] = grad_norm
        averaged["expert_load_max_over_mean"] = load_balance(counts)
        return averaged

    def train_step(self, step: int) -> dict:
        """Run global step ``step`` (0-based) of the schedule: enter its stage if needed, set the learning
        rates, train on the next batch. Returns the step's metrics record."""
        point = self.schedule.point(step)
        if point.index != self._stage_index:
            self._stage_index = point.index
            _set_trainable(self.model, point.stage, self.cfg.loss.mtp_depths)
            if not self.sharded:
                self._wrapped = dist_utils.wrap_ddp(self.model, self.dist)
        lrs = self.schedule.lrs(step)
        _set_learning_rates(self.optimizer, lrs, self.cfg.optimizer.muon.lr_ratio)
        with registry.record_reference_runs() as ran:
            values = self._step(self._wrapped, point.stage, step)
        return {"step": step + 1, "stage": point.stage.label, **values, "lr": lrs["main"], "indexer_lr": lrs["indexer"],
                "reference_ops": _reference_report(ran)}

    # ------------------------------------------------------------------------------------ the run
    def run(self) -> dict:
        cfg, d = self.cfg, self.dist
        logger = MetricsLogger(self.output_dir, enabled=d.is_main, tensorboard=cfg.logging.tensorboard,
                               resume_step=self.start_step)
        bar = _progress(cfg, d, self.start_step, self.stop_step)
        tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
        rates: list[float] = []
        recent_lm: collections.deque[float] = collections.deque(maxlen=LAST_LOSS_WINDOW)  # the bar's smoothed LM loss
        started = time.perf_counter()
        self.model.train()
        try:
            self._loop(logger, bar, tokens_per_step, rates, recent_lm)
        except BaseException as exc:  # interrupted (Ctrl-C, a kill turned into an exception, an error)
            if bar is not None:
                bar.close()
            logger.close()
            self._plot_interrupted(exc)
            raise
        if bar is not None:
            bar.close()
        logger.close()
        return self._finish(time.perf_counter() - started, rates, list(logger.skipped))

    def _plot_interrupted(self, exc: BaseException) -> None:
        """Rank 0 of an interrupted run plots the steps it logged (the title says partial) and, after Ctrl-C,
        says so in one line on stderr (an error keeps the CLI's own one line)."""
        if not (self.dist.is_main and self.cfg.logging.plot):
            return
        records = read_records(self.output_dir / "metrics.jsonl")
        if not records:
            return
        done, total = records[-1]["step"], self.schedule.total_steps
        why = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"stopped by {type(exc).__name__}"
        try:
            plotted = plot_losses(self.output_dir / "metrics.jsonl", self.output_dir / PLOT_FILE,
                                  title=f"partial run: {why} after step {done} of {total}")
        except Exception:  # the plot must never hide the interruption
            plotted = None
        if isinstance(exc, KeyboardInterrupt):  # an error has its own one line
            shown = (f"{plotted} plots the steps run" if plotted is not None else
                     f"metrics.jsonl holds the steps run ({PLOT_FILE} skipped: matplotlib not installed)")
            print(f"pretrain: {why} after step {done} of {total}: {shown} (--resume continues from the last "
                  f"checkpoint)", file=sys.stderr)

    def _loop(self, logger, bar, tokens_per_step: int, rates: list, recent_lm) -> None:
        for step in range(self.start_step, self.stop_step):
            t0 = time.perf_counter()
            record = self.train_step(step)
            rates.append(tokens_per_step / (time.perf_counter() - t0))
            record.update(tokens_per_s=rates[-1], tokens=(step + 1) * tokens_per_step)
            logger.log(record)
            if record.get("lm_loss") is not None:
                recent_lm.append(record["lm_loss"])
            if bar is not None:
                bar.set_postfix(bar_postfix(record, recent_lm), refresh=False)
                bar.update(1)
            if _checkpoint_due(self.cfg, step + 1, self.stop_step):
                self._save(step + 1)

    def _save(self, done: int) -> None:
        # Every rank takes part (sharded tensors are gathered whole); only rank 0 writes.
        root = self.output_dir / "checkpoints"
        if self.cfg.parallel.ep is not None:  # sharded: every rank writes its own shards (train/dcp_checkpoint.py)
            written = dcp_checkpoint.save(root, step=done, model=self.model, optimizer=self.optimizer,
                                          data_state=self.packer.state_dict(), world_size=self.dist.world_size,
                                          device_type=self.dist.device.type, ep=self.cfg.parallel.ep,
                                          keep_last=self.cfg.checkpoint.keep_last, is_main=self.dist.is_main,
                                          history=self._history)
            if written is not None:
                self._history = ckpt_folders.read_history(root)
            dist_utils.barrier(self.dist)
            return
        written = ckpt.save_checkpoint(root, step=done, model=self.model,
                                       optimizer=self.optimizer, data_state=self.packer.state_dict(),
                                       world_size=self.dist.world_size, device_type=self.dist.device.type,
                                       keep_last=self.cfg.checkpoint.keep_last, write=self.dist.is_main,
                                       history=self._history)
        if written is not None:
            self._history = ckpt_folders.read_history(root)
        dist_utils.barrier(self.dist)

    def _export_model(self) -> Optional[GLM5ForCausalLM]:
        """The model to export in HF layout on rank 0 (None elsewhere): the model itself, or under fsdp2 an
        unsharded copy built from the gathered weights (every rank must call this)."""
        if not self.sharded and self.cfg.parallel.ep is None:
            return self.model if self.dist.is_main else None
        state = fsdp.full_state_dict(self.model, keep=self.dist.is_main, ep_group=self.ep_group)
        if not self.dist.is_main:
            return None
        model_cfg = self.cfg.model_config()
        if self.cfg.parallel.ep is None:
            whole = GLM5ForCausalLM(model_cfg, backend=self.backend.name)
            whole.load_state_dict(state, strict=True)
            return whole
        # expert parallelism: the routed experts (most of the model) are not built a second time beside the
        # gathered ones: built for a rank holding one expert per layer, the rest on the meta device, then every
        # parameter takes the gathered tensor itself (assign)
        whole = GLM5ForCausalLM(model_cfg, backend=self.backend.name,
                                expert_shard=(0, model_cfg.n_routed_experts))
        whole.load_state_dict(state, strict=True, assign=True)
        if model_cfg.tie_word_embeddings:  # assign gave the two names two Parameters over one tensor
            whole.lm_head.weight = whole.model.embed_tokens.weight
        return whole

    def _memory_per_rank(self) -> dict[str, int]:
        """Bytes this rank holds for parameters and optimizer state (its shards under fsdp2)."""
        def local_bytes(t: torch.Tensor) -> int:
            t = t.to_local() if fsdp.is_dtensor(t) else t
            return t.numel() * t.element_size()

        states = [v for opt in self.optimizer.optimizers.values() for s in opt.state.values()
                  for v in s.values() if isinstance(v, torch.Tensor)]
        return {"parameter_bytes_per_rank": sum(local_bytes(p) for p in self.model.parameters()),
                "optimizer_state_bytes_per_rank": sum(local_bytes(v) for v in states)}

    def _finish(self, wall_s: float, rates: list[float], skipped: list[str]) -> dict:
        digests = dist_utils.gather_strings(dist_utils.parameter_digest(self.model, self.ep_group), self.dist)
        export = self._export_model()
        summary = {"backend": self.backend.name, "world_size": self.dist.world_size,
                   "parallel": self.cfg.parallel.strategy if self.dist.enabled else "none",
                   **({"expert_parallel": self.cfg.parallel.ep} if self.cfg.parallel.ep is not None else {}),
                   "steps": [self.start_step, self.stop_step], "wall_s": wall_s,
                   "median_tokens_per_s": statistics.median(rates) if rates else None,
                   "parameter_digests": digests, **self._memory_per_rank()}
        if self.dist.is_main:
            records = read_records(self.output_dir / "metrics.jsonl")
            lm = [r["lm_loss"] for r in records if r.get("lm_loss") is not None]
            if lm:
                summary["first_lm_loss"] = lm[0]
                summary["last_lm_loss"] = statistics.mean(lm[-LAST_LOSS_WINDOW:])
            summary["stages"] = sorted({r["stage"] for r in records}, key=[r["stage"] for r in records].index)
            save_pretrained(export, self.output_dir / EXPORT_DIR)
            summary["hf_checkpoint"] = str(self.output_dir / EXPORT_DIR)
            total = self.schedule.total_steps
            if self.stop_step < total:  # --max-steps: the plot and the closing line say it is partial
                summary["partial"] = {"steps_done": self.stop_step, "total_steps": total}
            if self.cfg.logging.plot:
                title = None if self.stop_step == total else f"partial run: steps 1-{self.stop_step} of {total}"
                plotted = plot_losses(self.output_dir / "metrics.jsonl", self.output_dir / PLOT_FILE, title=title)
                summary["plot"] = str(plotted) if plotted else None
                if plotted is None and importlib.util.find_spec("matplotlib") is None:
                    skipped.append(f"{PLOT_FILE} (matplotlib not installed)")
            summary["metrics_skipped"] = skipped
            (self.output_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1), encoding="utf-8")
        # DDP's reducer holds the process group: free it now, not at interpreter exit, where tearing down its
        # gloo threads aborted a rank now and then ("terminate called without an active exception")
        self._wrapped = self.model
        gc.collect()
        dist_utils.shutdown(self.dist)
        return summary


def bar_postfix(record: dict, recent_lm: Sequence[float]) -> dict[str, str]:
    """The progress bar's fields: the stage, and the LM loss averaged over the last ``LAST_LOSS_WINDOW`` steps
    (what the summary's ``last_lm_loss`` reports at the end), labelled so; before any LM step (an indexer warm-up
    first) the step's indexer KL, labelled so. Never the step's total loss: it adds the MTP and KL terms (the
    KL alone in a warm-up), so it is not comparable across stages or with the summary."""
    fields = {"stage": record["stage"]}
    if recent_lm:
        fields[f"lm_loss_mean{LAST_LOSS_WINDOW}"] = f"{sum(recent_lm) / len(recent_lm):.3f}"
    elif record.get("indexer_kl") is not None:
        fields["indexer_kl"] = f"{record['indexer_kl']:.3f}"
    return fields


def _progress(cfg: TrainConfig, d, start: int, stop: int):
    if not (cfg.logging.progress_bar and d.is_main):
        return None
    from tqdm import tqdm

    interactive = sys.stderr.isatty()  # in a log file, one line every 30 s instead of one per step
    return tqdm(total=stop, initial=start, desc="pretrain", unit="step", dynamic_ncols=True,
                mininterval=0.1 if interactive else 30.0)


def pretrain(cfg: TrainConfig, options: Optional[RunOptions] = None) -> dict:
    """Run (or resume) the pretraining described by ``cfg``; returns the run summary."""
    try:
        return PretrainTrainer(cfg, options or RunOptions()).run()
    except BaseException:
        dist_utils.abandon()
        raise
