"""The OpenAI-compatible TITO proxy, driven by the real ``openai`` client package.

The Done-means test runs a small calculator agent written against ``openai.OpenAI`` through the proxy against a real
RolloutEngine (tiny random model, behind its SGLang-style HTTP server): for every turn the trained token ids are the
engine's sampled ids and the loss mask is 1 on exactly those. A scripted model (a GenerateFn that writes the right
tool calls) checks the tool-call round trip and that the record equals transformers' rendering of the conversation.
"""
import concurrent.futures
import json
import re
import socket
import urllib.error
import urllib.request

import openai
import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletion

from glm5_core.rl.rollout.chat_tokenizer_builder import build_tokenizer_dir
from glm5_core.rl.rollout.envs.arithmetic import score_answer
from glm5_core.rl.rollout.envs.calculator_tool import ToolError, calculate
from glm5_core.rl.rollout.openai_protocol import parse_message
from glm5_core.rl.rollout.proxy import TRAJECTORY_HEADER, OpenAIProxy
from glm5_core.rl.rollout.tokenizer import load_chat_tokenizer
from glm5_core.rl.rollout.tool_calls import ToolCallParser
from glm5_core.rl.serving.client import EngineClient, EngineUnavailable

MODEL = "glm5-core"
CALC_TOOL = {"type": "function", "function": {
    "name": "calc", "description": "Evaluate an integer expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_chat_tokenizer(build_tokenizer_dir(str(tmp_path_factory.mktemp("tok"))))


class Recorder:
    """A GenerateFn wrapper keeping every (trajectory id, request, response) in order."""

    def __init__(self, generate_fn):
        self.generate_fn, self.calls = generate_fn, []

    def __call__(self, tid, request):
        response = self.generate_fn(tid, request)
        self.calls.append((tid, request, response))
        return response

    def of(self, tid):
        return [(req, resp) for t, req, resp in self.calls if t == tid]


def sglang_response(ids, finish="stop", logprob=-0.25):
    return {"output_ids": list(ids), "meta_info": {
        "output_token_logprobs": [[logprob - 0.01 * i, t, None] for i, t in enumerate(ids)],
        "finish_reason": {"type": finish}, "weight_version": 0, "cached_tokens": 0}}


class CalculatorModel:
    """A scripted GenerateFn that solves the calculator task: it reads the numbers revealed so far in the prompt and
    calls calc on their sum expression; asked for the answer, it writes the last tool result."""

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, tid, request):
        prompt = self.tok.decode(request["input_ids"], skip_special_tokens=False)
        numbers = re.findall(r"(?:First|Next): (\d+)", prompt)
        if prompt.endswith("answer:<|im_end|><|im_start|>assistant<|im_sep|>"):
            text = re.findall(r"<\|im_start\|>tool<\|im_sep\|>(-?\d+)<\|im_end\|>", prompt)[-1]
        else:
            call = json.dumps({"name": "calc", "arguments": {"expression": "+".join(numbers)}})
            text = ("" if len(numbers) == 1 else f"Adding {numbers[-1]}.") + f"<tool_call>{call}</tool_call>"
        return sglang_response(self.tok.encode_with_control_tokens(text + "<|im_end|>"))


def calculator_agent(client, numbers, *, max_tokens=12):
    """A small agent on the calculator task, written against the openai package: the numbers come one per turn,
    the model may call ``calc`` (its results go back as tool messages), and after the last number it is asked for
    the answer. Returns (reward, completions, the messages each request sent)."""
    messages = [{"role": "system", "content": "Add the numbers with calc."},
                {"role": "user", "content": f"First: {numbers[0]}"}]
    completions, sent = [], []
    for revealed in range(1, len(numbers) + 2):
        sent.append([dict(m) for m in messages])
        completion = client.chat.completions.create(model=MODEL, messages=messages, tools=[CALC_TOOL],
                                                    max_tokens=max_tokens, temperature=1.0, logprobs=True)
        completions.append(completion)
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if revealed > len(numbers):  # this turn was the answer
            return score_answer(message.content or "", sum(numbers)), completions, sent
        for call in message.tool_calls or []:
            try:
                result = str(calculate(json.loads(call.function.arguments)["expression"]))
            except (ToolError, ValueError, KeyError, TypeError) as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        messages.append({"role": "user", "content": f"Next: {numbers[revealed]}" if revealed < len(numbers)
                         else "answer:"})


def client_for(proxy, tid):
    return openai.OpenAI(base_url=proxy.base_url, api_key="unused", max_retries=0,
                         default_headers={TRAJECTORY_HEADER: tid})


def assert_trains_exactly_the_sampled_tokens(sample, turns, completions):
    """For every turn: its prompt extends the record, the record holds the engine's sampled ids right after the
    prompt with the engine's log-probs, and the loss mask is 1 on exactly those positions."""
    assert len(turns) == len(completions)
    expected_mask = []
    for (request, response), completion in zip(turns, completions):
        prompt, out = request["input_ids"], response["output_ids"]
        logprobs = [e[0] for e in response["meta_info"]["output_token_logprobs"]]
        assert sample.tokens[:len(prompt)] == prompt
        assert sample.tokens[len(prompt):len(prompt) + len(out)] == out
        assert sample.logprobs[len(prompt):len(prompt) + len(out)] == logprobs
        expected_mask += [0] * (len(prompt) - len(expected_mask)) + [1] * len(out)
        returned = [c.logprob for c in completion.choices[0].logprobs.content]
        assert returned == logprobs[:len(returned)]  # the client sees the engine's log-probs (stop token aside)
        assert completion.usage.prompt_tokens == len(prompt) and completion.usage.completion_tokens == len(out)
    assert sample.loss_mask == expected_mask and len(sample.tokens) == len(expected_mask)


def assert_context_is_the_templates(tok, sample, turns, sent):
    """The ids between two sampled turns are what the chat template writes for the messages the agent added (plus
    the end-of-turn token when the turn before was cut)."""
    def render(messages, gen=False):
        parsed = [parse_message(m, i) for i, m in enumerate(messages)]
        return tok.hf.apply_chat_template(parsed, tools=[CALC_TOOL], add_generation_prompt=gen, tokenize=False)

    assert tok.decode(turns[0][0]["input_ids"], skip_special_tokens=False) == render(sent[0], gen=True)
    for i in range(1, len(turns)):
        (before, previous), (request, _) = turns[i - 1], turns[i]
        end = len(before["input_ids"]) + len(previous["output_ids"])
        closing = "<|im_end|>" if previous["meta_info"]["finish_reason"]["type"] == "length" else ""
        new = render(sent[i], gen=True)[len(render(sent[i][:len(sent[i - 1]) + 1])):]
        assert tok.decode(sample.tokens[end:len(request["input_ids"])], skip_special_tokens=False) == closing + new


# -- the Done-means test ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_server(tok):
    from glm5_core.model import GLM5Config, GLM5ForCausalLM
    from glm5_core.rl.serving.engine import RolloutEngine
    from glm5_core.rl.serving.server import EngineServer

    torch.manual_seed(0)
    model = GLM5ForCausalLM(GLM5Config.tiny(vocab_size=tok.min_vocab_size, index_topk=8,
                                            max_position_embeddings=512)).eval()
    server = EngineServer(RolloutEngine(model, max_batch=4, max_len=512, seed=0)).start()
    yield server
    server.shutdown()


def test_openai_agent_through_the_proxy_trains_exactly_the_engines_tokens(tok, engine_server):
    engine = EngineClient(engine_server.url)
    recorder = Recorder(lambda tid, request: engine.generate(request))
    proxy = OpenAIProxy(tok, recorder, max_context_tokens=engine_server.engine.max_len,
                        max_new_tokens=engine_server.engine.limits.max_new_tokens).start()
    problems = {"a0": [3, 5, 2], "a1": [7, 1]}
    try:
        for tid in problems:
            proxy.open_trajectory(tid)
        with concurrent.futures.ThreadPoolExecutor(len(problems)) as pool:  # two agents at once, one engine
            runs = {tid: pool.submit(calculator_agent, client_for(proxy, tid), numbers)
                    for tid, numbers in problems.items()}
            results = {tid: run.result(timeout=600) for tid, run in runs.items()}
        for tid, numbers in problems.items():
            record = proxy.close_trajectory(tid)
            _, completions, sent = results[tid]
            assert len(completions) == len(numbers) + 1
            (sample,) = record.gateway.finished_samples()  # the agent only appended: one sequence
            turns = recorder.of(tid)
            assert all(request["rid"] == tid for request, _ in turns)
            assert_trains_exactly_the_sampled_tokens(sample, turns, completions)
            assert_context_is_the_templates(tok, sample, turns, sent)
            assert sample.finish_reasons == [r["meta_info"]["finish_reason"]["type"] for _, r in turns]
    finally:
        proxy.shutdown()


def test_scripted_calculator_agent_round_trips_tool_calls_and_matches_the_template(tok):
    recorder = Recorder(CalculatorModel(tok))
    proxy = OpenAIProxy(tok, recorder, max_context_tokens=1024).start()
    try:
        proxy.open_trajectory("t")
        reward, completions, sent = calculator_agent(client_for(proxy, "t"), [3, 5, 2], max_tokens=64)
        record = proxy.close_trajectory("t")
    finally:
        proxy.shutdown()
    assert reward == 1.0  # the tool results reached the model and its answer the agent
    for completion in completions[:-1]:
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "calc" and call.id.startswith("call_")
        assert set(json.loads(call.function.arguments)) == {"expression"}
    assert completions[1].choices[0].message.content == "Adding 5."
    assert completions[-1].choices[0].finish_reason == "stop" and completions[-1].choices[0].message.tool_calls is None
    (sample,) = record.gateway.finished_samples()
    turns = recorder.of("t")
    assert_trains_exactly_the_sampled_tokens(sample, turns, completions)
    assert_context_is_the_templates(tok, sample, turns, sent)
    # the model wrote the template's own text: the record is transformers' rendering of the whole conversation
    final = sent[-1] + [completions[-1].choices[0].message.model_dump(exclude_none=True)]
    reference = tok.hf.apply_chat_template([parse_message(m, i) for i, m in enumerate(final)], tools=[CALC_TOOL],
                                           tokenize=True, return_assistant_tokens_mask=True)
    assert sample.tokens == reference["input_ids"] and sample.loss_mask == reference["assistant_masks"]


# -- response shapes, parsed strictly by the openai package's own types ----------------------------------------
@pytest.fixture
def scripted(tok):
    """A proxy over a GenerateFn that answers each trajectory's requests from a queue of texts."""
    queue = []

    def generate(tid, request):
        text, finish = queue.pop(0)
        return sglang_response(tok.encode_with_control_tokens(text), finish)

    recorder = Recorder(generate)
    proxy = OpenAIProxy(tok, recorder, max_context_tokens=400, max_new_tokens=64, auto_open=True).start()
    proxy.queue, proxy.recorder = queue, recorder
    yield proxy
    proxy.shutdown()


def post(proxy, route, body, headers=None, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(proxy.url + route, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_chat_response_validates_as_openai_chat_completion(scripted):
    scripted.queue.append(('Sure.<tool_call>{"name": "calc", "arguments": {"expression": "1+2"}}</tool_call>'
                           "<|im_end|>", "stop"))
    client = client_for(scripted, "t")
    raw = client.chat.completions.with_raw_response.create(model=MODEL, tools=[CALC_TOOL], logprobs=True,
                                                           messages=[{"role": "user", "content": "1+2?"}])
    completion = ChatCompletion.model_validate(raw.http_response.json())  # strict: every field's type checked
    assert completion.object == "chat.completion" and completion.model == MODEL
    assert completion.id.startswith("chatcmpl-")
    choice = completion.choices[0]
    assert choice.index == 0 and choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    assert choice.message.tool_calls[0].function.arguments == '{"expression": "1+2"}'
    tokens = [entry.token for entry in choice.logprobs.content]
    assert "".join(tokens) == 'Sure.<tool_call>{"name": "calc", "arguments": {"expression": "1+2"}}</tool_call>'
    assert all(e.bytes == list(e.token.encode()) and e.top_logprobs == [] for e in choice.logprobs.content)
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
    assert raw.parse().choices[0].message.tool_calls[0].id == choice.message.tool_calls[0].id


def test_finish_reasons_and_tool_choice_none(scripted):
    client = client_for(scripted, "t")
    call = '<tool_call>{"name": "calc", "arguments": {"expression": "1"}}</tool_call>'
    scripted.queue += [("cut sho", "length"), (call + "<|im_end|>", "stop")]
    cut = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=4)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content == "cut sho"
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "b"}],
                                           tools=[CALC_TOOL], tool_choice="none")
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].message.content == call  # not parsed
    prompt = scripted.recorder.calls[-1][1]["input_ids"]
    assert "calc" not in scripted.tokenizer.decode(prompt)  # tools not rendered either


