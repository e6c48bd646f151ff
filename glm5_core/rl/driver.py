"""The RL run: builds the components from an :class:`RLConfig` and runs the sync or async loop.

sync:  rollout a full batch (all groups at once) -> train one step -> push weights -> repeat. The trainer
       waits for the slowest trajectory, the engines wait for the trainer.
async: a producer thread keeps groups in flight and fills the buffer; the trainer takes a batch whenever
       ``batch_size`` trajectories are ready, drops those older than ``max_staleness`` versions, and pushes
       weights every ``push_every`` steps while generation goes on.
"""
from __future__ import annotations

import collections
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
from glm5_core.rl.fleet.replicas import ReplicaSet, TrajectoryCloser
from glm5_core.rl.fleet.router import ConsistentHashRouter, RoundRobinRouter
from glm5_core.rl.metrics import MetricsLogger, idle_ratio_from_engines, prefill_counters
from glm5_core.rl.rollout.envs.codec import ByteCodec
from glm5_core.rl.rollout.runner import RolloutRunner
from glm5_core.rl.serving.client import EngineRequestError, EngineUnavailable, is_fleet_failure
from glm5_core.rl.serving.worker import WorkerSpec

StepHook = Callable[[int, "RLRun"], None]
PRODUCER_DRAIN_S = 300.0  # after the last step, how long trajectories in flight may take to finish


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
    """The policy, on the runtime device of ``backend``."""
    device = runtime_device(backend)
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


