"""Held-out evaluation: the arithmetic eval set is disjoint from the training problems, pass@k is the
unbiased estimator (checked against enumerating every k-subset), greedy answers are sampled at temperature 0."""
import itertools

import pytest

from glm5_core.rl.evaluation import Evaluator, pass_at_k
from glm5_core.rl.rollout.envs.arithmetic import ArithmeticEnv


@pytest.mark.parametrize("n,c,k", [(n, c, k) for n in range(1, 7) for c in range(n + 1) for k in range(1, n + 1)])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_sample(n, c, k):
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_pass_at_k_checks_its_arguments():
    for n, c, k in ((4, 5, 1), (4, 1, 5), (4, 1, 0), (4, -1, 1)):
        with pytest.raises(ValueError, match="pass_at_k"):
            pass_at_k(n, c, k)


@pytest.mark.parametrize("max_operand,held_out,split_seed", [(1, 0.2, 0), (4, 0.2, 0), (4, 0.4, 3), (9, 0.1, 7),
                                                             (30, 0.5, 1)])
def test_arithmetic_held_out_problems_are_disjoint_from_training_ones(max_operand, held_out, split_seed):
    env = ArithmeticEnv(max_operand=max_operand, held_out=held_out, split_seed=split_seed, seed=5)
    train, held = set(env.train_problems()), set(env.eval_problems())
    assert train and held and not train & held
    assert train | held == set(env.problems())
    n = (max_operand + 1) ** 2
    assert len(held) == min(n - 1, max(1, round(held_out * n)))
    drawn = {(e.a, e.b) for i in range(400) for e in env.new_group(f"g{i}", 1)}
    assert drawn <= train  # training never draws a held-out problem
    assert {(ep.a, ep.b) for ep in (make("eval") for make in env.eval_set())} == held
    # the split is the task's, not the run's: another run seed holds out the same problems
    assert set(ArithmeticEnv(max_operand=max_operand, held_out=held_out, split_seed=split_seed,
                             seed=99).eval_problems()) == held


def test_arithmetic_without_a_held_out_share_evaluates_every_problem_and_samples_as_before():
    env = ArithmeticEnv(max_operand=4, held_out=0.0, seed=1)
    assert env.eval_problems() == env.problems() == env.train_problems()
    import random

    rng = random.Random(1)
    for i in range(20):
        a, b = rng.randint(0, 4), rng.randint(0, 4)
        group = env.new_group(f"g{i}", 1)
        assert (group[0].a, group[0].b) == (a, b)


@pytest.mark.parametrize("kwargs,message", [({"held_out": 1.0}, "held_out: expected a share in"),
                                            ({"held_out": 0.2, "max_operand": 0}, "held_out: expected 0 with"),
                                            ({"held_out": 0.2, "max_operand": 300}, "held_out: expected 0 with"),
                                            ({"split_seed": "x"}, "split_seed: expected an int")])
def test_arithmetic_split_arguments_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ArithmeticEnv(**kwargs)


def test_evaluator_reports_greedy_accuracy_and_pass_at_k():
    """A fake policy: greedy answers are right for a < 2; sampled answers are right for the first sample of
    every problem only."""
    env = ArithmeticEnv(max_operand=3, max_new_tokens=1, held_out=0.5, split_seed=0)
    codec = env.codec
    temperatures, forgotten = [], []

    def generate(tid, request):
        temperature = request["sampling_params"]["temperature"]
        temperatures.append(temperature)
        text = codec.decode(request["input_ids"])  # "a+b="
        a, b = int(text[0]), int(text[2])
        right = (a < 2) if temperature == 0 else tid.endswith("-1")  # job 0 is greedy, 1..n sampled
        return {"output_ids": codec.encode(str(a + b if right else a + b + 1)[-1])}

    evaluator = Evaluator(env.eval_set(), generate=generate, forget=forgotten.append, map_fn=map,
                          temperature=0.7, top_p=1.0, max_len=16, samples_per_problem=4, pass_k=[1, 2, 4],
                          greedy=True, correct_reward=1.0)
    result = evaluator.run("0")
    held = env.eval_problems()
    one_digit = [(a, b) for a, b in held if a + b < 10]
    assert result["eval_problems"] == len(held) == len(one_digit)
    assert result["eval_greedy"] == pytest.approx(sum(a < 2 for a, _ in held) / len(held))
    assert result["eval_pass@1"] == pytest.approx(0.25) and result["eval_reward"] == pytest.approx(0.25)
    assert result["eval_pass@2"] == pytest.approx(pass_at_k(4, 1, 2))
    assert result["eval_pass@4"] == pytest.approx(1.0)
    assert temperatures.count(0.0) == len(held) and temperatures.count(0.7) == 4 * len(held)
    assert len(forgotten) == 5 * len(held)  # every eval trajectory is unpinned
