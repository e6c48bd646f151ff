"""The 2-process run of ``test_parallel_trainer.py`` (a module of its own: spawned processes import their target by
its name, ``tests.rl.algorithm.parallel_trainer_run``)."""
import datetime
import math
import os

import torch
import torch.distributed as dist

from glm5_core.testing import TOLERANCES

ATOL, RTOL = TOLERANCES[torch.float32]


def _policy():
    from glm5_core.model import GLM5Config, GLM5ForCausalLM

    torch.manual_seed(3)
    cfg = GLM5Config.tiny(num_hidden_layers=2, indexer_types=["full", "shared"], num_nextn_predict_layers=0,
                          index_topk=8, max_position_embeddings=64, n_routed_experts=4)
    return GLM5ForCausalLM(cfg)


def _rollouts(model):
    """Five one-turn trajectories (groups of 2, 2, 1) sampled from ``model`` at temperature 1, the same in every
    process (seeded engine)."""
    from glm5_core.rl.rollout.trajectory import Sample, Trajectory
    from glm5_core.rl.serving.engine import RolloutEngine
    from glm5_core.rl.serving.protocol import GenerateRequest

    engine = RolloutEngine(model, max_batch=5, max_len=64, seed=5)
    requests = [GenerateRequest(f"t{i}", [10 + i, 20, 30 + 2 * i, 40], temperature=1.0, max_new_tokens=4 + i)
                for i in range(5)]
    out = []
    for i, (req, res) in enumerate(zip(requests, engine.generate(requests))):
        s = Sample()
        s.append(req.input_ids, sampled=False)
        s.append(res.output_ids, sampled=True, logprobs=res.logprobs, versions=res.versions)
        out.append(Trajectory(req.rid, f"g{i // 2}", [s], reward=float(i % 2) + 0.25 * i))
    return out


def worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        from glm5_core.rl.algorithm.trainer import PolicyTrainer, TrainerConfig, release_followers
        from glm5_core.train import fsdp

        torch.set_num_threads(1)
        config = TrainerConfig(lr=1e-4, micro_batch_size=2, grad_clip=1.0)
        plain = _policy()
        batch = _rollouts(plain)
        one = PolicyTrainer(plain, config, temperature=1.0)  # one process, no expert parallelism
        want = [one.train_step(batch) for _ in range(2)]

        policy = _policy()
        plan = fsdp.parallelize(policy, strategy="fsdp2", ep=2, device_type="cpu", rank=rank, world_size=world)
        assert plan.sharded and plan.ep_group is not None and plan.expert_params
        held = {name.split(".experts.")[1].split(".")[0] for name, _ in policy.named_parameters()
                if ".experts." in name}
        assert held == {str(2 * rank), str(2 * rank + 1)}, held  # this rank's experts only
        trainer = PolicyTrainer(policy, config, temperature=1.0, parallel=plan)
        weights = os.path.join(os.path.dirname(init_file), "weights")
        if rank == 1:  # as under glm5 rl: rank 0 drives, the other ranks run its calls until released
            trainer.follow()
        else:
            got = [trainer.train_step(batch) for _ in range(2)]
            for step, (g, w) in enumerate(zip(got, want), 1):
                assert math.isfinite(g["loss"]) and math.isfinite(g["grad_norm"]), g
                assert g["trained_samples"] == w["trained_samples"] == 5.0
                assert w["masked_tokens"] < 0.5 and w["grad_norm"] > 0  # the step trains (not all clipped away)
                for key in ("loss", "grad_norm", "ratio", "abs_logprob_diff"):
                    assert math.isclose(g[key], w[key], rel_tol=RTOL, abs_tol=ATOL), (step, key, g[key], w[key])
            path = trainer.save_weights(weights)
            release_followers()
            from safetensors.torch import load_file

            saved = load_file(path)
            whole = plain.state_dict()
            assert set(saved) == set(whole)  # every expert, gathered from both ranks
            for name, t in whole.items():
                torch.testing.assert_close(saved[name], t, atol=1e-5, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # see tests/train/test_distributed.py: gloo's threads may abort interpreter teardown