class RLRun:
    def __init__(self, cfg: RLConfig, *, checkpoint: Optional[str] = None, backend: Optional[str] = None,
                 output_dir: Optional[str] = None, hooks: List[StepHook] = (), log: Callable[[str], None] = print):
        self.cfg = cfg
        self.out_dir = output_dir or cfg.output_dir
        self.backend = None if backend in (None, "auto") else backend
        self.hooks = list(hooks)
        self.log = log
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
        self.trainer = Trainer(self.model, cfg.train.optim, temperature=cfg.rollout.temperature, teacher=teacher)
        self.weights_dir = os.path.join(self.out_dir, "weights")
        self.latest_weights = self.trainer.save_weights(self.weights_dir)
        self.latest_version = self.trainer.version
        r = cfg.rollout
        self.router = (ConsistentHashRouter(virtual_nodes=r.virtual_nodes, imbalance_factor=r.imbalance_factor)
                       if r.routing == "dp_aware" else RoundRobinRouter())
        self.executor = self._make_executor()
        self.replicas = ReplicaSet(self.executor, self.router, [f"engine{i}" for i in range(r.num_engines)])
        self.buffer = TrajectoryBuffer(batch_size=cfg.train.batch_size, group_size=r.group_size,
                                       max_staleness=cfg.train.max_staleness)
        self.closer = TrajectoryCloser(self.replicas.end_trajectories)
        self.runner = RolloutRunner(self.env, self.replicas.generate, group_size=r.group_size,
                                    temperature=r.temperature, top_p=r.top_p, max_len=r.max_len,
                                    max_workers=r.episode_threads, forget_fn=self._trajectory_done)
        self.metrics = MetricsLogger(self.out_dir)
        self.summary: Dict = {}

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
                          torch_threads=r.engine_threads)

    def _make_executor(self):
        if self.cfg.executor == "ray":
            from glm5_core.rl.fleet.executors.ray_executor import RayExecutor

            return RayExecutor(self._spec)
        from glm5_core.rl.fleet.executors.local import LocalProcessExecutor

        return LocalProcessExecutor(self._spec)

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

    # -- main loop ----------------------------------------------------------------------------------------
    def _push_weights(self) -> None:
        self.latest_weights = self.trainer.save_weights(self.weights_dir)
        self.latest_version = self.trainer.version
        self.replicas.broadcast_weights(self.latest_weights, self.latest_version)

    def run(self) -> Dict:
        cfg = self.cfg
        self.replicas.start()
        producer_errors: List[BaseException] = []
        producer = None
        try:
            eval0 = self.evaluate()
            if eval0 is not None:
                self.log(f"[rl] eval reward at step 0: {eval0:.3f}")
                self.metrics.log(0, {"eval_reward": eval0})
            info_start = self.replicas.info()
            t_start = time.monotonic()
            deadline = t_start + cfg.max_minutes * 60
            waited = 0.0
            trained_tokens = context_tokens = 0.0
            if cfg.mode == "async":
                producer = threading.Thread(target=self.runner.run_forever, name="rl-producer", daemon=True, kwargs=dict(
                    sink=self.buffer.put, max_inflight_groups=cfg.rollout.max_inflight_groups,
                    backlog=self.buffer.num_ready, max_buffered=cfg.rollout.max_buffered, errors=producer_errors,
                    drain_timeout=PRODUCER_DRAIN_S))
                producer.start()
            while self.trainer.version < cfg.max_steps and time.monotonic() < deadline:
                t0 = time.monotonic()
                if cfg.mode == "async":
                    batch = self.buffer.take(self.trainer.version, timeout=max(1.0, deadline - t0))
                    if producer_errors:
                        raise producer_errors[0]
                    if batch is None:
                        break
                else:  # only the groups still missing from the batch (failed groups leave it short)
                    missing = max(0, cfg.train.batch_size - self.buffer.num_ready())
                    for t in self.runner.run_groups(-(-missing // cfg.rollout.group_size)):
                        self.buffer.put(t)
                    batch = self.buffer.take(self.trainer.version, timeout=0)
                    if batch is None:  # every group failed or was stale
                        continue
                waited += time.monotonic() - t0
                ages = staleness(batch, self.trainer.version)  # versions behind the trainer
                stats = self.trainer.train_step(batch)
                if self.trainer.should_push():
                    self._push_weights()
                trained_tokens += stats["trained_tokens"]
                context_tokens += stats["context_tokens"]
                elapsed = time.monotonic() - t_start
                row = dict(stats)
                row.update(reward=sum(t.reward for t in batch) / len(batch),
                           turns=sum(t.num_turns for t in batch) / len(batch),
                           trainer_idle_ratio=waited / elapsed, elapsed_s=elapsed,
                           trained_tokens_per_s=trained_tokens / elapsed,
                           staleness_mean=statistics.mean(ages) if ages else 0.0,  # none if nothing was sampled
                           staleness_histogram={str(k): n for k, n in sorted(collections.Counter(ages).items())},
                           dropped_stale=self.buffer.dropped_stale, replacements=self.replicas.replacements)
                step = self.trainer.version
                if cfg.eval.every and step % cfg.eval.every == 0:
                    row["eval_reward"] = self.evaluate()
                self.metrics.log(step, row)
                if step % 10 == 0 or step == 1:
                    self.log(f"[rl] step {step} reward {row['reward']:.3f} idle {row['trainer_idle_ratio']:.2f} "
                             f"tok/s {row['trained_tokens_per_s']:.1f} masked {row['masked_tokens']:.3f}"
                             + (f" eval {row['eval_reward']:.3f}" if "eval_reward" in row else ""))
                for hook in self.hooks:
                    hook(step, self)
            elapsed = time.monotonic() - t_start
            self.runner.stop()
            if producer is not None:  # it finishes the trajectories in flight (drain) before it returns
                producer.join(timeout=PRODUCER_DRAIN_S + 30)
                if producer.is_alive():
                    producer_errors.append(TimeoutError(f"rollout producer still draining after {PRODUCER_DRAIN_S} s"))
            info_end = self.replicas.info()
            eval_end = self.evaluate()
            counters = prefill_counters(info_end)
            self.summary = {
                "mode": cfg.mode, "steps": self.trainer.version, "elapsed_s": elapsed,
                "trained_tokens": trained_tokens, "trained_tokens_per_s": trained_tokens / max(elapsed, 1e-9),
                "context_tokens_per_s": context_tokens / max(elapsed, 1e-9),
                "trainer_idle_ratio": waited / max(elapsed, 1e-9),
                "rollout_idle_ratio": idle_ratio_from_engines(info_start, info_end),
                "staleness_histogram": {str(k): v for k, v in sorted(self.buffer.staleness_histogram.items())},
                "dropped_stale": self.buffer.dropped_stale, "env_failures": self.runner.env_failures,
                "rollout_failures": self.runner.rollout_failures,
                "replacements": self.replicas.replacements, "failed_restarts": self.replicas.failed_restarts,
                "failed_requests": self.replicas.failed_requests,
                "prefill_tokens": counters["prefill_tokens"], "prefill_tokens_saved": counters["cached_tokens"],
                "engine_busy_s": counters["busy_seconds"], "engine_prefill_s": counters["prefill_seconds"],
                "eval_reward_start": eval0, "eval_reward_end": eval_end,
                "issued_trajectories": len(self.runner.issued_ids), "trained_trajectories": len(self.buffer.taken_ids),
                "producer_errors": [f"{type(e).__name__}: {e}" for e in producer_errors],
            }
            if eval_end is not None:
                self.metrics.log(self.trainer.version, {"eval_reward": eval_end})
            self.metrics.log(self.trainer.version, {"summary": self.summary})
            self.summary["reward_curve"] = self.metrics.reward_curve(title=f"glm5 rl ({cfg.env['name']}, {cfg.mode})")
            self.summary["metrics_skipped"] = list(self.metrics.skipped)
            with open(os.path.join(self.out_dir, "summary.json"), "w", encoding="utf-8") as f:
                json.dump(self.summary, f, indent=2)
            return self.summary
        finally:
            self.runner.stop()
            self.runner.shutdown()
            self.buffer.close()
            self.replicas.shutdown()
            self.metrics.close()

    def accounting(self) -> Dict[str, List[str]]:
        """Where every issued trajectory ended up (for exactly-once checks)."""
        return {"issued": list(self.runner.issued_ids), "trained": list(self.buffer.taken_ids),
                "dropped": list(self.buffer.dropped_ids), "buffered": self.buffer.leftover_ids()}