def test_models_and_health(scripted):
    models = client_for(scripted, "t").models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].object == "model"
    with urllib.request.urlopen(scripted.url + "/health", timeout=10) as response:
        assert json.loads(response.read())["ok"] is True


def test_completions_append_token_ids_and_extending_text(scripted, tok):
    client = client_for(scripted, "c")
    scripted.queue += [(" 7", "length"), (" 9<|im_end|>", "stop"), (" x", "length")]
    prompt = tok.encode("3+4=")
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=2, logprobs=0)
    first = Completion.model_validate(raw.http_response.json())
    assert first.object == "text_completion" and first.choices[0].text == " 7"
    assert first.choices[0].finish_reason == "length" and first.choices[0].logprobs.tokens
    recorded = scripted.recorder.calls[-1][2]["output_ids"]
    second = client.completions.create(model=MODEL, prompt=prompt + recorded + tok.encode(" and 4+5="), max_tokens=4)
    assert second.choices[0].text == " 9" and second.choices[0].finish_reason == "stop"  # stop token not in text
    text = tok.decode(scripted.recorder.calls[-1][1]["input_ids"] + scripted.recorder.calls[-1][2]["output_ids"],
                      skip_special_tokens=False)
    client.completions.create(model=MODEL, prompt=text + " then?", max_tokens=2)  # a string extending the record
    record = scripted.close_trajectory("c")
    (sample,) = record.gateway.finished_samples()
    assert sample.tokens[:len(prompt) + len(recorded)] == prompt + recorded  # sampled ids kept, never re-encoded
    turns = scripted.recorder.of("c")
    assert sum(sample.loss_mask) == sum(len(response["output_ids"]) for _, response in turns)
    for request, response in turns:  # each prompt extends the record: token ids as sent, the rest encoded once
        assert sample.tokens[:len(request["input_ids"]) + len(response["output_ids"])] == \
            request["input_ids"] + response["output_ids"]


