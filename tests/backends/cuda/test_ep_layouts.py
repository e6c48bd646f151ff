"""DeepEP's expand-mode dispatch outputs mapped to the ep_dispatch contract, on a stand-in written from
deepseek-ai/DeepEP's source (commit dd758caf451848bd150e1046af3d0a73e5fff38d, deep_ep 2.1.0:
``deep_ep/buffers/elastic.py``, ``ElasticBuffer.dispatch`` with do_expand=True and ``EPHandle.deterministic_sort``),
none of glm5-core's code inside: recv_x grouped by local expert, each block padded to ``expert_alignment`` (zeros,
do_zero_padding), rows inside an expert sorted by the source token's global index (rank * num_max_tokens_per_rank
+ token), ``psum_num_recv_tokens_per_expert[i]`` = aligned rows before expert i + its real count,
``num_unaligned_recv_tokens_per_expert`` the real counts."""
import pytest
import torch

from glm5_core.backends.cuda import ep_layouts as L
from glm5_core.ops import moe


def _deep_ep_expand_dispatch(xs, ids_list, rank, world, num_experts, alignment, max_tokens):
    """What ElasticBuffer.dispatch(do_expand=True, deterministic=True) leaves on ``rank``."""
    local = num_experts // world
    blocks, psum, unaligned, aligned_before = [], [], [], 0
    for e in range(rank * local, (rank + 1) * local):
        keyed = []
        for src in range(world):
            for t in range(xs[src].shape[0]):
                if bool((ids_list[src][t] == e).any()):
                    keyed.append((src * max_tokens + t, xs[src][t]))
        keyed.sort(key=lambda kv: kv[0])  # deterministic_sort: by source global index
        n = len(keyed)
        padded = -(-n // alignment) * alignment
        block = torch.zeros(padded, xs[0].shape[1], dtype=xs[0].dtype)
        if n:
            block[:n] = torch.stack([row for _, row in keyed])
        blocks.append(block)
        psum.append(aligned_before + n)
        unaligned.append(n)
        aligned_before += padded
    return torch.cat(blocks), torch.tensor(psum, dtype=torch.int32), torch.tensor(unaligned, dtype=torch.int32)


@pytest.mark.parametrize("world,alignment", [(2, 1), (2, 4), (4, 8)])
def test_expand_mode_rows_and_counts_are_the_contract_bitwise(world, alignment):
    E, K, H, max_tokens = 8, 2, 16, 9
    g = torch.Generator().manual_seed(world * 10 + alignment)
    xs = [torch.randn(3 + 2 * r, H, generator=g).to(torch.bfloat16) for r in range(world)]
    ids = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(x.shape[0])]) for x in xs]
    ids[0][:, 0] = 0  # uneven: every token of rank 0 to expert 0
    ids[0][:, 1] = torch.where(ids[0][:, 1] == 0, torch.ones_like(ids[0][:, 1]), ids[0][:, 1])
    x_sorted, _, counts = moe.dispatch_reference(torch.cat(xs), torch.cat(ids).to(torch.int32), num_experts=E)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    local = E // world
    for rank in range(world):
        recv_x, psum, unaligned = _deep_ep_expand_dispatch(xs, ids, rank, world, E, alignment, max_tokens)
        rows, got_counts = L.expert_rows(recv_x, psum, unaligned)
        lo, hi = int(starts[rank * local]), int(starts[(rank + 1) * local])
        assert torch.equal(got_counts, counts[rank * local:(rank + 1) * local])
        assert torch.equal(rows, x_sorted[lo:hi])


def test_limits_name_what_fails():
    ok, why = L.dispatch_limits(torch.zeros(2, 4), deterministic=True)
    assert not ok and "bfloat16" in why and "float32" in why
    ok, why = L.dispatch_limits(torch.zeros(2, 4, dtype=torch.bfloat16), deterministic=False)
    assert not ok and "deterministic=True" in why
    assert L.dispatch_limits(torch.zeros(2, 4, dtype=torch.bfloat16), deterministic=True) == (True, "")
    ok, why = L.deep_ep_importable()
    assert ok or "reference (all_to_all_single over NCCL)" in why


def test_mismatched_count_tensors_are_refused():
    with pytest.raises(ValueError, match="num_unaligned_recv_tokens_per_expert"):
        L.expert_rows(torch.zeros(4, 2), torch.tensor([1, 2]), torch.tensor([1]))
