"""The trainer recomputes log-probs at the rollout temperature (one source of truth), rejects greedy
training rollouts, and leaves the MoE router biases alone."""
import pytest
import torch

from glm5_core.rl.config import config_from_dict
from glm5_core.rl.engine import RolloutEngine
from glm5_core.rl.protocol import GenerateRequest
from glm5_core.rl.rollout import RolloutRunner
from glm5_core.rl.trainer import Trainer, TrainerConfig
from glm5_core.rl.trajectory import Sample, Trajectory


@pytest.fixture
def small_policy():
    """A fresh tiny policy per test (the trainer changes its weights)."""
    from glm5_core.model import GLM5Config, GLM5ForCausalLM

    torch.manual_seed(3)
    cfg = GLM5Config.tiny(num_hidden_layers=2, indexer_types=["full", "shared"], num_nextn_predict_layers=0,
                          index_topk=8, max_position_embeddings=64)
    return GLM5ForCausalLM(cfg)


def rollouts(model, temperature):
    """Four one-turn trajectories in two groups with distinct rewards, sampled at ``temperature``."""
    engine = RolloutEngine(model, max_batch=4, max_len=64, seed=5)
    requests = [GenerateRequest(f"t{i}", [10 + i, 20, 30 + 2 * i, 40], temperature=temperature, max_new_tokens=5)
                for i in range(4)]
    trajectories = []
    for i, (req, res) in enumerate(zip(requests, engine.generate(requests))):
        s = Sample()
        s.append(req.input_ids, sampled=False)
        s.append(res.output_ids, sampled=True, logprobs=res.logprobs, versions=res.versions)
        trajectories.append(Trajectory(req.rid, f"g{i // 2}", [s], reward=float(i % 2)))
    return trajectories


@pytest.mark.parametrize("temperature", [0.6, 1.3])
def test_trainer_recomputes_logprobs_at_the_rollout_temperature(small_policy, temperature):
    batch = rollouts(small_policy, temperature)
    trainer = Trainer(small_policy, TrainerConfig(lr=1e-3, micro_batch_size=3), temperature=temperature)
    stats = trainer.train_step(batch)  # |logp_train - logp_rollout| is measured before the update
    assert stats["abs_logprob_diff"] <= 1e-5
    assert stats["masked_tokens"] == 0.0


def test_router_biases_are_unchanged_by_a_trainer_step(small_policy):
    with torch.no_grad():
        for i, bias in enumerate(small_policy.router_biases()):
            bias.copy_(torch.linspace(-0.3, 0.2 + i, bias.numel()))  # non-trivial values: zeroing would show
    before = [b.clone() for b in small_policy.router_biases()]
    weights_before = small_policy.lm_head.weight.detach().clone()
    trainer = Trainer(small_policy, TrainerConfig(lr=1e-2), temperature=1.0)
    assert not any(p is b for p in trainer.trainable for b in small_policy.router_biases())
    trainer.train_step(rollouts(small_policy, 1.0))
    assert not torch.equal(small_policy.lm_head.weight, weights_before)  # the step did update the policy
    for b0, b1 in zip(before, small_policy.router_biases()):
        assert torch.equal(b0, b1)


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, float("nan"), float("inf"), True, "1.0"])
def test_training_rollouts_reject_greedy_or_invalid_temperature(small_policy, bad):
    with pytest.raises(ValueError, match="rollout.temperature"):
        Trainer(small_policy, TrainerConfig(), temperature=bad)
    with pytest.raises(ValueError, match="rollout.temperature"):
        config_from_dict({"rollout": {"temperature": bad}})
    with pytest.raises(ValueError, match="temperature"):
        RolloutRunner(env=None, generate_fn=None, group_size=2, temperature=bad, top_p=1.0, max_len=16)


def test_config_has_one_temperature_and_names_both_keys_when_a_second_is_given():
    with pytest.raises(ValueError, match=r"train\.optim\.temperature.*rollout\.temperature"):
        config_from_dict({"rollout": {"temperature": 0.7}, "train": {"optim": {"temperature": 1.0}}})
    assert config_from_dict({"rollout": {"temperature": 0.7}}).rollout.temperature == 0.7