@pytest.mark.parametrize("echo", ["model_dump", "model_dump_exclude_none", "to_dict", "message_object", "minimal"])
def test_the_assistant_message_sent_back_in_any_client_form_extends_the_record(scripted, echo):
    client = client_for(scripted, "echo")
    call = '<tool_call>{"name": "calc", "arguments": {"expression": "1+1"}}</tool_call>'
    scripted.queue += [("Let me see." + call + "<|im_end|>", "stop"), ("2<|im_end|>", "stop")]
    messages = [{"role": "user", "content": "1+1?"}]
    message = client.chat.completions.create(model=MODEL, messages=messages, tools=[CALC_TOOL]).choices[0].message
    sent = {"model_dump": message.model_dump(), "model_dump_exclude_none": message.model_dump(exclude_none=True),
            "to_dict": message.to_dict(), "message_object": message,
            "minimal": {"role": "assistant", "content": message.content, "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                               "arguments": c.function.arguments}}
                for c in message.tool_calls]}}[echo]
    tool = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "2"}
    client.chat.completions.create(model=MODEL, messages=[*messages, sent, tool], tools=[CALC_TOOL])
    record = scripted.close_trajectory("echo")
    assert len(record.gateway.finished_samples()) == 1 and record.transcript.rerenders == 0


