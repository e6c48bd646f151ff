"""The trainer recomputes log-probs at the rollout temperature (one source of truth), rejects greedy
training rollouts, and leaves the MoE router biases alone."""
import pytest
import torch

from glm5_core.rl.algorithm.trainer import PolicyTrainer, TrainerConfig
from glm5_core.rl.config_loader import config_from_dict
from glm5_core.rl.rollout.runner import RolloutRunner
from glm5_core.rl.rollout.trajectory import Sample, Trajectory
from glm5_core.rl.serving.engine import RolloutEngine
from glm5_core.rl.serving.protocol import GenerateRequest


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
    trainer = PolicyTrainer(small_policy, TrainerConfig(lr=1e-3, micro_batch_size=3), temperature=temperature)
    stats = trainer.train_step(batch)  # |logp_train - logp_rollout| is measured before the update
    assert stats["abs_logprob_diff"] <= 1e-5
    assert stats["masked_tokens"] == 0.0


def test_router_biases_are_unchanged_by_a_trainer_step(small_policy):
    with torch.no_grad():
        for i, bias in enumerate(small_policy.router_biases()):
            bias.copy_(torch.linspace(-0.3, 0.2 + i, bias.numel()))  # non-trivial values: zeroing would show
    before = [b.clone() for b in small_policy.router_biases()]
    weights_before = small_policy.lm_head.weight.detach().clone()
    trainer = PolicyTrainer(small_policy, TrainerConfig(lr=1e-2), temperature=1.0)
    assert not any(p is b for p in trainer.trainable for b in small_policy.router_biases())
    trainer.train_step(rollouts(small_policy, 1.0))
    assert not torch.equal(small_policy.lm_head.weight, weights_before)  # the step did update the policy
    for b0, b1 in zip(before, small_policy.router_biases()):
        assert torch.equal(b0, b1)


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, float("nan"), float("inf"), True, "1.0"])
def test_training_rollouts_reject_greedy_or_invalid_temperature(small_policy, bad):
    with pytest.raises(ValueError, match="rollout.temperature"):
        PolicyTrainer(small_policy, TrainerConfig(), temperature=bad)
    with pytest.raises(ValueError, match="rollout.temperature"):
        config_from_dict({"rollout": {"temperature": bad}})
    with pytest.raises(ValueError, match="temperature"):
        RolloutRunner(env=None, generate_fn=None, group_size=2, temperature=bad, top_p=1.0, max_len=16)


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.01, float("nan"), True, "0.9"])
def test_a_top_p_every_engine_would_refuse_is_refused_with_the_config(bad):
    with pytest.raises(ValueError, match="rollout.top_p"):
        config_from_dict({"rollout": {"top_p": bad}})
    assert config_from_dict({"rollout": {"top_p": 1}}).rollout.top_p == 1


@pytest.mark.parametrize("key, bad", [("eps_low", 0.0), ("eps_low", 1.5), ("eps_high", 0.0),
                                      ("eps_high", float("nan"))])
def test_an_importance_sampling_band_the_loss_refuses_is_refused_with_the_config(key, bad):
    # before, it passed config validation and raised only at the first loss, after a whole batch of rollouts
    with pytest.raises(ValueError, match=key):
        config_from_dict({"train": {"optim": {key: bad}}})


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, float("nan"), True])
def test_rollout_runner_refuses_a_top_p_every_engine_would_refuse(bad):
    with pytest.raises(ValueError, match="top_p"):
        RolloutRunner(env=None, generate_fn=None, group_size=2, temperature=1.0, top_p=bad, max_len=16)


def test_config_has_one_temperature_and_names_both_keys_when_a_second_is_given():
    with pytest.raises(ValueError, match=r"train\.optim\.temperature.*rollout\.temperature"):
        config_from_dict({"rollout": {"temperature": 0.7}, "train": {"optim": {"temperature": 1.0}}})
    assert config_from_dict({"rollout": {"temperature": 0.7}}).rollout.temperature == 0.7


def test_the_indexer_stays_frozen_while_the_policy_trains(small_policy):
    indexer_before = [p.detach().clone() for p in small_policy.indexer_parameters()]
    assert indexer_before
    trainer = PolicyTrainer(small_policy, TrainerConfig(lr=1e-2), temperature=1.0)
    assert all(not p.requires_grad for p in small_policy.indexer_parameters())
    weights_before = small_policy.lm_head.weight.detach().clone()
    trainer.train_step(rollouts(small_policy, 1.0))
    assert not torch.equal(small_policy.lm_head.weight, weights_before)
    for before, after in zip(indexer_before, small_policy.indexer_parameters()):
        assert torch.equal(before, after)


def _policy_copy(model, perturb: float = 0.0):
    import copy

    twin = copy.deepcopy(model)
    if perturb:
        with torch.no_grad():
            twin.lm_head.weight.add_(perturb * torch.randn(twin.lm_head.weight.shape,
                                                           generator=torch.Generator().manual_seed(1)))
    return twin.eval()


