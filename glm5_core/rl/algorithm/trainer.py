"""RL trainer: recomputes log-probs of the sampled tokens, applies the double-sided IS loss, steps the
optimizer, and publishes weights for the engines every ``push_every`` steps.

Legend: B samples in a micro-batch, T padded length (targets shifted: position t scores token t + 1).

During RL the DSA indexer is frozen (no gradient, no indexer loss) and attention runs in ``"sparse"`` mode
with the deterministic top-k, so the trainer selects exactly the keys the engine selected. MoE router
biases (``e_score_correction_bias``, buffers, so never in the optimizer) are not updated: the trainer
takes no aux-loss-free step during RL.

Log-probs are recomputed at the rollout's sampling temperature (``rollout.temperature``, passed in as
``temperature``), the single temperature both sides of the importance ratio pi_theta / pi_rollout use.
Every tensor the trainer builds is created on the policy's device.

Parallel (``parallel``, a ``train.fsdp.Parallelized``: the policy built alike on every rank of a process group and
put through ``train.fsdp.parallelize``, the pretraining driver's own path: expert parallelism over a 2-D
DeviceMesh, FSDP2): every rank calls :meth:`PolicyTrainer.train_step` with the same batch and trains its share of
the samples (sample i on rank i % world), in the same number of micro-batches everywhere (a rank short of one runs
a stand-in with weight 0, so the MoE exchanges and FSDP2's collectives pair up); the objective keeps the token mean
over the whole batch (FSDP2 averages the ranks' gradients, so each rank's sum is scaled by the world size), the
statistics are summed over the ranks, the gradient norm is clipped over the meshes (``fsdp.clip_grad_norm``) and
:meth:`save_weights` gathers the whole policy (every rank calls it; rank 0 writes). Under ``glm5 rl`` only rank 0
runs the driver: its trainer tells the other ranks, waiting in :meth:`PolicyTrainer.follow`, which of those two
calls comes next (and the batch) before it runs it, and :func:`release_followers` ends them.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Optional

import torch

from glm5_core import device_kinds
from glm5_core.rl.algorithm.advantages import AdvantageFn, distillation_advantage, group_normalized, resolve_advantage
from glm5_core.rl.algorithm.loss import LossFn, double_sided_is_loss, resolve_loss
from glm5_core.rl.algorithm.replay_batch import pad_traces
from glm5_core.rl.config import TrainerConfig
from glm5_core.rl.device import module_device
from glm5_core.rl.rollout.trajectory import Sample, Trajectory
from glm5_core.rl.serving.replay_trace import TraceLayout
from glm5_core.rl.serving.sampling import check_training_temperature, token_logprobs


def pad_samples(samples: Sequence[Sample], device=None) -> dict[str, torch.Tensor]:
    """Right-pad samples into input ids [B, T] and shifted targets / masks / rollout log-probs [B, T-1],
    on ``device`` (default cpu)."""
    T = max(len(s.tokens) for s in samples)
    B = len(samples)
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.float32)
    rollout = torch.zeros(B, T, dtype=torch.float32)
    for i, s in enumerate(samples):
        n = len(s.tokens)
        ids[i, :n] = torch.tensor(s.tokens, dtype=torch.long)
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        rollout[i, :n] = torch.tensor(s.logprobs, dtype=torch.float32)
    if bool(mask[:, 0].any()):
        raise ValueError("samples: the first token of a sample cannot be a sampled token (no context)")
    ids, mask, rollout = (t.to(device) for t in (ids, mask, rollout))  # built on the host, moved once
    return {"input_ids": ids, "targets": ids[:, 1:], "loss_mask": mask[:, 1:], "rollout_logprobs": rollout[:, 1:]}


def sequence_logprobs(model, input_ids_BT: torch.Tensor, temperature: float, *,
                      routing_replay: Optional[torch.Tensor] = None,
                      index_replay: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """log pi(token t+1 | tokens <= t) for t < T-1: [B, T-1], and the DSA top-k per full-indexer layer.
    ``routing_replay`` / ``index_replay``: the rollout's experts / keys (``replay_batch.pad_traces``)."""
    out = model(input_ids_BT, attention="sparse", routing_replay=routing_replay, index_replay=index_replay)
    logp = token_logprobs(out.logits[:, :-1], input_ids_BT[:, 1:], temperature)  # [B, T-1]
    return logp, out.topk_idx


