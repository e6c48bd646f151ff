import random
import re

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


@pytest.mark.parametrize("template, field", [("{a}+{b}={b:>20}", "{b:>20}"), ("{a}+{b}={a!r}", "{a!r}"),
                                             ("{a}+{b}={a.upper}", "{a.upper}"), ("{a}+{b}={b[0]}", "{b[0]}")])
def test_arithmetic_env_refuses_a_field_with_a_format_spec_conversion_or_lookup(template, field):
    """A width is a size in the config text: {a:900000000} made `glm5 rl --check-config` build a 900 MB prompt."""
    with pytest.raises(ValueError, match=re.escape(f"(a field {field}")):
        ArithmeticEnv(template=template)


@pytest.mark.parametrize("name, bad", [("max_value", -1), ("max_new_tokens", 0), ("keep_recent", 0),
                                       ("token_budget", 0), ("max_value", 2.5)])
def test_calculator_env_rejects_bad_settings_at_construction(name, bad):
    # before, these passed the constructor and failed at the first group (in a rollout thread) or reached the
    # engine as max_new_tokens=0
    with pytest.raises(ValueError, match=name):
        CalculatorEnv(**{name: bad})


def test_arithmetic_answer_width_zero_pads_every_sum_and_refuses_a_width_that_pads_nothing():
    env = ArithmeticEnv(max_operand=9, max_new_tokens=2, answer_width=2)
    codec = env.codec
    assert [env.episode("g", a, b).expected for a, b in ((3, 4), (0, 0), (9, 9))] == ["07", "00", "18"]
    padded, unpadded = env.episode("g", 3, 4), ArithmeticEnv(max_operand=9).episode("g", 3, 4)
    for ep in (padded, unpadded):
        ep.observe(codec.encode("07"))
    assert (padded.reward, unpadded.reward) == (1.0, 0.0)
    padded.observe(codec.encode("7\n"))
    assert padded.reward == 0.0
    for kwargs, message in (({"answer_width": 1}, "answer_width: expected 0 .* or an int >= 2"),
                            ({"max_operand": 50, "answer_width": 2}, "answer_width: expected 0 .* or an int >= 3"),
                            ({"answer_width": True}, "answer_width: expected"),
                            ({"answer_width": 2, "max_new_tokens": 1}, "max_new_tokens: expected >= answer_width=2"),
                            ({"partial_credit": 1}, "partial_credit: expected true or false")):
        with pytest.raises(ValueError, match=message):
            ArithmeticEnv(**{"max_operand": 9, "max_new_tokens": 3, **kwargs})


@pytest.mark.parametrize("answer,exact_only,partial", [("07", 1.0, 1.0), ("17", 0.0, 0.5), ("08", 0.0, 0.5),
                                                       ("70", 0.0, 0.0), ("0", 0.0, 0.5), ("077", 0.0, 2 / 3),
                                                       ("", 0.0, 0.0), (" 07\nx", 1.0, 1.0)])
def test_arithmetic_partial_credit_pays_the_digits_right_in_place_and_only_an_exact_answer_in_full(
        answer, exact_only, partial):
    rewards = []
    for partial_credit in (False, True):
        env = ArithmeticEnv(max_operand=9, max_new_tokens=3, answer_width=2, partial_credit=partial_credit)
        ep = env.episode("g", 3, 4)
        ep.observe(env.codec.encode(answer))
        rewards.append(ep.reward)
    assert rewards == [exact_only, pytest.approx(partial)]


def test_arithmetic_options_are_config_keys_checked_at_config_time():
    from glm5_core.rl.rollout.envs.registry import env_problems

    assert env_problems({"name": "arithmetic", "max_operand": 9, "max_new_tokens": 2, "answer_width": 2,
                         "partial_credit": True}) == []
    problems = env_problems({"name": "arithmetic", "max_operand": 9, "max_new_tokens": 2, "answer_width": 1})
    assert len(problems) == 1 and "answer_width: expected 0" in problems[0]


