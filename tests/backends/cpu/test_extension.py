"""The extension's build states: skipped with GLM5_SKIP_EXT=1 (reference fallback, with the reason),
built and registered with fake implementations otherwise; and its build lock, which a killed builder cannot
leave held (the two end-to-end lock tests build the extension into a fresh cache: slow)."""
import os
import subprocess
import sys

import pytest
import torch

from glm5_core import testing

SKIP_SCRIPT = """
from glm5_core import registry
from glm5_core.backends.cpu import extension
status = extension.load()
assert not status.built and "GLM5_SKIP_EXT=1" in status.reason, status
rows = {r.op: r for r in registry.explain("cpu")}
assert rows["dsa_indexer_topk"].is_reference, rows["dsa_indexer_topk"]
assert "GLM5_SKIP_EXT=1" in rows["dsa_indexer_topk"].reason, rows["dsa_indexer_topk"].reason
assert "GLM5_SKIP_EXT=1" in rows["mla_decode"].reason
# torch's own fused attention needs no extension
assert rows["mla_prefill"].label == "cpu: glm5_core.backends.cpu.mla.prefill", rows["mla_prefill"]
import pytest
import torch
from glm5_core.ops import dsa
q, k, w = torch.randn(1, 3, 2, 4), torch.randn(1, 5, 4), torch.rand(1, 3, 2)
idx = dsa.indexer_topk(q, k, w, 2, start_pos=2, backend="cpu")
assert torch.equal(idx, dsa.indexer_topk_reference(q, k, w, topk=2, start_pos=2))
print("fallback ok")
"""


