"""Plug-ins the plug-in tests name by import path (``tests.rl.plugin_fixtures:...``)."""

from glm5_core.rl.algorithm.loss import double_sided_is_loss
from glm5_core.rl.rollout.envs.arithmetic import ArithmeticEnv
from glm5_core.rl.rollout.envs.base import Environment, Episode
from glm5_core.rl.rollout.envs.codec import ByteCodec


class ConstantEnv(Environment):
    """Every group asks ``a + b`` for fixed a and b (a stand-in third-party environment)."""

    def __init__(self, *, a: int, b: int = 1, codec: ByteCodec = None, seed: int = 0):
        if a < 0:
            raise ValueError(f"a: expected an int >= 0, got {a!r}")
        self._inner = ArithmeticEnv(max_operand=max(a, b), max_new_tokens=1, held_out=0.0, codec=codec, seed=seed)
        self.codec, self.a, self.b, self.seed = self._inner.codec, a, b, seed

    def new_group(self, group_id: str, group_size: int) -> list[Episode]:
        return [self._inner.episode(group_id, self.a, self.b) for _ in range(group_size)]


def make_constant_env(a: int, b: int = 1, codec: ByteCodec = None, seed: int = 0) -> ConstantEnv:
    return ConstantEnv(a=a, b=b, codec=codec, seed=seed)


def not_an_env(**kwargs):
    return object()


def length_reward(scale: float = 1.0):
    """A reward factory: the reward is ``scale`` times the number of sampled tokens."""
    def score(sample) -> float:
        return scale * len(sample["response_ids"])
    return score


def mean_zero_advantage(rewards, group_ids):
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def broken_advantage(rewards):
    return list(rewards)


def scaled_loss(logp, rollout_logp, advantages, loss_mask, *, eps_low, eps_high):
    return double_sided_is_loss(logp, rollout_logp, 2.0 * advantages, loss_mask, eps_low=eps_low, eps_high=eps_high)


NOT_CALLABLE = 3


def one_advantage_for_all(rewards, group_ids):
    return [0.0]