def test_arithmetic_max_digit_lists_only_operands_whose_digits_are_small_and_their_sums_never_carry():
    env = ArithmeticEnv(max_operand=44, max_digit=4, held_out=0.2, seed=3)
    operands = sorted({a for a, _ in env.problems()})
    assert operands == [10 * t + u for t in range(5) for u in range(5)]
    assert len(env.problems()) == 625 and len(env.eval_problems()) == 125
    for a, b in env.problems():  # every column's digits add up without a carry
        assert all(int(x) + int(y) <= 8 for x, y in zip(str(a).zfill(2), str(b).zfill(2)))
    drawn = {(e.a, e.b) for i in range(300) for e in env.new_group(f"g{i}", 1)}
    assert drawn <= set(env.train_problems())
    every_pair = ArithmeticEnv(max_operand=44, max_digit=4, held_out=0.0, seed=3)
    assert {(e.a, e.b) for i in range(300) for e in every_pair.new_group(f"g{i}", 1)} <= set(env.problems())
    # a split counts the listed operands, not max_operand: 8 operands up to 300 hold 64 pairs
    assert len(ArithmeticEnv(max_operand=300, max_digit=1, held_out=0.25).eval_problems()) == 16
    with pytest.raises(ValueError, match="held_out: expected 0 with"):
        ArithmeticEnv(max_operand=300, held_out=0.25)
    assert ArithmeticEnv(max_operand=12, max_digit=1).problems() == [(a, b) for a in (0, 1, 10, 11)
                                                                     for b in (0, 1, 10, 11)]


def test_arithmetic_operand_width_zero_pads_the_prompt_only():
    env = ArithmeticEnv(max_operand=44, max_digit=4, operand_width=2, answer_width=2, max_new_tokens=2)
    ep = env.episode("g", 3, 41)
    assert env.codec.decode(ep.context_tokens()) == "03+41="
    assert ep.expected == "44"
    assert ArithmeticEnv(max_operand=44).codec.decode(ArithmeticEnv(max_operand=44).episode("g", 3, 41)
                                                      .context_tokens()) == "3+41="


@pytest.mark.parametrize("kwargs,message", [({"max_digit": 10}, "max_digit: expected an int in"),
                                            ({"max_digit": 4, "max_operand": 4}, "max_digit: expected 9"),
                                            ({"operand_width": 1}, "operand_width: expected 0 .* or an int >= 2"),
                                            ({"operand_width": 2, "max_operand": 100}, "operand_width: .* >= 3"),
                                            ({"max_digit": 4, "max_operand": 4444, "held_out": 0.2},
                                             "held_out: expected 0 with .*625 operands")])
def test_arithmetic_operand_options_are_checked(kwargs, message):
    kwargs = {"max_operand": 44, **kwargs}
    with pytest.raises(ValueError, match=message):
        ArithmeticEnv(**kwargs)


def test_arithmetic_max_b_bounds_the_second_operand_only():
    env = ArithmeticEnv(max_operand=44, max_digit=4, max_b=4, operand_width=2, answer_width=2, max_new_tokens=2,
                        held_out=0.2, seed=2)
    assert env.problems() == [(a, b) for a in (10 * t + u for t in range(5) for u in range(5)) for b in range(5)]
    assert len(env.eval_problems()) == 25 and not set(env.eval_problems()) & set(env.train_problems())
    ep = env.episode("g", 23, 4)
    assert (env.codec.decode(ep.context_tokens()), ep.expected) == ("23+04=", "27")
    every_pair = ArithmeticEnv(max_operand=9, max_b=2, held_out=0.0, seed=1)
    drawn = {(e.a, e.b) for i in range(300) for e in every_pair.new_group(f"g{i}", 1)}
    assert drawn == set(every_pair.problems()) == {(a, b) for a in range(10) for b in range(3)}
    for max_b in (9, 10, -1, True):
        with pytest.raises(ValueError, match="max_b: expected null"):
            ArithmeticEnv(max_operand=9, max_b=max_b)
    with pytest.raises(ValueError, match="max_b: expected null or a bound below the largest operand 44"):
        ArithmeticEnv(max_operand=45, max_digit=4, max_b=44)  # the operands stop at 44 anyway
