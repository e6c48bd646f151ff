"""The fused indexer top-k never materialises the [queries x keys] scores: its extra memory is
O(queries x (k + block)), independent of the number of keys, where the reference's grows with it.
Bytes are counted under the interpreter by ``alloc_meter`` (method in its docstring)."""
import pytest
import torch

from glm5_core import testing
from glm5_core.ops import dsa
from tests.backends.triton import alloc_meter
from tests.backends.triton.helpers import kernel


def _inputs(num_keys):
    shape = testing.IndexerShape(B=1, T=2, S=num_keys, H=2, D=16, K=8)
    x = testing.make_indexer_inputs(shape, seed=5)
    return x["q"], x["k"], x["w"], num_keys - 2


def test_fused_topk_extra_memory_is_independent_of_the_key_count(device):
    if device != "cpu":
        pytest.skip("counts CPU allocations under the interpreter")
    from glm5_core.backends.cuda.launch import CUDA_CONFIGS
    from glm5_core.backends.triton import indexer, table

    topk = kernel("dsa_indexer_topk")
    K, block, queries = 8, table.launch_config(CUDA_CONFIGS, "indexer").block("keys"), 2
    topk(*_inputs(512)[:3], topk=K, start_pos=510)  # warm the interpreter's caches outside the measurement
    peaks, ref_peaks = {}, {}
    for S in (128, 512):
        q, k, w, start = _inputs(S)
        idx, peaks[S] = alloc_meter.measure(topk, q, k, w, topk=K, start_pos=start)
        ref_idx, ref_peaks[S] = alloc_meter.measure(dsa.indexer_topk_reference, q, k, w, topk=K, start_pos=start)
        assert torch.equal(idx, ref_idx)
    rows, width = indexer.scratch_shape(queries, K, block)
    budget = rows * width * 8 + queries * K * 4 + queries + 64  # scratch + output + NaN flags + start positions
    assert width <= 2 * max(K, block) * 2  # scratch row = O(k + block)
    for S, peak in peaks.items():
        assert peak.torch_bytes <= budget, (S, peak, budget)
        assert ref_peaks[S].torch_bytes >= queries * S * 4  # the reference holds [T, S] fp32 scores at least
    # Four times the keys: the reference's extra memory grows with S, the fused kernel's does not.
    assert ref_peaks[512].torch_bytes >= 3 * ref_peaks[128].torch_bytes
    assert peaks[512].torch_bytes == peaks[128].torch_bytes
    assert peaks[512].numpy_bytes <= peaks[128].numpy_bytes + 32 * 1024, (peaks[128], peaks[512])
