import pytest
import torch

from glm5_core.rl.algorithm.advantages import distillation_advantage, group_normalized
from glm5_core.rl.algorithm.loss import double_sided_is_loss


def test_group_normalized_matches_manual_and_zero_for_flat_groups():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.0]
    groups = ["a", "a", "a", "a", "b", "b", "c", "c"]
    adv = group_normalized(rewards, groups)
    ga = torch.tensor(rewards[:4], dtype=torch.float64)
    expected_a = ((ga - ga.mean()) / (ga.std(unbiased=False) + 1e-6)).tolist()
    assert adv[:4] == pytest.approx(expected_a)
    assert adv[4:6] == [0.0, 0.0]
    assert adv[6] == pytest.approx(1.0, abs=1e-5) and adv[7] == pytest.approx(-1.0, abs=1e-5)
    with pytest.raises(ValueError, match="equal lengths"):
        group_normalized([1.0], ["a", "b"])


@pytest.mark.parametrize("reward, size", [(0.1, 3), (1e6 + 0.1, 7)])
def test_group_normalized_is_exactly_zero_when_the_mean_of_equal_rewards_rounds(reward, size):
    # sum([0.1] * 3) / 3 != 0.1 in float64: the group's std is ~1e-17, not 0, and dividing by (std + eps) turned
    # that rounding into a nonzero advantage (1e-4 for rewards near 1e6) for a group that carries no signal
    assert group_normalized([reward] * size + [0.0, 1.0], ["flat"] * size + ["x", "x"])[:size] == [0.0] * size


def test_is_loss_gradient_is_ratio_times_advantage_inside_band_and_zero_outside():
    torch.manual_seed(0)
    logp = torch.log(torch.rand(2, 5, dtype=torch.float64) * 0.9 + 0.05).requires_grad_(True)
    shift = torch.tensor([[0.0, 0.1, -0.1, 0.5, -0.9], [0.3, -0.3, 0.05, 0.0, 2.0]], dtype=torch.float64)
    rollout = logp.detach() - shift  # ratio = exp(shift)
    adv = torch.randn(2, 5, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.float64)
    eps_l, eps_h = 0.2, 0.28
    stats = double_sided_is_loss(logp, rollout, adv, mask, eps_low=eps_l, eps_high=eps_h)
    stats.loss.backward()
    ratio = torch.exp(shift)
    in_band = (ratio > 1 - eps_l) & (ratio < 1 + eps_h)
    expected = -(ratio * adv * in_band * mask) / mask.sum()
    assert torch.allclose(logp.grad, expected)
    loss_tokens = mask.bool()
    assert stats.masked_fraction == pytest.approx(float((~in_band & loss_tokens).sum() / loss_tokens.sum()))
    assert stats.num_tokens == 9
    assert stats.mean_abs_logprob_diff == pytest.approx(float((shift.abs() * mask).sum() / 9))


def test_is_loss_on_policy_equals_reinforce():
    logp = torch.log(torch.tensor([[0.2, 0.5, 0.9]])).requires_grad_(True)
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    stats = double_sided_is_loss(logp, logp.detach(), adv, torch.ones(1, 3), eps_low=0.2, eps_high=0.2)
    stats.loss.backward()
    assert torch.allclose(logp.grad, -adv / 3)
    assert stats.masked_fraction == 0.0


def test_is_loss_argument_checks():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="eps_low"):
        double_sided_is_loss(x, x, x, x, eps_low=0.0, eps_high=0.2)
    with pytest.raises(ValueError, match="eps_high"):
        double_sided_is_loss(x, x, x, x, eps_low=0.2, eps_high=-1.0)
    with pytest.raises(ValueError, match="advantages"):
        double_sided_is_loss(x, x, torch.zeros(3), x, eps_low=0.2, eps_high=0.2)


def test_distillation_advantage_is_detached_difference():
    teacher = torch.tensor([-1.0, -2.0])
    policy = torch.tensor([-1.5, -1.0], requires_grad=True)
    adv = distillation_advantage(teacher, policy)
    assert not adv.requires_grad
    assert adv.tolist() == [0.5, -1.0]
    with pytest.raises(ValueError, match="shapes differ"):
        distillation_advantage(teacher, torch.zeros(3))