def test_an_agent_that_rewrites_history_opens_a_new_sample(scripted):
    client = client_for(scripted, "r")
    scripted.queue += [("one<|im_end|>", "stop"), ("two<|im_end|>", "stop")]
    messages = [{"role": "user", "content": "hi"}]
    first = client.chat.completions.create(model=MODEL, messages=messages)
    edited = messages + [{"role": "assistant", "content": first.choices[0].message.content + " (edited)"},
                         {"role": "user", "content": "and?"}]
    client.chat.completions.create(model=MODEL, messages=edited)
    record = scripted.close_trajectory("r")
    assert len(record.gateway.finished_samples()) == 2 and record.transcript.rerenders == 1


def test_tool_call_parser_keeps_what_is_not_a_call_as_content():
    ids = iter(["call_1", "call_2"])
    parser = ToolCallParser(new_id=lambda: next(ids))
    content, calls = parser.parse('a <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> b'
                                  '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    assert content == "a  b"
    assert calls == [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                     {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]
    for text in ['<tool_call>{"name": "f"</tool_call>', '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "f", "arguments": "x"}</tool_call>', '<tool_call>{"name": "f", "arguments": {}}',
                 '<tool_call>[1]</tool_call>', "  no call  "]:
        assert parser.parse(text) == (text, [])


# -- malformed requests: OpenAI's error body -------------------------------------------------------------------
GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("body,status,param", [
    ({**GOOD, "n": 2}, 400, "n"),
    ({**GOOD, "stream": True}, 400, "stream"),
    ({**GOOD, "seed": 1}, 400, "seed"),
    ({**GOOD, "frobnicate": 1}, 400, "frobnicate"),
    ({**GOOD, "temperature": 3}, 400, "temperature"),
    ({**GOOD, "top_p": 0}, 400, "top_p"),
    ({**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ({**GOOD, "max_tokens": 65}, 400, "max_tokens"),
    ({**GOOD, "max_tokens": 1000}, 400, "messages"),  # past the context: context_length_exceeded
    ({**GOOD, "top_logprobs": 3}, 400, "top_logprobs"),
    ({**GOOD, "tool_choice": "required"}, 400, "tool_choice"),
    ({**GOOD, "stop": ["two words"]}, 400, "stop"),
    ({**GOOD, "model": "gpt-4o"}, 404, "model"),
    ({**GOOD, "messages": []}, 400, "messages"),
    ({**GOOD, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages[0].content[0]"),
    ({**GOOD, "messages": [{"role": "tool", "content": "7"}]}, 400, "messages[0].tool_call_id"),
    ({**GOOD, "messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                                  "function": {"name": "f", "arguments": {}}}]}]},
     400, "messages[0].tool_calls[0].function.arguments"),
    ({**GOOD, "tools": [{"type": "function"}]}, 400, "tools[0]"),
    ([1, 2], 400, None),
])
def test_malformed_chat_requests_get_openai_error_bodies(scripted, body, status, param):
    code, payload = post(scripted, "/v1/chat/completions", body, {TRAJECTORY_HEADER: "m"})
    assert code == status
    assert set(payload) == {"error"} and set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["param"] == param and payload["error"]["message"]
    assert not scripted.recorder.calls  # nothing reached the engine


def test_the_openai_client_reads_the_error_bodies(scripted):
    client = client_for(scripted, "e")
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=GOOD["messages"], max_tokens=1000)
    assert exc.value.code == "context_length_exceeded" and exc.value.param == "messages"
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="nope", messages=GOOD["messages"])
    assert exc.value.code == "model_not_found"


def test_malformed_bodies_oversize_and_deep_json(scripted):
    headers = {TRAJECTORY_HEADER: "m"}
    code, payload = post(scripted, "/v1/chat/completions", None, headers, raw=b"{not json")
    assert code == 400 and "invalid JSON" in payload["error"]["message"]
    deep = b"[" * 100 + b"]" * 100
    code, payload = post(scripted, "/v1/chat/completions", None, headers, raw=deep)
    assert code == 400 and "nested deeper" in payload["error"]["message"]
    very_deep = b'{"a": ' + b"[" * 200000 + b"]" * 200000 + b"}"  # past Python's recursion limit
    code, payload = post(scripted, "/v1/chat/completions", None, headers, raw=very_deep)
    assert code == 400 and "nested deeper" in payload["error"]["message"]
    long_int = b'{"max_tokens": ' + b"1" * 5000 + b"}"  # past Python's digit limit for int literals
    code, payload = post(scripted, "/v1/chat/completions", None, headers, raw=long_int)
    assert code == 400 and "invalid JSON" in payload["error"]["message"], payload
    code, payload = post(scripted, "/v1/nope", GOOD, headers)
    assert code == 404 and payload["error"]["code"] == "not_found"


def test_bodies_past_the_cap_are_413(tok):
    proxy = OpenAIProxy(tok, Recorder(lambda tid, r: None), max_context_tokens=400, max_body_bytes=4096,
                        auto_open=True).start()
    try:
        body = {**GOOD, "messages": [{"role": "user", "content": "x" * 8000}]}
        code, payload = post(proxy, "/v1/chat/completions", body, {TRAJECTORY_HEADER: "m"})
        assert code == 413 and "at most 4096 bytes" in payload["error"]["message"]
        assert not proxy.generate_fn.calls
    finally:
        proxy.shutdown()


def test_requests_are_tied_to_open_trajectories(tok):
    proxy = OpenAIProxy(tok, Recorder(lambda tid, r: sglang_response(tok.encode("ok") + [tok.token("<|im_end|>")])),
                        max_context_tokens=400).start()
    try:
        code, payload = post(proxy, "/v1/chat/completions", GOOD)
        assert code == 400 and payload["error"]["param"] == "user"  # no header, no user field
        code, payload = post(proxy, "/v1/chat/completions", GOOD, {TRAJECTORY_HEADER: "unknown"})
        assert code == 404 and payload["error"]["code"] == "trajectory_not_found"
        proxy.open_trajectory("u1")
        code, payload = post(proxy, "/v1/chat/completions", {**GOOD, "user": "u1"})  # the user field names it
        assert code == 200 and payload["choices"][0]["message"]["content"] == "ok"
        with pytest.raises(ValueError, match="already open"):
            proxy.open_trajectory("u1")
        record = proxy.close_trajectory("u1")
        assert record.gateway.num_requests == 1
        code, _ = post(proxy, "/v1/chat/completions", {**GOOD, "user": "u1"})
        assert code == 404  # closed: a late request cannot add to a finished record
    finally:
        proxy.shutdown()


def test_engine_failure_is_503_and_the_retry_appends_to_the_same_sample(tok):
    failures = [EngineUnavailable("replica down")]

    def flaky(tid, request):
        if failures:
            raise failures.pop()
        return sglang_response(tok.encode("ok") + [tok.token("<|im_end|>")])

    proxy = OpenAIProxy(tok, Recorder(flaky), max_context_tokens=400, auto_open=True).start()
    try:
        client = client_for(proxy, "f")
        with pytest.raises(openai.InternalServerError) as exc:
            client.chat.completions.create(model=MODEL, messages=GOOD["messages"])
        assert exc.value.status_code == 503
        first = client.chat.completions.create(model=MODEL, messages=GOOD["messages"])
        client.chat.completions.create(model=MODEL, messages=GOOD["messages"] + [
            first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}])
        (sample,) = proxy.close_trajectory("f").gateway.finished_samples()
        assert sum(sample.loss_mask) == 2 * (len(tok.encode("ok")) + 1)
    finally:
        proxy.shutdown()


def test_fixed_training_sampling_is_applied_and_other_values_refused(tok):
    recorder = Recorder(lambda tid, r: sglang_response([tok.token("<|im_end|>")]))
    proxy = OpenAIProxy(tok, recorder, max_context_tokens=400, auto_open=True, temperature=0.9, top_p=0.95).start()
    try:
        client = client_for(proxy, "s")
        client.chat.completions.create(model=MODEL, messages=GOOD["messages"])
        client.chat.completions.create(model=MODEL, messages=GOOD["messages"], temperature=0.9)
        assert all(r["sampling_params"]["temperature"] == 0.9 and r["sampling_params"]["top_p"] == 0.95
                   for _, r, _ in recorder.calls)
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model=MODEL, messages=GOOD["messages"], temperature=0.2)
        assert exc.value.param == "temperature" and len(recorder.calls) == 2
    finally:
        proxy.shutdown()
    with pytest.raises(ValueError, match="temperature"):
        OpenAIProxy(tok, recorder, max_context_tokens=400, temperature=0.0)


def test_binds_localhost_only(scripted):
    assert scripted.url.startswith("http://127.0.0.1:")
    assert scripted._httpd.socket.getsockname()[0] == "127.0.0.1"
    with socket.create_connection(("127.0.0.1", scripted.port), timeout=5):
        pass
