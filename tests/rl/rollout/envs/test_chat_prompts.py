"""The built-in environments through a chat template (``rollout.tokenizer``), and unchanged with the byte codec.

Chat: the arithmetic prompt is transformers' rendering of one user message with the generation prompt; the
calculator appends, after the ids the model sampled (kept as sampled), the template's ids for the tool result and
the next user message. When the model writes the template's own text, the whole context is transformers' rendering
of the conversation (checked against ``PreTrainedTokenizerFast.apply_chat_template``, for a ChatML-style template
whose turn ends on an end-of-turn token and a GLM-style one whose next role token ends the turn).
Bytes: the contexts are the documented byte strings, token for token.
"""
import pytest

from glm5_core.rl.rollout.chat_tokenizer_builder import build_tokenizer_dir
from glm5_core.rl.rollout.envs.arithmetic import ArithmeticEnv
from glm5_core.rl.rollout.envs.calculator import CalculatorEnv
from glm5_core.rl.rollout.envs.codec import ByteCodec
from glm5_core.rl.rollout.envs.context import FOLDED_TEXT
from glm5_core.rl.rollout.tokenizer import load_chat_tokenizer


@pytest.fixture(scope="module", params=["chatml", "glm"])
def tok(request, tmp_path_factory):
    return load_chat_tokenizer(build_tokenizer_dir(str(tmp_path_factory.mktemp(request.param)), style=request.param))


def hf_ids(tok, messages, gen=True):
    """transformers' own tokenisation of the conversation (the reference)."""
    return tok.hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True, return_dict=False)


def end_of_turn(tok):
    """What the model writes to end its turn: ChatML's <|im_end|>; GLM's next role token opens the tool message."""
    return "<|im_end|>" if "<|im_end|>" in tok.control_tokens else "<|observation|>"


def answer(tok, text):
    """The ids of ``text`` written as the template writes an assistant turn (GLM's opens with a newline)."""
    return tok.encode_with_control_tokens(("\n" if end_of_turn(tok) == "<|observation|>" else "") + text
                                          + end_of_turn(tok))


# -- bytes: as before -----------------------------------------------------------------------------------------
def test_with_the_byte_codec_the_arithmetic_prompt_is_its_bytes():
    codec = ByteCodec(3)
    ep = ArithmeticEnv(max_operand=9, codec=codec).episode("g", 4, 7)
    assert ep.context_tokens() == [b + 3 for b in b"4+7="]
    assert ep.turn_limits().stop_token_ids == (ord("\n") + 3,)


def test_with_the_byte_codec_the_calculator_context_is_the_documented_bytes():
    codec = ByteCodec()
    env = CalculatorEnv(min_numbers=3, max_numbers=3, keep_recent=1, seed=0)
    ep = env.new_group("g", 1)[0]
    a, b, c = ep.numbers
    assert ep.turn_limits().stop_token_ids == (ord("\n"),)
    expected = f"Add the numbers with calc. First: {a}\n"
    assert ep.context_tokens() == codec.encode(expected)
    ep.observe(codec.encode(f"{a}+{b}\n"))
    expected += f"{a}+{b}\n<tool>{a + b}</tool> next: {b}\n"
    assert ep.context_tokens() == codec.encode(expected)
    ep.observe(codec.encode(f"{a + b}+{c}\n"))  # keep_recent 1: the first tool reply is folded
    expected = (f"Add the numbers with calc. First: {a}\n{a}+{b}\n{FOLDED_TEXT}{a + b}+{c}\n"
                f"<tool>{a + b + c}</tool> next: {c}\nanswer:")
    assert ep.context_tokens() == codec.encode(expected)
    assert ep.observe(codec.encode(f"{a + b + c}\n")) and ep.reward == 1.0


# -- chat templates ---------------------------------------------------------------------------------------------
def test_the_arithmetic_prompt_is_the_templates_user_turn(tok):
    env = ArithmeticEnv(max_operand=9, codec=tok, seed=0)
    ep = env.episode("g", 4, 7)
    assert ep.context_tokens() == hf_ids(tok, [{"role": "user", "content": "4+7="}])
    assert ep.turn_limits().stop_token_ids == tok.stop_token_ids  # the template's turn ends, not the newline
    ep.observe(answer(tok, "11"))
    assert ep.reward == 1.0
    (evaluated,) = [f("e") for f in ArithmeticEnv(max_operand=1, held_out=0.25, codec=tok).eval_set()]
    assert tok.decode(evaluated.context_tokens(), skip_special_tokens=False).count("+") == 1


