"""Issue 35 item 7: the OpenAI proxy under a standalone (``auto_open``) workload and a model that writes a bad tool
call. Auto-opened trajectories are closed by nobody: one whose first request failed is dropped at once and idle ones
are evicted when room is needed, so failures cannot fill ``max_trajectories`` and 429 every new trajectory; a
tool name the model wrote past the request limit is the model's text (OpenAI servers return an unparsable call as
content), not a 400 blaming the client. Driven with the real ``openai`` client."""
import time

import openai
import pytest

from glm5_core.rl.rollout.proxy import OpenAIProxy
from glm5_core.rl.rollout.tool_calls import ToolCallParser
from glm5_core.rl.serving.client import EngineUnavailable
from tests.rl.rollout.test_proxy import CALC_TOOL, MODEL, client_for, sglang_response, tok  # noqa: F401 (fixture)

MESSAGES = [{"role": "user", "content": "hi"}]


def test_auto_opened_trajectories_whose_request_failed_do_not_fill_the_table(tok):  # noqa: F811
    def down(tid, request):
        raise EngineUnavailable("replica down")

    proxy = OpenAIProxy(tok, down, max_context_tokens=400, auto_open=True, max_trajectories=2).start()
    try:
        for n in range(5):  # more failures than max_trajectories
            with pytest.raises(openai.InternalServerError) as exc:
                client_for(proxy, f"t{n}").chat.completions.create(model=MODEL, messages=MESSAGES)
            assert exc.value.status_code == 503  # the engine's failure, never a 429 for a full table
        assert proxy.open_trajectories() == []
    finally:
        proxy.shutdown()


def test_idle_auto_opened_trajectories_are_evicted_when_room_is_needed(tok):  # noqa: F811
    ok = sglang_response(tok.encode("ok") + [tok.token("<|im_end|>")])
    # 3 s: the first requests must stay "in use" however slowly a loaded machine serves them (0.3 s failed at load 9)
    proxy = OpenAIProxy(tok, lambda tid, r: ok, max_context_tokens=400, auto_open=True, max_trajectories=2,
                        idle_trajectory_timeout=3.0).start()
    try:
        for tid in ("a", "b"):
            client_for(proxy, tid).chat.completions.create(model=MODEL, messages=MESSAGES)
        with pytest.raises(openai.RateLimitError):  # both still in use (idle less than the timeout)
            client_for(proxy, "c").chat.completions.create(model=MODEL, messages=MESSAGES)
        time.sleep(3.1)
        client_for(proxy, "b").chat.completions.create(model=MODEL, messages=MESSAGES + [
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}])  # b is used again
        client_for(proxy, "c").chat.completions.create(model=MODEL, messages=MESSAGES)
        assert sorted(proxy.open_trajectories()) == ["b", "c"]  # a (idle) made room; b (just used) was kept
    finally:
        proxy.shutdown()


def test_driver_opened_trajectories_are_never_evicted(tok):  # noqa: F811
    proxy = OpenAIProxy(tok, lambda tid, r: None, max_context_tokens=400, max_trajectories=1,
                        idle_trajectory_timeout=0.01).start()
    try:
        proxy.open_trajectory("mine")
        time.sleep(0.05)
        with pytest.raises(ValueError, match="already open"):
            proxy.open_trajectory("other")
        assert proxy.open_trajectories() == ["mine"]
    finally:
        proxy.shutdown()


def test_a_model_written_tool_name_past_the_limit_is_content_not_a_client_error(tok):  # noqa: F811
    call = '<tool_call>{"name": "' + "n" * 300 + '", "arguments": {}}</tool_call>'
    ids = tok.encode_with_control_tokens(call + "<|im_end|>")
    proxy = OpenAIProxy(tok, lambda tid, r: sglang_response(ids), max_context_tokens=4000, max_new_tokens=1024,
                        auto_open=True).start()
    try:
        completion = client_for(proxy, "t").chat.completions.create(model=MODEL, messages=MESSAGES,
                                                                    tools=[CALC_TOOL])
        choice = completion.choices[0]
        assert choice.finish_reason == "stop" and choice.message.tool_calls is None
        assert choice.message.content == call
        # the conversation goes on with that message sent back as the agent received it
        client_for(proxy, "t").chat.completions.create(model=MODEL, tools=[CALC_TOOL], messages=MESSAGES + [
            choice.message.model_dump(exclude_none=True), {"role": "user", "content": "again"}])
    finally:
        proxy.shutdown()


def test_the_parser_takes_names_up_to_the_request_limit():
    parser = ToolCallParser()
    for length, parsed in ((256, True), (257, False)):
        text = '<tool_call>{"name": "' + "n" * length + '", "arguments": {}}</tool_call>'
        content, calls = parser.parse(text)
        assert bool(calls) == parsed and (content == text) != parsed
