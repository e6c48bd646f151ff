"""``glm5 proxy`` and ``glm5 make-tokenizer``: the OpenAI endpoint in front of an SGLang-API engine, with the
documentation's example agent (``docs/examples/openai_agent.py``, the ``openai`` package only) run against it as a
user runs it: a separate process pointed at the proxy by ``OPENAI_BASE_URL``."""
import argparse
import os
import subprocess
import sys

import pytest
import torch

from glm5_core.rl import proxy_cli
from glm5_core.rl.rollout.chat_tokenizer_builder import build_tokenizer_dir, tokenizer_vocab_size
from glm5_core.rl.rollout.tokenizer import load_chat_tokenizer
from tests.glm5_command import glm5_here

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "docs", "examples", "openai_agent.py")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tokenizer_dir(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def engine_server(tok_dir):
    from glm5_core.model import GLM5Config, GLM5ForCausalLM
    from glm5_core.rl.serving.engine import RolloutEngine
    from glm5_core.rl.serving.server import EngineServer

    torch.manual_seed(0)
    model = GLM5ForCausalLM(GLM5Config.tiny(vocab_size=tokenizer_vocab_size(tok_dir), index_topk=8,
                                            max_position_embeddings=512)).eval()
    server = EngineServer(RolloutEngine(model, max_batch=4, max_len=512, seed=0)).start()
    yield server
    server.shutdown()


def proxy_args(**overrides):
    parser = argparse.ArgumentParser()
    proxy_cli.add_arguments(parser)
    args = parser.parse_args(["--engine-url", "http://127.0.0.1:1", "--tokenizer", "unset", "--port", "0"])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_make_tokenizer_writes_a_chat_tokenizer_sized_for_the_policy(tmp_path, capsys):
    out = str(tmp_path / "tok")
    code, err = glm5_here(capsys, "make-tokenizer", out, "--style", "glm", "--vocab-size", "320")
    assert code == 0, err
    tok = load_chat_tokenizer(out)
    assert tok.has_chat_template and tok.min_vocab_size == tokenizer_vocab_size(out)
    assert tok.render([{"role": "user", "content": "hi"}], add_generation_prompt=True).startswith("[gMASK]<sop>")
    code, err = glm5_here(capsys, "make-tokenizer", out)  # never replaces one silently
    assert code == 2 and "--force" in err and len(err.strip().splitlines()) == 1
    code, err = glm5_here(capsys, "make-tokenizer", str(tmp_path / "small"), "--vocab-size", "100")
    assert code == 2 and "vocab_size" in err and len(err.strip().splitlines()) == 1


def test_proxy_refuses_an_unreachable_engine_and_a_template_less_tokenizer_in_one_line(tmp_path, tok_dir, capsys):
    code, err = glm5_here(capsys, "proxy", "--engine-url", "http://127.0.0.1:9", "--tokenizer", tok_dir,
                          "--port", "0")
    assert code == 2 and "--engine-url" in err and "--max-context-tokens" in err
    assert len(err.strip().splitlines()) == 1
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("tokenizer.json",):
        (bare / name).write_bytes(open(os.path.join(tok_dir, name), "rb").read())
    (bare / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    code, err = glm5_here(capsys, "proxy", "--engine-url", "http://127.0.0.1:9", "--tokenizer", str(bare),
                          "--port", "0", "--max-context-tokens", "512")
    assert code == 2 and "chat template" in err and len(err.strip().splitlines()) == 1
    code, err = glm5_here(capsys, "proxy", "--engine-url", "http://10.1.2.3:30000", "--tokenizer", tok_dir,
                          "--port", "0")
    assert code == 2 and "--engine-url" in err and len(err.strip().splitlines()) == 1


def test_engine_context_length_is_read_from_glm5_serve_or_sglang():
    assert proxy_cli.engine_context_tokens({"max_len": 512, "context_length": 4096}) == 512
    assert proxy_cli.engine_context_tokens({"context_length": 4096}) == 4096  # SGLang's server argument
    assert proxy_cli.engine_context_tokens({"context_length": None}) is None


def test_documented_openai_agent_runs_against_glm5_proxy(tok_dir, engine_server):
    proxy = proxy_cli.build(proxy_args(engine_url=engine_server.url, tokenizer=tok_dir)).start()
    try:
        assert proxy.max_context_tokens == engine_server.engine.max_len  # asked of the engine
        env = {**os.environ, "OPENAI_BASE_URL": proxy.base_url, "OPENAI_API_KEY": "none"}
        env.pop("PYTHONPATH", None)  # the example needs the openai package only, none of glm5-core
        done = subprocess.run([sys.executable, EXAMPLE, "2"], capture_output=True, text=True, env=env, timeout=300,
                              cwd=os.path.dirname(EXAMPLE))
        assert done.returncode == 0, done.stderr[-2000:]
        lines = done.stdout.strip().splitlines()
        assert [line.split(":")[0] for line in lines[:2]] == ["episode 0", "episode 1"]
        assert lines[-1].startswith("mean reward ")
        assert engine_server.engine.stats.as_dict()["requests"] >= 4  # two episodes, at least two requests each
        assert sorted(proxy.open_trajectories()) == ["episode-0", "episode-1"]  # one token record per episode
    finally:
        proxy.shutdown()


def test_readme_agent_command_names_the_vocabulary_make_tokenizer_prints(tok_dir):
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    line = next(line for line in readme.splitlines() if "glm5 make-tokenizer runs/chat_tokenizer && glm5 rl" in line)
    assert f"model.overrides.vocab_size={tokenizer_vocab_size(tok_dir)} " in line