def play_calculator(tok, numbers, answer_text, *, keep_recent=5):
    """Play the calculator with a model that writes the template's text (``calc`` expressions, then the total)."""
    env = CalculatorEnv(codec=tok, keep_recent=keep_recent)
    ep = env.new_group("g", 1)[0]
    ep.numbers = numbers
    ep.__init__("g", numbers, tok, max_new_tokens=8, keep_recent=keep_recent, token_budget=32768)
    contexts, outputs = [ep.context_tokens()], []
    total = numbers[0]
    for i in range(1, len(numbers)):
        outputs.append(answer(tok, f"{total}+{numbers[i]}"))
        assert ep.observe(outputs[-1]) is False
        total += numbers[i]
        contexts.append(ep.context_tokens())
    outputs.append(answer(tok, answer_text))
    assert ep.observe(outputs[-1]) is True
    return ep, contexts, outputs


def conversation(numbers, folded_before=0):
    """The calculator's messages up to the answer prompt; tool results of turns < ``folded_before`` folded."""
    messages = [{"role": "user", "content": f"Add the numbers with calc. First: {numbers[0]}\n"}]
    total = numbers[0]
    for i in range(1, len(numbers)):
        messages.append({"role": "assistant", "content": f"{total}+{numbers[i]}"})
        total += numbers[i]
        ask = f"next: {numbers[i]}\n" + ("answer:" if i == len(numbers) - 1 else "")
        result = FOLDED_TEXT.strip() if i - 1 < folded_before else str(total)
        messages += [{"role": "tool", "content": result}, {"role": "user", "content": ask}]
    return messages


def test_the_calculator_appends_the_templates_tool_and_user_turns_after_the_sampled_ids(tok):
    numbers = [3, 5, 2]
    ep, contexts, outputs = play_calculator(tok, numbers, "10")
    assert ep.reward == 1.0 and ep.num_turns == 3
    for before, output, after in zip(contexts, outputs, contexts[1:]):
        assert after[:len(before) + len(output)] == before + output  # appended: sampled ids kept as sampled
    assert contexts[-1] == hf_ids(tok, conversation(numbers))  # and the whole is the template's rendering
    messages = conversation(numbers)
    assert contexts[1] == hf_ids(tok, messages[:4])


def test_folded_tool_results_are_the_templates_folded_tool_turn(tok):
    numbers = [1, 2, 3, 4]
    _, contexts, _ = play_calculator(tok, numbers, "10", keep_recent=1)
    assert contexts[-1] == hf_ids(tok, conversation(numbers, folded_before=2))


def test_a_non_canonical_sampled_tokenisation_is_kept_as_sampled(tok):
    ep = CalculatorEnv(codec=tok, min_numbers=2, max_numbers=2, seed=0).new_group("g", 1)[0]
    canonical = answer(tok, "12+34")
    one_by_one = [i for ch in "12+34" for i in tok.encode(ch)] + canonical[len(canonical) - 1:]
    if end_of_turn(tok) == "<|observation|>":
        one_by_one = tok.encode("\n") + one_by_one
    assert one_by_one != canonical and tok.decode(one_by_one) == tok.decode(canonical)
    before = ep.context_tokens()
    ep.observe(one_by_one)
    after = ep.context_tokens()
    assert after[:len(before) + len(one_by_one)] == before + one_by_one
    assert tok.decode(after[len(before) + len(one_by_one):], skip_special_tokens=False).count("46") == 1


def test_a_turn_cut_before_its_end_of_turn_token_is_closed_by_the_template(tok):
    if end_of_turn(tok) != "<|im_end|>":
        pytest.skip("ChatML closes a turn with <|im_end|>; GLM's turns have no closing token")
    env = CalculatorEnv(codec=tok, min_numbers=2, max_numbers=2, seed=0)
    ep = env.new_group("g", 1)[0]
    a, b = ep.numbers
    before = ep.context_tokens()
    output = tok.encode(f"{a}+{b}\n")  # cut at max_new_tokens, before <|im_end|>
    ep.observe(output)
    appended = tok.decode(ep.context_tokens()[len(before) + len(output):], skip_special_tokens=False)
    assert appended.startswith("<|im_end|><|im_start|>tool<|im_sep|>" + str(a + b) + "<|im_end|>")