def test_distillation_from_an_identical_teacher_changes_nothing(small_policy):
    batch = rollouts(small_policy, 1.0)
    plain_model, taught_model = _policy_copy(small_policy), _policy_copy(small_policy)
    PolicyTrainer(plain_model, TrainerConfig(lr=1e-2), temperature=1.0).train_step(batch)
    taught = PolicyTrainer(taught_model, TrainerConfig(lr=1e-2, distill_coef=0.5), temperature=1.0,
                     teacher=_policy_copy(small_policy))
    stats = taught.train_step(batch)
    assert abs(stats["distill_adv"]) < 1e-6
    # The teacher's no-grad forward may take other kernels than the policy's (fp32 rounding ~1e-7 in log-probs),
    # which AdamW amplifies where gradients are tiny: the two updates differ by under 1% (L2).
    def flat(model):
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    update = flat(plain_model) - flat(small_policy)
    gap = flat(taught_model) - flat(plain_model)
    assert update.norm() > 1e-3 and gap.norm() < 0.01 * update.norm()


def test_distillation_advantage_is_teacher_minus_student_on_sampled_tokens(small_policy):
    from glm5_core.rl.algorithm.trainer import pad_samples, sequence_logprobs

    batch = rollouts(small_policy, 1.0)
    teacher = _policy_copy(small_policy, perturb=0.5)
    samples = [s for t in batch for s in t.samples]
    padded = pad_samples(samples)
    with torch.no_grad():
        student_logp, _ = sequence_logprobs(small_policy.eval(), padded["input_ids"], 1.0)
        teacher_logp, _ = sequence_logprobs(teacher, padded["input_ids"], 1.0)
    mask = padded["loss_mask"]
    expected = float(((teacher_logp - student_logp) * mask).sum() / mask.sum())
    assert abs(expected) > 1e-3  # the perturbed teacher does disagree
    trainer = PolicyTrainer(small_policy, TrainerConfig(lr=1e-2, distill_coef=1.0), temperature=1.0, teacher=teacher)
    stats = trainer.train_step(batch)
    assert stats["distill_adv"] == pytest.approx(expected, rel=1e-4, abs=1e-6)


def _equal_reward_batch(model):
    batch = rollouts(model, 1.0)
    for t in batch:
        t.reward = 1.0  # one reward per group: zero advantages, no policy-gradient signal
    return batch


def test_entropy_coef_raises_the_policy_entropy_where_the_loss_alone_gives_no_gradient(small_policy):
    from glm5_core.rl.algorithm.trainer import pad_samples, sequence_logprobs_and_entropy

    with torch.no_grad():
        small_policy.lm_head.weight.mul_(3.0)  # sharper than at init: below the uniform entropy
    batch = _equal_reward_batch(small_policy)
    padded = pad_samples([s for t in batch for s in t.samples])

    def mean_entropy():
        with torch.no_grad():
            _, entropy = sequence_logprobs_and_entropy(small_policy, padded["input_ids"], 1.0)
        return float((entropy * padded["loss_mask"]).sum() / padded["loss_mask"].sum())

    weights_before = small_policy.lm_head.weight.detach().clone()
    plain = PolicyTrainer(small_policy, TrainerConfig(lr=1e-2), temperature=1.0)
    assert plain.train_step(batch)["grad_norm"] == 0.0 and "entropy" not in plain.train_step(batch)
    assert torch.equal(small_policy.lm_head.weight, weights_before)  # zero advantages: nothing moves
    start = mean_entropy()
    trainer = PolicyTrainer(small_policy, TrainerConfig(lr=1e-3, entropy_coef=0.1), temperature=1.0)
    stats = trainer.train_step(batch)
    assert stats["grad_norm"] > 0 and stats["entropy"] == pytest.approx(start, rel=1e-4)
    for _ in range(4):
        trainer.train_step(batch)
    assert mean_entropy() > start


def test_entropy_is_that_of_the_softmax_at_the_rollout_temperature(small_policy):
    from glm5_core.rl.algorithm.trainer import sequence_logprobs, sequence_logprobs_and_entropy

    ids = torch.tensor([[3, 7, 11, 5, 9]])
    with torch.no_grad():
        logp, entropy = sequence_logprobs_and_entropy(small_policy, ids, 0.7)
        plain, _ = sequence_logprobs(small_policy, ids, 0.7)
        probs = torch.softmax(small_policy(ids, attention="sparse").logits[:, :-1].double() / 0.7, dim=-1)
    assert torch.equal(logp, plain)
    assert torch.allclose(entropy.double(), -(probs * probs.log()).sum(-1), atol=1e-4)
    with pytest.raises(ValueError, match="entropy_coef"):
        TrainerConfig(entropy_coef=-0.1).validate()
