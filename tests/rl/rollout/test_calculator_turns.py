"""The long-tailed turn distribution of the calculator environment, as its docstring states it:
``P(n >= k) = (k - 1) ** -alpha``, capped at ``max_numbers`` (configs/rl_longtail.yaml: 2 to 50 turns)."""
import math
import random

from glm5_core.rl.rollout.envs.calculator import CalculatorEnv, long_tailed_count


def test_turn_counts_follow_the_stated_pareto_tail():
    rng, draws = random.Random(0), 40000
    counts = [long_tailed_count(rng, 1.0, 50) for _ in range(draws)]
    assert min(counts) == 2 and max(counts) == 50
    for k, expected in ((2, 1.0), (3, 0.5), (4, 1 / 3), (21, 0.05), (41, 0.025), (50, 1 / 49)):
        share = sum(c >= k for c in counts) / draws
        assert abs(share - expected) < 4 * math.sqrt(expected * (1 - expected) / draws) + 1e-9, (k, share)
    mean = sum(counts) / draws
    assert abs(mean - (1 + sum(1 / j for j in range(1, 50)))) < 0.15  # 1 + H_49 = 5.48


def test_an_episode_takes_as_many_turns_as_it_has_numbers():
    env = CalculatorEnv(pareto_alpha=1.0, max_numbers=50, seed=3)
    for g in range(20):
        episode = env.new_group(f"g{g}", 1)[0]
        turns = 0
        while True:
            turns += 1
            if episode.observe(list(b"1+1\n")):
                break
        assert turns == episode.num_turns == len(episode.numbers)