def sequence_logprobs_and_entropy(model, input_ids_BT: torch.Tensor, temperature: float, *,
                                  routing_replay: Optional[torch.Tensor] = None,
                                  index_replay: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``sequence_logprobs``' log-probs [B, T-1] and the entropy of pi(. | tokens <= t) at ``temperature``,
    [B, T-1], from one forward."""
    out = model(input_ids_BT, attention="sparse", routing_replay=routing_replay, index_replay=index_replay)
    logits_BTV = out.logits[:, :-1]
    logp = token_logprobs(logits_BTV, input_ids_BT[:, 1:], temperature)  # [B, T-1]
    logp_all = torch.log_softmax(logits_BTV.float() / temperature, dim=-1)  # [B, T-1, V]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [B, T-1]
    return logp, entropy


class PolicyTrainer:
    """``temperature``: the rollout's sampling temperature (``rollout.temperature``), > 0. ``routing_replay`` /
    ``index_replay`` (``train.routing_replay`` / ``train.index_replay``): the policy's forward uses the experts /
    DSA keys the engine used for each sample (its recorded traces; see ``glm5_core.model.replay``)."""

    def __init__(self, model, config: TrainerConfig, *, temperature: float, teacher=None,
                 loss_fn: LossFn = double_sided_is_loss, advantage_fn: AdvantageFn = group_normalized,
                 routing_replay: bool = False, index_replay: bool = False, parallel=None):
        self.model = model
        self.parallel = parallel  # train.fsdp.Parallelized, or None: one process
        self.loss_fn, self.advantage_fn = loss_fn, advantage_fn  # train.loss / train.advantage
        self.replay = {"routing": bool(routing_replay), "index": bool(index_replay)}
        self.config = config.validate()
        self.temperature = check_training_temperature(temperature)
        self.device = module_device(model)
        if config.distill_coef > 0 and teacher is None:
            raise ValueError("trainer.distill_coef > 0 needs a teacher checkpoint")
        if teacher is not None and module_device(teacher) != self.device:
            raise ValueError(f"teacher: expected a model on the policy's device {self.device}, "
                             f"got one on {module_device(teacher)}")
        self.teacher = teacher.eval() if teacher is not None else None
        for p in model.indexer_parameters():
            p.requires_grad_(False)
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        # sharded: the experts' DTensors live on another mesh than the rest, so no multi-tensor (foreach) kernel
        # mixes them
        foreach = False if self._world > 1 else None
        self.optimizer = torch.optim.AdamW(self.trainable, lr=config.lr, betas=config.betas,
                                           weight_decay=config.weight_decay, foreach=foreach)
        self.step_count = 0
        self._weight_files: list[str] = []  # the files save_weights wrote, oldest first: the only ones it prunes

    @property
    def _world(self) -> int:
        return self.parallel.world_size if self.parallel is not None else 1

    @property
    def version(self) -> int:
        """Policy version = optimizer steps taken."""
        return self.step_count

    # -- the other ranks of a parallel trainer (glm5 rl under torchrun) ---------------------------------------
    def _lead(self, command: str, payload=None) -> None:
        """Rank 0 of a parallel trainer: tell the ranks waiting in :meth:`follow` what runs next."""
        if self._world > 1 and self.parallel.rank == 0:
            _broadcast_command(command, payload)

    def follow(self) -> None:
        """Ranks other than 0: run each collective call rank 0's trainer runs (its train_step with the same batch,
        its save_weights), in its order, until rank 0 calls :func:`release_followers`."""
        if self._world == 1 or self.parallel.rank == 0:
            raise ValueError("follow: expected a parallel trainer on a rank other than 0")
        while True:
            message = [None, None]
            torch.distributed.broadcast_object_list(message, src=0)
            command, payload = message
            if command == "release":
                return
            if command == "train_step":
                self.train_step(payload)
            elif command == "save_weights":
                self.save_weights(*payload)
            else:
                raise ValueError(f"follow: unexpected command {command!r:.40} from rank 0")

    def train_step(self, trajectories: list[Trajectory]) -> dict[str, float]:
        self._lead("train_step", trajectories)
        cfg = self.config
        self.model.train()
        advantages = self.advantage_fn([t.reward for t in trajectories], [t.group_id for t in trajectories])
        items = [(s, a) for t, a in zip(trajectories, advantages) for s in t.samples]
        total_tokens = sum(s.num_generated for s, _ in items)
        stats = {"masked_tokens": 0.0, "abs_logprob_diff": 0.0, "ratio": 0.0, "loss": 0.0, "distill_adv": 0.0}
        if cfg.entropy_coef > 0:
            stats["entropy"] = 0.0
        untraced = {f"{kind}_replay_untraced_samples": 0.0 for kind, on in self.replay.items() if on}
        stats.update(untraced)  # the same keys on every rank (summed over the ranks in parallel)
        self.optimizer.zero_grad(set_to_none=True)
        for chunk, weight in self._micro_batches(items):
            batch = pad_samples([s for s, _ in chunk], self.device)
            replay = self._replay_tensors([s for s, _ in chunk], stats if weight else {})
            entropy = None
            if cfg.entropy_coef > 0:
                logp, entropy = sequence_logprobs_and_entropy(self.model, batch["input_ids"], self.temperature,
                                                              **replay)
            else:
                logp, _ = sequence_logprobs(self.model, batch["input_ids"], self.temperature, **replay)
            adv_B = torch.tensor([a for _, a in chunk], dtype=torch.float32, device=self.device)
            adv = adv_B.unsqueeze(1).expand_as(logp).clone()  # [B, T-1]
            if self.teacher is not None and cfg.distill_coef > 0:
                with torch.no_grad():
                    teacher_logp, _ = sequence_logprobs(self.teacher, batch["input_ids"], self.temperature)
                distill = distillation_advantage(teacher_logp, logp.detach())
                adv = adv + cfg.distill_coef * distill
                stats["distill_adv"] += weight * float((distill * batch["loss_mask"]).sum())
            result = self.loss_fn(logp, batch["rollout_logprobs"], adv, batch["loss_mask"],
                                          eps_low=cfg.eps_low, eps_high=cfg.eps_high)
            n = result.num_tokens
            objective = result.loss * n / max(total_tokens, 1)  # token mean over the whole batch
            if entropy is not None:
                entropy_sum = (entropy * batch["loss_mask"]).sum()
                objective = objective - cfg.entropy_coef * entropy_sum / max(total_tokens, 1)
                stats["entropy"] += weight * float(entropy_sum.detach())
            if self._world > 1:  # FSDP2 averages the ranks' gradients: each rank's share of the sum, times world
                objective = objective * (weight * self._world)
            objective.backward()
            stats["loss"] += weight * float(result.loss.detach()) * n
            stats["masked_tokens"] += weight * result.masked_fraction * n
            stats["abs_logprob_diff"] += weight * result.mean_abs_logprob_diff * n
            stats["ratio"] += weight * result.mean_ratio * n
        if self._world > 1:
            stats = self._summed_over_ranks(stats)
        grad_norm = self._clip(cfg.grad_clip) if cfg.grad_clip > 0 else None
        self.optimizer.step()
        self.step_count += 1
        denom = max(total_tokens, 1)
        out = {k: v / denom for k, v in stats.items() if k not in untraced}
        out.update({k: stats[k] for k in untraced})  # counts of samples trained without their trace
        out.update(trained_tokens=float(total_tokens), trained_samples=float(len(items)),
                   context_tokens=float(sum(len(s.tokens) for s, _ in items)),
                   grad_norm=float(grad_norm) if grad_norm is not None else 0.0)
        return out

    def _micro_batches(self, items: list) -> list[tuple[list, float]]:
        """This rank's micro-batches of ``items`` [(chunk, weight)]: all of them on one process; in parallel,
        items i % world == rank, as many micro-batches on every rank (a rank short of one gets a stand-in,
        ``items[:1]`` at weight 0: its forward and backward join the collectives and add nothing)."""
        size = self.config.micro_batch_size
        if self._world == 1:
            return [(items[start:start + size], 1.0) for start in range(0, len(items), size)]
        mine = items[self.parallel.rank::self._world]
        per_rank = -(-len(items) // self._world)  # ceil: the most items a rank gets
        rounds = -(-per_rank // size)
        chunks = [(mine[i * size:(i + 1) * size], 1.0) for i in range(rounds)]
        return [(chunk, weight) if chunk else (items[:1], 0.0) for chunk, weight in chunks]

    def _summed_over_ranks(self, stats: dict[str, float]) -> dict[str, float]:
        keys = sorted(stats)
        # on the policy's device: an accelerator's collective library reduces only tensors on its device (a CPU
        # tensor has no backend in its process group); in fp64 where that device computes it (several do not)
        facts = device_kinds.facts_for(self.device.type)
        dtype = torch.float64 if facts is None or facts.supports(torch.float64) else torch.float32
        total = torch.tensor([stats[k] for k in keys], dtype=dtype, device=self.device)
        torch.distributed.all_reduce(total)
        return dict(zip(keys, total.tolist()))

    def _clip(self, max_norm: float) -> torch.Tensor:
        if self._world == 1:
            return torch.nn.utils.clip_grad_norm_(self.trainable, max_norm)
        from glm5_core.train import fsdp

        return fsdp.clip_grad_norm(self.trainable, max_norm, ep_group=self.parallel.ep_group,
                                   expert_params=self.parallel.expert_params)

    def _replay_tensors(self, samples: list[Sample], stats: dict[str, float]) -> dict[str, torch.Tensor]:
        """The micro-batch's routing_replay / index_replay forward arguments, for the kinds switched on."""
        cfg = self.model.config
        layout = TraceLayout.of(cfg)
        widths = {"routing": cfg.num_experts_per_tok, "index": cfg.index_topk}
        out = {}
        for kind, on in self.replay.items():
            if on:
                out[f"{kind}_replay"], missing = pad_traces(samples, kind, layout, widths[kind], device=self.device)
                key = f"{kind}_replay_untraced_samples"
                stats[key] = stats.get(key, 0.0) + missing
        return out

    def should_push(self) -> bool:
        return self.step_count % self.config.push_every == 0

    def save_weights(self, weights_dir: str, keep: int = 3) -> str:
        """Write the current weights as ``v{version}.safetensors`` (atomically) and keep the ``keep`` newest
        files this trainer wrote: pruned by write history, not by name, so a run into a directory holding an
        earlier run's ``v000040.safetensors`` keeps its own ``v000000`` (the earlier files are left alone
        until this run writes the same name)."""
        from safetensors.torch import save_file

        self._lead("save_weights", (weights_dir, keep))
        path = os.path.join(weights_dir, f"v{self.version:06d}.safetensors")
        if self.parallel is not None and (self._world > 1 or self.parallel.sharded):  # every rank gathers
            from glm5_core.train import fsdp

            writer = self.parallel.rank == 0
            state = fsdp.full_state_dict(self.model, keep=writer, ep_group=self.parallel.ep_group)
            if not writer:
                return path
        else:
            state = {k: v.detach().contiguous().clone() for k, v in self.model.state_dict().items()}
        os.makedirs(weights_dir, exist_ok=True)
        tmp = path + ".tmp"
        save_file({k: v.contiguous() for k, v in state.items()}, tmp)
        os.replace(tmp, path)
        self._weight_files = [f for f in self._weight_files if f != path] + [path]
        for old in self._weight_files[:-keep]:
            try:
                os.remove(old)
            except FileNotFoundError:
                pass
        self._weight_files = self._weight_files[-keep:]
        return path


