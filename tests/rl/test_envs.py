import random

import pytest

from glm5_core.rl.rollout.envs.arithmetic import ArithmeticEnv, score_answer
from glm5_core.rl.rollout.envs.calculator import CalculatorEnv, long_tailed_count
from glm5_core.rl.rollout.envs.calculator_tool import ToolError, calculate
from glm5_core.rl.rollout.envs.codec import ByteCodec
from glm5_core.rl.rollout.envs.context import DROPPED_TEXT, FOLDED_TEXT, ContextManager


def test_score_answer_exact_match_on_first_line():
    assert score_answer("7", 7) == 1.0
    assert score_answer(" 7\nfoo", 7) == 1.0
    assert score_answer("77", 7) == 0.0
    assert score_answer("7.0", 7) == 0.0
    assert score_answer("", 0) == 0.0


def test_arithmetic_episode_rewards_the_sum():
    env = ArithmeticEnv(max_operand=4, seed=1)
    group = env.new_group("g0", 3)
    assert len({(e.a, e.b) for e in group}) == 1
    ep = group[0]
    codec = env.codec
    assert codec.decode(ep.context_tokens()) == f"{ep.a}+{ep.b}="
    assert ep.observe(codec.encode(f"{ep.a + ep.b}\n")) is True
    assert ep.reward == 1.0
    wrong = env.episode("g", 2, 2)
    wrong.observe(codec.encode("5\n"))
    assert wrong.reward == 0.0
    assert len(env.problems()) == 25
    with pytest.raises(ValueError, match="template"):
        ArithmeticEnv(template="{a} plus")


@pytest.mark.parametrize("expr,value", [("1+2*3", 7), ("(1+2)*3", 9), ("-4//3", -2), ("7 % 3", 1), (" 12 ", 12)])
def test_calculator_evaluates_integer_arithmetic(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os')", "2**100", "1/0", "1//0", "a+1", "1.5+1", "", "9" * 80,
                                  "[1]", "(" * 40 + "1" + ")" * 40, "99999999*99999999"])
def test_calculator_rejects_everything_else(expr):
    with pytest.raises(ToolError):
        calculate(expr)


def test_context_manager_folds_old_tool_results_then_drops_history():
    codec = ByteCodec()
    prompt = codec.encode("P\n")
    cm = ContextManager(prompt, codec, keep_recent=2, token_budget=60)
    for i in range(3):
        cm.add_turn(codec.encode(f"m{i}\n"), codec.encode(f"<tool>{i}{i}{i}</tool>\n"))
    text = codec.decode(cm.render())
    assert text == "P\nm0\n" + FOLDED_TEXT + "m1\n<tool>111</tool>\nm2\n<tool>222</tool>\n"
    for i in range(3, 6):
        cm.add_turn(codec.encode(f"m{i}\n"), codec.encode(f"<tool>{i}{i}{i}</tool>\n"))
    text = codec.decode(cm.render())
    assert text == "P\n" + DROPPED_TEXT + "<tool>555</tool>\n"
    assert cm.num_drops == 1
    assert len(cm.render()) <= 60


def test_calculator_episode_runs_one_turn_per_number_and_scores_the_total():
    env = CalculatorEnv(seed=3, max_numbers=5, pareto_alpha=0.5)
    ep = env.new_group("g", 1)[0]
    codec = env.codec
    n = len(ep.numbers)
    total = ep.numbers[0]
    for i in range(1, n):
        assert ep.observe(codec.encode(f"{total}+{ep.numbers[i]}\n")) is False
        total += ep.numbers[i]
        assert f"<tool>{total}</tool>" in codec.decode(ep.context_tokens())
    assert codec.decode(ep.context_tokens()).endswith("answer:")
    assert ep.observe(codec.encode(f"{total}\n")) is True
    assert ep.reward == 1.0 and ep.num_turns == n


def test_turn_counts_are_long_tailed():
    rng = random.Random(0)
    counts = sorted(long_tailed_count(rng, 1.2, 32) for _ in range(4000))
    median, p99 = counts[len(counts) // 2], counts[int(0.99 * len(counts))]
    assert median <= 2 and p99 >= 8 * median


@pytest.mark.parametrize("template", ["{a}+{b}={c}", "{a}+{b}={}", "{a}+{b}={"])
def test_arithmetic_env_rejects_a_template_it_cannot_format_at_construction(template):
    with pytest.raises(ValueError, match="template"):
        ArithmeticEnv(template=template)
    assert ArithmeticEnv(template="{{{a}}}+{b}=").episode("g", 1, 2).context_tokens() == ByteCodec().encode("{1}+2=")


@pytest.mark.parametrize("name, bad", [("max_value", -1), ("max_new_tokens", 0), ("keep_recent", 0),
                                       ("token_budget", 0), ("max_value", 2.5)])
def test_calculator_env_rejects_bad_settings_at_construction(name, bad):
    # before, these passed the constructor and failed at the first group (in a rollout thread) or reached the
    # engine as max_new_tokens=0
    with pytest.raises(ValueError, match=name):
        CalculatorEnv(**{name: bad})
