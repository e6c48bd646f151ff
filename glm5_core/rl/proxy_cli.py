"""``glm5 proxy``: the OpenAI-compatible endpoint (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``) in
front of an SGLang-API engine (``glm5 serve`` or an SGLang server), so an agent written against the ``openai``
package talks to a glm5-core policy without any of glm5-core's code:

    glm5 proxy --engine-url http://127.0.0.1:30000 --tokenizer DIR --port 8000
    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=none python docs/examples/openai_agent.py

The tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json`` with a ``chat_template``: a real model's, or
one ``glm5 make-tokenizer`` writes) renders the chat requests into token ids; the engine generates and the answer is
parsed back (tool calls included). Each conversation is a trajectory: the ``X-Trajectory-Id`` header or the request's
``user`` field names it (a request with neither is refused); the proxy keeps its token record so later turns extend
the same ids the engine sampled (``docs/rl-agents.md``). A conversation idle for 10 minutes is forgotten once
4096 are open. It binds 127.0.0.1 only.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine-url", required=True,
                        help="the engine's base URL (glm5 serve or SGLang), e.g. http://127.0.0.1:30000")
    parser.add_argument("--tokenizer", required=True,
                        help="tokenizer directory with a chat template (glm5 make-tokenizer writes one)")
    parser.add_argument("--port", type=int, required=True, help="TCP port on 127.0.0.1 (0: any free one, printed)")
    parser.add_argument("--engine-api-key", default=None, help="the engine's --api-key, if it has one")
    parser.add_argument("--allow-remote-engine", action="store_true",
                        help="accept an engine URL that is not on this machine")
    parser.add_argument("--max-context-tokens", type=int, default=None,
                        help="prompt + completion tokens per request (default: what the engine reports)")
    parser.add_argument("--default-max-tokens", type=int, default=256,
                        help="new tokens of a request that names no max_tokens (default: %(default)s)")
    parser.add_argument("--model-name", default="glm5-core", help="the model name clients send (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="fix every request's temperature (a request asking for another is refused)")
    parser.add_argument("--top-p", type=float, default=None, help="fix every request's top_p")


def engine_context_tokens(info: dict) -> int | None:
    """The context length an engine's ``/get_server_info`` reports: glm5 serve's ``max_len`` or SGLang's
    ``context_length`` server argument (None when it reports neither)."""
    for key in ("max_len", "context_length"):
        value = info.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 2:
            return value
    return None


def build(args: argparse.Namespace):
    """The (not yet started) proxy ``args`` describe."""
    from glm5_core.rl.rollout.proxy import OpenAIProxy
    from glm5_core.rl.rollout.tokenizer import load_chat_tokenizer
    from glm5_core.rl.serving.client import EngineClient, EngineRequestError, EngineUnavailable

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port: expected a port in [0, 65535], got {args.port}")
    try:
        client = EngineClient(args.engine_url, api_key=args.engine_api_key, allow_remote=args.allow_remote_engine)
    except ValueError as exc:
        raise ValueError(f"--engine-url: {exc}") from None
    tokenizer = load_chat_tokenizer(args.tokenizer)
    if not tokenizer.has_chat_template:
        raise ValueError(f"--tokenizer: {args.tokenizer} has no chat template (tokenizer_config.json's "
                         "chat_template or chat_template.jinja)")
    context = args.max_context_tokens
    if context is None:
        try:
            context = engine_context_tokens(client.info())
        except (EngineUnavailable, EngineRequestError) as exc:
            raise ValueError(f"--engine-url: cannot reach the engine to ask its context length ({exc}); start it "
                             "first, or give --max-context-tokens") from None
        if context is None:
            raise ValueError("--max-context-tokens: the engine reports no context length (max_len / "
                             "context_length in /get_server_info); give it")

    def generate(trajectory_id: str, request: dict) -> dict:
        return client.generate(request)

    try:
        return OpenAIProxy(tokenizer, generate, max_context_tokens=context, model_name=args.model_name,
                           default_max_tokens=args.default_max_tokens, port=args.port, auto_open=True,
                           temperature=args.temperature, top_p=args.top_p)
    except OSError as exc:
        raise ValueError(f"--port: cannot bind 127.0.0.1:{args.port} ({exc.strerror or exc})") from None


def run(args: argparse.Namespace) -> int:
    proxy = build(args)

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    proxy.start()
    print(f"glm5 proxy: OpenAI API for {args.engine_url} on {proxy.base_url} (model {args.model_name!r})", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        proxy.shutdown()
    print("glm5 proxy: stopped", file=sys.stderr, flush=True)
    return 0