def _broadcast_command(command: str, payload=None) -> None:
    """Rank 0 -> every rank in ``PolicyTrainer.follow``: the next call and its arguments (between the ranks of
    one job, as torch's own object collectives pass them)."""
    torch.distributed.broadcast_object_list([command, payload], src=0)


def release_followers() -> None:
    """Rank 0 of ``glm5 rl`` under torchrun, once, whatever way its run ended: the other ranks leave
    ``PolicyTrainer.follow`` (also when rank 0 failed before building its trainer). No-op elsewhere."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size() > 1 and torch.distributed.get_rank() == 0:
        _broadcast_command("release")


def build_trainer(cfg, model, backend: Optional[str], parallel=None) -> PolicyTrainer:
    """The trainer of RLConfig ``cfg`` for ``model``: ``train.optim``, the ``train.loss`` / ``train.advantage``
    plug-ins, replay, and a distillation teacher (``train.teacher_checkpoint``) on the policy's device;
    ``parallel``: what ``rl/policy.parallelize_policy`` did to the policy (None: nothing)."""
    teacher = None
    if cfg.train.teacher_checkpoint:
        from glm5_core.model import load_pretrained

        teacher = load_pretrained(cfg.train.teacher_checkpoint, backend=backend).to(module_device(model))
    t = cfg.train
    return PolicyTrainer(model, t.optim, temperature=cfg.rollout.temperature, teacher=teacher,
                         loss_fn=resolve_loss(t.loss), advantage_fn=resolve_advantage(t.advantage),
                         routing_replay=t.routing_replay, index_replay=t.index_replay, parallel=parallel)