def test_skip_env_falls_back_with_reason():
    env = dict(os.environ, GLM5_SKIP_EXT="1")
    result = subprocess.run([sys.executable, "-c", SKIP_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "fallback ok" in result.stdout


def test_explain_names_the_native_kernels(native):
    from glm5_core import registry

    rows = {r.op: r for r in registry.explain("cpu")}
    for op in ("dsa_indexer_topk", "dsa_sparse_decode", "moe_route", "moe_dispatch", "moe_combine",
               "moe_experts", "moe_fused_experts", "dsa_sparse_prefill", "dsa_sparse_prefill_expanded",
               "muon_orthogonalize", "mla_prefill"):
        assert rows[op].label.startswith("cpu: glm5_core.backends.cpu."), rows[op]
    assert "native extension built" in rows["mla_decode"].reason


def test_fake_impls_trace_shapes(native):
    from torch._subclasses.fake_tensor import FakeTensorMode

    shape = testing.IndexerShape(B=2, T=3, S=9, H=2, D=8, K=4)
    inputs = testing.make_indexer_inputs(shape)
    with FakeTensorMode(allow_non_fake_inputs=True):
        ops = torch.ops.glm5_cpu
        idx = ops.indexer_topk(inputs["q"], inputs["k"], inputs["w"], torch.zeros(2, dtype=torch.int64), 4)
        ids = torch.zeros(5, 2, dtype=torch.int64)
        x_sorted, sort_idx, counts = ops.moe_dispatch(torch.empty(5, 3), ids, 4)
        w_gate, w_up, w_down = torch.empty(4, 2, 3), torch.empty(4, 2, 3), torch.empty(4, 3, 2)
        y = ops.moe_experts(x_sorted, counts, w_gate, w_up, w_down)
        fused = ops.moe_fused_experts(torch.empty(5, 3), torch.empty(5, 2), ids, w_gate, w_up, w_down)
    assert idx.shape == (2, 3, 4) and idx.dtype == torch.int32
    assert x_sorted.shape == (10, 3) and sort_idx.shape == (10,) and counts.shape == (4,)
    assert y.shape == (10, 3) and fused.shape == (5, 3)


def test_compiles_without_graph_break(native):
    from glm5_core.backends.cpu import dsa as native_dsa

    shape = testing.IndexerShape(B=1, T=4, S=40, H=3, D=8, K=6)
    inputs = testing.make_indexer_inputs(shape, seed=2)
    compiled = torch.compile(lambda q, k, w: native_dsa.indexer_topk(q, k, w, topk=6, start_pos=36),
                             fullgraph=True, backend="eager")
    assert torch.equal(compiled(inputs["q"], inputs["k"], inputs["w"]),
                       native_dsa.indexer_topk(inputs["q"], inputs["k"], inputs["w"], topk=6, start_pos=36))


# ------------------------------------------------------------------------------------------ build lock
HOLD_BUILD_LOCK = """
import sys, time
from pathlib import Path
from glm5_core.backends import jit_build
with jit_build.exclusive_build(Path(sys.argv[1])):
    (Path(sys.argv[1]) / jit_build.TORCH_BATON).touch()  # what torch's FileBaton does while it builds
    print("holding", flush=True)
    time.sleep(600)
"""

TAKE_BUILD_LOCK = """
import sys
from pathlib import Path
from glm5_core.backends import jit_build
with jit_build.exclusive_build(Path(sys.argv[1])):
    print("baton left:", (Path(sys.argv[1]) / jit_build.TORCH_BATON).exists())
"""


def test_build_lock_dies_with_a_killed_builder_and_takes_its_baton(tmp_path):
    """A builder killed mid-build leaves torch's baton file behind; the flock went with it, so the next
    builder gets the lock at once and removes the baton (torch would otherwise poll on it forever)."""
    import fcntl
    import signal

    from glm5_core.backends import jit_build

    holder = subprocess.Popen([sys.executable, "-c", HOLD_BUILD_LOCK, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with open(tmp_path / jit_build.BUILD_LOCK) as probe:  # a live builder holds it: others wait
            with pytest.raises(BlockingIOError):
                fcntl.flock(probe.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
        holder.stdout.close()
    assert (tmp_path / jit_build.TORCH_BATON).exists()  # the stale state a killed build leaves
    taker = subprocess.run([sys.executable, "-c", TAKE_BUILD_LOCK, str(tmp_path)], capture_output=True, text=True,
                           timeout=120)
    assert taker.returncode == 0, taker.stderr[-2000:]
    assert "baton left: False" in taker.stdout


LOAD_SCRIPT = """
from glm5_core.backends.cpu import extension
status = extension.load()
print(status.describe())
assert status.built, status
"""


def _can_build() -> str:
    import shutil

    from torch.utils import cpp_extension

    if os.environ.get("GLM5_SKIP_EXT", "0") not in ("", "0"):
        return "GLM5_SKIP_EXT=1"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler"
    if not cpp_extension.is_ninja_available():
        return "no ninja"
    return ""


def _fresh_cache_env(tmp_path):
    return dict(os.environ, GLM5_EXT_DIR=str(tmp_path / "ext"), GLM5_SKIP_EXT="0")


def _build_directory(env) -> str:
    code = "from glm5_core.backends.cpu import extension; print(extension.build_directory())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()


@pytest.mark.slow
def test_a_stale_torch_baton_does_not_block_loading(tmp_path):
    """The state a killed build leaves (``lock`` in the build folder): loading used to wait forever."""
    if _can_build():
        pytest.skip(_can_build())
    env = _fresh_cache_env(tmp_path)
    build_dir = _build_directory(env)
    os.makedirs(build_dir)
    open(os.path.join(build_dir, "lock"), "w").close()
    result = subprocess.run([sys.executable, "-c", LOAD_SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not os.path.exists(os.path.join(build_dir, "lock"))


@pytest.mark.slow
def test_two_processes_loading_a_fresh_cache_at_once_both_succeed(tmp_path):
    """One builds while the other waits on the flock, then loads what the first built."""
    if _can_build():
        pytest.skip(_can_build())
    env = _fresh_cache_env(tmp_path)
    loaders = [subprocess.Popen([sys.executable, "-c", LOAD_SCRIPT], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outcomes = []
    for loader in loaders:
        try:
            out, err = loader.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            loader.kill()
            out, err = loader.communicate()
        outcomes.append((loader.returncode, out, err[-2000:]))
    assert [rc for rc, _, _ in outcomes] == [0, 0], outcomes
    assert all("native extension built" in out for _, out, _ in outcomes), outcomes
