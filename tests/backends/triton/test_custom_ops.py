"""The inference kernels are torch.library custom ops with fake implementations (torch.compile-ready)."""
import torch

from glm5_core import testing
from tests.backends.triton.helpers import kernel


def test_indexer_topk_op_passes_opcheck_and_traces(device):
    kernel("dsa_indexer_topk")  # registers the ops
    x = testing.make_indexer_inputs(testing.IndexerShape(B=2, T=3, S=11, H=2, D=16, K=4), device=device)
    start = torch.tensor([8, 5], dtype=torch.int32, device=device)
    op = torch.ops.glm5_cuda.indexer_topk
    torch.library.opcheck(op, (x["q"], x["k"], x["w"], start, 4), test_utils=("test_schema", "test_faketensor"))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake, nan_rows = op(*(mode.from_tensor(t) for t in (x["q"], x["k"], x["w"], start)), 4)
    assert fake.shape == (2, 3, 4) and fake.dtype == torch.int32
    assert nan_rows.shape == (6,) and nan_rows.dtype == torch.int8  # 1 per query row with a NaN score


def test_sparse_decode_op_fake_shape(device):
    kernel("dsa_sparse_decode")
    shape = testing.MLAShape(B=1, T=2, S=9, H=3, Dn=8, Dr=4, Dv=6, C=16)
    x = testing.make_sparse_inputs(shape, 4, device=device)
    args = tuple(x[a] for a in ("q_nope", "q_pe", "c_kv", "k_pe", "w_uk", "w_uv", "topk_idx")) + (0.5,)
    torch.library.opcheck(torch.ops.glm5_cuda.sparse_decode, args, test_utils=("test_schema", "test_faketensor"))


def test_indexer_topk_wrapper_compiles_without_graph_break(device):
    """The wrapper reads the op's NaN flags only outside torch.compile: fullgraph tracing must not break on it."""
    from glm5_core.ops import dsa

    topk = kernel("dsa_indexer_topk")
    x = testing.make_indexer_inputs(testing.IndexerShape(B=2, T=3, S=11, H=2, D=16, K=4), device=device)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, w: topk(q, k, w, topk=4, start_pos=8), backend="aot_eager", fullgraph=True)
    out = compiled(x["q"], x["k"], x["w"])
    torch._dynamo.reset()
    assert torch.equal(out, dsa.indexer_topk_reference(x["q"], x["k"], x["w"], topk=4, start_pos=8))
