"""The RL run: builds the components from an :class:`RLConfig` and runs the sync or async loop.

sync:  rollout a full batch (all groups at once) -> train one step -> push weights -> repeat. The trainer
       waits for the slowest trajectory, the engines wait for the trainer.
async: a producer thread keeps groups in flight and fills the buffer; the trainer takes a batch whenever
       ``batch_size`` trajectories are ready, drops those older than ``max_staleness`` versions, and pushes
       weights every ``push_every`` steps while generation goes on.

Engines are spawned (local processes or Ray actors, on ``rollout.devices``) or external
(``rollout.engine_urls``: SGLang servers, ``glm5 serve``); weights reach them as ``rollout.weight_sync`` says
(see ``fleet/weight_sync``). A trainer that receives no batch for ``train.max_idle_minutes`` ends the run
with :class:`TrainerStarvedError` naming what went wrong.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import statistics
import threading
import time
from typing import Callable, Dict, List, Optional

import torch

from glm5_core.rl.algorithm.buffer import TrajectoryBuffer, staleness
from glm5_core.rl.algorithm.trainer import Trainer
from glm5_core.rl.config import RLConfig
from glm5_core.rl.device import module_device, runtime_device
from glm5_core.rl.fleet.placement import check_visible, engine_devices, probe_accelerators
from glm5_core.rl.fleet.replicas import ReplicaSet, TrajectoryCloser
from glm5_core.rl.fleet.router import ConsistentHashRouter, RoundRobinRouter
from glm5_core.rl.metrics import MetricsLogger, idle_ratio_from_engines, prefill_counters
from glm5_core.rl.rollout.envs.codec import ByteCodec
from glm5_core.rl.rollout.runner import RolloutRunner
from glm5_core.rl.serving.client import EngineClient, EngineRequestError, EngineUnavailable, is_fleet_failure
from glm5_core.rl.serving.worker import WorkerSpec

StepHook = Callable[[int, "RLRun"], None]
PRODUCER_DRAIN_S = 300.0  # after the last step, how long trajectories in flight may take to finish


class TrainerStarvedError(RuntimeError):
    """No training batch arrived for ``train.max_idle_minutes``: the run cannot make progress."""


def build_env(env_cfg: Dict, seed: int):
    cfg = dict(env_cfg)
    name = cfg.pop("name")
    codec = ByteCodec(int(cfg.pop("byte_offset", 0)))
    if name == "arithmetic":
        from glm5_core.rl.rollout.envs.arithmetic import ArithmeticEnv

        return ArithmeticEnv(codec=codec, seed=seed, **cfg)
    from glm5_core.rl.rollout.envs.calculator import CalculatorEnv

    return CalculatorEnv(codec=codec, seed=seed, **cfg)


def build_policy(cfg: RLConfig, checkpoint: Optional[str], backend: Optional[str]):
    """The policy, on ``train.device`` (default: the runtime device of ``backend``)."""
    device = torch.device(cfg.train.device) if cfg.train.device else runtime_device(backend)
    if checkpoint and os.path.isfile(os.path.join(checkpoint, "config.json")):
        from glm5_core.model import load_pretrained

        return load_pretrained(checkpoint, backend=backend).to(device)  # a save_pretrained directory
    return _policy_from_preset(cfg, checkpoint, backend).to(device)


def _policy_from_preset(cfg: RLConfig, checkpoint: Optional[str], backend: Optional[str]):
    from glm5_core.model import GLM5Config, GLM5ForCausalLM

    preset = cfg.model.get("preset", "tiny")
    if preset != "tiny":
        raise ValueError(f"model.preset: expected 'tiny' (or pass --checkpoint), got {preset!r}")
    torch.manual_seed(cfg.seed)
    model = GLM5ForCausalLM(GLM5Config.tiny(**cfg.model.get("overrides", {})), backend=backend)
    if checkpoint:  # a `glm5 pretrain` checkpoint folder: model.safetensors, architecture from model.preset
        weights = os.path.join(checkpoint, "model.safetensors")
        if not os.path.lexists(weights):  # a FIFO or a link out of the folder is refused by load_model_weights
            raise FileNotFoundError(f"--checkpoint: expected config.json (save_pretrained) or model.safetensors "
                                    f"(glm5 pretrain) in {checkpoint!r}")
        from glm5_core.train.checkpoint import load_model_weights

        try:
            load_model_weights(model, weights)
        except ValueError as exc:
            raise ValueError(f"--checkpoint: weights do not fit model.preset: {exc}") from None
    return model


@dataclasses.dataclass
class _Progress:
    """What the training loop counts between steps."""

    started: float
    deadline: float
    last_batch: float
    waited: float = 0.0
    trained_tokens: float = 0.0
    context_tokens: float = 0.0


class RLRun:
    def __init__(self, cfg: RLConfig, *, checkpoint: Optional[str] = None, backend: Optional[str] = None,
                 output_dir: Optional[str] = None, hooks: List[StepHook] = (), log: Callable[[str], None] = print,
                 probe: Callable[[], Dict[str, int]] = probe_accelerators):
        self.cfg = cfg
        self.out_dir = output_dir or cfg.output_dir
        self.backend = None if backend in (None, "auto") else backend
        self.hooks = list(hooks)
        self.log = log
        r = cfg.rollout
        self.external = r.engine_urls is not None
        self.engine_devices = engine_devices(r.devices, r.num_engines)
        check_visible([d for d in self.engine_devices if d], "rollout.devices", probe)
        if cfg.train.device:
            check_visible([cfg.train.device], "train.device", probe)
        torch.set_num_threads(cfg.torch_threads)
        self.model = build_policy(cfg, checkpoint, self.backend)
        self.env = build_env(cfg.env, cfg.seed)
        if self.env.codec.min_vocab_size > self.model.config.vocab_size:
            raise ValueError(f"env.byte_offset: byte tokens need vocab_size >= {self.env.codec.min_vocab_size}, "
                             f"the policy has {self.model.config.vocab_size}")
        teacher = None
        if cfg.train.teacher_checkpoint:
            from glm5_core.model import load_pretrained

            teacher = load_pretrained(cfg.train.teacher_checkpoint, backend=self.backend).to(module_device(self.model))
        self.trainer = Trainer(self.model, cfg.train.optim, temperature=r.temperature, teacher=teacher,
                               routing_replay=cfg.train.routing_replay, index_replay=cfg.train.index_replay)
        self.weights_dir = os.path.join(self.out_dir, "weights")
        self.latest_weights = self.trainer.save_weights(self.weights_dir)
        self.latest_version = self.trainer.version
        self.router = (ConsistentHashRouter(virtual_nodes=r.virtual_nodes, imbalance_factor=r.imbalance_factor)
                       if r.routing == "dp_aware" else RoundRobinRouter())
        self.executor = self._make_executor()
        names = self.executor.names if self.external else [f"engine{i}" for i in range(r.num_engines)]
        self.replicas = ReplicaSet(self.executor, self.router, names, client_factory=self._client)
        self.weight_sync = self._make_weight_sync()
        self.buffer = TrajectoryBuffer(batch_size=cfg.train.batch_size, group_size=r.group_size,
                                       max_staleness=cfg.train.max_staleness)
        self.closer = TrajectoryCloser(self.replicas.end_trajectories)
        self.runner = RolloutRunner(self.env, self.replicas.generate, group_size=r.group_size,
                                    temperature=r.temperature, top_p=r.top_p, max_len=r.max_len,
                                    max_workers=r.episode_threads, forget_fn=self._trajectory_done,
                                    return_routed_experts=cfg.train.routing_replay,
                                    return_indexer_topk=cfg.train.index_replay)
        self.metrics = MetricsLogger(self.out_dir)
        self.summary: Dict = {}
        self._producer: Optional[threading.Thread] = None
        self._producer_errors: List[BaseException] = []

    # -- construction -------------------------------------------------------------------------------------
    def _client(self, url: str) -> EngineClient:
        return EngineClient(url, api_key=self.cfg.rollout.api_key, allow_remote=self.external)

    def _trajectory_done(self, trajectory_id: str) -> None:
        """A trajectory ended: unpin it from its replica and (batched) free its engines' prefix-cache entries."""
        self.router.forget(trajectory_id)
        self.closer.add(trajectory_id)

    def _spec(self, name: str) -> WorkerSpec:
        r = self.cfg.rollout
        index = int(name.replace("engine", "") or 0)
        return WorkerSpec(model_config=self.model.config.to_hf_dict(), weights_path=self.latest_weights,
                          weight_version=self.latest_version, weights_dir=self.weights_dir, backend=self.backend,
                          max_batch=r.max_batch, max_len=r.max_len, prefix_cache_entries=r.prefix_cache_entries,
                          prefix_cache_tokens=r.prefix_cache_tokens,
                          seed=self.cfg.seed * 1000 + index + 7919 * self.latest_version,
                          torch_threads=r.engine_threads, placement=self.engine_devices[index],
                          record_routing=self.cfg.train.routing_replay, record_index_topk=self.cfg.train.index_replay)

    def _make_executor(self):
        if self.external:
            from glm5_core.rl.fleet.executors.external import ExternalEngines

            return ExternalEngines(self.cfg.rollout.engine_urls)
        if self.cfg.executor == "ray":
            from glm5_core.rl.fleet.executors.ray_executor import RayExecutor

            return RayExecutor(self._spec)
        from glm5_core.rl.fleet.executors.local import LocalProcessExecutor

        return LocalProcessExecutor(self._spec)

    def _make_weight_sync(self):
        from glm5_core.rl.fleet.weight_sync import DiskWeightSync, DistributedWeightSync

        r = self.cfg.rollout
        if r.weight_sync == "distributed":
            return DistributedWeightSync(self.replicas, master_address=r.sync_master_address, backend=r.sync_backend,
                                         bucket_bytes=int(r.sync_bucket_mb * (1 << 20)),
                                         flush_cache=r.flush_cache_on_sync)
        return DiskWeightSync(self.replicas, flush_cache=r.flush_cache_on_sync)

    # -- evaluation ---------------------------------------------------------------------------------------
    def evaluate(self) -> Optional[float]:
        """Mean reward over every problem of the arithmetic task (sampled at the rollout temperature)."""
        problems = getattr(self.env, "problems", None)
        if problems is None:
            return None
        r = self.cfg.rollout
        episodes = [self.env.episode("eval", a, b) for (a, b) in problems()
                    for _ in range(self.cfg.eval.samples_per_problem)]

        def one(i_ep):
            i, ep = i_ep
            limits = ep.turn_limits()
            tid = f"eval-{self.trainer.version}-{i}"
            try:
                response = self.replicas.generate(tid, {
                    "input_ids": ep.context_tokens(), "return_logprob": False, "rid": tid,
                    "sampling_params": {"temperature": r.temperature, "top_p": r.top_p,
                                        "max_new_tokens": limits.max_new_tokens,
                                        "stop_token_ids": list(limits.stop_token_ids)}})
            except (EngineUnavailable, EngineRequestError) as exc:
                if not is_fleet_failure(exc):
                    raise
                return None  # the fleet gave up on this sample: the mean goes over the others
            finally:  # unpin it and free its prefix-cache entry, like any finished trajectory
                self._trajectory_done(tid)
            ep.observe(response["output_ids"])
            return ep.reward

        rewards = [r for r in self.runner._pool.map(one, enumerate(episodes)) if r is not None]
        self.closer.flush()  # free the evaluation's cache entries now, not with the next training batch
        return sum(rewards) / len(rewards) if rewards else None

    # -- weights --------------------------------------------------------------------------------------------
    def _push_weights(self) -> None:
        """The trainer's weights to every engine (``rollout.weight_sync``)."""
        self.latest_weights = self.trainer.save_weights(self.weights_dir)  # what a restarted worker boots from
        self.latest_version = self.trainer.version
        if self.cfg.rollout.weight_sync == "distributed":
            self.weight_sync.push(self.model, self.latest_version)
        elif self.external:  # SGLang loads an HF-format directory
            from glm5_core.rl.fleet.weight_sync import write_hf_directory

            path = write_hf_directory(self.model, os.path.join(self.weights_dir, "hf"))
            self.weight_sync.push(os.path.abspath(path), self.latest_version)
        else:
            self.weight_sync.push(self.latest_weights, self.latest_version)

    # -- the run, step by step ----------------------------------------------------------------------------
    def run(self) -> Dict:
        try:
            self._start_fleet()
            eval0 = self._evaluate_at_start()
            info_start = self.replicas.info()
            progress = self._start_loop()
            while self.trainer.version < self.cfg.max_steps and time.monotonic() < progress.deadline:
                batch = self._next_batch(progress)
                if batch is None:
                    if self.cfg.mode == "async":
                        break  # the budget ran out while waiting
                    continue
                row = self._train_on(batch, progress)
                self._log_step(row)
            elapsed = time.monotonic() - progress.started
            self._drain()
            return self._finish(eval0, info_start, progress, elapsed)
        finally:
            self._teardown()

    def _start_fleet(self) -> None:
        """Start (or reach) the engines; external ones get the trainer's initial weights first, so every
        engine samples from the policy the trainer starts from."""
        self.replicas.start()
        if self.external:
            self._push_weights()

    def _evaluate_at_start(self) -> Optional[float]:
        eval0 = self.evaluate()
        if eval0 is not None:
            self.log(f"[rl] eval reward at step 0: {eval0:.3f}")
            self.metrics.log(0, {"eval_reward": eval0})
        return eval0

    def _start_loop(self) -> _Progress:
        now = time.monotonic()
        progress = _Progress(started=now, deadline=now + self.cfg.max_minutes * 60, last_batch=now)
        if self.cfg.mode == "async":
            self._producer = threading.Thread(
                target=self.runner.run_forever, name="rl-producer", daemon=True,
                kwargs=dict(sink=self.buffer.put, max_inflight_groups=self.cfg.rollout.max_inflight_groups,
                            backlog=self.buffer.num_ready, max_buffered=self.cfg.rollout.max_buffered,
                            errors=self._producer_errors, drain_timeout=PRODUCER_DRAIN_S))
            self._producer.start()
        return progress

    def _next_batch(self, progress: _Progress):
        """The next training batch (None: none this time); raises :class:`TrainerStarvedError` once none came
        for ``train.max_idle_minutes``."""
        t0 = time.monotonic()
        starve_at = progress.last_batch + self.cfg.train.max_idle_minutes * 60
        if self.cfg.mode == "async":
            batch = self.buffer.take(self.trainer.version, timeout=max(0.1, min(progress.deadline, starve_at) - t0))
            if self._producer_errors:
                raise self._producer_errors[0]
        else:  # only the groups still missing from the batch (failed groups leave it short)
            missing = max(0, self.cfg.train.batch_size - self.buffer.num_ready())
            for t in self.runner.run_groups(-(-missing // self.cfg.rollout.group_size)):
                self.buffer.put(t)
            batch = self.buffer.take(self.trainer.version, timeout=0)
        now = time.monotonic()
        progress.waited += now - t0
        if batch is not None:
            progress.last_batch = now
        elif now >= starve_at and now < progress.deadline:
            raise TrainerStarvedError(self._starvation_reason(now - progress.last_batch))
        return batch

    def _starvation_reason(self, idle_s: float) -> str:
        sync_error = getattr(self.weight_sync, "last_error", "")
        return (f"no training batch for {idle_s / 60:.1f} min (train.max_idle_minutes="
                f"{self.cfg.train.max_idle_minutes}) at step {self.trainer.version}: "
                f"{self.buffer.dropped_stale} trajectories dropped as stale (train.max_staleness="
                f"{self.cfg.train.max_staleness}), {self.runner.rollout_failures} rollouts failed on every engine, "
                f"{self.runner.env_failures} environment failures, healthy engines "
                f"{self.router.healthy_replicas() or 'none'}"
                + (f"; last engine error: {self.replicas.last_error}" if self.replicas.last_error else "")
                + (f"; last weight-sync error: {sync_error}" if sync_error else ""))

    def _train_on(self, batch, progress: _Progress) -> Dict:
        """One optimizer step on ``batch`` (and a weight push when due); the step's metrics row."""
        ages = staleness(batch, self.trainer.version)  # versions behind the trainer
        stats = self.trainer.train_step(batch)
        if self.trainer.should_push():
            self._push_weights()
        progress.trained_tokens += stats["trained_tokens"]
        progress.context_tokens += stats["context_tokens"]
        elapsed = time.monotonic() - progress.started
        row = dict(stats)
        row.update(reward=sum(t.reward for t in batch) / len(batch),
                   turns=sum(t.num_turns for t in batch) / len(batch),
                   trainer_idle_ratio=progress.waited / elapsed, elapsed_s=elapsed,
                   trained_tokens_per_s=progress.trained_tokens / elapsed,
                   staleness_mean=statistics.mean(ages) if ages else 0.0,  # none if nothing was sampled
                   staleness_histogram={str(k): n for k, n in sorted(collections.Counter(ages).items())},
                   dropped_stale=self.buffer.dropped_stale, replacements=self.replicas.replacements)
        step = self.trainer.version
        if self.cfg.eval.every and step % self.cfg.eval.every == 0:
            row["eval_reward"] = self.evaluate()
        return row

    def _log_step(self, row: Dict) -> None:
        step = self.trainer.version
        self.metrics.log(step, row)
        if step % 10 == 0 or step == 1:
            self.log(f"[rl] step {step} reward {row['reward']:.3f} idle {row['trainer_idle_ratio']:.2f} "
                     f"tok/s {row['trained_tokens_per_s']:.1f} masked {row['masked_tokens']:.3f}"
                     + (f" eval {row['eval_reward']:.3f}" if "eval_reward" in row else ""))
        for hook in self.hooks:
            hook(step, self)

    def _drain(self) -> None:
        """Stop issuing rollouts; the producer finishes the trajectories in flight before it returns."""
        self.runner.stop()
        if self._producer is not None:
            self._producer.join(timeout=PRODUCER_DRAIN_S + 30)
            if self._producer.is_alive():
                self._producer_errors.append(
                    TimeoutError(f"rollout producer still draining after {PRODUCER_DRAIN_S} s"))

    def _finish(self, eval0: Optional[float], info_start: Dict, progress: _Progress, elapsed: float) -> Dict:
        """Final evaluation, the summary (written to summary.json), the reward curve."""
        info_end = self.replicas.info()
        eval_end = self.evaluate()
        counters = prefill_counters(info_end)
        per_s = max(elapsed, 1e-9)
        self.summary = {
            "mode": self.cfg.mode, "steps": self.trainer.version, "elapsed_s": elapsed,
            "trained_tokens": progress.trained_tokens, "trained_tokens_per_s": progress.trained_tokens / per_s,
            "context_tokens_per_s": progress.context_tokens / per_s,
            "trainer_idle_ratio": progress.waited / per_s,
            "rollout_idle_ratio": idle_ratio_from_engines(info_start, info_end),
            "staleness_histogram": {str(k): v for k, v in sorted(self.buffer.staleness_histogram.items())},
            "dropped_stale": self.buffer.dropped_stale, "env_failures": self.runner.env_failures,
            "rollout_failures": self.runner.rollout_failures,
            "replacements": self.replicas.replacements, "failed_restarts": self.replicas.failed_restarts,
            "failed_requests": self.replicas.failed_requests,
            "prefill_tokens": counters["prefill_tokens"], "prefill_tokens_saved": counters["cached_tokens"],
            "engine_busy_s": counters["busy_seconds"], "engine_prefill_s": counters["prefill_seconds"],
            "weight_sync": self.cfg.rollout.weight_sync, "weight_sync_s": list(self.weight_sync.seconds),
            "failed_pushes": getattr(self.weight_sync, "failed_pushes", 0),
            "eval_reward_start": eval0, "eval_reward_end": eval_end,
            "issued_trajectories": len(self.runner.issued_ids), "trained_trajectories": len(self.buffer.taken_ids),
            "producer_errors": [f"{type(e).__name__}: {e}" for e in self._producer_errors],
        }
        if eval_end is not None:
            self.metrics.log(self.trainer.version, {"eval_reward": eval_end})
        self.metrics.log(self.trainer.version, {"summary": self.summary})
        title = f"glm5 rl ({self.cfg.env['name']}, {self.cfg.mode})"
        self.summary["reward_curve"] = self.metrics.reward_curve(title=title)
        self.summary["metrics_skipped"] = list(self.metrics.skipped)
        with open(os.path.join(self.out_dir, "summary.json"), "w", encoding="utf-8") as f:
            json.dump(self.summary, f, indent=2)
        return self.summary

    def _teardown(self) -> None:
        self.runner.stop()
        self.runner.shutdown()
        self.buffer.close()
        self.weight_sync.shutdown()
        self.replicas.shutdown()
        self.metrics.close()

    def accounting(self) -> Dict[str, List[str]]:
        """Where every issued trajectory ended up (for exactly-once checks)."""
        return {"issued": list(self.runner.issued_ids), "trained": list(self.buffer.taken_ids),
                "dropped": list(self.buffer.dropped_ids), "buffered": self.buffer.leftover_ids()}
