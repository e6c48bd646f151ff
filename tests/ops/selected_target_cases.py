"""Shapes and inputs shared by the tests of ``dsa_selected_attention_target`` (reference, cpu and Triton)."""
import torch

from glm5_core import testing

RAGGED = "ragged"
SMALL_CASES = (  # (shape, K, start position: int, or RAGGED for a [B] tensor)
    (testing.MLAShape(B=1, T=1, S=1, H=1, Dn=8, Dr=4, Dv=8, C=16), 1, 0),  # one key, K = 1
    (testing.MLAShape(B=2, T=5, S=13, H=3, Dn=12, Dr=6, Dv=10, C=24), 1, 8),  # K = 1, keys before the queries
    (testing.MLAShape(B=2, T=7, S=7, H=3, Dn=5, Dr=3, Dv=6, C=7), 4, 0),  # odd sizes, early rows -1 padded
    (testing.MLAShape(B=1, T=9, S=9, H=2, Dn=8, Dr=4, Dv=8, C=16), 20, 0),  # K > S: -1 padding everywhere
    (testing.MLAShape(B=3, T=6, S=17, H=5, Dn=7, Dr=5, Dv=4, C=11), 5, RAGGED),  # rows with their own start
)


def start_of(shape, start):
    """The start position of a case: the int, or a [B] tensor for RAGGED."""
    return torch.tensor([0, 7, 11][:shape.B]) if start == RAGGED else start


def case_inputs(shape, K, start, dtype, seed, past_the_query=False):
    """(the op's tensor arguments, start position) of a case. ``past_the_query``: the last slot of every row holds
    the last key slot, past every query but the last one (rows holding that key already keep their last slot: the
    indices of a row stay distinct)."""
    start_pos = start_of(shape, start)
    x = testing.make_sparse_inputs(shape, K, dtype=dtype, seed=seed, start_pos=start_pos)
    args = {n: x[n] for n in ("q_nope", "q_pe", "c_kv", "k_pe", "w_uk", "topk_idx")}
    if past_the_query:
        idx = args["topk_idx"]
        holds_last = (idx[..., :-1] == shape.S - 1).any(-1)  # [B, T]
        idx[..., -1] = torch.where(holds_last, idx[..., -1], torch.full_like(idx[..., -1], shape.S - 1))
    return args, start_pos


def as64(args):
    """The floating-point arguments in fp64 (the exact baseline)."""
    return {n: t.double() if t.is_floating_point() else t for n, t in args.items()}


def scale_of(shape):
    return (shape.Dn + shape.Dr) ** -0.5
